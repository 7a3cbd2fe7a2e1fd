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
//! Exact rows go to the kernels where they lie; the rows of a coded page
//! (the quantized cache modes) are first dequantized, page by page, into the
//! thread's scratch and rounded to f16, as the kernels read them. Splitting a
//! head's rows into stretches changes no result: every score is its own sum,
//! and the weighted values accumulate row after row into the output.
//!
//! The batch's own keys and values are read from the batch, rounded to f16 as
//! the cache stores them, not from the cache, which may already have coded
//! them: a prefill batch attends to itself at full precision, as KIVI's
//! prefill does, and only later batches and decoding steps see its codes.

use std::cell::RefCell;
use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use simd::Kernels;

use crate::kv::quant::ValueRows;
use crate::kv::{KeySketch, PagedLayer, Rows};

/// What one layer's attention needs to know about the batch.
pub struct AttentionBatch<'a> {
    /// Queries after RoPE: `n_tokens` rows of `n_head * head_dim_k`.
    pub queries: &'a [f32],
    /// The batch's keys (after RoPE) and values, as stored in the cache:
    /// `n_tokens` rows of `n_kv_head * head_dim_k` and `n_kv_head * head_dim_v`.
    pub keys: &'a [f32],
    pub values: &'a [f32],
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
    /// Rows of a coded page, dequantized, then as the kernels read them.
    decoded: Vec<f32>,
    decoded_halves: Vec<f16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `out` gets `n_tokens` rows of `n_head * head_dim_v`: for every token and
/// head, softmax(scale · q·K) · V over the positions the cache shows it.
pub fn attend(batch: &AttentionBatch, cache: &PagedLayer, out: &mut [f32]) {
    let kernels = simd::kernels();
    let own = BatchRows::new(batch);
    out.par_chunks_mut(batch.head_dim_v).enumerate().for_each(|(i, out)| {
        let (t, h) = (i / batch.n_head, i % batch.n_head);
        let visible = cache.visible(batch.pos0 + t);
        let head = Head {
            query: &batch.queries[i * batch.head_dim_k..][..batch.head_dim_k],
            scale: batch.scale,
            keys: cache.key_rows(h / batch.n_gqa, visible.start..batch.pos0.max(visible.start)),
            values: cache.value_rows(h / batch.n_gqa, visible.start..batch.pos0.max(visible.start)),
            own: own.head(h / batch.n_gqa, visible.start.saturating_sub(batch.pos0)..t + 1),
            n_visible: visible.len(),
        };
        SCRATCH.with_borrow_mut(|scratch| head.attend(kernels, scratch, out));
    });
}

/// The batch's keys and values in f16, per KV head: `[head][token][dim]`,
/// so that a head's rows lie end to end.
struct BatchRows {
    keys: Vec<f16>,
    values: Vec<f16>,
    n_tokens: usize,
    dim_k: usize,
    dim_v: usize,
}

impl BatchRows {
    fn new(batch: &AttentionBatch) -> Self {
        let n_tokens = batch.queries.len() / (batch.n_head * batch.head_dim_k);
        let by_head = |rows: &[f32], dim: usize| {
            let n_kv_head = batch.n_head / batch.n_gqa;
            let mut out = vec![f16::ZERO; n_tokens * n_kv_head * dim];
            for (t, row) in rows.chunks_exact(n_kv_head * dim).take(n_tokens).enumerate() {
                for (h, x) in row.chunks_exact(dim).enumerate() {
                    out[(h * n_tokens + t) * dim..][..dim].convert_from_f32_slice(x);
                }
            }
            out
        };
        Self {
            keys: by_head(batch.keys, batch.head_dim_k),
            values: by_head(batch.values, batch.head_dim_v),
            n_tokens,
            dim_k: batch.head_dim_k,
            dim_v: batch.head_dim_v,
        }
    }

    /// The keys and values of `tokens` (batch indices) for one KV head.
    fn head(&self, kv_head: usize, tokens: Range<usize>) -> (&[f16], &[f16]) {
        let rows = kv_head * self.n_tokens + tokens.start..kv_head * self.n_tokens + tokens.end;
        (
            &self.keys[rows.start * self.dim_k..rows.end * self.dim_k],
            &self.values[rows.start * self.dim_v..rows.end * self.dim_v],
        )
    }
}

/// One query head of one token: its keys and values from the cache, then
/// its own batch's.
struct Head<'a, K, V> {
    query: &'a [f32],
    scale: f32,
    keys: K,
    values: V,
    own: (&'a [f16], &'a [f16]),
    n_visible: usize,
}

impl<'a, K, V> Head<'a, K, V>
where
    K: Iterator<Item = Rows<'a, KeySketch>>,
    V: Iterator<Item = Rows<'a, ValueRows>>,
{
    /// `out = softmax(scale · q·K) · V` over the visible positions.
    fn attend(self, kernels: &Kernels, s: &mut Scratch, out: &mut [f32]) {
        let dim_k = self.query.len();
        s.query.clear();
        s.query.extend_from_slice(self.query);
        round_to_f16(&mut s.query, &mut s.halves);

        s.scores.resize(self.n_visible, 0.0);
        let mut scores = &mut s.scores[..];
        for rows in self.keys.chain([Rows::Exact(self.own.0)]) {
            let keys = match rows {
                Rows::Exact(keys) => keys,
                Rows::Coded(sketch, rows) => decode(&mut s.decoded, &mut s.decoded_halves, rows.len() * dim_k, |out| {
                    sketch.dequantize_keys(rows, out)
                }),
            };
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
        let dim_v = out.len();
        let mut probs = &s.scores[..];
        for rows in self.values.chain([Rows::Exact(self.own.1)]) {
            let values = match rows {
                Rows::Exact(values) => values,
                Rows::Coded(coded, rows) => decode(&mut s.decoded, &mut s.decoded_halves, rows.len() * dim_v, |out| {
                    coded.dequantize_rows(rows, out)
                }),
            };
            let (run, rest) = probs.split_at(values.len() / dim_v);
            kernels.add_weighted_f16(run, values, out);
            probs = rest;
        }
    }
}

/// `len` numbers of a coded page, dequantized by `fill` and rounded to f16
/// in `halves`.
fn decode<'a>(
    decoded: &mut Vec<f32>,
    halves: &'a mut Vec<f16>,
    len: usize,
    fill: impl FnOnce(&mut [f32]),
) -> &'a [f16] {
    decoded.resize(len, 0.0);
    fill(decoded);
    halves.resize(len, f16::ZERO);
    halves.convert_from_f32_slice(decoded);
    halves
}

/// Rounds every element to the nearest f16, through the buffer `halves`.
fn round_to_f16(x: &mut [f32], halves: &mut Vec<f16>) {
    halves.resize(x.len(), f16::ZERO);
    halves.convert_from_f32_slice(x);
    halves.convert_to_f32_slice(x);
}
