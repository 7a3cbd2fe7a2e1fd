//! Candidate generation over the real cache: deterministic score bounds
//! from the key sketch, and the reads a head makes through them.
//!
//! For one KV head at one decoding step, [`GroupScan`] scans the 4-bit
//! sketch of every pool page once for all the query heads of the group
//! (`KeySketch::scan_heads`), and keeps per head and pool key the bounds
//! `l_i ≤ s_i ≤ u_i` on the score `s_i = scale·q·k_i`, soft-capped where
//! the model caps (the sketch bounds `q·k` for the f32 dot of the query
//! given, in any order; [`Scorer::bounds`] carries them to the score, in
//! f32 and in f64).
//! Keys no sketch bounds (the newest pages, not yet sketched, and the sinks
//! of a coded page 0) get infinite bounds, so [`super::head`] scores them
//! exactly when it looks for the maximum. The scan also takes `V_max`, the
//! largest value norm over the pool's pages, from the per-page maxima the
//! cache keeps as it stores values: a deterministic bound, as the
//! certificate needs.
//!
//! [`CacheHead`] is one query head's view for [`super::head::HeadAttention`]:
//! the exact set is the sinks and the window, and exact scores and values
//! are read from the cache as dense attention reads them: f16 rows, or the
//! codes' levels in the quantized modes. The query is rounded to f16 first,
//! as dense attention (ggml) does, and the sketch is scanned with that same
//! query, so the bounds hold for the scores used. The perturbations are the
//! group's, drawn once for all its query heads, and so are the exact
//! scores: the first head that needs a key's score reads the key once and
//! scores it for every head of the group ([`SharedScores`]), as dense
//! attention reads each key once for the group.
//!
//! The 8-bit refinement (`KeySketch::refine`) is not used: it is a scalar
//! computation in f64 over every channel, several times dearer than the
//! exact f16 dot product it would save (measured on the synthetic
//! benchmark: with it, refinement and its per-page set-up took over half
//! of a call), so a key whose scan bound lets it enter is scored exactly.
//!
//! # Bytes
//!
//! Each head counts what it reads: its share of the scan (the sketch's
//! minima and steps and its coarse codes, split evenly among the group's
//! heads, which read them once together), the bytes of the keys it read
//! first for the group, and its value bytes, as the cache holds them
//! ([`HeadRows::key_bytes`], [`HeadRows::value_bytes`]), the exact set's
//! included.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::head::HeadKeys;
use super::perturb::Perturbations;
use crate::attn::read::{self, HeadRows, Stretch};
use crate::attn::{LayerCall, Scorer, Split};
use crate::kv::quant::{packed_len, Affine, Bits};
use crate::kv::{Bounds, KeyCover, KvMode, PagedLayer, ScanQuery, PAGE};

/// The pool of one KV head at one decoding step, scanned for the query
/// heads of its group.
#[derive(Default)]
pub struct GroupScan {
    /// The group's queries rounded to f16: `n_gqa` rows of `head_dim_k`.
    queries: Vec<f32>,
    halves: Vec<f16>,
    prepared: Vec<ScanQuery>,
    page_bounds: Vec<Bounds>,
    /// `[head][pool key]`: bounds on the scaled scores.
    bounds: Vec<(f64, f64)>,
    pool: usize,
    /// `E_i` of every pool key.
    exponentials: Vec<f64>,
    /// `V_max` over the pool's pages.
    pub value_norm_max: f64,
    /// Sketch bytes the scan read, for the whole group.
    pub scanned_bytes: usize,
}

impl GroupScan {
    /// Scans the pool `split.pool` of `kv_head` for the group's queries,
    /// and draws the pool's perturbations.
    pub fn scan(&mut self, call: &LayerCall, kv_head: usize, split: &Split, perturbations: &Perturbations) {
        let (batch, cache) = (call.batch, call.cache);
        let (n_gqa, dim) = (batch.n_gqa, batch.head_dim_k);
        self.queries.clear();
        self.queries.extend_from_slice(&batch.queries[kv_head * n_gqa * dim..][..n_gqa * dim]);
        self.halves.resize(self.queries.len(), f16::ZERO);
        self.halves.convert_from_f32_slice(&self.queries);
        self.halves.convert_to_f32_slice(&mut self.queries);
        self.prepared.resize_with(n_gqa, ScanQuery::default);
        self.pool = split.pool.len();
        self.bounds.clear();
        self.bounds.resize(n_gqa * self.pool, (f64::NEG_INFINITY, f64::INFINITY));
        self.page_bounds.resize(n_gqa * PAGE, Bounds { lower: 0.0, upper: 0.0 });
        self.scanned_bytes = 0;
        self.value_norm_max = 0.0;
        self.exponentials.clear();
        self.exponentials.extend(split.pool.clone().map(|pos| perturbations.exponential(pos)));
        if split.pool.is_empty() {
            return;
        }
        let scorer = batch.scorer;
        for page in split.pool.start / PAGE..split.pool.end.div_ceil(PAGE) {
            self.value_norm_max = self.value_norm_max.max(f64::from(cache.value_norm(kv_head, page)));
        }
        for cover in cache.key_cover(kv_head, split.pool.clone()) {
            let KeyCover::Sketched { page, sketch, rows } = cover else { continue };
            for (prepared, q) in self.prepared.iter_mut().zip(self.queries.chunks_exact(dim)) {
                prepared.prepare(sketch, q);
            }
            sketch.scan_heads(&self.prepared, &mut self.page_bounds);
            self.scanned_bytes += scan_bytes(cache.mode(), dim);
            let first = page * PAGE + rows.start - split.pool.start;
            for h in 0..n_gqa {
                let page_bounds = &self.page_bounds[h * PAGE..][rows.clone()];
                let bounds = &mut self.bounds[h * self.pool + first..][..rows.len()];
                for (b, pb) in bounds.iter_mut().zip(page_bounds) {
                    *b = scorer.bounds(pb.lower, pb.upper);
                }
            }
        }
    }

    /// Query head `g` of the group, rounded to f16.
    pub fn query(&self, g: usize, dim: usize) -> &[f32] {
        &self.queries[g * dim..][..dim]
    }

    /// Keys the group's heads may score: the exact set's and the pool's.
    pub fn keys(&self, split: &Split) -> usize {
        split.sinks.len() + split.window.len() + self.pool
    }

    /// `E_i` per pool key.
    pub fn exponentials(&self) -> &[f64] {
        &self.exponentials
    }

    /// Bounds of query head `g` of the group, per pool key.
    pub fn bounds(&self, g: usize) -> &[(f64, f64)] {
        &self.bounds[g * self.pool..][..self.pool]
    }
}

/// Exact scores of the group's keys, for all its query heads at once: the
/// first head that needs a key's score reads the key once for all of them.
/// Keys are numbered as the exact set (sinks, window) and then the pool.
#[derive(Default)]
pub struct SharedScores {
    /// `[key][head]`: the scaled score, NaN until read.
    scores: Vec<f32>,
    n_gqa: usize,
    dots: Vec<f32>,
}

impl SharedScores {
    /// Forgets every score, for `keys` keys of `n_gqa` heads.
    pub fn reset(&mut self, keys: usize, n_gqa: usize) {
        self.n_gqa = n_gqa;
        self.scores.clear();
        self.scores.resize(keys * n_gqa, f32::NAN);
        self.dots.resize(n_gqa, 0.0);
    }
}

/// Runs of keys to score this close are read as one, the keys between them
/// included: a kernel call costs about as much as reading a few keys.
const RUN_GAP: usize = 8;

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
    /// The group's queries (rounded to f16) and this head's place among them.
    queries: &'a [f32],
    g: usize,
    shared: &'a mut SharedScores,
    scorer: Scorer,
    bounds: &'a [(f64, f64)],
    exponentials: &'a [f64],
    value_norm_max: f64,
    runs: Vec<std::ops::Range<usize>>,
    pub bytes: HeadBytes,
}

impl<'a> CacheHead<'a> {
    /// Query head `g` of `kv_head`'s group, scanned by `scan`; `shared`
    /// holds the group's scores, reset for this call.
    pub fn new(
        call: &LayerCall<'a>,
        kv_head: usize,
        split: &'a Split,
        scan: &'a GroupScan,
        g: usize,
        shared: &'a mut SharedScores,
    ) -> Self {
        let rows = HeadRows::new(call, kv_head);
        Self {
            rows,
            split,
            queries: &scan.queries,
            g,
            shared,
            scorer: call.batch.scorer,
            bounds: scan.bounds(g),
            exponentials: scan.exponentials(),
            value_norm_max: scan.value_norm_max,
            runs: Vec::new(),
            bytes: HeadBytes::default(),
        }
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

    /// Reads those of `keys` (numbered as in [`SharedScores`], ascending,
    /// at `position(key)`, consecutive keys at consecutive positions) that
    /// no head has read yet, and scores them for every head of the group, a
    /// run of keys per kernel call (runs closer than [`RUN_GAP`] read the
    /// keys between them too); counts their bytes here.
    fn read_scores(&mut self, keys: impl Iterator<Item = usize>, position: impl Fn(usize) -> usize) {
        let n = self.shared.n_gqa;
        self.runs.clear();
        for key in keys.filter(|&key| self.shared.scores[key * n].is_nan()) {
            match self.runs.last_mut() {
                Some(run) if key - run.end < RUN_GAP => run.end = key + 1,
                _ => self.runs.push(key..key + 1),
            }
        }
        for k in 0..self.runs.len() {
            let run = self.runs[k].clone();
            let positions = position(run.start)..position(run.start) + run.len();
            self.shared.dots.resize(n * run.len(), 0.0);
            let rows = self.cache().key_rows(self.rows.head, positions.clone()).map(Stretch::from);
            read::score(simd::kernels(), self.rows.dim_k, self.queries, rows, &mut self.shared.dots, run.len());
            for (j, key) in run.enumerate() {
                for h in 0..n {
                    self.shared.scores[key * n + h] = self.scorer.score(self.shared.dots[h * (positions.len()) + j]);
                }
            }
            self.bytes.keys += self.rows.key_bytes(&[positions]);
        }
    }

    /// The score of key `key`, once read.
    fn score(&self, key: usize) -> f64 {
        f64::from(self.shared.scores[key * self.shared.n_gqa + self.g])
    }

    fn value_at(&mut self, pos: usize, out: &mut [f32]) {
        self.cache().value(self.rows.head, pos, out);
        self.bytes.values += self.rows.value_bytes(std::slice::from_ref(&(pos..pos + 1)));
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
        if self.shared.scores[i * self.shared.n_gqa].is_nan() {
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

    fn pool_bounds(&self, i: usize) -> (f64, f64) {
        self.bounds[i]
    }

    fn pool_refined_upper(&mut self, _: usize) -> Option<f64> {
        None
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

    fn perturbation(&self, i: usize) -> f64 {
        self.exponentials[i]
    }

    fn value_norm_max(&self) -> f64 {
        self.value_norm_max
    }
}
