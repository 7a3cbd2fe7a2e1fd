//! Certified attention as a session's [`AttentionPolicy`].
//!
//! A decoding step whose pool is large enough to pay ([`worth_sparse`]: at
//! least [`SPARSE_MIN_VISIBLE`](crate::attn::SPARSE_MIN_VISIBLE) visible
//! positions, which keeps Gemma 3's sliding layers dense) is read sparsely:
//! per KV head, the pool is scanned once for the group's query heads
//! ([`GroupScan`]), the group draws one set of perturbations (layer, KV
//! head, step), and each query head runs [`HeadAttention`] over its own
//! bounds. The KV heads run in parallel, each with its own buffers. Every
//! other call (prefill batches, short contexts) is dense.
//!
//! Each head's record says what it did: the level it stopped at, or a
//! fallback to exact attention (with [`Certificate::DENSE`], which exact
//! attention has); the keys whose exact scores it used (the exact set's and
//! the pool's); the bytes it read (its share of the scan, exact keys and
//! values); and the estimate `ln D̂` (the shift added back) with
//! the certificate's bound on the measure's scale.

use rayon::prelude::*;

use super::candidates::{CacheHead, GroupReads, GroupScan};
use super::head::{f32_down, HeadAttention, HeadKeys, HeadRecord as Driven, Params, Stop};
use super::perturb::{PerturbationSeed, Perturbations};
use crate::attn::dense::Dense;
use crate::attn::read::HeadRows;
use crate::attn::{worth_sparse, AttentionKind, AttentionPolicy, Certificate, Estimate, HeadRecord, LayerCall, Split};
use crate::kv::PAGE;

/// Certified sparse attention on decoding steps, dense elsewhere.
pub struct CertifiedPolicy {
    params: Params,
    seed: PerturbationSeed,
    certificate: Certificate,
    /// One per KV head.
    groups: Vec<Group>,
}

/// The buffers of one KV head's group, and its records of a call.
struct Group {
    heads: HeadAttention,
    scan: GroupScan,
    reads: GroupReads,
    records: Vec<HeadRecord>,
    /// Per layer: how the next call refines ahead.
    ahead: Vec<Ahead>,
    thresholds: Vec<f32>,
}

/// How a layer's next call refines ahead of its levels.
#[derive(Clone, Copy)]
struct Ahead {
    /// The level down to which it refines: one below the deepest level the
    /// group's heads stopped at in the layer's last call (at first, the
    /// last level).
    level: usize,
    /// Whether it refines every page as it scans it: half the pages or
    /// more reached that level in the last call.
    every_page: bool,
}

impl CertifiedPolicy {
    pub fn new(params: Params, seed: PerturbationSeed) -> Self {
        let certificate = Certificate {
            kind: AttentionKind::Certified,
            epsilon: params.eps,
            delta: params.delta,
            measure: Some(params.measure),
        };
        Self { params, seed, certificate, groups: Vec::new() }
    }
}

impl Group {
    /// KV head `kv_head`'s query heads, into `out` (theirs only).
    fn attend(
        &mut self,
        certificate: &Certificate,
        seed: PerturbationSeed,
        call: &LayerCall,
        kv_head: usize,
        out: &mut [f32],
    ) {
        let batch = call.batch;
        let (n_gqa, dim_v) = (batch.n_gqa, batch.head_dim_v);
        let split = Split::of(call.visible(0));
        self.records.clear();
        let perturbations = Perturbations::new(seed, call.layer, kv_head, call.step);
        self.scan.start(call, kv_head, &split, &perturbations);
        self.reads.reset(self.scan.keys(&split), split.pool.len(), n_gqa);
        // The exact set's scores give each head its shift, and with the
        // level reached last time, the keys worth refining in one pass.
        let grid = self.heads.params().grid;
        let layer = call.layer;
        if self.ahead.len() <= layer {
            self.ahead.resize(layer + 1, Ahead { level: grid.last, every_page: false });
        }
        let mut shared = {
            let mut keys = CacheHead::new(call, kv_head, &split, &self.scan, 0, &mut self.reads);
            if keys.exact_len() > 0 {
                keys.exact_score(0);
            }
            keys.bytes.keys
        };
        let exact = split.sinks.len() + split.window.len();
        let every_page = self.ahead[layer].every_page;
        shared += self.scan.scan_pages(call, kv_head, every_page.then_some(&mut self.reads));
        let log_tau = grid.log_threshold(self.ahead[layer].level);
        self.thresholds.clear();
        self.thresholds.extend((0..n_gqa).map(|g| {
            let c = self.reads.exact_max(g, exact).max(self.scan.lower_max(g));
            f32_down(c + log_tau - 1e-9 * (1.0 + c.abs()))
        }));
        // Where most pages are refined ahead, the next call refines every
        // page as it scans it.
        let reaching = if every_page {
            self.scan.pages_reaching(&self.thresholds).count()
        } else {
            let (bytes, refined) =
                self.reads.refine_ahead(&mut self.scan, HeadRows::new(call, kv_head), &self.thresholds);
            shared += bytes;
            refined
        };
        let pages = split.pool.end.div_ceil(PAGE) - split.pool.start / PAGE;
        self.ahead[layer].every_page = 2 * reaching >= pages;
        let shared = (self.scan.scanned_bytes + shared) as f64 / n_gqa as f64;
        let mut deepest = 0;
        for (g, out) in out.chunks_exact_mut(dim_v).enumerate() {
            let mut keys = CacheHead::new(call, kv_head, &split, &self.scan, g, &mut self.reads);
            let driven = self.heads.attend(&mut keys, Stop::Certified, out);
            deepest = deepest.max(driven.level.unwrap_or(grid.last));
            let read = keys.bytes.keys + keys.bytes.values;
            let mut record = record(certificate, call, kv_head * n_gqa + g, &split, &driven, read);
            record.bytes_read += shared;
            self.records.push(record);
        }
        self.ahead[layer].level = (deepest + 1).min(grid.last);
    }
}

/// The record of query `head`, from what the driver did.
fn record(
    certified: &Certificate,
    call: &LayerCall,
    head: usize,
    split: &Split,
    driven: &Driven,
    bytes: usize,
) -> HeadRecord {
    let exact_set = split.sinks.len() + split.window.len();
    let (certificate, bound) = match driven.certificate {
        Some(level) => (*certified, level.bound),
        None => (Certificate::DENSE, 0.0),
    };
    HeadRecord {
        layer: call.layer,
        head,
        certificate,
        level: driven.level.map(|j| j as u32),
        fallback: driven.fallback(),
        visible: exact_set + driven.pool,
        keys_read: exact_set + driven.scored,
        bytes_read: bytes as f64,
        estimate: Some(Estimate { log_denominator: driven.shift + driven.denominator.ln(), bound }),
        audit: None,
    }
}

impl AttentionPolicy for CertifiedPolicy {
    fn kind(&self) -> AttentionKind {
        AttentionKind::Certified
    }

    fn reads_sketch(&self) -> bool {
        true
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        if !worth_sparse(call) {
            return Dense.attend(call, out, records);
        }
        let batch = call.batch;
        let params = self.params;
        self.groups.resize_with(batch.n_kv_head(), || Group {
            heads: HeadAttention::new(params),
            scan: GroupScan::default(),
            reads: GroupReads::default(),
            records: Vec::new(),
            ahead: Vec::new(),
            thresholds: Vec::new(),
        });
        let (certificate, seed) = (&self.certificate, self.seed);
        let group_len = batch.n_gqa * batch.head_dim_v;
        self.groups
            .par_iter_mut()
            .zip(out.par_chunks_exact_mut(group_len))
            .enumerate()
            .for_each(|(kv_head, (group, out))| group.attend(certificate, seed, call, kv_head, out));
        records.extend(self.groups.iter_mut().flat_map(|g| g.records.drain(..)));
    }
}
