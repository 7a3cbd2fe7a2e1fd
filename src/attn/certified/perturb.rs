//! The perturbations: one Exp(1) variable per key and call, from a
//! counter-based hash.
//!
//! Threshold sampling needs, for every pool key `i` of a call, an `E_i`
//! distributed as Exp(1), independent of every other key's and of the
//! scores. It is drawn as `E_i = −ln u_i` with `u_i` uniform on `(0, 1]`:
//! `P(E_i ≥ x) = P(u_i ≤ e^{−x}) = e^{−x}`.
//!
//! `u_i` comes from a hash of the counter `(seed, layer, KV head, position,
//! step)`, so no state is kept and any key's perturbation can be drawn in
//! any order, by any thread, and drawn again. The hash is SplitMix64's: a
//! stream's start `base` is mixed from the seed, layer, KV head and step
//! (each folded in with the finalizer, so that neighbouring fields land far
//! apart), and position `p` of the stream is the finalizer of
//! `base + (p + 1)·γ`, `γ` the odd 64-bit golden-ratio constant. This is
//! exactly SplitMix64's output sequence started at `base`, which passes the
//! BigCrush battery; two streams overlap only if their bases differ by a
//! multiple of `γ` smaller than the context, which for mixed bases has
//! probability about `n_ctx·2^−64`.
//!
//! The top 53 bits `m` of the hash give `u = (m + 1)·2^−53`: every double of
//! that grid in `(0, 1]`, each with probability `2^−53`, so `u` is never 0
//! and `E` never infinite (at most `53·ln 2 ≈ 36.7`). The discretisation
//! shifts any probability by at most `2^−53`.
//!
//! With `fixed = true` (`--fixed-perturbation`) every call uses step 0, so a
//! key keeps its perturbation from step to step; each call's certificate
//! still holds, since within a call the `E_i` are as before, but the calls'
//! errors are no longer independent.

/// SplitMix64's increment: `2^64 / φ`, odd.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: a bijection of `u64` with full avalanche.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What the perturbations of one run depend on besides the call.
#[derive(Clone, Copy, Debug)]
pub struct PerturbationSeed {
    pub seed: u64,
    /// Reuse step 0's perturbations at every step.
    pub fixed: bool,
}

/// The perturbations of one call: one layer, one KV head, one step.
#[derive(Clone, Copy, Debug)]
pub struct Perturbations {
    base: u64,
}

impl Perturbations {
    pub fn new(seed: PerturbationSeed, layer: usize, kv_head: usize, step: u64) -> Self {
        let step = if seed.fixed { 0 } else { step };
        let base = [layer as u64, kv_head as u64, step].into_iter().fold(mix(seed.seed), |h, field| mix(h ^ field));
        Self { base }
    }

    /// The uniform `u ∈ (0, 1]` of the key at `position`, on the grid of
    /// multiples of `2^−53`.
    pub fn uniform(&self, position: usize) -> f64 {
        let z = mix(self.base.wrapping_add((position as u64).wrapping_add(1).wrapping_mul(GAMMA)));
        ((z >> 11) + 1) as f64 * 2f64.powi(-53)
    }

    /// `E = −ln u` of the key at `position`: Exp(1), at most `53·ln 2`.
    pub fn exponential(&self, position: usize) -> f64 {
        -self.uniform(position).ln()
    }

    /// A cheap upper bound on [`Self::exponential`], within 0.06 of it
    /// (for `u ≥ 2^−10`; closer to `E` relatively below): no logarithm, for
    /// screening every key of a pool.
    ///
    /// The top 24 bits `t` of the hash give `x = t·2^−24 ≤ u`, exact in f32,
    /// so `−ln x ≥ −ln u`. Writing `x = 2^e·(1 + f)`, its bits are
    /// `b = (e + 127)·2^23 + f·2^23`, and `log₂(1 + f) ≥ f` on `[0, 1]` (the
    /// chord lies below the concave curve, at most `0.0861` in `log₂` —
    /// `0.0597` in nats — below it), so
    /// `−ln x ≤ ln 2·(127·2^23 − b)·2^−23`. That product, `k·c` with
    /// `k < 2^31` converted and `c = ln 2·2^−23` rounded, errs by under
    /// `3·2^−24` relatively; the factor `1 + 2^−21` covers it. (For `t = 0`
    /// the bound is `127·ln 2 ≈ 88`, above the largest `E`, `53·ln 2`.)
    pub fn exponential_upper(&self, position: usize) -> f32 {
        let z = mix(self.base.wrapping_add((position as u64).wrapping_add(1).wrapping_mul(GAMMA)));
        let x = (z >> 40) as f32 * 2f32.powi(-24);
        let k = (127 << 23) - x.to_bits() as i32;
        k as f32 * (std::f32::consts::LN_2 * 2f32.powi(-23)) * (1.0 + 2f32.powi(-21))
    }
}

#[cfg(test)]
mod tests {
    //! The statistical checks each have a false-alarm probability of at most
    //! `1e−6` for an ideal uniform source, stated where the threshold is set.
    use super::*;

    const SEED: PerturbationSeed = PerturbationSeed { seed: 0x5eed, fixed: false };

    /// Kolmogorov–Smirnov against U(0, 1]: by the Dvoretzky–Kiefer–Wolfowitz
    /// inequality with Massart's constant, `P(sup |F_n − F| > t) ≤
    /// 2·exp(−2n t²)`, exactly, for every n; the threshold makes that 1e−6.
    fn assert_uniform(mut u: Vec<f64>) {
        let n = u.len() as f64;
        u.sort_by(f64::total_cmp);
        let sup = u
            .iter()
            .enumerate()
            .map(|(i, &x)| ((i + 1) as f64 / n - x).abs().max((x - i as f64 / n).abs()))
            .fold(0.0, f64::max);
        let threshold = ((2.0 / 1e-6f64).ln() / (2.0 * n)).sqrt();
        assert!(sup <= threshold, "KS distance {sup} above {threshold} over {n} draws");
    }

    /// Pearson's χ² over a 16 × 16 grid of pairs `(a_k, b_k)` is below the
    /// 1 − 1e−6 quantile of χ²(255) (Wilson–Hilferty's approximation, good to
    /// a few tenths at 255 degrees of freedom; z = 4.753 is the normal's).
    fn assert_independent(pairs: impl Iterator<Item = (f64, f64)>) {
        let mut cells = [0u64; 256];
        let mut n = 0;
        for (a, b) in pairs {
            let (i, j) = (((a * 16.0).ceil() as usize - 1).min(15), ((b * 16.0).ceil() as usize - 1).min(15));
            cells[i * 16 + j] += 1;
            n += 1;
        }
        let expected = n as f64 / 256.0;
        let chi2: f64 = cells.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum();
        let k: f64 = 255.0;
        let threshold = k * (1.0 - 2.0 / (9.0 * k) + 4.753 * (2.0 / (9.0 * k)).sqrt()).powi(3);
        assert!(chi2 <= threshold, "χ² {chi2} above {threshold}");
    }

    #[test]
    fn uniforms_are_uniform_along_positions_steps_and_heads() {
        let call = Perturbations::new(SEED, 3, 1, 7);
        assert_uniform((0..200_000).map(|p| call.uniform(p)).collect());
        assert_uniform((0..200_000).map(|s| Perturbations::new(SEED, 3, 1, s).uniform(42)).collect());
        assert_uniform((0..50_000).map(|h| Perturbations::new(SEED, 0, h, 0).uniform(0)).collect());
    }

    #[test]
    fn neighbouring_counters_are_independent() {
        let call = Perturbations::new(SEED, 5, 2, 11);
        assert_independent((0..100_000).map(|p| (call.uniform(p), call.uniform(p + 1))));
        let step = |s| Perturbations::new(SEED, 5, 2, s);
        assert_independent((0..100_000).map(|s| (step(s).uniform(9), step(s + 1).uniform(9))));
        let head = |h| Perturbations::new(SEED, 5, h, 11);
        assert_independent((0..100_000).map(|h| (head(h).uniform(9), head(h + 1).uniform(9))));
        let layer = |l| Perturbations::new(SEED, l, 2, 11);
        assert_independent((0..100_000).map(|l| (layer(l).uniform(9), layer(l + 1).uniform(9))));
        let seed = |s| Perturbations::new(PerturbationSeed { seed: s, fixed: false }, 5, 2, 11);
        assert_independent((0..100_000).map(|s| (seed(s).uniform(9), seed(s + 1).uniform(9))));
    }

    #[test]
    fn exponentials_have_mean_one() {
        // Exp(1) has variance 1: the mean of 10^5 draws lies within 5
        // standard errors (0.0158) except with probability under 1e−6.
        let call = Perturbations::new(SEED, 0, 0, 0);
        let mean = (0..100_000).map(|p| call.exponential(p)).sum::<f64>() / 1e5;
        assert!((mean - 1.0).abs() < 5.0 / 1e5f64.sqrt(), "mean {mean}");
    }

    #[test]
    fn exponential_uppers_bound_the_exponentials_closely() {
        let call = Perturbations::new(SEED, 2, 1, 9);
        for p in 0..200_000 {
            let (e, upper) = (call.exponential(p), f64::from(call.exponential_upper(p)));
            assert!(upper >= e, "position {p}: {upper} below {e}");
            assert!(upper - e <= 0.06 || e > 10.0 * std::f64::consts::LN_2, "position {p}: {upper} far above {e}");
        }
    }

    #[test]
    fn fixed_perturbations_repeat_across_steps_and_fresh_ones_do_not() {
        let fixed = PerturbationSeed { fixed: true, ..SEED };
        let (a, b) = (Perturbations::new(fixed, 1, 0, 3), Perturbations::new(fixed, 1, 0, 4));
        assert!((0..100).all(|p| a.uniform(p) == b.uniform(p)));
        let (a, b) = (Perturbations::new(SEED, 1, 0, 3), Perturbations::new(SEED, 1, 0, 4));
        assert!((0..100).all(|p| a.uniform(p) != b.uniform(p)));
    }
}
