//! Exact attention: every visible key is read.
//!
//! The arithmetic follows ggml's non-flash attention path, whose results
//! llama.cpp's references were computed with: the query is rounded to f16 for
//! the q·k products (ggml multiplies an f16 cache with f16 operands), the
//! softmax is taken in f32, and the probabilities are rounded to f16 before
//! they weight the f16 values. Sums are in f32.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

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

/// Per-task buffers: scores over the visible keys, the rounded query, one
/// widened key or value row.
#[derive(Default)]
struct Buffers {
    scores: Vec<f32>,
    query: Vec<f32>,
    row: Vec<f32>,
}

/// `out` gets `n_tokens` rows of `n_head * head_dim_v`: for every token and
/// head, softmax(scale · q·K) · V over the positions the cache shows it.
pub fn attend(batch: &AttentionBatch, cache: &LayerCache, out: &mut [f32]) {
    let AttentionBatch { queries, pos0, n_head, head_dim_k, head_dim_v, n_gqa, scale } = *batch;
    out.par_chunks_mut(head_dim_v).enumerate().for_each_init(Buffers::default, |b, (i, out)| {
        let (t, h) = (i / n_head, i % n_head);
        let kv_head = h / n_gqa;
        b.query.clear();
        b.query.extend(queries[i * head_dim_k..(i + 1) * head_dim_k].iter().map(|&x| round_f16(x)));
        b.row.resize(head_dim_k.max(head_dim_v), 0.0);
        let visible = cache.visible(pos0 + t);

        b.scores.clear();
        let mut max = f32::NEG_INFINITY;
        for pos in visible.clone() {
            let key = &mut b.row[..head_dim_k];
            cache.key(kv_head, pos).convert_to_f32_slice(key);
            let s = scale * dot(&b.query, key);
            max = max.max(s);
            b.scores.push(s);
        }
        let mut sum = 0.0f32;
        for s in b.scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }

        out.fill(0.0);
        for (pos, &s) in visible.zip(&b.scores) {
            let p = round_f16(s / sum);
            let value = &mut b.row[..head_dim_v];
            cache.value(kv_head, pos).convert_to_f32_slice(value);
            for (o, &v) in out.iter_mut().zip(value.iter()) {
                *o += p * v;
            }
        }
    });
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
