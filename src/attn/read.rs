//! Exact reads of a KV head's rows at any set of positions: scores `q·k`
//! for some queries and weighted sums of values, with `simd`'s attention
//! kernels, over f16 rows where they lie and over coded pages in place.
//!
//! Dense attention reads every visible position through these; a sparse
//! policy reads the positions it chose ([`HeadRows`]), given as sorted,
//! disjoint ranges ([`pages`] makes them from page numbers, [`join`] merges
//! adjacent ones). Splitting positions into ranges and ranges into
//! stretches changes no result: every score is its own sum, and weighted
//! values accumulate row after row, in position order.

use std::cell::RefCell;
use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use simd::Kernels;

use super::{LayerCall, Scorer};
use crate::kv::quant::ValueRows;
use crate::kv::{KeySketch, PagedLayer, Rows, PAGE};

thread_local! {
    /// A thread's minima and steps of the coded page it reads, in f32.
    static AFFINE: RefCell<Vec<f32>> = RefCell::default();
}

/// `f` of the calling thread's buffer for a coded page's minima and steps.
/// Nothing inside may run parallel loops (it is borrowed, not taken out).
pub(super) fn with_affine<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    AFFINE.with_borrow_mut(f)
}

/// A stretch of one head's key or value rows, as the kernels take it.
pub enum Stretch<'a, C> {
    /// f16 rows end to end: exact, staged or a batch's own.
    Halves(&'a [f16]),
    /// These rows of a coded page, read in place.
    Coded(&'a C, Range<usize>),
}

impl<'a, C> From<Rows<'a, C>> for Stretch<'a, C> {
    fn from(rows: Rows<'a, C>) -> Self {
        match rows {
            Rows::Exact(rows) => Stretch::Halves(rows),
            Rows::Coded(coded, rows) => Stretch::Coded(coded, rows),
        }
    }
}

/// `scores[h · n + j] = q_h·k_j` for the keys of `stretches` in order, from
/// column 0 on; `queries` holds rows of `dim`. Returns the columns written.
pub fn score<'a>(
    kernels: &Kernels,
    dim: usize,
    queries: &[f32],
    stretches: impl Iterator<Item = Stretch<'a, KeySketch>>,
    scores: &mut [f32],
    n: usize,
) -> usize {
    let mut col = 0;
    for keys in stretches {
        col += match keys {
            Stretch::Halves(keys) => {
                kernels.scores_f16(dim, queries, keys, &mut scores[col..], n);
                keys.len() / dim
            }
            Stretch::Coded(sketch, rows) => with_affine(|affine| {
                let keys = sketch.code_rows(rows.clone(), affine);
                kernels.scores_coded(queries, &keys, &mut scores[col..], n);
                rows.len()
            }),
        };
    }
    col
}

/// `sums[h] += Σ_j weights[h · n + j] · v_j` for the values of `stretches`
/// in order, from column 0 on; `sums` holds rows of `dim`. Returns the
/// columns read.
pub fn weigh<'a>(
    kernels: &Kernels,
    dim: usize,
    weights: &[f32],
    n: usize,
    stretches: impl Iterator<Item = Stretch<'a, ValueRows>>,
    sums: &mut [f32],
) -> usize {
    let mut col = 0;
    for values in stretches {
        col += match values {
            Stretch::Halves(values) => {
                kernels.add_weighted_f16(dim, &weights[col..], n, values, sums);
                values.len() / dim
            }
            Stretch::Coded(coded, rows) => with_affine(|affine| {
                let values = coded.code_rows(rows.clone(), affine);
                kernels.add_weighted_coded(&weights[col..], n, &values, sums);
                rows.len()
            }),
        };
    }
    col
}

/// One KV head's rows in a layer's cache, read at any positions.
#[derive(Clone, Copy)]
pub struct HeadRows<'a> {
    pub cache: &'a PagedLayer,
    pub head: usize,
    pub dim_k: usize,
    pub dim_v: usize,
}

impl<'a> HeadRows<'a> {
    /// KV head `head` of `call`'s cache.
    pub fn new(call: &LayerCall<'a>, head: usize) -> Self {
        Self { cache: call.cache, head, dim_k: call.batch.head_dim_k, dim_v: call.batch.head_dim_v }
    }

    /// `scores[h · n + j] = q_h·k_j` (unscaled) over the keys at
    /// `positions`, in order, `n` being their count.
    pub fn scores(&self, kernels: &Kernels, queries: &[f32], positions: &[Range<usize>], scores: &mut [f32]) {
        let n = count(positions);
        let mut col = 0;
        for range in positions {
            let keys = self.cache.key_rows(self.head, range.clone()).map(Stretch::from);
            col += score(kernels, self.dim_k, queries, keys, &mut scores[col..], n);
        }
    }

    /// `sums[h] += Σ_j weights[h · n + j] · v_j` over the values at
    /// `positions`, in order, `n` being their count.
    pub fn weigh(&self, kernels: &Kernels, weights: &[f32], positions: &[Range<usize>], sums: &mut [f32]) {
        let n = count(positions);
        let mut col = 0;
        for range in positions {
            let values = self.cache.value_rows(self.head, range.clone()).map(Stretch::from);
            col += weigh(kernels, self.dim_v, &weights[col..], n, values, sums);
        }
    }

    /// The bytes of the keys at `positions` as the cache holds them: f16
    /// rows, or a coded page's share per row of its codes, minima and steps.
    pub fn key_bytes(&self, positions: &[Range<usize>]) -> usize {
        let rows = |range: &Range<usize>| self.cache.key_rows(self.head, range.clone());
        positions.iter().flat_map(rows).map(|rows| stretch_bytes(rows, KeySketch::bytes)).sum()
    }

    /// The bytes of the values at `positions`, as [`Self::key_bytes`] counts.
    pub fn value_bytes(&self, positions: &[Range<usize>]) -> usize {
        let rows = |range: &Range<usize>| self.cache.value_rows(self.head, range.clone());
        positions.iter().flat_map(rows).map(|rows| stretch_bytes(rows, ValueRows::bytes)).sum()
    }
}

/// Buffers for [`attend_positions`].
#[derive(Default)]
pub struct AttendScratch {
    scores: Vec<f32>,
    halves: Vec<f16>,
}

/// Attention of the query rows `queries` (of one KV head's query heads,
/// rounded to f16 as every policy rounds them) over the keys and values at
/// `positions` alone, in ggml's arithmetic: scores by `scorer`, the
/// softmax in f32, its weights rounded to f16, and their sum of values into
/// `out` (a row of the value size per query). The softmax's mass elsewhere
/// is dropped. Pushes each query's `ln Σ exp(s_i)` over those keys to
/// `log_denominators`.
#[allow(clippy::too_many_arguments)]
pub fn attend_positions(
    kernels: &Kernels,
    rows: &HeadRows,
    queries: &[f32],
    scorer: Scorer,
    positions: &[Range<usize>],
    s: &mut AttendScratch,
    out: &mut [f32],
    log_denominators: &mut Vec<f64>,
) {
    let (heads, n) = (queries.len() / rows.dim_k, count(positions));
    s.scores.resize(heads * n, 0.0);
    rows.scores(kernels, queries, positions, &mut s.scores);
    for scores in s.scores.chunks_exact_mut(n) {
        scorer.score_all(scores);
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum = kernels.softmax_exp(scores, max);
        let inv_sum = 1.0 / sum;
        scores.iter_mut().for_each(|p| *p *= inv_sum);
        log_denominators.push(f64::from(max) + f64::from(sum).ln());
    }
    round_to_f16(&mut s.scores, &mut s.halves);
    out.fill(0.0);
    rows.weigh(kernels, &s.scores, positions, out);
}

/// Appends to `chosen` the numbers of the `keep` (at most all) of `scored`'s
/// `(score, number)` pairs with the largest scores, ties to the smaller
/// number, in no particular order; `scored` is reordered. A sparse policy's
/// choice of the pages or blocks it reads.
pub fn choose_largest(scored: &mut [(f32, usize)], keep: usize, chosen: &mut Vec<usize>) {
    let keep = keep.min(scored.len());
    let by_score = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if keep > 0 && keep < scored.len() {
        scored.select_nth_unstable_by(keep - 1, by_score);
    }
    chosen.extend(scored[..keep].iter().map(|&(_, number)| number));
}

/// The bytes of one stretch; `page_bytes` is a coded page's size.
fn stretch_bytes<C>(rows: Rows<'_, C>, page_bytes: impl Fn(&C) -> usize) -> usize {
    match rows {
        Rows::Exact(rows) => std::mem::size_of_val(rows),
        Rows::Coded(coded, rows) => rows.len() * page_bytes(coded) / PAGE,
    }
}

/// The positions in `ranges`.
pub fn count(ranges: &[Range<usize>]) -> usize {
    ranges.iter().map(ExactSizeIterator::len).sum()
}

/// The positions of sorted distinct `pages` that lie within `visible`, as
/// ranges (adjacent pages make one).
pub fn pages(pages: impl IntoIterator<Item = usize>, visible: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let clip = move |p: usize| (p * PAGE).max(visible.start)..((p + 1) * PAGE).min(visible.end);
    join(pages.into_iter().map(clip))
}

/// Sorted disjoint `ranges` with the empty ones dropped and adjacent ones
/// made one.
pub fn join(ranges: impl IntoIterator<Item = Range<usize>>) -> impl Iterator<Item = Range<usize>> {
    let mut ranges = ranges.into_iter().filter(|r| !r.is_empty()).peekable();
    std::iter::from_fn(move || {
        let mut range = ranges.next()?;
        while let Some(next) = ranges.next_if(|next| next.start == range.end) {
            range.end = next.end;
        }
        Some(range)
    })
}

/// Rounds every element to the nearest f16, through the buffer `halves`.
pub fn round_to_f16(x: &mut [f32], halves: &mut Vec<f16>) {
    halves.resize(x.len(), f16::ZERO);
    halves.convert_from_f32_slice(x);
    halves.convert_to_f32_slice(x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_clipped_to_the_visible_positions_and_joined() {
        let ranges: Vec<_> = pages([0, 1, 3, 9], 10..200).collect();
        assert_eq!(ranges, vec![10..128, 192..200]);
    }

    #[test]
    fn the_largest_scores_are_chosen_ties_to_the_smaller_number() {
        let mut scored = vec![(1.0, 0), (3.0, 1), (2.0, 2), (3.0, 3), (2.0, 4), (0.5, 5)];
        let mut chosen = vec![9];
        choose_largest(&mut scored, 3, &mut chosen);
        chosen[1..].sort_unstable();
        assert_eq!(chosen, vec![9, 1, 2, 3]);
        let mut all = Vec::new();
        choose_largest(&mut scored, 10, &mut all);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn join_drops_empty_ranges_and_joins_adjacent_ones() {
        let ranges: Vec<_> = join([0..4, 4..4, 4..9, 20..30, 30..31]).collect();
        assert_eq!(ranges, vec![0..9, 20..31]);
    }
}
