//! Rectified sparse decoding on the default model, against caches built
//! densely from scratch:
//!
//! * after `2F` sparse decoding steps rectified every `F`, every layer's keys
//!   and values at every position are, bit for bit, those of a dense session
//!   that prefilled the prompt and then the decoded tokens in batches of `F`
//!   (which is what a rectification pass is), in the f16 cache and in a
//!   quantized one; without rectification they are not;
//! * after a rectification, resa decodes bit for bit what a fresh resa
//!   session decodes from that dense cache (its block descriptors are the
//!   ones it would build from scratch);
//! * the drift a session reports is the relative L2 distance this test
//!   computes between the sparse session's rows and the dense ones;
//! * windows that no step read sparsely are not run again;
//! * a conversation rectifies when a reply ends;
//! * an interval longer than a batch is refused.

mod common;

use sift::attn::dense::Dense;
use sift::attn::resa::{self, Resa};
use sift::attn::AttentionPolicy;
use sift::conversation::Conversation;
use sift::engine::{EngineError, Session, DEFAULT_BATCH};
use sift::generate::Limits;
use sift::gguf::GgufFile;
use sift::kv::{KvMode, Storage};
use sift::model::Model;
use sift::rectify::{read_rows, Rectify};
use sift::sample::SamplingParams;

use common::Rng;

/// Enough context that the global layers' decoding steps read sparsely.
const PROMPT: usize = 1100;
const EVERY: usize = 32;

fn tokens(n: usize, seed: u64, n_vocab: usize) -> Vec<u32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| (rng.next() % n_vocab as u64) as u32).collect()
}

fn resa() -> Box<dyn AttentionPolicy> {
    Box::new(Resa::new(resa::Params::default()))
}

/// Every layer's keys and values at the positions every layer still holds,
/// as bits.
fn rows(session: &Session) -> Vec<Vec<u32>> {
    let hp = &session.model().hp;
    let dims = (hp.head_dim_k, hp.head_dim_v);
    let cache = session.cache();
    let first = (0..hp.n_layer).map(|il| cache.layer(il).held().start).max().unwrap_or(0);
    let rows = read_rows(cache, hp.n_head_kv, dims, first..session.n_past());
    rows.iter().map(|layer| layer.iter().map(|x| x.to_bits()).collect()).collect()
}

#[test]
fn a_rectified_cache_is_the_dense_batched_one() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let n_vocab = model.hp.n_vocab;
    let (prompt, decoded) = (tokens(PROMPT, 1, n_vocab), tokens(2 * EVERY, 2, n_vocab));
    let n = PROMPT + decoded.len();
    for mode in [KvMode::F16, KvMode::Q4] {
        let storage = Storage::from(mode);
        let mut base = Session::with_policy(&model, n + 1, DEFAULT_BATCH, storage, Box::new(Dense));
        base.prefill(&prompt).unwrap();

        let mut dense = base.fork(Box::new(Dense), Rectify::default()).unwrap();
        for window in decoded.chunks(EVERY) {
            dense.prefill(window).unwrap();
        }
        let mut rectified = base.fork(resa(), Rectify::every(EVERY)).unwrap();
        let mut sparse = base.fork(resa(), Rectify::default()).unwrap();
        for &token in &decoded {
            rectified.decode(token).unwrap();
            sparse.decode(token).unwrap();
        }
        assert_eq!(rectified.rectify_stats().passes, 2, "{mode}");
        assert_eq!(rectified.rectify_stats().tokens, 2 * EVERY as u64, "{mode}");
        let want = rows(&dense);
        assert!(rows(&rectified) == want, "{mode}: the rectified cache is not the dense one");
        let differ = rows(&sparse).iter().zip(&want).filter(|(a, b)| a != b).count();
        assert!(differ > 0, "{mode}: sparse decoding wrote the dense rows without rectification");
    }
}

/// After a rectification, a resa session decodes what a fresh resa session
/// decodes from the dense cache the pass rebuilt: the block descriptors it
/// keeps are those it would build from scratch.
#[test]
fn after_a_rectification_resa_decodes_as_from_a_fresh_dense_cache() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let n_vocab = model.hp.n_vocab;
    // The rewritten tokens start inside a block, and at a block's start.
    for prompt_len in [PROMPT, PROMPT.next_multiple_of(resa::BLOCK)] {
        let (prompt, decoded) = (tokens(prompt_len, 11, n_vocab), tokens(3 * EVERY, 12, n_vocab));
        let n_ctx = prompt_len + decoded.len() + 1;
        let mut base = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, Storage::default(), resa());
        base.prefill(&prompt).unwrap();
        let (first, rest) = decoded.split_at(EVERY);
        let mut rectified = base.fork(resa(), Rectify::every(EVERY)).unwrap();
        for &token in first {
            rectified.decode(token).unwrap();
        }
        let mut dense = base.fork(Box::new(Dense), Rectify::default()).unwrap();
        dense.prefill(first).unwrap();
        let mut fresh = dense.fork(resa(), Rectify::every(EVERY)).unwrap();
        for (step, &token) in rest.iter().enumerate() {
            let want: Vec<u32> = fresh.decode(token).unwrap().iter().map(|x| x.to_bits()).collect();
            let got: Vec<u32> = rectified.decode(token).unwrap().iter().map(|x| x.to_bits()).collect();
            assert!(got == want, "prompt {prompt_len}, step {step} after a rectification: not a fresh session's");
        }
        assert_eq!(rectified.rectify_stats().passes, 3, "prompt {prompt_len}");
    }
}

#[test]
fn the_drift_reported_is_the_distance_of_the_sparse_rows_from_the_dense_ones() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let hp = &model.hp;
    let (prompt, decoded) = (tokens(PROMPT, 3, hp.n_vocab), tokens(EVERY, 4, hp.n_vocab));
    let positions = PROMPT..PROMPT + EVERY;
    let mut base = Session::with_policy(&model, PROMPT + EVERY + 1, DEFAULT_BATCH, Storage::default(), resa());
    base.prefill(&prompt).unwrap();
    let mut measured = base.fork(resa(), Rectify { every: EVERY, measure_drift: true }).unwrap();
    let mut sparse = base.fork(resa(), Rectify::default()).unwrap();
    for &token in &decoded {
        measured.decode(token).unwrap();
        sparse.decode(token).unwrap();
    }
    let dims = (hp.head_dim_k, hp.head_dim_v);
    let keys_len = EVERY * hp.n_head_kv * hp.head_dim_k;
    let old = read_rows(sparse.cache(), hp.n_head_kv, dims, positions.clone());
    let new = read_rows(measured.cache(), hp.n_head_kv, dims, positions);
    let distance = |old: &[f32], new: &[f32]| {
        let diff: f64 = old.iter().zip(new).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
        (diff / new.iter().map(|&b| f64::from(b).powi(2)).sum::<f64>()).sqrt()
    };
    let drift = &measured.rectify_stats().drift;
    assert_eq!(drift.len(), hp.n_layer);
    let mut moved = 0;
    for (il, (old, new)) in old.iter().zip(&new).enumerate() {
        let (keys, values) =
            (distance(&old[..keys_len], &new[..keys_len]), distance(&old[keys_len..], &new[keys_len..]));
        let reported = (drift[il].keys.relative(), drift[il].values.relative());
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 + 1e-6 * b;
        assert!(close(reported.0, keys) && close(reported.1, values), "layer {il}: {reported:?} vs {keys}, {values}");
        moved += usize::from(keys > 0.0);
    }
    assert!(moved > 0, "no layer's keys moved: the sparse steps wrote the dense rows");
}

#[test]
fn windows_decoded_densely_are_not_run_again() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let mut session = Session::with_policy(&model, 300, DEFAULT_BATCH, Storage::default(), resa());
    session.set_rectify(Rectify::every(EVERY)).unwrap();
    session.prefill(&tokens(100, 5, model.hp.n_vocab)).unwrap();
    for token in tokens(3 * EVERY, 6, model.hp.n_vocab) {
        session.decode(token).unwrap();
    }
    assert_eq!(session.rectify_stats().passes, 0, "steps under 1024 positions are dense: nothing to rectify");
}

#[test]
fn a_conversation_rectifies_when_a_reply_ends() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let tokenizer = common::gemma3_tokenizer();
    let sampling = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let mut conversation = Conversation::new(&model, tokenizer, 1300, Storage::default(), resa(), sampling);
    conversation.set_rectify(Rectify::every(EVERY)).unwrap();
    let prompt = tokens(PROMPT, 7, model.hp.n_vocab);
    let limits = Limits { max_tokens: 10, stop: &[], interrupt: None, grammar: None };
    let reply = conversation.generate(&prompt, limits, |_| {}, |_| std::ops::ControlFlow::Continue(())).unwrap();
    // The last token sampled is not decoded: 9 steps, rectified at the end.
    assert_eq!(reply.decode_steps, 9);
    assert_eq!(reply.rectifications, 1);
    let stats = conversation.session().rectify_stats();
    assert_eq!((stats.passes, stats.tokens), (1, 9));
    assert!(reply.rectify_time <= reply.decode_time && reply.rectify_share() > 0.0);
}

#[test]
fn an_interval_longer_than_a_batch_is_refused() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let mut session = Session::with_policy(&model, 4096, DEFAULT_BATCH, Storage::default(), resa());
    let err = session.set_rectify(Rectify::every(DEFAULT_BATCH + 1)).unwrap_err();
    assert!(matches!(err, EngineError::RectifyWindow { every: 513, batch: 512 }), "{err}");
    let q2 = Session::with_policy(&model, 4096, DEFAULT_BATCH, Storage::from(KvMode::Q2), resa());
    assert!(q2.fork(resa(), Rectify::every(100)).is_err(), "the default residual keeps only 65 tokens exact");
}

/// `sift run --attn resa` over a prompt long enough to decode sparsely:
/// `--json` counts the rectifications (the default interval, 32, none in 3
/// steps; one at the end of the reply), and an interval over a batch is a
/// one-line usage error.
#[test]
fn run_reports_rectifications_and_refuses_bad_intervals() {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(110);
    let args = ["run", "-p", "-", "--temp", "0", "-n", "4", "--attn", "resa", "--json", "--quiet"];
    let out = common::sift_with_stdin(&args, prompt.as_bytes());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["prompt_tokens"].as_u64().unwrap() > 1024, "{json}");
    let timings = &json["timings"];
    assert_eq!(timings["rectifications"], 1, "{json}");
    assert!(timings["rectify_share"].as_f64().unwrap() > 0.0, "{json}");

    let out = common::sift_with_stdin(&["run", "-p", "hi", "--attn", "resa", "--rectify-every", "513"], b"");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--rectify-every must be at most one batch of 512 tokens, not 513"), "{stderr}");
}
