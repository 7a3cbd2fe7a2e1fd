//! Horvitz–Thompson estimates of one level, from running sums.
//!
//! At level `j` with threshold `τ = τ_j` the visible keys fall in three
//! parts: the exact set `X` (sinks and newest keys, read whatever happens),
//! the heavy pool keys `B = {i ∈ P : w_i ≥ τ}` (sampled with probability
//! 1), and the light pool keys `A = P \ B`, each sampled with probability
//! `w_i/τ < 1`. Dividing a sampled light key by its inclusion probability
//! gives it the weight `w_i / (w_i/τ) = τ`, whatever `w_i`:
//!
//! ```text
//! D̂ = D_X + D_B + τ·k                  k = |S ∩ A|
//! N̂ = N_X + N_B + τ·Σ_{i ∈ S∩A} v_i     ô = N̂ / D̂
//! ```
//!
//! Both are unbiased: `E[τ·[i ∈ S]] = τ·w_i/τ = w_i` for every light key,
//! and the other terms are exact. Their variances are
//! `Var D̂ = Σ_A w_i(τ − w_i)` and, per coordinate `d`,
//! `Var N̂_d = Σ_A w_i(τ − w_i)·v_id²`: what the statistical tests check
//! the sample means against.
//!
//! [`LevelSums`] holds the exact part `X ∪ B` (`Σ w`, `Σ w·v`, `Σ w·‖v‖²`)
//! and the light sample (`k`, `Σ v`, `Σ ‖v‖²`) and is carried from level
//! to level: a key that enters is added as heavy or light, and a sampled
//! light key is
//! *promoted* to the exact part at the level where it becomes heavy, since
//! `B_j` grows as `τ_j` falls. Everything is summed in f64, so the rounding
//! (about `10^−16` relative, promotions' subtractions included) is far below
//! any `ε` a certificate is asked for (the sums run through `simd`'s
//! [`add_scaled_f64`](simd::Kernels::add_scaled_f64) and
//! [`squared_norm_f64`](simd::Kernels::squared_norm_f64), the same bits on
//! every table).

/// The running sums of one level's exact part and light sample.
#[derive(Clone, Debug, Default)]
pub struct LevelSums {
    /// `D_X + D_B`.
    pub exact_weight: f64,
    /// `N_X + N_B`.
    pub exact_numerator: Vec<f64>,
    /// `Σ_{X∪B} w_i‖v_i‖²`, for the value scale's lower bound.
    pub exact_square: f64,
    /// `k = |S ∩ A|`.
    pub light_count: u64,
    /// `Σ_{S∩A} v_i`.
    pub light_values: Vec<f64>,
    /// `Σ_{S∩A} ‖v_i‖²`, for the sample's spread about a centre.
    pub light_square: f64,
}

impl LevelSums {
    /// Empty sums for values of `dim` numbers.
    pub fn reset(&mut self, dim: usize) {
        self.exact_weight = 0.0;
        self.exact_square = 0.0;
        self.light_count = 0;
        self.light_square = 0.0;
        for sum in [&mut self.exact_numerator, &mut self.light_values] {
            sum.clear();
            sum.resize(dim, 0.0);
        }
    }

    /// A key of the exact set, or a heavy pool key, of weight `w`.
    pub fn add_exact(&mut self, w: f64, value: &[f32]) {
        let kernels = simd::kernels();
        self.exact_weight += w;
        kernels.add_scaled_f64(w, value, &mut self.exact_numerator);
        self.exact_square += w * kernels.squared_norm_f64(value);
    }

    /// A sampled light key.
    pub fn add_light(&mut self, value: &[f32]) {
        let kernels = simd::kernels();
        self.light_count += 1;
        kernels.add_scaled_f64(1.0, value, &mut self.light_values);
        self.light_square += kernels.squared_norm_f64(value);
    }

    /// A sampled light key of weight `w` that has become heavy.
    pub fn promote(&mut self, w: f64, value: &[f32]) {
        let kernels = simd::kernels();
        self.light_count -= 1;
        kernels.add_scaled_f64(-1.0, value, &mut self.light_values);
        self.light_square -= kernels.squared_norm_f64(value);
        self.add_exact(w, value);
    }

    /// `D̂` at threshold `tau`.
    pub fn denominator(&self, tau: f64) -> f64 {
        self.exact_weight + tau * self.light_count as f64
    }

    /// `N̂` at threshold `tau`, into `out`.
    pub fn numerator(&self, tau: f64, out: &mut [f64]) {
        for ((o, &n), &l) in out.iter_mut().zip(&self.exact_numerator).zip(&self.light_values) {
            *o = n + tau * l;
        }
    }

    /// `ô = N̂ / D̂` at threshold `tau`, into `out`.
    pub fn output(&self, tau: f64, out: &mut [f64]) {
        self.numerator(tau, out);
        let d = self.denominator(tau);
        out.iter_mut().for_each(|o| *o /= d);
    }
}
