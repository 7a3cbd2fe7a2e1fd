//! The engine's prefill seam: a backend takes the prompts it says it takes,
//! and decoding steps stay on the CPU under the session's attention policy,
//! even when the backend would take a single token.

mod common;

use sift::attn::dense::Dense;
use sift::attn::HeadRecord;
use sift::engine::{CpuPrefill, EngineError, PrefillBackend, Session};
use sift::gguf::GgufFile;
use sift::kv::KvCache;
use sift::model::{Attention, Model, Outputs, Scratch};
use sift::sample::argmax;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A backend that takes every call, however short, runs it densely on the
/// CPU, and counts the tokens it was given.
struct Counting<'m> {
    model: &'m Model<'m>,
    scratch: Scratch,
    tokens: Arc<AtomicUsize>,
}

impl PrefillBackend for Counting<'_> {
    fn takes(&mut self, _pos0: usize, _n: usize) -> bool {
        true
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        self.tokens.fetch_add(tokens.len(), Ordering::Relaxed);
        let mut records: Vec<HeadRecord> = Vec::new();
        let attention = Attention { policy: &mut Dense, step: 0, records: &mut records };
        let mut cpu =
            CpuPrefill { model: self.model, scratch: &mut self.scratch, attention, batch: 512, progress: None };
        cpu.prefill(tokens, pos0, cache, outputs, hidden)
    }
}

/// The tiny random-weight Llama of the shared anchors, if they are here.
fn tiny_llama(test: &str) -> Option<GgufFile> {
    let shared = common::shared_dir(test)?;
    Some(GgufFile::open(shared.join("anchors/models/tiny-llama.gguf")).unwrap())
}

/// A prompt of 39 tokens.
fn prompt() -> Vec<u32> {
    (1..40).map(|i| (i * 7) % 200 + 3).collect()
}

#[test]
fn decoding_steps_never_go_to_the_prefill_backend() {
    let Some(file) = tiny_llama("decoding_steps_never_go_to_the_prefill_backend") else { return };
    let model = Model::load(&file).unwrap();
    let prompt = prompt();

    let mut plain = Session::new(&model, 256);
    let mut backed = Session::new(&model, 256);
    let taken = Arc::new(AtomicUsize::new(0));
    backed.set_prefill_backend(Box::new(Counting {
        model: &model,
        scratch: Scratch::default(),
        tokens: taken.clone(),
    }));

    let mut next = argmax(plain.prefill(&prompt).unwrap()) as u32;
    assert_eq!(argmax(backed.prefill(&prompt).unwrap()) as u32, next);
    for _ in 0..8 {
        let want = plain.decode(next).unwrap().to_vec();
        let got = backed.decode(next).unwrap().to_vec();
        assert_eq!(got, want, "a decoding step's logits");
        // Records come only from the CPU's pass under the session's policy.
        assert!(!backed.last_records().is_empty(), "a decoding step left no attention records");
        next = argmax(&want) as u32;
    }
    assert_eq!(taken.load(Ordering::Relaxed), prompt.len(), "the backend took the prompt and nothing else");
}

#[test]
fn prefill_progress_is_told_each_batch_of_a_prompt_and_changes_nothing() {
    let Some(file) = tiny_llama("prefill_progress_is_told_each_batch_of_a_prompt") else { return };
    let model = Model::load(&file).unwrap();
    let prompt = prompt();

    let mut plain = Session::with_batch(&model, 256, 16);
    let mut watched = Session::with_batch(&model, 256, 16);
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = told.clone();
    watched.set_prefill_progress(Some(Box::new(move |done, total| {
        log.lock().unwrap().push((done, total));
        ControlFlow::Continue(())
    })));

    let want = plain.prefill(&prompt).unwrap().to_vec();
    assert_eq!(watched.prefill(&prompt).unwrap(), &want[..], "the prompt's logits");
    assert_eq!(
        *told.lock().unwrap(),
        [(0, 39), (16, 39), (32, 39), (39, 39)],
        "one report before the batches and one after each"
    );
    let next = argmax(&want) as u32;
    assert_eq!(watched.decode(next).unwrap(), plain.decode(next).unwrap(), "a decoding step's logits");
    assert_eq!(told.lock().unwrap().len(), 4, "a decoding step is not a prompt: no report");

    // A later prompt (a chat's next turn) counts from its own start.
    told.lock().unwrap().clear();
    let turn = &prompt[..20];
    assert_eq!(watched.prefill(turn).unwrap(), plain.prefill(turn).unwrap(), "the next prompt's logits");
    assert_eq!(*told.lock().unwrap(), [(0, 20), (16, 20), (20, 20)], "the next prompt's reports");

    // A prompt a backend takes is the backend's to report.
    watched.reset();
    told.lock().unwrap().clear();
    let taken = Arc::new(AtomicUsize::new(0));
    watched.set_prefill_backend(Box::new(Counting { model: &model, scratch: Scratch::default(), tokens: taken }));
    watched.prefill(&prompt).unwrap();
    assert!(told.lock().unwrap().is_empty(), "reports for a prompt the CPU did not run: {:?}", told.lock().unwrap());
}

#[test]
fn a_prefill_stopped_by_its_progress_keeps_its_batches_and_goes_on_from_them() {
    let Some(file) = tiny_llama("a_prefill_stopped_by_its_progress_keeps_its_batches") else { return };
    let model = Model::load(&file).unwrap();
    let prompt = prompt();

    let mut plain = Session::with_batch(&model, 256, 16);
    let want = plain.prefill(&prompt).unwrap().to_vec();

    let mut stopped = Session::with_batch(&model, 256, 16);
    stopped.set_prefill_progress(Some(Box::new(|done, _| match done {
        0 => ControlFlow::Continue(()),
        _ => ControlFlow::Break(()),
    })));
    match stopped.prefill(&prompt) {
        Err(EngineError::Interrupted { done: 16 }) => {}
        other => panic!("stopped after the first batch: {:?}", other.map(|logits| logits.len())),
    }
    assert_eq!(stopped.n_past(), 16, "the batch done is counted");
    stopped.set_prefill_progress(None);
    assert_eq!(stopped.prefill(&prompt[16..]).unwrap(), &want[..], "going on from the batch done");
    let next = argmax(&want) as u32;
    assert_eq!(stopped.decode(next).unwrap(), plain.decode(next).unwrap(), "a decoding step after it");
}
