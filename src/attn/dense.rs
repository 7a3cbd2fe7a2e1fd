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

use crate::kv::{PagedLayer, Rows, PAGE};

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

/// Visible positions from which one group's keys are split among the threads,
/// when the batch has too few groups to keep every thread busy (decoding).
const SPLIT_MIN: usize = 1024;

/// The buffers of the thread that runs a group, kept across calls: its
/// queries rounded to f16, its scores (then probabilities) per query head, and
/// the weighted sums of each piece of the visible positions.
#[derive(Default)]
struct GroupScratch {
    queries: Vec<f32>,
    scores: Vec<f32>,
    halves: Vec<f16>,
    sums: Vec<f32>,
}

/// The buffers of the thread that reads a piece: rows of a coded page,
/// dequantized, then rounded to f16 as the kernels read them.
#[derive(Default)]
struct Decoded {
    numbers: Vec<f32>,
    halves: Vec<f16>,
}

thread_local! {
    static GROUP: RefCell<GroupScratch> = RefCell::default();
    static DECODED: RefCell<Decoded> = RefCell::default();
}

/// `out` gets `n_tokens` rows of `n_head * head_dim_v`: for every token and
/// head, softmax(scale · q·K) · V over the positions the cache shows it.
///
/// The work goes by *group*: one token's query heads that share a KV head,
/// which read each key and value once for all of them. Groups run in
/// parallel; when there are fewer than threads and a group sees many
/// positions, each group's positions are split among the threads instead.
pub fn attend(batch: &AttentionBatch, cache: &PagedLayer, out: &mut [f32]) {
    let kernels = simd::kernels();
    let own = BatchRows::new(batch);
    let n_kv_head = batch.n_head / batch.n_gqa;
    let group = |i: usize| {
        let t = i / n_kv_head;
        Group {
            batch,
            cache,
            own: &own,
            kv_head: i % n_kv_head,
            queries: &batch.queries[i * batch.n_gqa * batch.head_dim_k..][..batch.n_gqa * batch.head_dim_k],
            visible: cache.visible(batch.pos0 + t),
            token: t,
        }
    };
    let group_len = batch.n_gqa * batch.head_dim_v;
    let n_groups = out.len() / group_len;
    let threads = rayon::current_num_threads();
    let longest = cache.visible(batch.pos0 + own.n_tokens - 1).len();
    if n_groups < threads && longest >= SPLIT_MIN {
        for (i, out) in out.chunks_mut(group_len).enumerate() {
            GROUP.with_borrow_mut(|scratch| group(i).attend(kernels, scratch, out, 2 * threads));
        }
    } else {
        out.par_chunks_mut(group_len).enumerate().for_each(|(i, out)| {
            GROUP.with_borrow_mut(|scratch| group(i).attend(kernels, scratch, out, 1));
        });
    }
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

/// One token's query heads that share a KV head, and where their keys and
/// values lie: in the cache before the batch, in the batch from `pos0` on.
struct Group<'a> {
    batch: &'a AttentionBatch<'a>,
    cache: &'a PagedLayer,
    own: &'a BatchRows,
    kv_head: usize,
    /// `n_gqa` rows of `head_dim_k`.
    queries: &'a [f32],
    visible: Range<usize>,
    /// Index in the batch.
    token: usize,
}

impl<'a> Group<'a> {
    /// `out = softmax(scale · q·K) · V` over the visible positions for each
    /// query head (`n_gqa` rows of `head_dim_v`), reading the positions in
    /// up to `pieces` stretches in parallel.
    ///
    /// Each score is its own sum and each piece's weighted sums add row
    /// after row, so one piece reproduces ggml's arithmetic; several add
    /// their sums at the end, in order.
    fn attend(&self, kernels: &Kernels, s: &mut GroupScratch, out: &mut [f32], pieces: usize) {
        let (heads, n) = (self.batch.n_gqa, self.visible.len());
        let piece_len = n.div_ceil(pieces).next_multiple_of(PAGE);
        let piece = |p: usize| {
            let start = self.visible.start + p * piece_len;
            start..self.visible.end.min(start + piece_len)
        };
        s.queries.clear();
        s.queries.extend_from_slice(self.queries);
        round_to_f16(&mut s.queries, &mut s.halves);
        let queries = &s.queries[..];

        // Each piece's scores lie together: `[head][position in the piece]`.
        s.scores.resize(heads * n, 0.0);
        s.scores.par_chunks_mut(heads * piece_len).enumerate().for_each(|(p, scores)| {
            DECODED.with_borrow_mut(|d| self.score(kernels, queries, piece(p), scores, d));
        });
        self.softmax(kernels, s, piece_len);

        let dim_v = self.batch.head_dim_v;
        s.sums.resize(n.div_ceil(piece_len) * heads * dim_v, 0.0);
        let probs = &s.scores[..];
        s.sums.par_chunks_mut(heads * dim_v).enumerate().for_each(|(p, sums)| {
            let probs = &probs[p * heads * piece_len..][..heads * piece(p).len()];
            DECODED.with_borrow_mut(|d| self.weigh(kernels, probs, piece(p), sums, d));
        });
        let mut sums = s.sums.chunks_exact(heads * dim_v);
        out.copy_from_slice(sums.next().expect("at least one piece"));
        for sums in sums {
            out.iter_mut().zip(sums).for_each(|(o, x)| *o += x);
        }
    }

    /// `scores[h][j] = scale · q_h·k_j` for the keys at `positions`.
    fn score(&self, kernels: &Kernels, queries: &[f32], positions: Range<usize>, scores: &mut [f32], d: &mut Decoded) {
        let (dim, n) = (self.batch.head_dim_k, positions.len());
        let (cached, own) = self.split(positions);
        let own = self.own.head(self.kv_head, own).0;
        let mut col = 0;
        for rows in self.cache.key_rows(self.kv_head, cached).chain([Rows::Exact(own)]) {
            let keys = match rows {
                Rows::Exact(keys) => keys,
                Rows::Coded(sketch, rows) => d.decode(rows.len() * dim, |out| sketch.dequantize_keys(rows, out)),
            };
            kernels.scores_f16(dim, queries, keys, &mut scores[col..], n);
            col += keys.len() / dim;
        }
        scores.iter_mut().for_each(|x| *x *= self.batch.scale);
    }

    /// Turns each head's scores into probabilities rounded to f16 (as ggml
    /// does), over the pieces of `piece_len` positions they lie in.
    fn softmax(&self, kernels: &Kernels, s: &mut GroupScratch, piece_len: usize) {
        let (heads, n) = (self.batch.n_gqa, self.visible.len());
        for h in 0..heads {
            let max = head_rows(&mut s.scores, heads, piece_len, h).flatten().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
            let sum: f32 = head_rows(&mut s.scores, heads, piece_len, h).map(|row| kernels.softmax_exp(row, max)).sum();
            let inv_sum = 1.0 / sum;
            head_rows(&mut s.scores, heads, piece_len, h).flatten().for_each(|x| *x *= inv_sum);
        }
        debug_assert_eq!(s.scores.len(), heads * n);
        round_to_f16(&mut s.scores, &mut s.halves);
    }

    /// `sums[h] = Σ_j probs[h][j] · v_j` over the values at `positions`.
    fn weigh(&self, kernels: &Kernels, probs: &[f32], positions: Range<usize>, sums: &mut [f32], d: &mut Decoded) {
        let (dim, n) = (self.batch.head_dim_v, positions.len());
        let (cached, own) = self.split(positions);
        let own = self.own.head(self.kv_head, own).1;
        sums.fill(0.0);
        let mut col = 0;
        for rows in self.cache.value_rows(self.kv_head, cached).chain([Rows::Exact(own)]) {
            let values = match rows {
                Rows::Exact(values) => values,
                Rows::Coded(coded, rows) => d.decode(rows.len() * dim, |out| coded.dequantize_rows(rows, out)),
            };
            kernels.add_weighted_f16(dim, &probs[col..], n, values, sums);
            col += values.len() / dim;
        }
    }

    /// `positions` as the cache's (before the batch) and the batch's own
    /// (as indices into the batch, up to this token).
    fn split(&self, positions: Range<usize>) -> (Range<usize>, Range<usize>) {
        let pos0 = self.batch.pos0;
        debug_assert!(positions.end <= pos0 + self.token + 1);
        (
            positions.start.min(pos0)..positions.end.min(pos0),
            positions.start.max(pos0) - pos0..positions.end.max(pos0) - pos0,
        )
    }
}

/// The stretch of head `h`'s scores in each piece of `piece_len` positions.
fn head_rows(scores: &mut [f32], heads: usize, piece_len: usize, h: usize) -> impl Iterator<Item = &mut [f32]> {
    scores.chunks_mut(heads * piece_len).map(move |piece| {
        let len = piece.len() / heads;
        &mut piece[h * len..][..len]
    })
}

impl Decoded {
    /// `len` numbers of a coded page, dequantized by `fill` and rounded to f16.
    fn decode(&mut self, len: usize, fill: impl FnOnce(&mut [f32])) -> &[f16] {
        self.numbers.resize(len, 0.0);
        fill(&mut self.numbers);
        self.halves.resize(len, f16::ZERO);
        self.halves.convert_from_f32_slice(&self.numbers);
        &self.halves
    }
}

/// Rounds every element to the nearest f16, through the buffer `halves`.
fn round_to_f16(x: &mut [f32], halves: &mut Vec<f16>) {
    halves.resize(x.len(), f16::ZERO);
    halves.convert_from_f32_slice(x);
    halves.convert_to_f32_slice(x);
}
