//! The certificate of one level: how far `D̂` and `ô` can be from `D` and
//! `o`, except with a probability charged to the failure budget.
//!
//! Notation as in [`super::estimate`]; `τ` is the level's threshold,
//! `k = |S ∩ A|` the light keys sampled, `μ = D_A/τ = E k`.
//!
//! # The denominator: Chernoff on a Poisson-binomial count
//!
//! `k` is a sum of independent Bernoulli(`w_i/τ`) over `A`. Its moment
//! generating function is at most that of a Poisson(`μ`) variable, since
//! `1 + p(e^t − 1) ≤ exp(p(e^t − 1))`; Chernoff's method at `t = ln(κ/μ)`
//! then gives, with `g_κ(μ) = e^{−μ}(eμ/κ)^κ` (and `g_0(μ) = e^{−μ}`),
//!
//! ```text
//! P(k ≥ κ) ≤ g_κ(μ)  for κ > μ,        P(k ≤ κ) ≤ g_κ(μ)  for κ < μ.
//! ```
//!
//! Inverting at level `δ'`: `μ_hi(k)` is the largest `μ ≥ k` with
//! `g_k(μ) ≥ δ'` (for `k = 0`, `ln(1/δ')`) and `μ_lo(k)` the smallest
//! `μ ≤ k` with `g_k(μ) ≥ δ'` (for `k = 0`, 0). The true `μ` exceeds
//! `μ_hi(k)` only if `k < μ` and `g_k(μ) < δ'`; as `ln g_κ(μ)` grows with
//! `κ` on `κ < μ` (its derivative in `κ` is `ln(μ/κ) > 0`), those `k` form a
//! lower tail `k ≤ κ*` of probability at most `g_{κ*}(μ) < δ'`. Likewise
//! for `μ < μ_lo(k)` with the upper tail. So except with probability `2δ'`
//! (two events, each charged `δ'`):
//!
//! ```text
//! D ∈ [D_lo, D_hi] = [D_X + D_B + τ·μ_lo,  D_X + D_B + τ·μ_hi],
//! |D̂ − D| = τ·|k − μ| ≤ dD = τ·max(k − μ_lo, μ_hi − k).
//! ```
//!
//! Both ends are found by bisection on `ln g`, which is monotone on either
//! side of `k`, and rounded outward: the bracket's outer end, widened by
//! `10^−9` of itself, far more than the rounding of `ln g` can move the
//! root. They depend only on `k` and `δ'`, so [`Chernoff`] keeps them.
//!
//! # The numerator: Bernstein in Hilbert space
//!
//! Take any centre `c_v` that does not depend on the perturbations; here
//! `c_v = (N_X + N_B)/(D_X + D_B)`, the exact part's own output (0 if that
//! part has no weight), which depends on the scores alone. Let
//! `Z = Σ_{i∈A} (τ·X_i − w_i)(v_i − c_v)`, `X_i = [i ∈ S]`: a sum of
//! independent zero-mean vectors. Then, exactly,
//!
//! ```text
//! N̂ − N = Σ_A (τ X_i − w_i) v_i,   D̂ − D = Σ_A (τ X_i − w_i),   so   Z = (N̂ − N) − c_v (D̂ − D),
//! D·(ô − o) = D ô − N̂ + (N̂ − N) = (ô − c_v)(D − D̂) + Z,
//! ‖ô − o‖ ≤ β = (ζ + ‖ô − c_v‖·dD) / D_lo      whenever ‖Z‖ ≤ ζ and the Chernoff events hold.
//! ```
//!
//! Each term of `Z` has norm at most `max(τ − w_i, w_i)·‖v_i − c_v‖ ≤ τ·R`
//! and variance `w_i(τ − w_i)‖v_i − c_v‖²`, which sum to at most
//! `τ·D_A·R² = τ²·μ·R² ≤ τ²·μ_hi·R²` on the Chernoff events. Here
//! `R = ‖c_v‖ + V_max ≥ max_A ‖v_i − c_v‖` is **deterministic**: `V_max` is
//! the largest value norm over the pool, from the per-page maxima kept when
//! the values are stored. Pinelis's inequality for independent zero-mean
//! vectors in a Hilbert space with `‖terms‖ ≤ b`, `Σ E‖term‖² ≤ σ²`,
//! `P(‖Z‖ ≥ t) ≤ 2·exp(−t² / (2σ² + 2bt/3))`, charged `δ'` with
//! `L = ln(2/δ')`, gives the root of `t² = 2σ²L + (2/3)·b·L·t`,
//!
//! ```text
//! ζ = b·L/3 + sqrt((b·L/3)² + 2σ²·L),
//! ```
//!
//! which is below the usual `sqrt(2σ²L) + 2bL/3` (a valid tightening:
//! it is the exact inversion). The event is stated for the true `σ²`
//! (which depends on the scores only), and `ζ` grows with `σ²`, so any
//! upper bound on it that holds on the other events may take its place.
//!
//! # The variance: from the sample's own spread
//!
//! The spec bounds `σ²` by `τ·D_A·R² ≤ τ²·μ_hi·R²`: every light key as far
//! from the centre as the longest value in the pool could be. Where value
//! norms vary (on the default model the pool's longest value is several
//! times the typical distance to the centre) that is loose by the square
//! of the ratio, and `ζ` by the ratio, which costs levels: `ζ` falls only
//! as `sqrt(τ)`. This module uses the smaller of that bound and one from
//! the sample, a valid tightening charged one more event. With
//! `a_i = ‖v_i − c_v‖² ∈ [0, R²]` (fixed: `c_v` depends on the scores only),
//!
//! ```text
//! σ² = Σ_A w_i(τ − w_i)·a_i ≤ τ·Σ_A w_i·a_i = τ²·m,     m = E[Y],  Y = Σ_A X_i·a_i = Σ_{S∩A} ‖v_i − c_v‖²,
//! ```
//!
//! and `Y`, read off the sample, is a sum of independent non-negative terms
//! `X_i·a_i`. For such sums the lower tail is sub-Gaussian with the sum of
//! the terms' second moments (A. Maurer, 2003, "A bound on the deviation
//! probability for sums of non-negative random variables"):
//! `P(Y ≤ m − t) ≤ exp(−t² / (2·Σ E[(X_i a_i)²]))`, and
//! `Σ E[(X_i a_i)²] = Σ_A p_i·a_i² ≤ R²·m`. So, except with probability
//! `δ'` (with `L₁ = ln(1/δ')`), `m − R·sqrt(2mL₁) < Y`, a quadratic in
//! `sqrt(m)`:
//!
//! ```text
//! m ≤ m_hi = ((s + sqrt(s² + 4Y)) / 2)²,     s = R·sqrt(2L₁),
//! σ² ≤ τ²·min(μ_hi·R², m_hi).
//! ```
//!
//! `Y = Σ_{S∩A}‖v_i‖² − 2 c_v·Σ_{S∩A} v_i + k‖c_v‖²` from the running sums,
//! raised by `10^−9` of its terms' size, far more than their f64
//! rounding (about `n·2^−53` of it over `n` keys' sums). For `k` light
//! keys at typical distance `ā` from the centre, `m_hi ≈ kā² +
//! R·sqrt(2kā²L₁) + 2R²L₁` against `μ_hi·R² ≈ k·R²`: once `k` is a few
//! times `L₁`, the sample's spread wins.
//!
//! # The measures
//!
//! | measure | claim | certified when |
//! | --- | --- | --- |
//! | denominator | `|D̂ − D| ≤ ε·D` | `dD / D_lo ≤ ε` |
//! | output norm | `‖ô − o‖ ≤ ε·‖o‖` | `β ≤ ε·(‖ô‖ − β)`, as `‖o‖ ≥ ‖ô‖ − β` |
//! | value scale | `‖ô − o‖ ≤ ε·M` | `β ≤ ε·M_lo` |
//!
//! with `M² = Σ_i a_i‖v_i‖² = Σ_i w_i‖v_i‖²/D` and
//! `M_lo = max(sqrt(Σ_{X∪B} w_i‖v_i‖² / D_hi), ‖ô‖ − β) ≤ M`: the first
//! leaves out the light keys' (non-negative) share and divides by an upper
//! bound on `D`; the second is `M ≥ ‖o‖` (Jensen). [`LevelCertificate::bound`]
//! is the error bound in units of the measure's scale (the bound divided by
//! the scale's lower bound): certified when it is at most `ε`. A bound of
//! exactly 0 (every pool value and the centre 0, say) certifies any scale.
//!
//! # What each term is
//!
//! * exact: `D_X`, `N_X`, `D_B`, `N_B`, `Σ_{X∪B} w‖v‖²`, `k`, `Σ_{S∩A} v`,
//!   `Σ_{S∩A} ‖v‖²`, `Y`, `c_v`, `ô`, `τ` (sums over keys whose scores and
//!   values were read);
//! * deterministic bounds from store-time metadata: `V_max` (per-page
//!   maxima of the value norms), hence `R` and `b = τR`;
//! * confidence bounds charged to `δ`: `μ_lo` and `μ_hi` (one event each),
//!   `m_hi` (one event), `ζ` (one event); with them `dD`, `D_lo`, `D_hi`,
//!   `σ²`, `β`, `M_lo`.

use super::estimate::LevelSums;
use crate::attn::Measure;

/// The Chernoff interval `[μ_lo(k), μ_hi(k)]` at one `δ'`, kept per `k`.
#[derive(Clone, Debug)]
pub struct Chernoff {
    log_delta: f64,
    intervals: Vec<(f64, f64)>,
}

/// Relative widening of a bisection's outer end.
const OUTWARD: f64 = 1e-9;

impl Chernoff {
    pub fn new(delta: f64) -> Self {
        assert!(delta > 0.0 && delta < 1.0, "a failure probability lies in (0, 1)");
        Self { log_delta: delta.ln(), intervals: Vec::new() }
    }

    /// `(μ_lo, μ_hi)` for a count of `k`.
    pub fn interval(&mut self, k: u64) -> (f64, f64) {
        let k = k as usize;
        while self.intervals.len() <= k {
            let next = self.intervals.len() as f64;
            self.intervals.push((self.low(next), self.high(next)));
        }
        self.intervals[k]
    }

    /// `ln g_k(μ)`, with `ln(μ/k)` as `ln_1p` for accuracy near `μ = k`.
    fn log_tail(k: f64, mu: f64) -> f64 {
        if k == 0.0 {
            -mu
        } else {
            k - mu + k * ((mu - k) / k).ln_1p()
        }
    }

    fn high(&self, k: f64) -> f64 {
        if k == 0.0 {
            return -self.log_delta * (1.0 + OUTWARD);
        }
        // g_k falls from 1 at μ = k: grow the bracket until it is below δ'.
        let (mut inside, mut outside) = (k, k + 1.0);
        while Self::log_tail(k, outside) >= self.log_delta {
            (inside, outside) = (outside, k + 2.0 * (outside - k));
        }
        let (_, outside) = self.bisect(k, inside, outside);
        outside * (1.0 + OUTWARD)
    }

    fn low(&self, k: f64) -> f64 {
        if k == 0.0 {
            return 0.0;
        }
        // g_k rises from 0 at μ = 0 to 1 at μ = k.
        let (_, outside) = self.bisect(k, k, 0.0);
        outside * (1.0 - OUTWARD)
    }

    /// Narrows `[inside, outside]` (in either order), `g_k ≥ δ'` at
    /// `inside` and `< δ'` at `outside`, to a relative width of `10^−14`.
    fn bisect(&self, k: f64, mut inside: f64, mut outside: f64) -> (f64, f64) {
        for _ in 0..200 {
            if (inside - outside).abs() <= 1e-14 * inside.abs().max(outside.abs()) {
                break;
            }
            let mid = 0.5 * (inside + outside);
            if Self::log_tail(k, mid) >= self.log_delta {
                inside = mid;
            } else {
                outside = mid;
            }
        }
        (inside, outside)
    }
}

/// `ζ = bL/3 + sqrt((bL/3)² + 2σ²L)`: Pinelis's bound on `‖Z‖` inverted,
/// for terms of norm at most `b` and total variance at most `variance`.
pub fn bernstein_radius(b: f64, variance: f64, log_term: f64) -> f64 {
    let third = b * log_term / 3.0;
    third + (third * third + 2.0 * variance * log_term).sqrt()
}

/// The certificate of one level.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LevelCertificate {
    /// `D̂`.
    pub denominator: f64,
    /// `dD ≥ |D̂ − D|`.
    pub denominator_error: f64,
    /// `D_lo ≤ D`.
    pub denominator_low: f64,
    /// `β ≥ ‖ô − o‖` (the output measures only; else infinite).
    pub output_error: f64,
    /// The error bound in units of the measure's scale.
    pub bound: f64,
}

impl LevelCertificate {
    pub fn meets(&self, eps: f64) -> bool {
        self.bound <= eps
    }
}

/// What a level's certificate needs besides its sums.
pub struct CertificateInputs<'a> {
    pub measure: Measure,
    /// `τ`.
    pub tau: f64,
    /// `[μ_lo, μ_hi]` for the level's `k`.
    pub interval: (f64, f64),
    /// `V_max`: no pool value is longer.
    pub value_norm_max: f64,
    /// `L = ln(2/δ')` for the Bernstein event (the spread's event, charged
    /// the same `δ'`, takes `L₁ = L − ln 2`).
    pub log_term: f64,
    /// `ô` of the level ([`LevelSums::output`]).
    pub output: &'a [f64],
}

/// The certificate of a level with sums `sums`.
pub fn certify(sums: &LevelSums, inputs: &CertificateInputs) -> LevelCertificate {
    let CertificateInputs { measure, tau, interval: (mu_lo, mu_hi), value_norm_max, log_term, output } = *inputs;
    let k = sums.light_count as f64;
    let exact = sums.exact_weight;
    let denominator = exact + tau * k;
    let denominator_error = tau * (k - mu_lo).max(mu_hi - k);
    let (denominator_low, denominator_high) = (exact + tau * mu_lo, exact + tau * mu_hi);
    let mut certificate =
        LevelCertificate { denominator, denominator_error, denominator_low, output_error: f64::INFINITY, bound: 0.0 };
    if measure == Measure::Denominator {
        certificate.bound = ratio(denominator_error, denominator_low);
        return certificate;
    }
    let centre_scale = if exact > 0.0 { 1.0 / exact } else { 0.0 };
    let (mut centre_norm2, mut distance2, mut output_norm2, mut centre_dot_light) = (0.0, 0.0, 0.0, 0.0);
    for ((&n, &o), &l) in sums.exact_numerator.iter().zip(output).zip(&sums.light_values) {
        let centre = n * centre_scale;
        centre_norm2 += centre * centre;
        distance2 += (o - centre) * (o - centre);
        output_norm2 += o * o;
        centre_dot_light += centre * l;
    }
    let r = centre_norm2.sqrt() + value_norm_max;
    let spread = spread_high(sums, centre_norm2, centre_dot_light, r, log_term - std::f64::consts::LN_2);
    let zeta = bernstein_radius(tau * r, tau * tau * (mu_hi * r * r).min(spread), log_term);
    let beta = (zeta + distance2.sqrt() * denominator_error) / denominator_low;
    let output_low = output_norm2.sqrt() - beta;
    let scale = match measure {
        Measure::Output => output_low,
        _ => (sums.exact_square / denominator_high).sqrt().max(output_low),
    };
    certificate.output_error = beta;
    certificate.bound = ratio(beta, scale);
    certificate
}

/// `m_hi ≥ m = E[Σ_{S∩A} ‖v_i − c_v‖²]` except with probability
/// `e^{−log_term}`, for a centre of squared norm `centre_norm2` whose dot
/// product with `Σ_{S∩A} v_i` is `centre_dot_light`, and `r ≥ ‖v_i − c_v‖`.
fn spread_high(sums: &LevelSums, centre_norm2: f64, centre_dot_light: f64, r: f64, log_term: f64) -> f64 {
    let k = sums.light_count as f64;
    let terms = sums.light_square + 2.0 * centre_dot_light.abs() + k * centre_norm2;
    let y = (sums.light_square - 2.0 * centre_dot_light + k * centre_norm2).max(0.0) + 1e-9 * terms;
    let s = r * (2.0 * log_term).sqrt();
    let root = 0.5 * (s + (s * s + 4.0 * y).sqrt());
    root * root
}

/// `error / scale` for a scale that may be 0 or below: an error of 0 is
/// within any scale, any other error within none that is not positive.
fn ratio(error: f64, scale: f64) -> f64 {
    if error == 0.0 {
        0.0
    } else if scale > 0.0 {
        error / scale
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `P(Poisson(μ) ≤ k)`, summed term by term.
    fn poisson_cdf(k: u64, mu: f64) -> f64 {
        let mut term = (-mu).exp();
        let mut sum = term;
        for i in 1..=k {
            term *= mu / i as f64;
            sum += term;
        }
        sum
    }

    /// The Chernoff tail is above the exact Poisson tail, so its interval
    /// must contain the exact (Garwood) interval of a Poisson count at the
    /// same level: an inversion that is too narrow fails here.
    #[test]
    fn chernoff_interval_contains_the_exact_poisson_interval() {
        for delta in [0.2, 1e-3, 1e-6] {
            let mut chernoff = Chernoff::new(delta);
            for k in [0u64, 1, 2, 5, 10, 50, 200, 600] {
                let (lo, hi) = chernoff.interval(k);
                assert!(lo <= k as f64 && k as f64 <= hi);
                // At μ_hi, seeing k or fewer is at most δ' likely.
                assert!(poisson_cdf(k, hi) <= delta, "k {k} δ {delta}: P(K ≤ k; μ_hi = {hi}) above δ");
                if k > 0 {
                    assert!(1.0 - poisson_cdf(k - 1, lo) <= delta, "k {k} δ {delta}: P(K ≥ k; μ_lo = {lo}) above δ");
                }
                // And the ends are where the bound says, not anywhere wider.
                let g = |mu: f64| Chernoff::log_tail(k as f64, mu).exp();
                assert!((g(hi) - delta).abs() <= 1e-6 * delta, "k {k}: g(μ_hi) = {} vs δ {delta}", g(hi));
                if k > 0 {
                    assert!((g(lo) - delta).abs() <= 1e-6 * delta, "k {k}: g(μ_lo) = {} vs δ {delta}", g(lo));
                }
            }
        }
    }

    #[test]
    fn chernoff_intervals_grow_with_the_count_and_narrow_relatively() {
        let mut chernoff = Chernoff::new(1e-4);
        let mut previous = chernoff.interval(0);
        for k in 1..2000 {
            let (lo, hi) = chernoff.interval(k);
            assert!(lo >= previous.0 && hi >= previous.1, "k {k}");
            previous = (lo, hi);
        }
        let (lo, hi) = chernoff.interval(1999);
        assert!((hi - lo) / 1999.0 < 0.3);
    }

    /// The sample's spread about a centre, from the running sums, is the
    /// plain sum `Σ‖v_i − c‖²` raised by its margin (with no confidence
    /// term); and `m_hi` covers the true mean `m` but with probability at
    /// most `δ'`: over 20,000
    /// samples at `δ' = 0.2` of a population where one far key, rarely
    /// sampled, holds most of `m`, the misses are compared with
    /// Binomial(20,000, 0.2), failing if their upper tail is below 10^−6.
    #[test]
    fn spread_bound_is_the_sample_spread_and_covers_its_mean() {
        use rand::rngs::StdRng;
        use rand::{RngExt, SeedableRng};
        let mut rng = StdRng::seed_from_u64(7);
        let dim = 4;
        let centre = [0.5, -1.0, 0.25, 2.0];
        let centre_norm2: f64 = centre.iter().map(|c| c * c).sum();
        // 300 near keys sampled with probability 0.3, one far key with 0.02.
        let mut keys: Vec<(Vec<f32>, f64)> = (0..300)
            .map(|_| ((0..dim).map(|d| (centre[d] + rng.random::<f64>() * 0.2 - 0.1) as f32).collect(), 0.3))
            .collect();
        keys.push((vec![40.0, 0.0, 0.0, 0.0], 0.02));
        let distance2 = |v: &[f32]| v.iter().zip(&centre).map(|(&x, c)| (f64::from(x) - c).powi(2)).sum::<f64>();
        let r = keys.iter().map(|(v, _)| distance2(v).sqrt()).fold(0.0, f64::max);
        let m: f64 = keys.iter().map(|(v, p)| p * distance2(v)).sum();
        let (trials, delta) = (20_000u64, 0.2f64);
        let mut misses = 0u64;
        for trial in 0..trials {
            let mut sums = LevelSums::default();
            sums.reset(dim);
            let mut direct = 0.0;
            for (v, p) in &keys {
                if rng.random::<f64>() < *p {
                    sums.add_light(v);
                    direct += distance2(v);
                }
            }
            let dot: f64 = sums.light_values.iter().zip(&centre).map(|(l, c)| l * c).sum();
            if trial < 100 {
                // Raised past the rounding by a hair of the terms' size.
                let terms = sums.light_square + 2.0 * dot.abs() + sums.light_count as f64 * centre_norm2;
                let y = spread_high(&sums, centre_norm2, dot, r, 0.0);
                assert!(y >= direct && y - direct <= 2e-9 * terms, "spread {y} vs {direct}");
            }
            misses += u64::from(spread_high(&sums, centre_norm2, dot, r, (1.0 / delta).ln()) < m);
        }
        // Upper tail of Binomial(trials, δ) at `misses`, by Chernoff.
        let q = misses as f64 / trials as f64;
        if q > delta {
            let kl = q * (q / delta).ln() + (1.0 - q) * ((1.0 - q) / (1.0 - delta)).ln();
            assert!(-(trials as f64) * kl > (1e-6f64).ln(), "{misses} misses of {trials} at δ' = {delta}");
        }
    }

    /// The radius solves `t² = 2σ²L + (2/3)bLt`, and lies below the sum form.
    #[test]
    fn bernstein_radius_inverts_pinelis() {
        for (b, variance, l) in [(1.0, 4.0, 9.0), (0.01, 1e-3, 14.0), (3.0, 0.0, 5.0)] {
            let t = bernstein_radius(b, variance, l);
            assert!((t * t - 2.0 * variance * l - 2.0 * b * l * t / 3.0).abs() < 1e-9 * t * t);
            assert!(t <= (2.0 * variance * l).sqrt() + 2.0 * b * l / 3.0 + 1e-12);
        }
    }
}
