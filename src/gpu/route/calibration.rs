//! δ_q: the one-sided residual quantile that turns the probe's mass estimate
//! into a lower bound, m̲ = max(0, m̂ − δ_q).
//!
//! `sift gpu-profile --calibrate FILE...` prefills each calibration text on
//! the GPU with every candidate's mask measured against dense attention: per
//! global layer, KV head and sparse candidate, the residual m̂ − m between the
//! probe's estimate and the mean mass m the mask truly keeps (over 256 rows
//! spread over the prompt). δ_q is the q-quantile of those residuals, so that
//! m̂ − δ_q ≤ m held for a fraction q of the calibration cases. The bound
//! `--prefill-recent-rows` uses, min(m̂, ŵ) − δ_q, has its own residuals,
//! min(m̂, ŵ) − m, and its own quantile (no larger: min(m̂, ŵ) ≤ m̂); the
//! file keeps both, and each pattern's too (the probe errs differently on
//! a band, on lines and on pooled blocks), by which the router bounds each
//! pattern's candidates. The texts must
//! not be the evaluation texts (the repository calibrates on PG-19 books other
//! than those it reports perplexity on). The result is a small JSON file
//! beside the latency profile, named after the model's shape.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::candidates::Pattern;
use super::RecentRows;

/// One calibration case (a layer, KV head and sparse candidate): the probe's
/// estimates against the mass m the candidate's mask truly keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Residual {
    pub pattern: Pattern,
    /// m̂ − m.
    pub mean: f64,
    /// min(m̂, ŵ) − m, ŵ the mass kept of the least-kept recent probe row.
    pub recent: f64,
}

/// The quantiles of one pattern's residuals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PatternDelta {
    pub pattern: Pattern,
    pub residuals: usize,
    pub delta: f64,
    pub delta_recent: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationFile {
    /// The model file's name.
    pub model: String,
    pub quantile: f64,
    /// The quantile of m̂ − m.
    pub delta: f64,
    /// The quantile of min(m̂, ŵ) − m, for `--prefill-recent-rows`; absent
    /// from files written before it was recorded.
    #[serde(default)]
    pub delta_recent: Option<f64>,
    /// Per pattern: the router bounds a pattern's candidates by its own δ
    /// (absent from older files, which pool one δ for all).
    #[serde(default)]
    pub patterns: Vec<PatternDelta>,
    /// Residuals the quantile was taken over.
    pub residuals: usize,
    pub mean_residual: f64,
    pub max_residual: f64,
    /// The texts calibrated on, and the tokens of each.
    pub texts: Vec<String>,
    pub tokens: usize,
}

impl CalibrationFile {
    /// From the residuals; `None` without any.
    pub fn from_residuals(
        residuals: &[Residual],
        quantile: f64,
        model: String,
        texts: Vec<String>,
        tokens: usize,
    ) -> Option<Self> {
        let mean: Vec<f64> = residuals.iter().map(|r| r.mean).collect();
        let recent: Vec<f64> = residuals.iter().map(|r| r.recent).collect();
        let patterns = Pattern::SPARSE
            .iter()
            .filter_map(|&pattern| {
                let of = |f: fn(&Residual) -> f64| -> Vec<f64> {
                    residuals.iter().filter(|r| r.pattern == pattern).map(f).collect()
                };
                Some(PatternDelta {
                    pattern,
                    residuals: of(|r| r.mean).len(),
                    delta: upper_quantile(&of(|r| r.mean), quantile)?,
                    delta_recent: upper_quantile(&of(|r| r.recent), quantile)?,
                })
            })
            .collect();
        Some(Self {
            model,
            quantile,
            delta: upper_quantile(&mean, quantile)?,
            delta_recent: upper_quantile(&recent, quantile),
            patterns,
            residuals: mean.len(),
            mean_residual: mean.iter().sum::<f64>() / mean.len() as f64,
            max_residual: mean.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            texts,
            tokens,
        })
    }

    /// The δ of the bound in use: the recent-rows one when `recent_rows`
    /// bounds them and the file has it, else the mean's.
    pub fn delta_for(&self, recent_rows: RecentRows) -> f64 {
        match (recent_rows, self.delta_recent) {
            (RecentRows::Bound, Some(d)) => d,
            _ => self.delta,
        }
    }

    /// Each pattern's δ of the bound in use, as [`Self::delta_for`] picks.
    pub fn pattern_deltas(&self, recent_rows: RecentRows) -> Vec<(Pattern, f64)> {
        let recent = recent_rows == RecentRows::Bound && self.delta_recent.is_some();
        self.patterns.iter().map(|p| (p.pattern, if recent { p.delta_recent } else { p.delta })).collect()
    }

    /// The default file for a model of these hyper-parameters.
    pub fn file(hp: &crate::model::hparams::HParams) -> PathBuf {
        let name = format!(
            "route-calibration-{:?}-{}x{}-h{}x{}-d{}.json",
            hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k
        );
        super::profile::cache_dir().join(name.to_lowercase())
    }

    pub fn load(file: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))
    }

    pub fn save(&self, file: &Path) -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(file, serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n")
    }
}

/// The ⌈q·n⌉-th smallest of `x`, at least 0; `None` when `x` is empty.
fn upper_quantile(x: &[f64], q: f64) -> Option<f64> {
    let mut sorted = x.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(at).map(|r| r.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_is_the_upper_quantile_of_the_residuals() {
        // Block-sparse residuals i/1000 − 0.02 (the recent bound's 0.01 lower),
        // A-shape ones 0.5 higher.
        let residuals: Vec<Residual> = (0..100)
            .map(|i| i as f64 / 1000.0 - 0.02)
            .flat_map(|mean| {
                [
                    Residual { pattern: Pattern::BlockSparse, mean, recent: mean - 0.01 },
                    Residual { pattern: Pattern::AShape, mean: mean + 0.5, recent: mean + 0.5 },
                ]
            })
            .collect();
        let c = CalibrationFile::from_residuals(
            &residuals[..].iter().step_by(2).copied().collect::<Vec<_>>(),
            0.95,
            "m".into(),
            vec![],
            0,
        )
        .unwrap();
        // The 95th of 100 sorted residuals: 0.094 − 0.02.
        assert!((c.delta - 0.074).abs() < 1e-12, "{c:?}");
        assert!((c.delta_for(RecentRows::Bound) - 0.064).abs() < 1e-12, "{c:?}");
        // Widened recent rows are bounded with the mean, as without them.
        assert_eq!(c.delta_for(RecentRows::Keep), c.delta);
        assert_eq!(c.patterns.len(), 1, "{c:?}");
        assert_eq!(c.pattern_deltas(RecentRows::Mean), vec![(Pattern::BlockSparse, c.delta)]);
        // Over both patterns, the 190th of 200: A-shape's 90th, 0.089 + 0.48.
        let both = CalibrationFile::from_residuals(&residuals, 0.95, "m".into(), vec![], 0).unwrap();
        assert!((both.delta - 0.569).abs() < 1e-12, "{both:?}");
        let ashape = both.patterns.iter().find(|p| p.pattern == Pattern::AShape).unwrap();
        assert!((ashape.delta - 0.574).abs() < 1e-12 && ashape.residuals == 100, "{both:?}");
        // Routing bounds each pattern by its own δ: block-sparse's, not the pooled one.
        let settings = crate::gpu::route::RouteSettings {
            delta: both.delta,
            pattern_deltas: both.pattern_deltas(RecentRows::Mean),
            ..Default::default()
        };
        assert!((settings.delta_of(Pattern::BlockSparse) - 0.074).abs() < 1e-12, "{settings:?}");
        assert_eq!(settings.delta_of(Pattern::VerticalSlash), both.delta);
        let low = [Residual { pattern: Pattern::AShape, mean: -0.1, recent: -0.2 }];
        let low = CalibrationFile::from_residuals(&low, 0.95, "m".into(), vec![], 0).unwrap();
        assert_eq!((low.delta, low.delta_for(RecentRows::Bound)), (0.0, 0.0));
    }
}
