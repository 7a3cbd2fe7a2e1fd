//! RouteSparse: sparse prefill attention chosen per input under a latency
//! budget.
//!
//! A global layer's attention can run on a library of structured sparse
//! masks ([`index::Mask`]): A-shape (sinks and a local band), vertical-slash
//! (columns and diagonals estimated from the last queries) and block-sparse
//! (the best 64 × 64 blocks by pooled scores), on the same flash-style
//! kernels as dense attention, which then visit only the listed keys.
//! Which mask each KV head gets is decided per prompt: a shared probe of a few
//! queries ([`probe`]) estimates the attention mass each candidate keeps
//! ([`candidates`]), and the router ([`router`]) picks, per layer, the
//! lowest-risk choices whose measured kernel times ([`profile`]) fit the
//! budget, falling back to dense attention where the lower mass bound
//! m̲ = max(0, m̂ − δ_q) ([`calibration`]) is under τ. [`routed`] puts it
//! together for one layer; the prefill's report is [`crate::gpu::report`].

pub mod calibration;
pub mod candidates;
pub mod captured;
pub mod index;
pub mod probe;
pub mod profile;
pub mod routed;
pub mod router;

use std::path::PathBuf;

pub use candidates::{Candidate, Pattern};
pub use index::{GpuIndex, Mask, SparseIndex};
pub use routed::RoutedAttention;

/// How a routed (or fixed-pattern) prefill behaves.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteSettings {
    /// A fixed pattern for every KV head (the baselines); `None` routes.
    pub pattern: Option<Pattern>,
    /// Each layer's attention time as a fraction of its dense time.
    pub budget: f64,
    /// Dense fallback when m̲ < τ.
    pub tau: f64,
    /// What the probe's recent rows (the prompt's last queries, which read
    /// the answer) add to the mean bound.
    pub recent_rows: RecentRows,
    /// The weight of the probe subsets' disagreement in the risk.
    pub alpha: f64,
    /// δ_q, and where it came from (for the report).
    pub delta: f64,
    /// δ_q per sparse pattern, where calibrated (each its own residuals'
    /// quantile); a pattern not listed takes `delta`.
    pub pattern_deltas: Vec<(Pattern, f64)>,
    pub delta_source: crate::gpu::report::Calibration,
    /// Measure each routed head against dense attention.
    pub audit: bool,
    /// Record every candidate's residual m̂ − m (`sift gpu-profile --calibrate`).
    pub calibrate: bool,
    /// Where the prefill report goes.
    pub report: Option<PathBuf>,
}

impl RouteSettings {
    /// The δ_q a candidate of `pattern` is bounded with.
    pub fn delta_of(&self, pattern: Pattern) -> f64 {
        self.pattern_deltas.iter().find(|(p, _)| *p == pattern).map_or(self.delta, |&(_, d)| d)
    }
}

/// How the recent probe rows weigh in a candidate's lower mass bound. A mask
/// that drops a far block the prompt's last queries attend to (a needle)
/// loses much of one row's mass and little of the mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecentRows {
    /// m̲ = max(0, m̂ − δ_q), the seed's bound on the mean alone.
    #[default]
    Mean,
    /// m̲ bounds the least-kept recent row too: m̲ = max(0, min(m̂, ŵ) − δ_q).
    Bound,
    /// The query blocks of the recent rows list, beyond the mask's own key
    /// blocks, those the rows attend to most, until each of them keeps τ of
    /// its mass as the probe measures it ([`candidates::keep_recent`]); m̲
    /// bounds the mean, the recent rows in it.
    Keep,
}

impl RecentRows {
    pub const ALL: [RecentRows; 3] = [RecentRows::Mean, RecentRows::Bound, RecentRows::Keep];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RecentRows::Mean => "mean",
            RecentRows::Bound => "bound",
            RecentRows::Keep => "keep",
        }
    }
}

impl std::str::FromStr for RecentRows {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| format!("unknown recent-rows mode '{s}'"))
    }
}

impl Default for RouteSettings {
    fn default() -> Self {
        let delta = 0.05;
        Self {
            pattern: None,
            budget: 0.25,
            tau: 0.95,
            recent_rows: RecentRows::Mean,
            alpha: 0.5,
            delta,
            pattern_deltas: Vec::new(),
            delta_source: crate::gpu::report::Calibration { delta, quantile: 0.95, file: None },
            audit: false,
            calibrate: false,
            report: None,
        }
    }
}
