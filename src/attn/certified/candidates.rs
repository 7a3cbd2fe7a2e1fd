//! Candidate generation over the real cache: deterministic score bounds
//! from the key sketch, and the reads a head makes through them.
//!
//! For one KV head at one decoding step, [`GroupScan`] scans the 4-bit
//! sketch of every pool page once for all the query heads of the group
//! (`KeySketch::scan_heads`, after `ScanQuery::prepare_with` has set up each
//! head's weights and constants from the page's minima and steps, converted
//! once for the group), and keeps per head the largest lower bound and per
//! pool key an upper bound on the *perturbed* score, `p_i ≥ s_i + E_i`, in
//! f32: [`Scorer::upper`] of the bound `u_i` on `q·k` bounds the score as
//! the policy computes it (`fl(scale·fl(q·k))`, rounding being monotone;
//! soft-capped where the model caps, the cap being increasing), and
//! `Ê_i ≥ E_i` is the perturbation's cheap upper bound
//! ([`Perturbations::exponential_upper`]); their f32 sum is moved up by
//! `2^−22` of its terms' size, more than its rounding.
//! Keys no sketch bounds (the newest pages, not yet sketched, and the sinks
//! of a coded page 0) get `p_i = +∞`, so [`super::head`] scores them at
//! once. The scan also takes `V_max`, the largest value norm over the
//! pool's pages, from the per-page maxima the cache keeps as it stores
//! values: a deterministic bound, as the certificate needs.
//!
//! Where the sketch keeps 8-bit codes, the scan refines as it goes: one
//! pass over each page's coarse and fine codes gives, for all the group's
//! heads at once, the scan's bounds and the 8-bit ones
//! ([`KeySketch::refine_page`](crate::kv::KeySketch::refine_page)), and the keys get the refined upper bounds
//! at once. The largest lower bound, and so each head's shift, is the 4-bit
//! scan's all the same (its bounds come out of the same pass, bit for bit),
//! so the keys that enter a level are those the 4-bit scan alone would have
//! let enter; only fewer are read to find them. (On the benchmark's caches
//! and the default model's, the 4-bit bounds let 60–92% of the pool reach
//! the levels the heads go down to, so a 4-bit pass that refined only the
//! pages it could not rule out refined nearly every page anyway, and read
//! their coarse codes twice.)
//!
//! [`CacheHead`] is one query head's view for [`super::head::HeadAttention`]:
//! the exact set is the sinks and the window, and exact scores and values
//! are read from the cache as dense attention reads them: f16 rows, or the
//! codes' levels in the quantized modes. The query is rounded to f16 first,
//! as dense attention (ggml) does, and the sketch is scanned with that same
//! query, so the bounds hold for the scores used. The perturbations are the
//! group's, drawn once for all its query heads, and so are the exact
//! scores and the refinements: the first head that needs a key's score (or
//! its 8-bit bound) reads the key once for every head of the group
//! ([`GroupReads`]), as dense attention reads each key once for the group.
//! (Where the group's heads are split among threads, as on a model with
//! fewer KV heads than threads, a key is read once for each thread's heads.)
//! The key rows a head scores at one level are asked of the caches first,
//! then gathered end to end for one kernel call, and the value rows of the
//! keys that enter at a level are asked for before the first is read: these
//! rows lie scattered over the cache, and read one by one each would wait
//! on memory.
//!
//! # Bytes
//!
//! Each head counts what it reads: its share of the scan (the sketch's
//! minima and steps and its coarse codes, split evenly among the group's
//! heads, which read them once together, fine codes included where the
//! scan refines), the bytes of the keys it read first for the group (the
//! key rows of an exact score), and its value bytes, as the cache holds
//! them ([`HeadRows::key_bytes`], [`HeadRows::value_bytes`]), the exact
//! set's included.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::head::HeadKeys;
use super::perturb::Perturbations;
use crate::attn::read::{self, HeadRows};
use crate::attn::{LayerCall, Scorer, Split};
use crate::kv::quant::{packed_len, Affine, Bits};
use crate::kv::{Bounds, KeyCover, KvMode, PagedLayer, Rows, ScanQuery, PAGE};
use simd::RefinedRows;

/// The pool of one KV head at one decoding step, scanned for the query
/// heads of its group.
#[derive(Default)]
pub struct GroupScan {
    /// The group's queries rounded to f16: `n_gqa` rows of `head_dim_k`.
    queries: Vec<f32>,
    halves: Vec<f16>,
    n_gqa: usize,
    /// How a dot product becomes a score (scale, and soft-cap where the
    /// model caps).
    scorer: Scorer,
    /// The pool's pages split into stretches, one per thread that scans.
    stretches: Vec<Stretch>,
    /// `[head][pool key]`: `p_i ≥ s_i + E_i`.
    perturbed: Vec<f32>,
    /// Per head: the largest lower bound of a pool key's score.
    lower_max: Vec<f64>,
    /// `Ê_i` of every pool key.
    exponential_uppers: Vec<f32>,
    pool: Range<usize>,
    perturbations: Option<Perturbations>,
    /// `V_max` over the pool's pages.
    pub value_norm_max: f64,
    /// Sketch bytes the scan read, for the whole group.
    pub scanned_bytes: usize,
    /// Whether some page's sketch keeps more bits than it scans (and so
    /// its keys' bounds are refined).
    refines: bool,
}

impl GroupScan {
    /// Scans the pool `split.pool` of `kv_head` for the group's queries,
    /// with the pool's perturbations.
    pub fn scan(&mut self, call: &LayerCall, kv_head: usize, split: &Split, perturbations: &Perturbations) {
        self.start(call, kv_head, split, perturbations);
        self.scan_pages(call, kv_head);
    }

    /// Takes the call's queries, rounded to f16, and the pool's
    /// perturbations, and forgets every bound.
    fn start(&mut self, call: &LayerCall, kv_head: usize, split: &Split, perturbations: &Perturbations) {
        let (batch, cache) = (call.batch, call.cache);
        let (n_gqa, dim) = (batch.n_gqa, batch.head_dim_k);
        self.queries.clear();
        self.queries.extend_from_slice(&batch.queries[kv_head * n_gqa * dim..][..n_gqa * dim]);
        self.halves.resize(self.queries.len(), f16::ZERO);
        self.halves.convert_from_f32_slice(&self.queries);
        self.halves.convert_to_f32_slice(&mut self.queries);
        self.n_gqa = n_gqa;
        self.scorer = batch.scorer;
        self.pool = split.pool.clone();
        self.perturbations = Some(*perturbations);
        self.lower_max.clear();
        self.lower_max.resize(n_gqa, f64::NEG_INFINITY);
        self.scanned_bytes = 0;
        self.value_norm_max = 0.0;
        self.refines = false;
        self.exponential_uppers.clear();
        self.exponential_uppers.extend(split.pool.clone().map(|pos| perturbations.exponential_upper(pos)));
        if split.pool.is_empty() {
            return;
        }
        for page in split.pool.start / PAGE..split.pool.end.div_ceil(PAGE) {
            self.value_norm_max = self.value_norm_max.max(f64::from(cache.value_norm(kv_head, page)));
        }
    }

    /// Scans the sketched pages of the pool, refining those whose sketch
    /// keeps 8-bit codes in the same pass. Where the group's share of the
    /// threads is more than one (a model with fewer KV heads than threads),
    /// the pages are split into as many stretches, scanned in parallel: the
    /// bounds are those of one thread, bit for bit, each page's being its own.
    fn scan_pages(&mut self, call: &LayerCall, kv_head: usize) {
        /// The fewest pages worth a thread of their own.
        const MIN_PAGES: usize = 16;
        let pool = self.pool.clone();
        if pool.is_empty() {
            self.perturbed.clear();
            return;
        }
        let (first_page, last_page) = (pool.start / PAGE, pool.end.div_ceil(PAGE));
        let pages = last_page - first_page;
        let n = group_threads(call).min(pages / MIN_PAGES).max(1);
        let mut stretches = std::mem::take(&mut self.stretches);
        stretches.resize_with(n, Stretch::default);
        let this = &*self;
        let positions = |k: usize| {
            let (from, to) = (first_page + pages * k / n, first_page + pages * (k + 1) / n);
            (from * PAGE).max(pool.start)..(to * PAGE).min(pool.end)
        };
        if n == 1 {
            stretches[0].scan(this, call, kv_head, pool.clone());
        } else {
            stretches
                .par_iter_mut()
                .enumerate()
                .for_each(|(k, stretch)| stretch.scan(this, call, kv_head, positions(k)));
        }
        let (n_gqa, len) = (self.n_gqa, pool.len());
        if n > 1 {
            // (Every number is the copy of a stretch's, below.)
            self.perturbed.resize(n_gqa * len, 0.0);
        }
        for (k, stretch) in stretches.iter_mut().enumerate() {
            let keys = positions(k);
            if n == 1 {
                std::mem::swap(&mut self.perturbed, &mut stretch.perturbed);
            } else {
                for (h, perturbed) in stretch.perturbed.chunks_exact(keys.len()).enumerate() {
                    self.perturbed[h * len + keys.start - pool.start..][..keys.len()].copy_from_slice(perturbed);
                }
            }
            for (max, &lower) in self.lower_max.iter_mut().zip(&stretch.lower_max) {
                *max = max.max(lower);
            }
            self.scanned_bytes += stretch.bytes;
            self.refines |= stretch.refines;
        }
        debug_assert_eq!(self.perturbed.len(), n_gqa * len);
        self.stretches = stretches;
    }

    /// Query head `g` of the group, rounded to f16.
    pub fn query(&self, g: usize, dim: usize) -> &[f32] {
        &self.queries[g * dim..][..dim]
    }

    /// Keys the group's heads may score: the exact set's and the pool's.
    pub fn keys(&self, split: &Split) -> usize {
        split.sinks.len() + split.window.len() + self.pool.len()
    }

    /// Query head `g`'s `p_i ≥ s_i + E_i` per pool key (`+∞` where no
    /// sketch bounds the key).
    pub fn perturbed_uppers(&self, g: usize) -> &[f32] {
        &self.perturbed[g * self.pool.len()..][..self.pool.len()]
    }

    /// Query head `g`'s largest lower bound on a pool key's score.
    pub fn lower_max(&self, g: usize) -> f64 {
        self.lower_max[g]
    }
}

/// The threads one KV head's group may use: the pool's share of each KV
/// head (more than one where the threads outnumber the KV heads).
pub fn group_threads(call: &LayerCall) -> usize {
    rayon::current_num_threads().div_ceil(call.batch.n_kv_head())
}

/// One stretch of the pool's pages, as one thread scans it for the group:
/// its buffers, and its part of the scan's results.
#[derive(Default)]
struct Stretch {
    /// The group's queries prepared for the page being scanned.
    prepared: Vec<ScanQuery>,
    /// The group's queries in the scan's weight order (the same for every
    /// sketched page), once a stretch.
    ordered_queries: Vec<f32>,
    /// The page's minima and steps, in channel order, then in the scan's.
    affine: Vec<f32>,
    ordered_affine: Vec<f32>,
    page_bounds: Vec<Bounds>,
    /// The fields of a page's refined bounds ([`RefinedRows::of`]).
    refined_bounds: Vec<f32>,
    /// `[head][key of the stretch]`: `p_i ≥ s_i + E_i`.
    perturbed: Vec<f32>,
    /// Per head: the largest lower bound of a key's score in the stretch.
    lower_max: Vec<f64>,
    /// Sketch bytes read.
    bytes: usize,
    refines: bool,
}

impl Stretch {
    /// Scans the sketched pages of `positions` (a stretch of the pool of
    /// `kv_head`, page-aligned but for the pool's ends) for the queries of
    /// `group`.
    fn scan(&mut self, group: &GroupScan, call: &LayerCall, kv_head: usize, positions: Range<usize>) {
        let cache = call.cache;
        let (n_gqa, dim, len) = (group.n_gqa, call.batch.head_dim_k, positions.len());
        let scorer = group.scorer;
        // Every key's bound is written below: a sketched page's by its scan,
        // the others' as `+∞`.
        self.perturbed.resize(n_gqa * len, f32::INFINITY);
        self.lower_max.clear();
        self.lower_max.resize(n_gqa, f64::NEG_INFINITY);
        self.ordered_queries.clear();
        (self.bytes, self.refines) = (0, false);
        self.prepared.resize_with(n_gqa, ScanQuery::default);
        self.page_bounds.resize(n_gqa * PAGE, Bounds::default());
        self.refined_bounds.resize(4 * n_gqa * PAGE, 0.0);
        for cover in cache.key_cover(kv_head, positions.clone()) {
            let (page, sketch, rows) = match cover {
                KeyCover::Sketched { page, sketch, rows } => (page, sketch, rows),
                KeyCover::Exact(keys) => {
                    let keys = keys.start - positions.start..keys.end - positions.start;
                    for perturbed in self.perturbed.chunks_exact_mut(len) {
                        perturbed[keys.clone()].fill(f32::INFINITY);
                    }
                    continue;
                }
            };
            if let Some(next) = cache.sketch(kv_head, page + 1) {
                next.prefetch();
            }
            if self.ordered_queries.is_empty() {
                sketch.weight_order(&group.queries, &mut self.ordered_queries);
            }
            sketch.affine_f32(&mut self.affine);
            sketch.weight_order(&self.affine, &mut self.ordered_affine);
            let ordered = self.ordered_queries.chunks_exact(self.ordered_queries.len() / n_gqa);
            for (prepared, q) in self.prepared.iter_mut().zip(ordered) {
                prepared.prepare_with(sketch, q, &self.ordered_affine);
            }
            let refines = sketch.refines();
            self.refines |= refines;
            if refines {
                sketch.refine_page(&self.prepared, &mut RefinedRows::of(&mut self.refined_bounds));
                self.bytes += dim * std::mem::size_of::<Affine>() + PAGE * sketch.refinement_bytes();
            } else {
                sketch.scan_heads(&self.prepared, &mut self.page_bounds);
                self.bytes += scan_bytes(cache.mode(), dim);
            }
            let first = page * PAGE + rows.start - positions.start;
            let exponentials = &group.exponential_uppers[page * PAGE + rows.start - group.pool.start..][..rows.len()];
            let refined = RefinedRows::of(&mut self.refined_bounds);
            for h in 0..n_gqa {
                let perturbed = &mut self.perturbed[h * len + first..][..rows.len()];
                let rows = h * PAGE + rows.start..h * PAGE + rows.end;
                let lower = if refines {
                    perturb(scorer, refined.upper[rows.clone()].iter().copied(), exponentials, perturbed);
                    largest(&refined.scanned_lower[rows], |&b| b)
                } else {
                    let bounds = &self.page_bounds[rows];
                    perturb(scorer, bounds.iter().map(|b| b.upper), exponentials, perturbed);
                    largest(bounds, |b| b.lower)
                };
                self.lower_max[h] = self.lower_max[h].max(scorer.bounds(lower, lower).0);
            }
        }
    }
}

/// Scores per key for the group's heads, valid for the current call only:
/// each key's stamp says whether its scores are this call's, so starting a
/// call writes nothing per key. A key's stamp and scores lie side by side,
/// so that looking one up, at keys scattered over the pool, touches one
/// cache line rather than two.
#[derive(Default)]
struct Memo {
    /// Per key: the stamp, then `width` scores as f32 bits.
    entries: Vec<u32>,
    width: usize,
    stamp: u32,
}

impl Memo {
    /// Forgets every score, for `keys` keys of `width` scores.
    fn reset(&mut self, keys: usize, width: usize) {
        if width != self.width {
            self.entries.clear();
            self.width = width;
        }
        self.entries.resize(keys * (width + 1), 0);
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.entries.fill(0);
            self.stamp = 1;
        }
    }

    /// Where key `key`'s stamp and scores lie in `entries`.
    fn entry(&self, key: usize) -> std::ops::Range<usize> {
        key * (self.width + 1)..(key + 1) * (self.width + 1)
    }

    fn get(&self, key: usize) -> Option<&[f32]> {
        let entry = &self.entries[self.entry(key)];
        (entry[0] == self.stamp).then(|| bytemuck::cast_slice(&entry[1..]))
    }

    fn set(&mut self, key: usize) -> &mut [f32] {
        let (range, stamp) = (self.entry(key), self.stamp);
        let entry = &mut self.entries[range];
        entry[0] = stamp;
        bytemuck::cast_slice_mut(&mut entry[1..])
    }
}

/// What a run of the group's query heads (all of them, or the share one
/// thread attends) have read of its keys this call, for all of them at
/// once: exact scores (keys numbered as the exact set, sinks then window,
/// then the pool).
#[derive(Default)]
pub struct GroupReads {
    /// The query heads of the group whose scores are read.
    heads: Range<usize>,
    scores: Memo,
    dots: Vec<f32>,
    /// The exact key rows to score, end to end.
    gathered: Vec<f16>,
}

impl GroupReads {
    /// Forgets everything, for `keys` keys (the exact set's and the pool's)
    /// of the group's query heads `heads`.
    pub fn reset(&mut self, keys: usize, heads: Range<usize>) {
        self.scores.reset(keys, heads.len());
        self.heads = heads;
    }
}

/// `p ≥ upper + e` for an upper bound on a score and one on its
/// perturbation: their f32 sum moved up past its rounding.
fn perturbed_upper(upper: f32, e: f32) -> f32 {
    (upper + e) + (upper.abs() + e) * 2f32.powi(-22)
}

/// `out[i] ≥ s + E` for the keys of `dots`, upper bounds on their dot
/// products, and `exponentials`, upper bounds on their perturbations:
/// [`perturbed_upper`] of [`Scorer::upper`], with the scorer's cap decided
/// once for the run rather than per key (so that the loop without a cap is
/// plain arithmetic, vectorized).
fn perturb(scorer: Scorer, dots: impl Iterator<Item = f32>, exponentials: &[f32], out: &mut [f32]) {
    let keys = out.iter_mut().zip(dots).zip(exponentials);
    match scorer.softcap {
        None => keys.for_each(|((p, u), &e)| *p = perturbed_upper(scorer.scale * u, e)),
        Some(_) => keys.for_each(|((p, u), &e)| *p = perturbed_upper(scorer.upper(u), e)),
    }
}

/// The largest `f(item)` of `items` (`−∞` for none), in eight running
/// maxima rather than one chain of comparisons as long as the page.
fn largest<T>(items: &[T], f: impl Fn(&T) -> f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = items.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, item) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(f(item));
        }
    }
    for (lane, item) in lanes.iter_mut().zip(rest) {
        *lane = lane.max(f(item));
    }
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// The sketch bytes a scan of one page reads: the channels' minima and steps,
/// and the coarse codes (4 bits a channel, 2 in the 2-bit mode).
fn scan_bytes(mode: KvMode, dim: usize) -> usize {
    let bits = if mode == KvMode::Q2 { Bits::Two } else { Bits::Four };
    dim * std::mem::size_of::<Affine>() + PAGE * packed_len(dim, bits)
}

/// What a head read beyond its share of the scan.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeadBytes {
    pub keys: usize,
    pub values: usize,
}

/// One query head's keys as [`super::head::HeadAttention`] reads them.
pub struct CacheHead<'a> {
    rows: HeadRows<'a>,
    split: &'a Split,
    scan: &'a GroupScan,
    g: usize,
    reads: &'a mut GroupReads,
    /// The keys to score and their exact rows.
    pending: Vec<(usize, &'a [f16])>,
    pub bytes: HeadBytes,
}

impl<'a> CacheHead<'a> {
    /// Query head `g` of `kv_head`'s group, scanned by `scan`; `reads`
    /// holds the reads of a run of the group's heads that includes `g`,
    /// reset for this call.
    pub fn new(
        call: &LayerCall<'a>,
        kv_head: usize,
        split: &'a Split,
        scan: &'a GroupScan,
        g: usize,
        reads: &'a mut GroupReads,
    ) -> Self {
        let rows = HeadRows::new(call, kv_head);
        Self { rows, split, scan, g, reads, pending: Vec::new(), bytes: HeadBytes::default() }
    }

    fn cache(&self) -> &'a PagedLayer {
        self.rows.cache
    }

    /// The position of exact-set key `i`: the sinks, then the window.
    fn exact_position(&self, i: usize) -> usize {
        let sinks = self.split.sinks.len();
        if i < sinks {
            self.split.sinks.start + i
        } else {
            self.split.window.start + i - sinks
        }
    }

    /// Reads those of `keys` (numbered as in [`GroupReads`]) at
    /// `position(key)` that no head has read yet, and scores them for every
    /// head of the group: exact rows gathered end to end for one kernel
    /// call (all of them asked of the caches first: they lie scattered),
    /// coded rows in place; counts their bytes here.
    fn read_scores(&mut self, keys: impl Iterator<Item = usize>, position: impl Fn(usize) -> usize) {
        let (dim, kernels) = (self.rows.dim_k, simd::kernels());
        let reads = &mut *self.reads;
        let n = reads.heads.len();
        let queries = &self.scan.queries[reads.heads.start * dim..reads.heads.end * dim];
        self.pending.clear();
        for key in keys {
            if reads.scores.get(key).is_some() {
                continue;
            }
            let pos = position(key);
            match self.rows.cache.key_rows(self.rows.head, pos..pos + 1).next().expect("one row") {
                Rows::Exact(row) => {
                    simd::prefetch(row);
                    self.pending.push((key, row));
                    self.bytes.keys += std::mem::size_of_val(row);
                }
                Rows::Coded(sketch, rows) => {
                    self.bytes.keys += sketch.bytes() / PAGE;
                    reads.dots.resize(n, 0.0);
                    let coded = std::iter::once(read::Stretch::Coded(sketch, rows));
                    read::score(kernels, dim, queries, coded, &mut reads.dots, 1);
                    let scorer = self.scan.scorer;
                    for (score, &dot) in reads.scores.set(key).iter_mut().zip(&reads.dots) {
                        *score = scorer.score(dot);
                    }
                }
            }
        }
        let m = self.pending.len();
        if m == 0 {
            return;
        }
        reads.gathered.clear();
        for (_, row) in &self.pending {
            reads.gathered.extend_from_slice(row);
        }
        reads.dots.resize(n * m, 0.0);
        kernels.scores_f16(dim, queries, &reads.gathered, &mut reads.dots, m);
        for (j, &(key, _)) in self.pending.iter().enumerate() {
            let scorer = self.scan.scorer;
            for (h, score) in reads.scores.set(key).iter_mut().enumerate() {
                *score = scorer.score(reads.dots[h * m + j]);
            }
        }
    }

    /// The score of key `key`, once read.
    fn score(&self, key: usize) -> f64 {
        f64::from(self.reads.scores.get(key).expect("a key read")[self.g - self.reads.heads.start])
    }

    fn value_at(&mut self, pos: usize, out: &mut [f32]) {
        match self.cache().value_rows(self.rows.head, pos..pos + 1).next().expect("one row") {
            Rows::Exact(row) => {
                simd::kernels().dequantize_row(simd::WeightType::F16, bytemuck::cast_slice(row), out);
                self.bytes.values += std::mem::size_of_val(row);
            }
            Rows::Coded(values, rows) => {
                values.dequantize(rows.start, out);
                self.bytes.values += values.bytes() / PAGE;
            }
        }
    }
}

impl HeadKeys for CacheHead<'_> {
    fn value_dim(&self) -> usize {
        self.rows.dim_v
    }

    fn exact_len(&self) -> usize {
        self.split.sinks.len() + self.split.window.len()
    }

    fn exact_score(&mut self, i: usize) -> f64 {
        // The whole exact set at once: the sinks, then the window.
        if self.reads.scores.get(i).is_none() {
            let sinks = self.split.sinks.clone();
            self.read_scores(0..sinks.len(), |key| sinks.start + key);
            let (skip, window) = (sinks.len(), self.split.window.clone());
            self.read_scores(skip..skip + window.len(), |key| window.start + key - skip);
        }
        self.score(i)
    }

    fn exact_value(&mut self, i: usize, out: &mut [f32]) {
        self.value_at(self.exact_position(i), out);
    }

    fn pool_len(&self) -> usize {
        self.split.pool.len()
    }

    fn pool_lower_max(&self) -> f64 {
        self.scan.lower_max(self.g)
    }

    fn perturbed_uppers(&self) -> &[f32] {
        self.scan.perturbed_uppers(self.g)
    }

    fn refines(&self) -> bool {
        self.scan.refines
    }

    /// The scan has refined every key it could: these are its bounds.
    fn refine(&mut self, indices: &[u32], out: &mut [f64]) {
        let uppers = self.scan.perturbed_uppers(self.g);
        for (o, &i) in out.iter_mut().zip(indices) {
            *o = f64::from(uppers[i as usize]);
        }
    }

    fn pool_scores(&mut self, indices: &[u32], out: &mut [f64]) {
        let (skip, start) = (self.exact_len(), self.split.pool.start);
        self.read_scores(indices.iter().map(|&i| skip + i as usize), |key| start + key - skip);
        for (o, &i) in out.iter_mut().zip(indices) {
            *o = self.score(skip + i as usize);
        }
    }

    fn pool_value(&mut self, i: usize, out: &mut [f32]) {
        self.value_at(self.split.pool.start + i, out);
    }

    /// Asks the caches for the values of the pool keys `indices`.
    fn prefetch_values(&mut self, indices: &[u32]) {
        let start = self.split.pool.start;
        for &i in indices {
            let pos = start + i as usize;
            if let Some(Rows::Exact(row)) = self.cache().value_rows(self.rows.head, pos..pos + 1).next() {
                simd::prefetch(row);
            }
        }
    }

    /// Drawn anew from the hash: cheaper than remembering it for the group
    /// (a memo's entries lie scattered like the keys).
    fn perturbation(&mut self, i: usize) -> f64 {
        let perturbations = self.scan.perturbations.expect("a scanned pool");
        perturbations.exponential(self.split.pool.start + i)
    }

    fn value_norm_max(&self) -> f64 {
        self.scan.value_norm_max
    }
}
