//! The audit (`--audit`): exact attention beside any policy, on the same
//! cache, and each head's error on its measure's scale.
//!
//! [`Audited`] wraps a policy. On every call the policy could read sparsely
//! ([`worth_sparse`]) it computes exact attention for every query head
//! ([`ExactAttention`]), from the keys and values as the cache holds them and
//! the query rounded to f16 as every policy rounds it, and fills each record's
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
//! **Shadows.** An audit can also run other policies beside the one that
//! drives the session ([`Audited::with_shadows`]): on every call it checks,
//! each shadow attends the same call (the same queries, the same cache) into
//! an output of its own, which is discarded, and its records are checked
//! against the same exact attention and kept in a [`ShadowLog`]. One run then
//! measures several configurations (say ε and measures of certified
//! attention, or top-k at several page counts) call for call. What a shadow
//! does not see is its own trajectory: the cache holds the keys and values
//! that the driving policy's outputs produced, and the tokens scored are the
//! driving policy's. A certified shadow draws the perturbations of the same
//! seed as the driver; its certificate holds per call whatever the other
//! configurations do, so its violations count as a run of its own would.
//!
//! [`AuditTable`] sums the checked records up: what `sift perplexity
//! --audit` prints.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::read::{round_to_f16, HeadRows};
use super::{worth_sparse, AttentionKind, AttentionPolicy, Checked, HeadRecord, LayerCall, Measure, Scorer};
use crate::kv::Rows;

/// A policy with exact attention computed beside it, and perhaps other
/// policies run as its shadows.
pub struct Audited {
    inner: Box<dyn AttentionPolicy>,
    measure: Measure,
    shadows: Vec<Shadow>,
    log: ShadowLog,
}

/// A policy run beside the audited one, and its buffers.
struct Shadow {
    policy: Box<dyn AttentionPolicy>,
    out: Vec<f32>,
    records: Vec<HeadRecord>,
}

/// The checked records of an audit's shadows, one list per shadow in the
/// order they were given; shared between the audit, which appends, and
/// whoever reads them.
#[derive(Clone, Default)]
pub struct ShadowLog(Arc<Mutex<Vec<Vec<HeadRecord>>>>);

impl ShadowLog {
    /// Every shadow's records so far, leaving the log's lists empty.
    pub fn take(&self) -> Vec<Vec<HeadRecord>> {
        let mut lists = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        lists.iter_mut().map(std::mem::take).collect()
    }
}

impl Audited {
    /// Audits `inner`, measuring heads without a certificate on `measure`.
    pub fn new(inner: Box<dyn AttentionPolicy>, measure: Measure) -> Self {
        Self::with_shadows(inner, measure, Vec::new()).0
    }

    /// Audits `inner` with `shadows` run beside it on every call checked;
    /// the log receives their checked records.
    pub fn with_shadows(
        inner: Box<dyn AttentionPolicy>,
        measure: Measure,
        shadows: Vec<Box<dyn AttentionPolicy>>,
    ) -> (Self, ShadowLog) {
        let log = ShadowLog(Arc::new(Mutex::new(vec![Vec::new(); shadows.len()])));
        let shadows = shadows.into_iter().map(|policy| Shadow { policy, out: Vec::new(), records: Vec::new() });
        (Self { inner, measure, shadows: shadows.collect(), log: log.clone() }, log)
    }
}

impl AttentionPolicy for Audited {
    fn kind(&self) -> AttentionKind {
        self.inner.kind()
    }

    fn reads_sketch(&self) -> bool {
        self.inner.reads_sketch() || self.shadows.iter().any(|s| s.policy.reads_sketch())
    }

    fn forget_from(&mut self, pos: usize) {
        self.inner.forget_from(pos);
        self.shadows.iter_mut().for_each(|s| s.policy.forget_from(pos));
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        let first = records.len();
        self.inner.attend(call, out, records);
        if !worth_sparse(call) {
            return;
        }
        let exact = ExactHeads::of(call);
        exact.check(self.measure, out, &mut records[first..]);
        let measure = self.measure;
        self.shadows.par_iter_mut().for_each(|shadow| {
            shadow.records.clear();
            shadow.out.resize(out.len(), 0.0);
            shadow.policy.attend(call, &mut shadow.out, &mut shadow.records);
            exact.check(measure, &shadow.out, &mut shadow.records);
        });
        let mut lists = self.log.0.lock().unwrap_or_else(PoisonError::into_inner);
        for (list, shadow) in lists.iter_mut().zip(&mut self.shadows) {
            list.append(&mut shadow.records);
        }
    }
}

/// Exact attention of every query head of a call, with what dense attention
/// reads for each.
struct ExactHeads {
    /// Per query head, in order.
    heads: Vec<ExactAttention>,
    /// Per query head: its share of the bytes dense attention reads.
    dense_bytes: Vec<f64>,
}

impl ExactHeads {
    fn of(call: &LayerCall) -> Self {
        let batch = call.batch;
        let (g, dim_k) = (batch.n_gqa, batch.head_dim_k);
        let visible = call.visible(0);
        let (mut heads, mut dense_bytes, mut halves) = (Vec::new(), Vec::new(), Vec::new());
        for kv_head in 0..batch.n_kv_head() {
            let rows = HeadRows::new(call, kv_head);
            let mut queries = batch.queries[kv_head * g * dim_k..][..g * dim_k].to_vec();
            round_to_f16(&mut queries, &mut halves);
            heads.extend(ExactAttention::of(&rows, &queries, batch.scorer, visible.clone()));
            let all = std::slice::from_ref(&visible);
            let bytes = (rows.key_bytes(all) + rows.value_bytes(all)) as f64;
            dense_bytes.extend(std::iter::repeat_n(bytes / g as f64, g));
        }
        Self { heads, dense_bytes }
    }

    /// Fills the [`Checked`] of each of `records` (a policy's records of the
    /// call) from `out`, the policy's output; heads without a certificate
    /// are measured on `measure`.
    fn check(&self, measure: Measure, out: &[f32], records: &mut [HeadRecord]) {
        let dim_v = out.len() / self.heads.len();
        for record in records {
            let (exact, dense_bytes) = (&self.heads[record.head], self.dense_bytes[record.head]);
            let measure = record.certificate.measure.unwrap_or(measure);
            let error = exact.error(measure, &out[record.head * dim_v..][..dim_v], record);
            let certified = record.certificate.kind == AttentionKind::Certified && !record.fallback;
            record.audit = Some(Checked {
                measure,
                error,
                dense_bytes,
                violated: certified && error > record.certificate.epsilon,
            });
        }
    }
}

/// One head's exact attention.
#[derive(Debug, Clone, PartialEq)]
pub struct ExactAttention {
    /// `ln D`, `D = Σ exp(s_i)`.
    pub log_denominator: f64,
    /// `o = Σ a_i v_i`.
    pub output: Vec<f64>,
    /// `M = sqrt(Σ a_i ‖v_i‖²)`.
    pub value_scale: f64,
}

impl ExactAttention {
    /// Exact attention of each of `queries` (rows of the head's key size)
    /// over `positions` of `rows`, scored by `scorer`. The dot
    /// products and weighted sums are `simd`'s, in f32 without any f16
    /// rounding (relative error about `2^-24·√d`, far below any error the
    /// audit reports); the softmax and its normalization are in f64.
    pub fn of(rows: &HeadRows, queries: &[f32], scorer: Scorer, positions: Range<usize>) -> Vec<Self> {
        let kernels = simd::kernels();
        let (heads, n, dim_v) = (queries.len() / rows.dim_k, positions.len(), rows.dim_v);
        let all = std::slice::from_ref(&positions);
        let mut scores = vec![0.0f32; heads * n];
        rows.scores(kernels, queries, all, &mut scores);
        let squares = value_squares(rows, positions.clone());
        let mut weights = vec![0.0f32; heads * n];
        let mut results = Vec::with_capacity(heads);
        for (scores, weights) in scores.chunks_exact(n).zip(weights.chunks_exact_mut(n)) {
            let s = |x: f32| scorer.score_f64(f64::from(x));
            let max = scores.iter().map(|&x| s(x)).fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|&x| (s(x) - max).exp()).collect();
            let d: f64 = w.iter().sum();
            weights.iter_mut().zip(&w).for_each(|(a, w)| *a = (w / d) as f32);
            let square: f64 = w.iter().zip(&squares).map(|(w, q)| w * q).sum::<f64>() / d;
            results.push((max + d.ln(), square.sqrt()));
        }
        let mut sums = vec![0.0f32; heads * dim_v];
        rows.weigh(kernels, &weights, all, &mut sums);
        sums.chunks_exact(dim_v)
            .zip(results)
            .map(|(output, (log_denominator, value_scale))| Self {
                log_denominator,
                output: output.iter().map(|&o| f64::from(o)).collect(),
                value_scale,
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

/// `‖v‖²` of every value at `positions`, in f64, as the cache holds them.
fn value_squares(rows: &HeadRows, positions: Range<usize>) -> Vec<f64> {
    let dim = rows.dim_v;
    let mut squares = Vec::with_capacity(positions.len());
    let mut row = vec![0.0f32; dim];
    let square = |row: &[f32]| row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
    for stretch in rows.cache.value_rows(rows.head, positions) {
        match stretch {
            Rows::Exact(halves) => {
                for exact in halves.chunks_exact(dim) {
                    exact.convert_to_f32_slice(&mut row);
                    squares.push(square(&row));
                }
            }
            Rows::Coded(coded, range) => {
                for i in range {
                    coded.dequantize(i, &mut row);
                    squares.push(square(&row));
                }
            }
        }
    }
    squares
}

/// The audit's summary of checked records (`sift perplexity --audit`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AuditTable {
    /// The policy the records are of, as its row names it.
    pub policy: String,
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
    pub resa: usize,
}

impl AuditTable {
    /// The summary of the checked ones of `records`, the records of
    /// `policy`, errors in units of `epsilon`.
    pub fn of<'a>(policy: &str, records: impl IntoIterator<Item = &'a HeadRecord>, epsilon: f64) -> Self {
        let mut table = Self { policy: policy.to_string(), epsilon, ..Self::default() };
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
                let layer = LayerKinds { layer: record.layer, dense: 0, certified: 0, topk: 0, resa: 0 };
                table.layers.insert(at, layer);
            }
            let layer = &mut table.layers[at];
            *match kind {
                AttentionKind::Dense => &mut layer.dense,
                AttentionKind::Certified => &mut layer.certified,
                AttentionKind::Topk => &mut layer.topk,
                AttentionKind::Resa => &mut layer.resa,
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

/// Several audit tables as one markdown table, a row each (the audited
/// policy's, then its shadows'), then the layers the first checked and
/// which policy ran in each (a shadow's fallbacks show in its row).
pub struct AuditTables<'a>(pub &'a [AuditTable]);

impl fmt::Display for AuditTables<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        writeln!(
            f,
            "| policy | calls | certified | fallback | keys read mean | keys read p90 | bytes vs dense | error p50 \
             | error p90 | error max | violations |"
        )?;
        writeln!(f, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")?;
        for t in self.0 {
            let pct = |n: usize| 100.0 * n as f64 / t.calls.max(1) as f64;
            writeln!(
                f,
                "| {} | {} | {:.1}% | {:.1}% | {:.2}% | {:.2}% | {:.2}% | {:.4}ε | {:.4}ε | {:.4}ε | {} |",
                t.policy,
                t.calls,
                pct(t.certified),
                pct(t.fallbacks),
                100.0 * t.keys_mean,
                100.0 * t.keys_p90,
                100.0 * t.bytes_vs_dense,
                t.error_p50,
                t.error_p90,
                t.error_max,
                t.violations
            )?;
        }
        // Shadows are checked on the driver's calls: its layers stand for all.
        write!(f, "(errors in units of ε, a certified row's own, ε = {} for the others; keys as a share of the visible positions; layers checked:", self.0.first().map_or(0.0, |t| t.epsilon))?;
        for l in self.0.first().map_or(&[][..], |t| &t.layers[..]) {
            let (layer, dense, certified, topk, resa) = (l.layer, l.dense, l.certified, l.topk, l.resa);
            write!(f, " {layer} [dense {dense}, certified {certified}, topk {topk}, resa {resa}]")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for AuditTable {
    /// A markdown table of one row, then the layers checked.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        AuditTables(std::slice::from_ref(self)).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attn::{Certificate, Estimate};

    fn record(layer: usize, kind: AttentionKind, fallback: bool, keys_read: usize, error: f64) -> HeadRecord {
        let certificate = match kind {
            AttentionKind::Certified if !fallback => {
                Certificate { kind, epsilon: 0.1, delta: 0.001, measure: Some(Measure::Value) }
            }
            _ => Certificate::DENSE,
        };
        HeadRecord {
            layer,
            head: 0,
            certificate,
            level: None,
            fallback,
            visible: 1000,
            keys_read,
            bytes_read: keys_read as f64,
            estimate: Some(Estimate { log_denominator: 0.0, bound: 0.05 }),
            audit: Some(Checked { measure: Measure::Value, error, dense_bytes: 1000.0, violated: error > 0.1 }),
        }
    }

    #[test]
    fn the_table_counts_kinds_and_takes_nearest_rank_percentiles() {
        let mut records: Vec<HeadRecord> =
            (0..9).map(|i| record(5, AttentionKind::Certified, false, 100 * (i + 1), 0.01 * i as f64)).collect();
        records.push(record(11, AttentionKind::Certified, true, 1000, 0.0));
        records.push(record(11, AttentionKind::Certified, false, 500, 0.2));
        let unchecked = HeadRecord { audit: None, ..record(17, AttentionKind::Dense, false, 1000, 0.0) };
        records.push(unchecked);
        let table = AuditTable::of("certified", &records, 0.1);
        assert_eq!((table.calls, table.certified, table.fallbacks, table.violations), (11, 10, 1, 1));
        let keys: f64 = (1..=9).map(|i| i as f64 / 10.0).sum::<f64>() + 1.0 + 0.5;
        assert!((table.keys_mean - keys / 11.0).abs() < 1e-12);
        assert!((table.bytes_vs_dense - keys * 1000.0 / 11_000.0).abs() < 1e-12);
        // Errors in units of ε: 0, 0, 0.1, ..., 0.8, 2; the median is the 6th of 11.
        assert!((table.error_p50 - 0.4).abs() < 1e-12, "{}", table.error_p50);
        assert!((table.error_p90 - 0.8).abs() < 1e-12, "{}", table.error_p90);
        assert!((table.error_max - 2.0).abs() < 1e-12);
        let layers = [
            LayerKinds { layer: 5, dense: 0, certified: 9, topk: 0, resa: 0 },
            LayerKinds { layer: 11, dense: 1, certified: 1, topk: 0, resa: 0 },
        ];
        assert_eq!(table.layers, layers);
    }
}
