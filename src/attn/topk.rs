//! Top-k pages, Quest's way: a baseline without a certificate.
//!
//! On a decoding step whose pool is large enough ([`super::worth_sparse`]),
//! each query head bounds its score over every sketched page of the pool
//! from the page's per-channel ranges alone
//! ([`KeySketch::page_upper_bound`](crate::kv::KeySketch::page_upper_bound)),
//! and reads exactly the `pages` pages with the largest bounds, the
//! [`SINKS`](super::SINKS) and the [`WINDOW`](super::WINDOW) newest
//! positions; pages without a sketch (the quantized modes' exact residual)
//! are read as well. Attention is then ggml's arithmetic over those keys
//! alone: the rest of the softmax's mass is dropped, so nothing bounds the
//! error, which the certificate says with an infinite ε. The query heads
//! run in parallel, each with its own buffers. Every other call is dense.

use std::ops::Range;

use half::f16;
use rayon::prelude::*;
use simd::Kernels;

use super::dense::Dense;
use super::read::{self, round_to_f16, AttendScratch, HeadRows};
use super::{worth_sparse, AttentionKind, AttentionPolicy, Certificate, Estimate, HeadRecord, LayerCall, Split};
use crate::kv::quant::Affine;
use crate::kv::PAGE;

/// What a top-k head promises: nothing.
pub const UNBOUNDED: Certificate =
    Certificate { kind: AttentionKind::Topk, epsilon: f64::INFINITY, delta: 0.0, measure: None };

/// Reads the `pages` most promising pages of every head's pool.
#[derive(Default)]
pub struct Topk {
    pages: usize,
    /// One per query head: the heads run in parallel.
    heads: Vec<TopkHead>,
}

/// One query head's buffers.
#[derive(Default)]
struct TopkHead {
    query: Vec<f32>,
    halves: Vec<f16>,
    /// Bounds of the pool's sketched pages, with their numbers.
    bounds: Vec<(f32, usize)>,
    /// Pages read: the chosen and the unsketched.
    chosen: Vec<usize>,
    ranges: Vec<Range<usize>>,
    attend: AttendScratch,
    log_denominator: Vec<f64>,
}

impl Topk {
    pub fn new(pages: usize) -> Self {
        Self { pages, ..Self::default() }
    }
}

impl TopkHead {
    /// Query head `head`'s attention over its chosen keys (its `pages`
    /// pages of largest bound, the sinks and the window) into `out`, and
    /// its record.
    fn attend(
        &mut self,
        kernels: &Kernels,
        call: &LayerCall,
        pages: usize,
        head: usize,
        out: &mut [f32],
    ) -> HeadRecord {
        let batch = call.batch;
        let rows = HeadRows::new(call, head / batch.n_gqa);
        self.query.clear();
        self.query.extend_from_slice(&batch.queries[head * batch.head_dim_k..][..batch.head_dim_k]);
        round_to_f16(&mut self.query, &mut self.halves);

        let visible = call.visible(0);
        let split = Split::of(visible.clone());
        let scanned = self.choose_pages(&rows, &split, pages);
        self.ranges.clear();
        let pages = read::pages(self.chosen.iter().copied(), split.pool.clone());
        let ranges = [split.sinks.clone()].into_iter().chain(pages).chain([split.window.clone()]);
        self.ranges.extend(read::join(ranges));

        let n = read::count(&self.ranges);
        self.log_denominator.clear();
        let (query, scratch) = (&self.query, &mut self.attend);
        read::attend_positions(
            kernels,
            &rows,
            query,
            batch.scorer,
            &self.ranges,
            scratch,
            out,
            &mut self.log_denominator,
        );

        let sketch_bytes = scanned * batch.head_dim_k * std::mem::size_of::<Affine>();
        let bytes = rows.key_bytes(&self.ranges) + rows.value_bytes(&self.ranges) + sketch_bytes;
        HeadRecord {
            layer: call.layer,
            head,
            certificate: UNBOUNDED,
            level: None,
            fallback: false,
            visible: visible.len(),
            keys_read: n,
            bytes_read: bytes as f64,
            estimate: Some(Estimate { log_denominator: self.log_denominator[0], bound: f64::INFINITY }),
            audit: None,
        }
    }

    /// Fills `chosen` with the pool's pages to read, in order: the `pages`
    /// sketched ones of the largest bounds (ties to the earlier page) and
    /// every unsketched one. Returns the pages whose bound was computed.
    fn choose_pages(&mut self, rows: &HeadRows, split: &Split, pages: usize) -> usize {
        self.bounds.clear();
        self.chosen.clear();
        if split.pool.is_empty() {
            return 0;
        }
        for page in split.pool.start / PAGE..split.pool.end.div_ceil(PAGE) {
            match rows.cache.sketch(rows.head, page) {
                Some(sketch) => self.bounds.push((sketch.page_upper_bound(&self.query), page)),
                None => self.chosen.push(page),
            }
        }
        read::choose_largest(&mut self.bounds, pages, &mut self.chosen);
        self.chosen.sort_unstable();
        self.bounds.len()
    }
}

impl AttentionPolicy for Topk {
    fn kind(&self) -> AttentionKind {
        AttentionKind::Topk
    }

    fn reads_sketch(&self) -> bool {
        true
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        if !worth_sparse(call) {
            return Dense.attend(call, out, records);
        }
        let (kernels, dim_v, pages) = (simd::kernels(), call.batch.head_dim_v, self.pages);
        self.heads.resize_with(call.batch.n_head, TopkHead::default);
        let heads = self.heads.par_iter_mut().zip(out.par_chunks_exact_mut(dim_v)).enumerate();
        records.par_extend(heads.map(|(head, (buffers, out))| buffers.attend(kernels, call, pages, head, out)));
    }
}
