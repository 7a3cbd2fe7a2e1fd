//! Certified attention as a session's [`AttentionPolicy`].
//!
//! A decoding step whose pool is large enough to pay ([`worth_sparse`]: at
//! least [`SPARSE_MIN_VISIBLE`](crate::attn::SPARSE_MIN_VISIBLE) visible
//! positions, which keeps Gemma 3's sliding layers dense) is read sparsely:
//! per KV head, the pool is scanned once for the group's query heads
//! ([`GroupScan`]), the group draws one set of perturbations (layer, KV
//! head, step), and each query head runs [`HeadAttention`] over its own
//! bounds. The KV heads run in parallel, each with its own buffers, and
//! where the threads outnumber the KV heads (Gemma 3's global layers have
//! one), each group's query heads are split among its share of them. Every
//! other call (prefill batches, short contexts) is dense.
//!
//! Each head's record says what it did: the level it stopped at, or a
//! fallback to exact attention (with [`Certificate::DENSE`], which exact
//! attention has); the keys whose exact scores it used (the exact set's and
//! the pool's); the bytes it read (its share of the scan, exact keys and
//! values); and the estimate `ln D̂` (the shift added back) with
//! the certificate's bound on the measure's scale.

use std::ops::Range;

use rayon::prelude::*;

use super::candidates::{group_threads, CacheHead, GroupReads, GroupScan};
use super::head::{HeadAttention, HeadKeys, HeadRecord as Driven, Params, Stop};
use super::perturb::{PerturbationSeed, Perturbations};
use crate::attn::dense::Dense;
use crate::attn::{worth_sparse, AttentionKind, AttentionPolicy, Certificate, Estimate, HeadRecord, LayerCall, Split};

/// Certified sparse attention on decoding steps, dense elsewhere.
pub struct CertifiedPolicy {
    params: Params,
    seed: PerturbationSeed,
    certificate: Certificate,
    /// One per KV head.
    groups: Vec<Group>,
}

/// The buffers of one KV head's group: its scan, and its query heads in
/// parts, each attended by one thread.
struct Group {
    scan: GroupScan,
    parts: Vec<Part>,
}

/// A run of a group's query heads, attended one after another by one
/// thread, with its own reads of the keys and its records of a call.
struct Part {
    heads: HeadAttention,
    reads: GroupReads,
    records: Vec<HeadRecord>,
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
    /// KV head `kv_head`'s query heads, into `out` (theirs only). Where the
    /// group's share of the threads is more than one (a model with fewer KV
    /// heads than threads), its query heads are split into as many parts,
    /// attended in parallel: each head's output, level and keys are those
    /// of one thread, bit for bit (its scores are the same products), and
    /// only a key two parts need is read by each.
    fn attend(
        &mut self,
        params: Params,
        certificate: &Certificate,
        seed: PerturbationSeed,
        call: &LayerCall,
        kv_head: usize,
        out: &mut [f32],
    ) {
        let batch = call.batch;
        let (n_gqa, dim_v) = (batch.n_gqa, batch.head_dim_v);
        let split = Split::of(call.visible(0));
        let perturbations = Perturbations::new(seed, call.layer, kv_head, call.step);
        self.scan.scan(call, kv_head, &split, &perturbations);
        let n = group_threads(call).min(n_gqa).max(1);
        if self.parts.len() < n {
            self.parts.resize_with(n, || Part {
                heads: HeadAttention::new(params),
                reads: GroupReads::default(),
                records: Vec::new(),
            });
        }
        let heads = |k: usize| n_gqa * k / n..n_gqa * (k + 1) / n;
        let shared = GroupCall { certificate, call, kv_head, split: &split, scan: &self.scan };
        if n == 1 {
            self.parts[0].attend(&shared, heads(0), out);
        } else {
            let mut outs = Vec::with_capacity(n);
            let mut rest = out;
            for k in 0..n {
                let (part_out, tail) = rest.split_at_mut(heads(k).len() * dim_v);
                outs.push(part_out);
                rest = tail;
            }
            self.parts[..n]
                .par_iter_mut()
                .zip(outs)
                .enumerate()
                .for_each(|(k, (part, out))| part.attend(&shared, heads(k), out));
        }
    }
}

/// What the parts of a group share of one call: the call, the KV head, its
/// split and its scan.
struct GroupCall<'a> {
    certificate: &'a Certificate,
    call: &'a LayerCall<'a>,
    kv_head: usize,
    split: &'a Split,
    scan: &'a GroupScan,
}

impl Part {
    /// Query heads `heads` of the group, into `out` (theirs only).
    fn attend(&mut self, group: &GroupCall, heads: Range<usize>, out: &mut [f32]) {
        let GroupCall { certificate, call, kv_head, split, scan } = *group;
        let (n_gqa, dim_v) = (call.batch.n_gqa, call.batch.head_dim_v);
        self.records.clear();
        self.reads.reset(scan.keys(split), heads.clone());
        // The exact set's scores, read once for the part's heads.
        let exact = {
            let mut keys = CacheHead::new(call, kv_head, split, scan, heads.start, &mut self.reads);
            if keys.exact_len() > 0 {
                keys.exact_score(0);
            }
            keys.bytes.keys
        };
        let shared = scan.scanned_bytes as f64 / n_gqa as f64 + exact as f64 / heads.len() as f64;
        for (g, out) in heads.zip(out.chunks_exact_mut(dim_v)) {
            let mut keys = CacheHead::new(call, kv_head, split, scan, g, &mut self.reads);
            let driven = self.heads.attend(&mut keys, Stop::Certified, out);
            let read = keys.bytes.keys + keys.bytes.values;
            let mut record = record(certificate, call, kv_head * n_gqa + g, split, &driven, read);
            record.bytes_read += shared;
            self.records.push(record);
        }
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
        self.groups.resize_with(batch.n_kv_head(), || Group { scan: GroupScan::default(), parts: Vec::new() });
        let (params, certificate, seed) = (self.params, &self.certificate, self.seed);
        let group_len = batch.n_gqa * batch.head_dim_v;
        self.groups
            .par_iter_mut()
            .zip(out.par_chunks_exact_mut(group_len))
            .enumerate()
            .for_each(|(kv_head, (group, out))| group.attend(params, certificate, seed, call, kv_head, out));
        records.extend(self.groups.iter_mut().flat_map(|g| g.parts.iter_mut().flat_map(|p| p.records.drain(..))));
    }
}
