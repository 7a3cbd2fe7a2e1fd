//! Exact attention: every visible key is read.
//!
//! The arithmetic follows ggml's non-flash attention path, whose results
//! llama.cpp's references were computed with: the query is rounded to f16 for
//! the q·k products (ggml multiplies an f16 cache with f16 operands), the
//! softmax is taken in f32 (normalized by multiplying with the reciprocal of
//! the sum, as ggml does), and the probabilities are rounded to f16 before
//! they weight the f16 values. Sums are in f32.
//!
//! The loops over keys and values are `simd`'s attention kernels; this module
//! walks the cache and shares the (token, head) pairs among the threads.

use std::cell::RefCell;
use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use simd::Kernels;

use crate::kv::LayerCache;

/// What one layer's attention needs to know about the batch.
pub struct AttentionBatch<'a> {
    /// Queries after RoPE: `n_tokens` rows of `n_head * head_dim_k`.
    pub queries: &'a [f32],
    /// Position of the batch's first token.
    pub pos0: usize,
    pub n_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Query heads per KV head.
    pub n_gqa: usize,
    pub scale: f32,
}

/// One thread's buffers, kept across calls: the query, and the scores over
/// the visible keys (then the probabilities), each rounded to f16 through
/// `halves`.
#[derive(Default)]
struct Scratch {
    query: Vec<f32>,
    scores: Vec<f32>,
    halves: Vec<f16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `out` gets `n_tokens` rows of `n_head * head_dim_v`: for every token and
/// head, softmax(scale · q·K) · V over the positions the cache shows it.
pub fn attend(batch: &AttentionBatch, cache: &LayerCache, out: &mut [f32]) {
    let kernels = simd::kernels();
    out.par_chunks_mut(batch.head_dim_v).enumerate().for_each(|(i, out)| {
        let (t, h) = (i / batch.n_head, i % batch.n_head);
        let head = Head {
            query: &batch.queries[i * batch.head_dim_k..][..batch.head_dim_k],
            kv_head: h / batch.n_gqa,
            visible: cache.visible(batch.pos0 + t),
            scale: batch.scale,
        };
        SCRATCH.with_borrow_mut(|scratch| head.attend(kernels, cache, scratch, out));
    });
}

/// One query head of one token.
struct Head<'a> {
    query: &'a [f32],
    kv_head: usize,
    visible: Range<usize>,
    scale: f32,
}

impl Head<'_> {
    /// `out = softmax(scale · q·K) · V` over the visible positions.
    fn attend(&self, kernels: &Kernels, cache: &LayerCache, s: &mut Scratch, out: &mut [f32]) {
        let dim_k = self.query.len();
        s.query.clear();
        s.query.extend_from_slice(self.query);
        round_to_f16(&mut s.query, &mut s.halves);

        s.scores.resize(self.visible.len(), 0.0);
        let mut scores = &mut s.scores[..];
        for keys in key_runs(cache, self.kv_head, self.visible.clone()) {
            let (run, rest) = scores.split_at_mut(keys.len() / dim_k);
            kernels.scores_f16(&s.query, keys, run);
            scores = rest;
        }

        let mut max = f32::NEG_INFINITY;
        for x in &mut s.scores {
            *x *= self.scale;
            max = max.max(*x);
        }
        let inv_sum = 1.0 / kernels.softmax_exp(&mut s.scores, max);
        for x in &mut s.scores {
            *x *= inv_sum;
        }
        round_to_f16(&mut s.scores, &mut s.halves);

        out.fill(0.0);
        let mut probs = &s.scores[..];
        for values in value_runs(cache, self.kv_head, self.visible.clone()) {
            let (run, rest) = probs.split_at(values.len() / out.len());
            kernels.add_weighted_f16(run, values, out);
            probs = rest;
        }
    }
}

/// Rounds every element to the nearest f16, through the buffer `halves`.
fn round_to_f16(x: &mut [f32], halves: &mut Vec<f16>) {
    halves.resize(x.len(), f16::ZERO);
    halves.convert_from_f32_slice(x);
    halves.convert_to_f32_slice(x);
}

/// The keys at `positions` for one KV head, in order, as runs of rows that lie
/// end to end: one run, or two where the ring of a sliding-window layer wraps.
fn key_runs(cache: &LayerCache, kv_head: usize, positions: Range<usize>) -> impl Iterator<Item = &[f16]> {
    let (a, b) = cache.keys(kv_head, positions);
    [a, b].into_iter().filter(|run| !run.is_empty())
}

/// The values at `positions`, as [`key_runs`] gives the keys.
fn value_runs(cache: &LayerCache, kv_head: usize, positions: Range<usize>) -> impl Iterator<Item = &[f16]> {
    let (a, b) = cache.values(kv_head, positions);
    [a, b].into_iter().filter(|run| !run.is_empty())
}
