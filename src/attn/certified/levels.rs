//! The grid of thresholds and the failure budget spread over it.
//!
//! Level `j = 0 … J` has threshold `τ_j = 2^(−j/r)`: `r` levels per octave.
//! A pool key with weight `w_i = e^{s_i − c}` and perturbation `E_i` is
//! *sampled* at level `j` when its perturbed log-weight reaches the level's
//! log-threshold,
//!
//! ```text
//! i ∈ S_j  ⇔  s_i − c + E_i ≥ ln τ_j  ⇔  u_i ≤ w_i / τ_j,
//! ```
//!
//! which has probability `π_i = min(1, w_i/τ_j)` (threshold, or Poisson PPS,
//! sampling). The thresholds fall with `j`, so the samples are nested,
//! `S_0 ⊆ S_1 ⊆ …`, and a key is described by one number, the first level
//! it enters ([`Grid::level_of`] of its perturbed log-weight): it belongs to
//! `S_j` for every `j` from there on. Likewise the key is *heavy* at level
//! `j` (`w_i ≥ τ_j`, so sampled whatever `E_i`) from `level_of(s_i − c)` on.
//!
//! Every comparison with a threshold goes through [`Grid::level_of`], so the
//! sample, the heavy set and the candidate buckets agree to the last bit.
//!
//! # The failure budget
//!
//! At each level the certificate rests on a few confidence statements, each
//! false with probability at most `δ'`: the count of light keys is not
//! implausibly low, nor implausibly high (Chernoff), and, for the measures
//! on the output, the light keys' spread about the centre is not
//! implausibly small (Maurer) and the centred numerator is not implausibly
//! long (Bernstein). With `e` such events per level, `δ' = δ / (e·(J + 1))`
//! makes all of them hold at once except with probability `δ` (the union
//! bound): then every level's claim is true, whichever level a
//! data-dependent rule stops at. The denominator measure needs only the
//! two Chernoff events (`e = 2`), the output measures all four (`e = 4`).

use crate::attn::Measure;

/// The thresholds `τ_j = 2^(−j/r)`, `j = 0..=last`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grid {
    /// Levels per octave, `r`.
    pub per_octave: u32,
    /// The last level, `J`.
    pub last: usize,
}

impl Default for Grid {
    /// Two levels per octave down to `τ_40 = 2^−20 ≈ 10^−6`: a key that
    /// cannot reach a millionth of the largest weight even perturbed is never
    /// read.
    fn default() -> Self {
        Self { per_octave: 2, last: 40 }
    }
}

impl Grid {
    pub fn levels(&self) -> usize {
        self.last + 1
    }

    /// `ln τ_j`.
    pub fn log_threshold(&self, j: usize) -> f64 {
        -(j as f64) * std::f64::consts::LN_2 / f64::from(self.per_octave)
    }

    /// `τ_j`.
    pub fn threshold(&self, j: usize) -> f64 {
        self.log_threshold(j).exp()
    }

    /// The first level whose log-threshold `log_weight` reaches, if any:
    /// the least `j` with `log_weight ≥ ln τ_j`.
    pub fn level_of(&self, log_weight: f64) -> Option<usize> {
        if log_weight >= 0.0 {
            return Some(0);
        }
        // Below the last threshold, or NaN.
        if log_weight.partial_cmp(&self.log_threshold(self.last)).is_none_or(|o| o.is_lt()) {
            return None;
        }
        // The closed form, then a step either way to agree exactly with
        // `log_threshold`'s rounding.
        let mut j =
            ((-log_weight * f64::from(self.per_octave) / std::f64::consts::LN_2).ceil() as usize).min(self.last);
        while j > 0 && log_weight >= self.log_threshold(j - 1) {
            j -= 1;
        }
        while log_weight < self.log_threshold(j) {
            j += 1;
        }
        Some(j)
    }
}

/// Confidence events per level for a certificate on `measure`'s scale.
pub fn events_per_level(measure: Measure) -> usize {
    match measure {
        Measure::Denominator => 2,
        Measure::Output | Measure::Value => 4,
    }
}

/// `δ'`: the failure probability each confidence event of one level gets.
pub fn event_budget(delta: f64, measure: Measure, grid: &Grid) -> f64 {
    delta / (events_per_level(measure) * grid.levels()) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_of_is_the_first_threshold_reached() {
        let grid = Grid::default();
        for k in 0..200_000 {
            let x = -(k as f64) * 1.5e-4;
            let j = grid.level_of(x);
            let expected = (0..grid.levels()).find(|&j| x >= grid.log_threshold(j));
            assert_eq!(j, expected, "log weight {x}");
        }
        // Exactly on a threshold, and one ulp either side.
        for j in 0..grid.levels() {
            let t = grid.log_threshold(j);
            assert_eq!(grid.level_of(t), Some(j));
            assert_eq!(grid.level_of(t.next_up()), Some(j));
            assert_eq!(grid.level_of(t.next_down()), (j < grid.last).then_some(j + 1));
        }
        assert_eq!(grid.level_of(f64::NEG_INFINITY), None);
        assert_eq!(grid.level_of(f64::NAN), None);
        assert_eq!(grid.level_of(3.0), Some(0));
    }

    #[test]
    fn thresholds_halve_every_octave() {
        let grid = Grid::default();
        assert_eq!(grid.threshold(0), 1.0);
        assert!((grid.threshold(2) - 0.5).abs() < 1e-15);
        assert!((grid.threshold(40) - 2f64.powi(-20)).abs() < 1e-20);
    }
}
