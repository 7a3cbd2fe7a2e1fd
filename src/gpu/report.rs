//! What a GPU prefill did, for `--prefill-report FILE` (JSON).
//!
//! One [`PrefillReport`] per prompt: how attention was computed (`dense`, a
//! fixed sparse pattern, or `routed`), the latency budget, where the time went,
//! and per layer and KV head the choice the router made with its evidence: the
//! probe's mass estimate m̂, the lower bound m̲ = max(0, m̂ − δ_q), whether the
//! head fell back to dense attention, and the certificate 2(1 − m̲)·V_max on the
//! mean per-row error of the head's attention output (‖aV − ãV‖₂ ≤ 2(1 − m)·V_max
//! for a row keeping mass m; averaged over rows, the mean mass stands in for m).
//! With `--audit`, each head also carries the error measured against dense
//! attention and whether the certificate covered it.
//!
//! Times are GPU milliseconds from timestamp queries where the adapter has
//! them, wall-clock milliseconds otherwise; routing runs on the CPU.

use std::fmt;

use serde::Serialize;

/// The whole prompt's prefill.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PrefillReport {
    /// `dense`, `routed`, `ashape`, `vslash` or `blocksparse`.
    pub method: String,
    /// The adapter the prefill ran on, as wgpu names it.
    pub adapter: String,
    /// Prompt tokens prefilled.
    pub tokens: usize,
    /// `--prefill-budget`: each layer's attention time as a fraction of its dense time (routed only).
    pub budget: Option<f64>,
    /// The residual quantile δ_q subtracted from m̂, and the file it came from.
    pub delta: Option<Calibration>,
    /// The fallback threshold τ on m̲.
    pub tau: Option<f64>,
    pub timing: Timing,
    pub summary: Summary,
    /// The global (full-attention) layers' attention calls, in order; layers that
    /// attend within a sliding window stay dense and are not listed.
    pub layers: Vec<LayerReport>,
    /// Attention calls past `--gpu-mem-budget`, decomposed by Stream-CQSA:
    /// depth reached, pieces, and gather, transfer, compute and merge times.
    pub decomposed: Option<crate::gpu::cqs::CqsReport>,
}

/// Where a δ_q came from.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Calibration {
    pub delta: f64,
    /// The one-sided quantile it is (0.95: m̂ − m ≤ δ_q for 95% of calibration heads).
    pub quantile: f64,
    pub file: Option<String>,
}

/// Milliseconds spent on each step, summed over layers and chunks.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timing {
    /// The shared probe (row statistics and pooled masses of the probe queries).
    pub probe_ms: f64,
    /// Index builders: last-query column and diagonal scores, pooled block scores,
    /// selection and upload of the key lists.
    pub index_ms: f64,
    /// The probe's and index builders' kernels one by one, GPU milliseconds.
    pub probe_kernels_ms: std::collections::BTreeMap<String, f64>,
    /// The router, on the CPU: every candidate's mask and estimate, and the plan.
    pub routing_ms: f64,
    /// The chosen masks spelt out into key lists, and their upload (CPU;
    /// each sparse head's while the GPU computes the heads submitted before it).
    pub lists_ms: f64,
    /// GPU time between a routed layer's attention dispatches: the GPU
    /// waiting for the next head's lists (what of `lists_ms` lay on the
    /// critical path), and the barrier between dispatches.
    pub lists_waited_ms: f64,
    /// The attention kernels themselves: the dense kernel over the heads
    /// that chose dense, then the sparse kernel over the others.
    pub kernel_ms: f64,
    /// Of `kernel_ms`, the dense kernel's and the sparse kernel's parts.
    pub dense_kernel_ms: f64,
    pub sparse_kernel_ms: f64,
    /// The routed layers' attention on the wall clock, probe to kernel, the
    /// readbacks and the CPU's work included (the audit not), counted from
    /// when the GPU has finished the layer's earlier work.
    pub routed_wall_ms: f64,
    /// What the latency profile says dense attention would have taken.
    pub dense_estimate_ms: f64,
    /// With `--audit`: dense attention of the same calls, measured.
    pub dense_measured_ms: Option<f64>,
    /// The whole prefill, wall clock, weights already on the GPU.
    pub prefill_ms: f64,
}

/// Counts over every head of every routed layer.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub heads: usize,
    /// Heads whose every sparse candidate had m̲ < τ, so dense attention ran.
    pub fallbacks: usize,
    pub fallback_rate: f64,
    /// Heads compared with dense attention (`--audit`).
    pub audited: usize,
    /// Audited heads whose measured error the certificate covered.
    pub covered: usize,
    /// `covered / audited`.
    pub coverage: Option<f64>,
    /// Layers whose planned time met the budget.
    pub layers_within_budget: usize,
}

/// One attention call of a global layer (one chunk of the prompt).
#[derive(Clone, Debug, Default, Serialize)]
pub struct LayerReport {
    pub layer: usize,
    /// First query position of the chunk.
    pub pos0: usize,
    /// Queries in the chunk.
    pub queries: usize,
    /// The layer's budget and the router's plan, in microseconds of the latency profile.
    pub budget_us: Option<f64>,
    pub planned_us: f64,
    pub dense_us: f64,
    /// The call on the wall clock, probe to kernels (as `Timing::routed_wall_ms`).
    pub wall_ms: f64,
    /// Its attention kernels, GPU time.
    pub kernel_ms: f64,
    /// With `--audit`: the dense kernel over every head of the call, GPU time.
    pub dense_ms: Option<f64>,
    pub heads: Vec<HeadReport>,
}

/// One KV head (its query heads share every key the kernel reads, so they share a choice).
#[derive(Clone, Debug, Default, Serialize)]
pub struct HeadReport {
    pub kv_head: usize,
    /// `dense`, `ashape`, `vslash` or `blocksparse`.
    pub pattern: String,
    /// The pattern's budget in its own units (see [`super::route::Mask`]), empty for dense.
    pub budget: Vec<usize>,
    /// Fraction of the causal key blocks the kernel visits.
    pub density: f64,
    /// m̂: the probe's estimate of the attention mass the choice keeps.
    pub mass_estimate: f64,
    /// m̲ = max(0, m̂ − δ_q).
    pub mass_lower: f64,
    /// u: disagreement of the probe's query subsets on m̂.
    pub disagreement: f64,
    /// R = 1 − m̂ + α·u.
    pub risk: f64,
    pub fallback: bool,
    /// The largest value-vector norm of the head.
    pub v_max: f64,
    /// 2(1 − m̲)·V_max: a bound on the mean per-row L2 error of the head's output.
    pub certificate: f64,
    pub audit: Option<HeadAudit>,
    /// Every candidate the router weighed for the head, the chosen one included.
    pub candidates: Vec<CandidateReport>,
}

/// One line: the choice, its evidence, and the audit where there is one.
impl fmt::Display for HeadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kv head {}: {} {:?} density {:.3} m̂ {:.4} m̲ {:.4} u {:.4} fallback {} certificate {:.2e}",
            self.kv_head,
            self.pattern,
            self.budget,
            self.density,
            self.mass_estimate,
            self.mass_lower,
            self.disagreement,
            self.fallback,
            self.certificate
        )?;
        if let Some(a) = &self.audit {
            write!(
                f,
                " true m {:.4} rel. error {:.2e} mean row error {:.2e} covered {}",
                a.true_mass, a.relative_error, a.mean_row_error, a.covered
            )?;
        }
        Ok(())
    }
}

/// One candidate (pattern and budget) for one KV head, as the router saw it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CandidateReport {
    pub pattern: String,
    pub budget: Vec<usize>,
    /// m̂ and m̲.
    pub mass_estimate: f64,
    pub mass_lower: f64,
    /// The latency profile's kernel time for the head's mask, µs.
    pub time_us: f64,
}

/// A head measured against dense attention.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HeadAudit {
    /// ‖O − Õ‖_F / ‖O‖_F over the chunk's rows and the KV head's query heads.
    pub relative_error: f64,
    /// Mean over rows of ‖o − õ‖₂, the quantity the certificate bounds.
    pub mean_row_error: f64,
    /// The mean attention mass the choice actually kept, over the audited rows.
    pub true_mass: f64,
    /// `mean_row_error <= certificate`.
    pub covered: bool,
}

impl PrefillReport {
    /// Fills [`Summary`] from the layers.
    pub fn summarize(&mut self) {
        let heads = self.layers.iter().flat_map(|l| &l.heads);
        let mut s = Summary::default();
        for h in heads {
            s.heads += 1;
            s.fallbacks += usize::from(h.fallback);
            if let Some(a) = &h.audit {
                s.audited += 1;
                s.covered += usize::from(a.covered);
            }
        }
        s.fallback_rate = if s.heads == 0 { 0.0 } else { s.fallbacks as f64 / s.heads as f64 };
        s.coverage = (s.audited > 0).then(|| s.covered as f64 / s.audited as f64);
        s.layers_within_budget =
            self.layers.iter().filter(|l| l.budget_us.is_none_or(|b| l.planned_us <= b * (1.0 + 1e-9))).count();
        self.summary = s;
    }

    /// Writes the report as pretty JSON to `path`.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, json + "\n")
    }
}
