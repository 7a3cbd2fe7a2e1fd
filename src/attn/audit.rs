//! The audit (`--audit`): exact attention beside any policy, on the same
//! cache, and each head's error on its measure's scale.
//!
//! [`Audited`] wraps a policy. On every call the policy could read sparsely
//! ([`worth_sparse`]) it computes exact attention for every query head in
//! f64, from the keys and values as the cache holds them and the query
//! rounded to f16 as every policy rounds it, and fills each record's
//! [`Checked`]: the error of the policy's output `ô` against the exact `o`,
//!
//! * value scale: `‖ô − o‖ / M`, `M² = Σ a_i ‖v_i‖²`;
//! * output norm: `‖ô − o‖ / ‖o‖`;
//! * denominator: `|D̂ − D| / D` from the record's estimate of `ln D`; a head
//!   without one summed the whole softmax denominator, and counts 0;
//!
//! on the certificate's measure, or the audit's for heads without one (dense
//! and top-k heads, so that they compare with certified ones). A certified
//! head whose error exceeds its ε is a violation. Dense heads' errors are
//! the f16 rounding of ggml's arithmetic, the floor of any policy's.
//!
//! [`AuditTable`] sums the checked records up: what `sift perplexity
//! --audit` prints.

use std::fmt;
use std::ops::Range;

use half::f16;
use rayon::prelude::*;

use super::read::{round_to_f16, HeadRows};
use super::{worth_sparse, AttentionKind, AttentionPolicy, Checked, HeadRecord, LayerCall, Measure};
use crate::kv::Rows;

/// A policy with exact attention computed beside it.
pub struct Audited {
    inner: Box<dyn AttentionPolicy>,
    measure: Measure,
}

impl Audited {
    /// Audits `inner`, measuring heads without a certificate on `measure`.
    pub fn new(inner: Box<dyn AttentionPolicy>, measure: Measure) -> Self {
        Self { inner, measure }
    }
}

impl AttentionPolicy for Audited {
    fn kind(&self) -> AttentionKind {
        self.inner.kind()
    }

    fn reads_sketch(&self) -> bool {
        self.inner.reads_sketch()
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        let first = records.len();
        self.inner.attend(call, out, records);
        if !worth_sparse(call) {
            return;
        }
        let batch = call.batch;
        let (g, dim_k, dim_v) = (batch.n_gqa, batch.head_dim_k, batch.head_dim_v);
        let visible = call.visible(0);
        let mut halves = Vec::new();
        for kv_head in 0..batch.n_kv_head() {
            let rows = HeadRows::new(call, kv_head);
            let mut queries = batch.queries[kv_head * g * dim_k..][..g * dim_k].to_vec();
            round_to_f16(&mut queries, &mut halves);
            let exact = ExactAttention::of(&rows, &queries, batch.scale, visible.clone());
            let all = std::slice::from_ref(&visible);
            let dense_bytes = (rows.key_bytes(all) + rows.value_bytes(all)) as f64;
            for (i, exact) in exact.iter().enumerate() {
                let head = kv_head * g + i;
                let Some(record) = records[first..].iter_mut().find(|r| r.head == head) else {
                    continue;
                };
                let measure = record.certificate.measure.unwrap_or(self.measure);
                let error = exact.error(measure, &out[head * dim_v..][..dim_v], record);
                let certified = record.certificate.kind == AttentionKind::Certified && !record.fallback;
                record.audit = Some(Checked {
                    measure,
                    error,
                    dense_bytes: dense_bytes / g as f64,
                    violated: certified && error > record.certificate.epsilon,
                });
            }
        }
    }
}

/// One head's exact attention, in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct ExactAttention {
    /// `ln D`, `D = Σ exp(s_i)`.
    pub log_denominator: f64,
    /// `o = Σ a_i v_i`.
    pub output: Vec<f64>,
    /// `M = sqrt(Σ a_i ‖v_i‖²)`.
    pub value_scale: f64,
}

/// Positions per parallel task of the reference.
const CHUNK: usize = 1024;

impl ExactAttention {
    /// Exact attention of each of `queries` (rows of the head's key size)
    /// over `positions` of `rows`, scores scaled by `scale`.
    pub fn of(rows: &HeadRows, queries: &[f32], scale: f32, positions: Range<usize>) -> Vec<Self> {
        let heads = queries.len() / rows.dim_k;
        let chunks: Vec<Range<usize>> =
            positions.clone().step_by(CHUNK).map(|start| start..(start + CHUNK).min(positions.end)).collect();
        // Scores, `[position][head]`.
        let scores: Vec<f64> = chunks
            .par_iter()
            .flat_map_iter(|chunk| {
                let mut scores = Vec::with_capacity(chunk.len() * heads);
                for_each_row(rows.cache.key_rows(rows.head, chunk.clone()), rows.dim_k, dequantize_key, |key| {
                    scores.extend(queries.chunks_exact(rows.dim_k).map(|q| f64::from(scale) * dot(q, key)));
                });
                scores
            })
            .collect();
        let mut max = vec![f64::NEG_INFINITY; heads];
        for row in scores.chunks_exact(heads) {
            max.iter_mut().zip(row).for_each(|(m, &s)| *m = m.max(s));
        }
        // Per head: Σ w, Σ w v, Σ w ‖v‖², with w = exp(s − max).
        let dim_v = rows.dim_v;
        let sums = chunks
            .par_iter()
            .map(|chunk| {
                let mut sums = vec![0.0; heads * (dim_v + 2)];
                let mut at = (chunk.start - positions.start) * heads;
                for_each_row(rows.cache.value_rows(rows.head, chunk.clone()), dim_v, dequantize_value, |value| {
                    let square: f64 = value.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                    for (h, sums) in sums.chunks_exact_mut(dim_v + 2).enumerate() {
                        let w = (scores[at + h] - max[h]).exp();
                        sums[0] += w;
                        sums[1] += w * square;
                        sums[2..].iter_mut().zip(value).for_each(|(s, &v)| *s += w * f64::from(v));
                    }
                    at += heads;
                });
                sums
            })
            .reduce(
                || vec![0.0; heads * (dim_v + 2)],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        sums.chunks_exact(dim_v + 2)
            .zip(&max)
            .map(|(sums, &max)| Self {
                log_denominator: max + sums[0].ln(),
                output: sums[2..].iter().map(|s| s / sums[0]).collect(),
                value_scale: (sums[1] / sums[0]).sqrt(),
            })
            .collect()
    }

    /// The error of `output` (and of `record`'s estimate of the
    /// denominator) on `measure`'s scale.
    pub fn error(&self, measure: Measure, output: &[f32], record: &HeadRecord) -> f64 {
        let distance = || self.output.iter().zip(output).map(|(o, &x)| (f64::from(x) - o).powi(2)).sum::<f64>().sqrt();
        match measure {
            Measure::Value => distance() / self.value_scale,
            Measure::Output => distance() / self.output.iter().map(|o| o * o).sum::<f64>().sqrt(),
            Measure::Denominator => {
                record.estimate.map_or(0.0, |e| (e.log_denominator - self.log_denominator).exp_m1().abs())
            }
        }
    }
}

fn dot(q: &[f32], k: &[f32]) -> f64 {
    q.iter().zip(k).map(|(&q, &k)| f64::from(q) * f64::from(k)).sum()
}

fn dequantize_key(sketch: &crate::kv::KeySketch, row: usize, out: &mut [f32]) {
    sketch.dequantize_key(row, out);
}

fn dequantize_value(values: &crate::kv::quant::ValueRows, row: usize, out: &mut [f32]) {
    values.dequantize(row, out);
}

/// `f` of every row of `stretches` in f32, in order; `dequantize` reads a
/// coded page's row.
fn for_each_row<'a, C: 'a>(
    stretches: impl Iterator<Item = Rows<'a, C>>,
    dim: usize,
    dequantize: impl Fn(&C, usize, &mut [f32]),
    mut f: impl FnMut(&[f32]),
) {
    let mut row = vec![0.0; dim];
    for stretch in stretches {
        match stretch {
            Rows::Exact(rows) => {
                for exact in rows.chunks_exact(dim) {
                    row.iter_mut().zip(exact).for_each(|(r, x)| *r = f16::to_f32(*x));
                    f(&row);
                }
            }
            Rows::Coded(coded, rows) => {
                for i in rows {
                    dequantize(coded, i, &mut row);
                    f(&row);
                }
            }
        }
    }
}

/// The audit's summary of checked records (`sift perplexity --audit`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AuditTable {
    /// Head calls checked.
    pub calls: usize,
    /// Of them, certified (not fallen back) and fallen back.
    pub certified: usize,
    pub fallbacks: usize,
    /// Keys read as a fraction of the visible positions: mean and 90th
    /// percentile.
    pub keys_mean: f64,
    pub keys_p90: f64,
    /// Bytes read over dense attention's on the same cache, all calls
    /// together.
    pub bytes_vs_dense: f64,
    /// Errors in units of ε: median, 90th percentile, largest.
    pub error_p50: f64,
    pub error_p90: f64,
    pub error_max: f64,
    pub violations: usize,
    /// The ε errors are in units of.
    pub epsilon: f64,
    /// Per layer checked: how many head calls ran each kind of attention
    /// (dense for a fallback).
    pub layers: Vec<LayerKinds>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerKinds {
    pub layer: usize,
    pub dense: usize,
    pub certified: usize,
    pub topk: usize,
}

impl AuditTable {
    /// The summary of the checked ones of `records`, errors in units of
    /// `epsilon`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a HeadRecord>, epsilon: f64) -> Self {
        let mut table = Self { epsilon, ..Self::default() };
        let (mut keys, mut errors, mut bytes, mut dense_bytes) = (Vec::new(), Vec::new(), 0.0, 0.0);
        for record in records {
            let Some(checked) = record.audit else {
                continue;
            };
            table.calls += 1;
            table.fallbacks += usize::from(record.fallback);
            let kind = if record.fallback { AttentionKind::Dense } else { record.certificate.kind };
            table.certified += usize::from(kind == AttentionKind::Certified);
            table.violations += usize::from(checked.violated);
            keys.push(record.keys_read as f64 / record.visible.max(1) as f64);
            errors.push(checked.error / epsilon);
            bytes += record.bytes_read;
            dense_bytes += checked.dense_bytes;
            let at = table.layers.partition_point(|l| l.layer < record.layer);
            if table.layers.get(at).is_none_or(|l| l.layer != record.layer) {
                let layer = LayerKinds { layer: record.layer, dense: 0, certified: 0, topk: 0 };
                table.layers.insert(at, layer);
            }
            let layer = &mut table.layers[at];
            *match kind {
                AttentionKind::Dense => &mut layer.dense,
                AttentionKind::Certified => &mut layer.certified,
                AttentionKind::Topk => &mut layer.topk,
            } += 1;
        }
        table.keys_mean = keys.iter().sum::<f64>() / keys.len().max(1) as f64;
        table.keys_p90 = percentile(&mut keys, 0.9);
        table.bytes_vs_dense = if dense_bytes > 0.0 { bytes / dense_bytes } else { 0.0 };
        table.error_p50 = percentile(&mut errors, 0.5);
        table.error_p90 = percentile(&mut errors, 0.9);
        table.error_max = errors.last().copied().unwrap_or(0.0);
        table
    }
}

/// The `q` quantile of `x` (nearest rank), sorting `x`; 0 for none.
fn percentile(x: &mut [f64], q: f64) -> f64 {
    x.sort_by(f64::total_cmp);
    match x.len() {
        0 => 0.0,
        n => x[((n - 1) as f64 * q).round() as usize],
    }
}

impl fmt::Display for AuditTable {
    /// A markdown table of one row, then the layers checked.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let pct = |n: usize| 100.0 * n as f64 / self.calls.max(1) as f64;
        writeln!(
            f,
            "| calls | certified | fallback | keys read mean | keys read p90 | bytes vs dense | error p50 | error p90 | error max | violations |"
        )?;
        writeln!(f, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")?;
        writeln!(
            f,
            "| {} | {:.1}% | {:.1}% | {:.2}% | {:.2}% | {:.2}% | {:.4}ε | {:.4}ε | {:.4}ε | {} |",
            self.calls,
            pct(self.certified),
            pct(self.fallbacks),
            100.0 * self.keys_mean,
            100.0 * self.keys_p90,
            100.0 * self.bytes_vs_dense,
            self.error_p50,
            self.error_p90,
            self.error_max,
            self.violations
        )?;
        write!(f, "(ε = {}; keys as a share of the visible positions; layers checked:", self.epsilon)?;
        for l in &self.layers {
            write!(f, " {} [dense {}, certified {}, topk {}]", l.layer, l.dense, l.certified, l.topk)?;
        }
        write!(f, ")")
    }
}
