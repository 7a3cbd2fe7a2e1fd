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

/// The buffers of one KV head's group, and its records of a call.
struct Group {
    heads: HeadAttention,
    scan: GroupScan,
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
        self.scan.scan(call, kv_head, &split, &perturbations);
        self.reads.reset(self.scan.keys(&split), n_gqa);
        // The exact set's scores, read once for the group's heads.
        let exact = {
            let mut keys = CacheHead::new(call, kv_head, &split, &self.scan, 0, &mut self.reads);
            if keys.exact_len() > 0 {
                keys.exact_score(0);
            }
            keys.bytes.keys
        };
        let shared = (self.scan.scanned_bytes + exact) as f64 / n_gqa as f64;
        for (g, out) in out.chunks_exact_mut(dim_v).enumerate() {
            let mut keys = CacheHead::new(call, kv_head, &split, &self.scan, g, &mut self.reads);
            let driven = self.heads.attend(&mut keys, Stop::Certified, out);
            let read = keys.bytes.keys + keys.bytes.values;
            let mut record = record(certificate, call, kv_head * n_gqa + g, &split, &driven, read);
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
        let params = self.params;
        self.groups.resize_with(batch.n_kv_head(), || Group {
            heads: HeadAttention::new(params),
            scan: GroupScan::default(),
            reads: GroupReads::default(),
            records: Vec::new(),
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
