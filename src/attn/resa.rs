//! Group block-sparse attention, as ReSA decodes (arXiv 2506.04108): a
//! baseline without a certificate, the sparse phase that rectification
//! ([`crate::rectify`]) was proposed with.
//!
//! The keys are cut into blocks of [`BLOCK`] positions, and each block is
//! described by the per-channel minimum `m` and maximum `M` of its keys (as
//! the cache returns them). On a decoding step whose pool is large enough
//! ([`super::worth_sparse`]), the query heads of one KV head choose their
//! blocks together, with their mean query `q̄`: a block's score is Quest's
//! bound on `q̄·k` over the block, `Σ_c max(q̄_c·M_c, q̄_c·m_c)`. Of the `n`
//! blocks the step sees, it keeps the newest (partly stored) block and the
//! `max(⌈p·n⌉, min(n, n_min))` others of the largest scores (ties to the
//! earlier block), with the seed's `p = 0.1` and `n_min = 16`
//! ([`Params::default`]). Every query head then attends to those blocks
//! alone, in ggml's arithmetic; the rest of the softmax's mass is dropped,
//! which the certificate says with an infinite ε. Every other call is dense.
//!
//! The descriptors are the policy's own, per layer and KV head, built from
//! the cache as blocks fill and dropped when the cache forgets their
//! positions ([`AttentionPolicy::forget_from`]): a rectification rebuilds
//! them from the keys it rewrote. A block that began before a sliding
//! window's first visible position is described from that position on.

use std::ops::Range;

use half::f16;
use rayon::prelude::*;
use simd::Kernels;

use super::dense::Dense;
use super::read::{self, round_to_f16, AttendScratch, HeadRows};
use super::{worth_sparse, AttentionKind, AttentionPolicy, Certificate, Estimate, HeadRecord, LayerCall};

/// Positions per block.
pub const BLOCK: usize = 16;

/// What a ReSA head promises: nothing.
pub const UNBOUNDED: Certificate =
    Certificate { kind: AttentionKind::Resa, epsilon: f64::INFINITY, delta: 0.0, measure: None };

/// How many blocks a step keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// The share of the blocks kept, `p`.
    pub ratio: f64,
    /// The fewest blocks kept (all of them, when there are fewer), `n_min`.
    pub min_blocks: usize,
}

impl Default for Params {
    /// The seed's configuration: 10% of the blocks, at least 16.
    fn default() -> Self {
        Self { ratio: 0.1, min_blocks: 16 }
    }
}

impl Params {
    /// The blocks chosen by score when a step sees `n` (the newest comes
    /// on top).
    pub fn budget(&self, n: usize) -> usize {
        let share = (self.ratio * n as f64).ceil() as usize;
        share.max(n.min(self.min_blocks))
    }
}

/// The block descriptors of one layer: per block and KV head, the minima
/// then the maxima of its keys' channels.
#[derive(Default)]
struct LayerBlocks {
    /// `[block][kv head][min | max][channel]`.
    bounds: Vec<f32>,
    /// Blocks described: `0..described` (those before the visible positions
    /// were skipped and hold nothing).
    described: usize,
    /// Numbers per block: `n_kv_head · 2 · head_dim`.
    per_block: usize,
}

/// Block-sparse attention with min/max block descriptors.
#[derive(Default)]
pub struct Resa {
    params: Params,
    layers: Vec<LayerBlocks>,
    key: Vec<f32>,
    /// One per KV head: their groups attend in parallel.
    groups: Vec<GroupScratch>,
}

/// The buffers of one KV head's group.
#[derive(Default)]
struct GroupScratch {
    query: Vec<f32>,
    mean_query: Vec<f32>,
    halves: Vec<f16>,
    /// Scores of the blocks that compete, with their numbers.
    scores: Vec<(f32, usize)>,
    chosen: Vec<usize>,
    ranges: Vec<Range<usize>>,
    attend: AttendScratch,
    log_denominators: Vec<f64>,
}

impl Resa {
    pub fn new(params: Params) -> Self {
        Self { params, ..Self::default() }
    }

    /// The descriptors layer `layer` holds, of its blocks `0..n` described
    /// so far: `n` and `[block][kv head][min | max][channel]` (blocks before
    /// a sliding window's first visible position are zeros). A block is
    /// described when a sparse step first sees it complete, and described
    /// anew after a rectification rewrote any of its keys.
    pub fn descriptors(&self, layer: usize) -> (usize, &[f32]) {
        self.layers.get(layer).map_or((0, &[]), |b| (b.described, &b.bounds[..b.described * b.per_block]))
    }

    /// Describes the complete blocks of `call`'s layer up to the newest,
    /// from the first visible position on.
    fn describe(&mut self, call: &LayerCall, visible: &Range<usize>) {
        if self.layers.len() <= call.layer {
            self.layers.resize_with(call.layer + 1, LayerBlocks::default);
        }
        let batch = call.batch;
        let (n_kv, dim) = (batch.n_kv_head(), batch.head_dim_k);
        let blocks = &mut self.layers[call.layer];
        blocks.per_block = n_kv * 2 * dim;
        let complete = visible.end / BLOCK;
        blocks.described = blocks.described.max(visible.start / BLOCK);
        blocks.bounds.resize(complete.max(blocks.described) * n_kv * 2 * dim, 0.0);
        self.key.resize(dim, 0.0);
        for block in blocks.described..complete {
            for h in 0..n_kv {
                let (min, max) = blocks.bounds[(block * n_kv + h) * 2 * dim..][..2 * dim].split_at_mut(dim);
                min.fill(f32::INFINITY);
                max.fill(f32::NEG_INFINITY);
                for pos in (block * BLOCK).max(visible.start)..(block + 1) * BLOCK {
                    call.cache.key(h, pos, &mut self.key);
                    for ((lo, hi), &k) in min.iter_mut().zip(max.iter_mut()).zip(&self.key) {
                        *lo = lo.min(k);
                        *hi = hi.max(k);
                    }
                }
            }
        }
        blocks.described = blocks.described.max(complete);
    }
}

impl GroupScratch {
    /// Fills `chosen` with the blocks KV head `kv_head` reads, in order: the
    /// newest, and the budget's of the largest scores among the others.
    /// Returns the blocks scored.
    fn choose_blocks(
        &mut self,
        params: Params,
        blocks: &LayerBlocks,
        call: &LayerCall,
        kv_head: usize,
        visible: &Range<usize>,
    ) -> usize {
        let batch = call.batch;
        let (g, dim) = (batch.n_gqa, batch.head_dim_k);
        let queries = &batch.queries[kv_head * g * dim..][..g * dim];
        self.mean_query.clear();
        self.mean_query.resize(dim, 0.0);
        for q in queries.chunks_exact(dim) {
            self.mean_query.iter_mut().zip(q).for_each(|(m, &x)| *m += x / g as f32);
        }
        let (first, newest) = (visible.start / BLOCK, (visible.end - 1) / BLOCK);
        let n_kv = batch.n_kv_head();
        let bounds = &blocks.bounds;
        self.scores.clear();
        for block in first..newest {
            let (min, max) = bounds[(block * n_kv + kv_head) * 2 * dim..][..2 * dim].split_at(dim);
            let score = self.mean_query.iter().zip(min.iter().zip(max)).map(|(&q, (&lo, &hi))| (q * lo).max(q * hi));
            self.scores.push((score.sum(), block));
        }
        self.chosen.clear();
        read::choose_largest(&mut self.scores, params.budget(newest - first + 1), &mut self.chosen);
        self.chosen.push(newest);
        self.chosen.sort_unstable();
        self.scores.len()
    }

    /// The attention of KV head `kv_head`'s query heads over their chosen
    /// blocks into `out`, and their records.
    fn attend_group(
        &mut self,
        kernels: &Kernels,
        (params, blocks): (Params, &LayerBlocks),
        call: &LayerCall,
        kv_head: usize,
        out: &mut [f32],
    ) -> Vec<HeadRecord> {
        let batch = call.batch;
        let (g, dim_k) = (batch.n_gqa, batch.head_dim_k);
        let visible = call.visible(0);
        let scored = self.choose_blocks(params, blocks, call, kv_head, &visible);
        let clip = |b: usize| (b * BLOCK).max(visible.start)..((b + 1) * BLOCK).min(visible.end);
        self.ranges.clear();
        self.ranges.extend(read::join(self.chosen.iter().map(|&b| clip(b))));

        let rows = HeadRows::new(call, kv_head);
        self.query.clear();
        self.query.extend_from_slice(&batch.queries[kv_head * g * dim_k..][..g * dim_k]);
        round_to_f16(&mut self.query, &mut self.halves);
        self.log_denominators.clear();
        let (query, scratch) = (&self.query, &mut self.attend);
        read::attend_positions(
            kernels,
            &rows,
            query,
            batch.scorer,
            &self.ranges,
            scratch,
            out,
            &mut self.log_denominators,
        );

        let n = read::count(&self.ranges);
        let descriptor_bytes = scored * 2 * dim_k * std::mem::size_of::<f32>();
        let bytes = rows.key_bytes(&self.ranges) + rows.value_bytes(&self.ranges) + descriptor_bytes;
        let record = |i: usize| HeadRecord {
            layer: call.layer,
            head: kv_head * g + i,
            certificate: UNBOUNDED,
            level: None,
            fallback: false,
            visible: visible.len(),
            keys_read: n,
            bytes_read: bytes as f64 / g as f64,
            estimate: Some(Estimate { log_denominator: self.log_denominators[i], bound: f64::INFINITY }),
            audit: None,
        };
        (0..g).map(record).collect()
    }
}

impl AttentionPolicy for Resa {
    fn kind(&self) -> AttentionKind {
        AttentionKind::Resa
    }

    fn reads_sketch(&self) -> bool {
        false
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        if !worth_sparse(call) {
            return Dense.attend(call, out, records);
        }
        let visible = call.visible(0);
        self.describe(call, &visible);
        let (kernels, group_out) = (simd::kernels(), call.batch.n_gqa * call.batch.head_dim_v);
        self.groups.resize_with(call.batch.n_kv_head(), GroupScratch::default);
        let shared = (self.params, &self.layers[call.layer]);
        let groups = self.groups.par_iter_mut().zip(out.par_chunks_exact_mut(group_out)).enumerate();
        let records_by_group: Vec<Vec<HeadRecord>> =
            groups.map(|(kv_head, (group, out))| group.attend_group(kernels, shared, call, kv_head, out)).collect();
        records.extend(records_by_group.into_iter().flatten());
    }

    fn forget_from(&mut self, pos: usize) {
        for blocks in &mut self.layers {
            blocks.described = blocks.described.min(pos / BLOCK);
        }
    }
}
