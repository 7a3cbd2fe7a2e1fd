//! Resa rectified after every token, teacher-forced, against resa computed
//! beside a dense run, on the default model with f32 activations (a process
//! of its own: the switch is global).
//!
//! A rectification rewrites a decoded token's keys and values densely before
//! the next step reads them, so a session that rectifies after every token
//! keeps, step after step, the cache of a dense session decoding the same
//! tokens. Each of its steps must then be, to the bit, resa's step on the
//! dense run's own cache: a fresh resa session forked from the dense session
//! at that step, which has written no sparse keys or values at all and
//! builds its block descriptors from scratch. At every sparse call the
//! descriptors the rectifying session's resa holds must also be the per
//! block minima and maxima this test computes from the keys the call sees,
//! and the two caches must be equal.

mod common;

use std::sync::{Arc, Mutex};

use sift::attn::dense::Dense;
use sift::attn::resa::{self, Resa};
use sift::attn::{worth_sparse, AttentionKind, AttentionPolicy, HeadRecord, LayerCall};
use sift::engine::{Session, DEFAULT_BATCH};
use sift::gguf::GgufFile;
use sift::kv::Storage;
use sift::model::Model;
use sift::rectify::{read_rows, Rectify};

use common::Rng;

/// Enough context that the global layers' steps read sparsely, starting
/// inside a block.
const PROMPT: usize = 1100;
/// Steps decoded: through 3 blocks of 16 positions, the first entered
/// part-way.
const STEPS: usize = 48;

/// Resa, shared with the test, which checks its descriptors after every
/// sparse call against the keys the call saw.
struct Checked {
    resa: Arc<Mutex<Resa>>,
    /// Sparse calls checked, and those whose descriptors were wrong.
    calls: Arc<Mutex<(usize, Vec<String>)>>,
}

impl AttentionPolicy for Checked {
    fn kind(&self) -> AttentionKind {
        AttentionKind::Resa
    }

    fn reads_sketch(&self) -> bool {
        false
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        let mut resa = self.resa.lock().unwrap();
        resa.attend(call, out, records);
        if !worth_sparse(call) {
            return;
        }
        let (described, held) = resa.descriptors(call.layer);
        let want = descriptors_from_scratch(call);
        let mut calls = self.calls.lock().unwrap();
        calls.0 += 1;
        if described != call.visible(0).end / resa::BLOCK || bits(held) != bits(&want) {
            let pos = call.batch.pos0;
            calls.1.push(format!("layer {} at position {pos}: {described} blocks described", call.layer));
        }
    }

    fn forget_from(&mut self, pos: usize) {
        self.resa.lock().unwrap().forget_from(pos);
    }
}

/// The minima and maxima of every complete block's keys, per KV head, in
/// resa's layout, from the keys `call`'s cache returns.
fn descriptors_from_scratch(call: &LayerCall) -> Vec<f32> {
    let (n_kv, dim) = (call.batch.n_kv_head(), call.batch.head_dim_k);
    let visible = call.visible(0);
    let mut key = vec![0.0f32; dim];
    let mut out = Vec::new();
    for block in 0..visible.end / resa::BLOCK {
        for h in 0..n_kv {
            let (mut min, mut max) = (vec![f32::INFINITY; dim], vec![f32::NEG_INFINITY; dim]);
            for pos in block * resa::BLOCK..(block + 1) * resa::BLOCK {
                call.cache.key(h, pos, &mut key);
                for c in 0..dim {
                    min[c] = min[c].min(key[c]);
                    max[c] = max[c].max(key[c]);
                }
            }
            out.extend(min.into_iter().chain(max));
        }
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |best, i| if x[i] > x[best] { i } else { best }) as u32
}

fn resa() -> Box<dyn AttentionPolicy> {
    Box::new(Resa::new(resa::Params::default()))
}

/// Every layer's keys and values at every position, as bits.
fn rows(session: &Session) -> Vec<Vec<u32>> {
    let hp = &session.model().hp;
    let cache = session.cache();
    let first = (0..hp.n_layer).map(|il| cache.layer(il).held().start).max().unwrap_or(0);
    let rows = read_rows(cache, hp.n_head_kv, (hp.head_dim_k, hp.head_dim_v), first..session.n_past());
    rows.iter().map(|layer| bits(layer)).collect()
}

#[test]
fn resa_rectified_after_every_token_is_resa_beside_the_dense_run() {
    sift::matmul::set_f32_activations(true);
    sift::matmul::keep_dequantized_weights(true);
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let mut rng = Rng(31);
    let prompt: Vec<u32> = (0..PROMPT).map(|_| (rng.next() % model.hp.n_vocab as u64) as u32).collect();
    let n_ctx = PROMPT + STEPS + 1;
    let mut dense = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, Storage::default(), Box::new(Dense));
    let mut token = argmax(dense.prefill(&prompt).unwrap());

    let shared = Arc::new(Mutex::new(Resa::new(resa::Params::default())));
    let calls = Arc::new(Mutex::new((0, Vec::new())));
    let checked = Checked { resa: shared.clone(), calls: calls.clone() };
    let mut rectified = dense.fork(Box::new(checked), Rectify::every(1)).unwrap();
    let mut unrectified = dense.fork(resa(), Rectify::default()).unwrap();
    let (mut sparse_steps, mut differs_from_dense, mut unrectified_differs) = (0, 0, 0);
    for step in 0..STEPS {
        // Resa's step on the dense run's own cache: no sparse K/V in it.
        let mut beside = dense.fork(resa(), Rectify::default()).unwrap();
        let want = bits(beside.decode(token).unwrap());
        sparse_steps += usize::from(beside.last_records().iter().any(|r| r.certificate.kind == AttentionKind::Resa));
        let got = bits(rectified.decode(token).unwrap());
        assert!(got == want, "step {step}: rectified every token, resa is not resa beside the dense run");
        unrectified_differs += usize::from(bits(unrectified.decode(token).unwrap()) != want);
        let dense_logits = dense.decode(token).unwrap();
        differs_from_dense += usize::from(bits(dense_logits) != want);
        token = argmax(dense_logits);
    }
    assert_eq!(rectified.rectify_stats().passes, STEPS as u64);
    assert!(rows(&rectified) == rows(&dense), "rectified every token, the cache is not the dense run's");
    assert_eq!(sparse_steps, STEPS, "every step reads the global layers sparsely");
    assert!(differs_from_dense == STEPS, "resa's steps are dense ones");
    assert!(unrectified_differs > STEPS / 2, "without rectification resa wrote the dense keys and values");
    let (checked, wrong) = &*calls.lock().unwrap();
    let global_layers = (0..model.hp.n_layer).filter(|&il| !model.hp.is_sliding(il)).count();
    assert_eq!(*checked, STEPS * global_layers, "sparse calls checked");
    assert!(wrong.is_empty(), "descriptors not the ones built from scratch: {wrong:?}");
}
