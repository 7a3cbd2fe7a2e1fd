//! δ_q: the one-sided residual quantile that turns the probe's mass estimate
//! into a lower bound, m̲ = max(0, m̂ − δ_q).
//!
//! `sift gpu-profile --calibrate FILE...` prefills each calibration text on
//! the GPU with every candidate's mask measured against dense attention: per
//! global layer, KV head and sparse candidate, the residual m̂ − m between the
//! probe's estimate and the mean mass m the mask truly keeps (over 256 rows
//! spread over the prompt). δ_q is the q-quantile of those residuals, so that
//! m̂ − δ_q ≤ m held for a fraction q of the calibration cases. The texts must
//! not be the evaluation texts (the repository calibrates on PG-19 books other
//! than those it reports perplexity on). The result is a small JSON file
//! beside the latency profile, named after the model's shape.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationFile {
    /// The model file's name.
    pub model: String,
    pub quantile: f64,
    pub delta: f64,
    /// Residuals the quantile was taken over.
    pub residuals: usize,
    pub mean_residual: f64,
    pub max_residual: f64,
    /// The texts calibrated on, and the tokens of each.
    pub texts: Vec<String>,
    pub tokens: usize,
}

impl CalibrationFile {
    /// From the residuals `m̂ − m`; `None` without any.
    pub fn from_residuals(
        residuals: &[f64],
        quantile: f64,
        model: String,
        texts: Vec<String>,
        tokens: usize,
    ) -> Option<Self> {
        if residuals.is_empty() {
            return None;
        }
        let mut sorted = residuals.to_vec();
        sorted.sort_by(f64::total_cmp);
        let at = ((quantile * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
        Some(Self {
            model,
            quantile,
            delta: sorted[at].max(0.0),
            residuals: sorted.len(),
            mean_residual: sorted.iter().sum::<f64>() / sorted.len() as f64,
            max_residual: *sorted.last()?,
            texts,
            tokens,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_is_the_upper_quantile_of_the_residuals() {
        let residuals: Vec<f64> = (0..100).map(|i| i as f64 / 1000.0 - 0.02).collect();
        let c = CalibrationFile::from_residuals(&residuals, 0.95, "m".into(), vec![], 0).unwrap();
        // The 95th of 100 sorted residuals: 0.094 − 0.02.
        assert!((c.delta - 0.074).abs() < 1e-12, "{c:?}");
        let low = CalibrationFile::from_residuals(&[-0.1, -0.2], 0.95, "m".into(), vec![], 0).unwrap();
        assert_eq!(low.delta, 0.0);
    }
}
