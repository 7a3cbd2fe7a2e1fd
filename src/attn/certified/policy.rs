//! Certified attention as a session's [`AttentionPolicy`].
//!
//! A decoding step whose pool is large enough to pay ([`worth_sparse`]: at
//! least [`SPARSE_MIN_VISIBLE`](crate::attn::SPARSE_MIN_VISIBLE) visible
//! positions, which keeps Gemma 3's sliding layers dense) is read sparsely:
//! per KV head, the pool is scanned once for the group's query heads
//! ([`GroupScan`]), the group draws one set of perturbations (layer, KV
//! head, step), and each query head runs [`HeadAttention`] over its own
//! bounds. The KV heads run in parallel, each with its own buffers; where
//! they are fewer than the threads (Gemma 3's global layers have one), the
//! query heads of a group are split among its share of the threads too,
//! each part with its own buffers and reads, which changes no output or
//! record (`tests/certified_threads.rs`). Every other call (prefill
//! batches, short contexts) is dense.
//!
//! Each head's record says what it did: the level it stopped at, or a
//! fallback to exact attention (with [`Certificate::DENSE`], which exact
//! attention has); the keys whose exact scores it used (the exact set's and
//! the pool's); the bytes it read (its share of the scan, exact keys and
//! values); and the estimate `ln D̂` (the shift added back) with
//! the certificate's bound on the measure's scale.

use std::ops::Range;

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
    scan: GroupScan,
    /// The group's query heads in contiguous parts, one per thread.
    parts: Vec<Part>,
    /// Which pool keys some part before the one being counted read.
    counted: Vec<u32>,
    stamp: u32,
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

/// Some of a group's query heads, walked one after another on one thread,
/// sharing their reads.
struct Part {
    heads: HeadAttention,
    reads: GroupReads,
    /// Per head of the part.
    walks: Vec<Walk>,
    /// The bytes of the exact set's keys, read once for the part's heads.
    exact_bytes: usize,
}

/// One head's walk: what it did, the bytes it read beyond the group's scan,
/// and the keys it read first in its part, with their bytes.
struct Walk {
    driven: Driven,
    read: usize,
    first_reads: Vec<(u32, u32)>,
}

impl Part {
    fn new(params: Params) -> Self {
        Self { heads: HeadAttention::new(params), reads: GroupReads::default(), walks: Vec::new(), exact_bytes: 0 }
    }

    /// Query heads `heads` of `kv_head`'s group, scanned by `scan`, into
    /// `out` (theirs only).
    fn walk(
        &mut self,
        call: &LayerCall,
        kv_head: usize,
        split: &Split,
        scan: &GroupScan,
        heads: Range<usize>,
        out: &mut [f32],
    ) {
        self.reads.reset(scan.keys(split), split.pool.len(), heads.clone());
        // The exact set's scores, read once for the part's heads.
        self.exact_bytes = {
            let mut keys = CacheHead::new(call, kv_head, split, scan, heads.start, &mut self.reads);
            if keys.exact_len() > 0 {
                keys.exact_score(0);
            }
            keys.bytes.keys
        };
        self.walks.clear();
        for (g, out) in heads.zip(out.chunks_exact_mut(call.batch.head_dim_v)) {
            self.reads.first_reads.clear();
            let mut keys = CacheHead::new(call, kv_head, split, scan, g, &mut self.reads);
            let driven = self.heads.attend(&mut keys, Stop::Certified, out);
            let read = keys.bytes.keys + keys.bytes.values;
            self.walks.push(Walk { driven, read, first_reads: self.reads.first_reads.clone() });
        }
    }
}

impl Group {
    /// KV head `kv_head`'s query heads, into `out` (theirs only).
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
        let share = rayon::current_num_threads().div_ceil(batch.n_kv_head());
        let n = share.clamp(1, n_gqa);
        self.parts.resize_with(n, || Part::new(params));
        self.parts.truncate(n);
        let heads = |k: usize| n_gqa * k / n..n_gqa * (k + 1) / n;
        let scan = &self.scan;
        if n == 1 {
            self.parts[0].walk(call, kv_head, &split, scan, 0..n_gqa, out);
        } else {
            let mut outs = Vec::with_capacity(n);
            let mut rest = out;
            for k in 0..n {
                let (part, after) = rest.split_at_mut(heads(k).len() * dim_v);
                outs.push(part);
                rest = after;
            }
            self.parts
                .par_iter_mut()
                .zip(outs)
                .enumerate()
                .for_each(|(k, (part, out))| part.walk(call, kv_head, &split, scan, heads(k), out));
        }
        self.count_first_reads(scan.keys(&split));
        let shared = (self.scan.scanned_bytes + self.parts[0].exact_bytes) as f64 / n_gqa as f64;
        self.records.clear();
        for (k, part) in self.parts.iter().enumerate() {
            for (g, walk) in heads(k).zip(&part.walks) {
                let mut record = record(certificate, call, kv_head * n_gqa + g, &split, &walk.driven, walk.read);
                record.bytes_read += shared;
                self.records.push(record);
            }
        }
    }

    /// Takes from each head's bytes the keys it read first in its part but
    /// that a head of an earlier part read too: what is left is what it
    /// read first in the group, as on one thread (`keys` keys).
    fn count_first_reads(&mut self, keys: usize) {
        self.counted.resize(keys, 0);
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.counted.fill(0);
            self.stamp = 1;
        }
        let (counted, stamp) = (&mut self.counted, self.stamp);
        for part in &mut self.parts {
            // Within a part each key is read first by one head at most.
            for walk in &mut part.walks {
                for &(key, bytes) in &walk.first_reads {
                    if counted[key as usize] == stamp {
                        walk.read -= bytes as usize;
                    }
                }
            }
            for &(key, _) in part.walks.iter().flat_map(|w| &w.first_reads) {
                counted[key as usize] = stamp;
            }
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
            scan: GroupScan::default(),
            parts: Vec::new(),
            counted: Vec::new(),
            stamp: 0,
            records: Vec::new(),
        });
        let (certificate, seed) = (&self.certificate, self.seed);
        let group_len = batch.n_gqa * batch.head_dim_v;
        self.groups
            .par_iter_mut()
            .zip(out.par_chunks_exact_mut(group_len))
            .enumerate()
            .for_each(|(kv_head, (group, out))| group.attend(params, certificate, seed, call, kv_head, out));
        records.extend(self.groups.iter_mut().flat_map(|g| g.records.drain(..)));
    }
}
