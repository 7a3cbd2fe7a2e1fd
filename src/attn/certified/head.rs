//! One query head's certified attention: levels from the top until a
//! certificate meets `ε`, reading only the keys that can enter.
//!
//! The caller describes the head's keys through [`HeadKeys`]: the exact set
//! (read whatever happens), and the pool, whose keys come with cheap
//! deterministic bounds on their scores (the 4-bit sketch scan): the largest
//! lower bound, and per key an upper bound `p_i ≥ s_i + E_i` on its
//! *perturbed* score, in f32; a tighter upper bound on demand (the 8-bit
//! refinement), the exact score, the value, and the perturbation `E_i`.
//! [`HeadAttention`] then proceeds as follows.
//!
//! 1. **Shift.** `c = max(max_X s_i, max_P l_i)`: the exact set's largest
//!    score or the largest lower bound of the pool, a lower bound on the
//!    largest score that reads no pool key. Any `c` that does not depend on
//!    the perturbations keeps the estimates unbiased and the certificates
//!    valid (nothing in them needs `w_i ≤ 1`; a key with `w_i ≥ 1` is heavy
//!    at every level). The spec's exact maximum would score every pool key
//!    whose upper bound reaches `c`: with the 4-bit bounds a few nats wide,
//!    on the default model's 256-wide heads that was every key of the pool
//!    (measured: keys read 100% on PG-19 at `-c 8192`), for a shift at most
//!    the bounds' width higher, which moves the grid by as many levels.
//! 2. **Candidates.** Key `i` enters at level `j` when
//!    `s_i − c + E_i ≥ ln τ_j`, so it can only if `p_i ≥ c + ln τ_j`. At
//!    level `j` the keys with `p_i ≥ T_j`, `T_j` that threshold rounded
//!    down to f32 (and lowered by far more than the f64 rounding of the
//!    entry rule), are selected in one vectorized pass
//!    ([`simd::Kernels::select_at_least`]); keys that entered are marked
//!    `p_i = −∞`, so the selection is exactly the keys not yet in the
//!    sample that may enter now.
//! 3. **Levels.** Each candidate is refined once (its `p_i` replaced by the
//!    tighter bound), then, if it still reaches `T_j`, scored exactly, and
//!    its `p_i` becomes its exact perturbed score rounded up. A key whose
//!    exact perturbed log-weight reaches `ln τ_j` enters the sample, and its
//!    value is read. It enters as heavy if `w_i ≥ τ_j`, else as light, to be
//!    promoted at the level where it becomes heavy. A key that does not
//!    enter keeps its tighter `p_i` and is selected again no earlier than
//!    its bound allows. Then the level's certificate
//!    ([`super::certificate`]) is computed; the first that meets `ε` is the
//!    answer.
//! 4. **Fallback.** If no level certifies, the head's attention is computed
//!    exactly over every visible key, and the record says so.
//!
//! Because the sample at each level is exactly `{i : s_i − c + E_i ≥ ln τ_j}`
//! (bounds only ever postpone a read, never decide an entry: the entry is
//! [`Grid::level_of`] of the exact perturbed log-weight), the estimates are
//! those of threshold sampling, and the certificate's guarantee holds for
//! the level the rule stops at: `P(certified and error > ε) ≤ δ`.

use super::certificate::{certify, CertificateInputs, Chernoff, LevelCertificate};
use super::estimate::LevelSums;
use super::levels::{event_budget, Grid};
use crate::attn::Measure;

/// A certified attention's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// `ε`, in units of the measure's scale.
    pub eps: f64,
    /// `δ`: the probability, per head and call, of a certified error above `ε`.
    pub delta: f64,
    pub measure: Measure,
    pub grid: Grid,
}

impl Default for Params {
    fn default() -> Self {
        Self { eps: 0.1, delta: 1e-3, measure: Measure::Value, grid: Grid::default() }
    }
}

/// One head's keys, values and perturbations, as [`HeadAttention`] reads them.
/// Scores are scaled (`s_i = scale·q·k_i`); pool keys are numbered from 0.
pub trait HeadKeys {
    fn value_dim(&self) -> usize;
    fn exact_len(&self) -> usize;
    fn exact_score(&mut self, i: usize) -> f64;
    fn exact_value(&mut self, i: usize, out: &mut [f32]);
    fn pool_len(&self) -> usize;
    /// A deterministic lower bound on some pool key's score, as high as the
    /// bounds give (`−∞` when no key is bounded).
    fn pool_lower_max(&self) -> f64;
    /// Deterministic `out[i] ≥ s_i + E_i` for every pool key (`+∞` where
    /// nothing bounds the score).
    fn perturbed_uppers(&self, out: &mut [f32]);
    /// Whether [`Self::refine`] can tighten any key's bound.
    fn refines(&self) -> bool;
    /// Deterministic upper bounds on `s_i + E_i` of the pool keys
    /// `indices` (ascending) into `out`, dearer to get than
    /// [`Self::perturbed_uppers`]'s (`+∞` where there is none).
    fn refine(&mut self, indices: &[u32], out: &mut [f64]);
    /// The scores of the pool keys `indices` (ascending), into `out`.
    fn pool_scores(&mut self, indices: &[u32], out: &mut [f64]);
    fn pool_value(&mut self, i: usize, out: &mut [f32]);
    /// `E_i ~ Exp(1)`, independent of everything else.
    fn perturbation(&mut self, i: usize) -> f64;
    /// A deterministic bound on every pool value's norm.
    fn value_norm_max(&self) -> f64;
}

/// When to stop going down the levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// At the first level whose certificate meets `ε`, else fall back to
    /// exact attention.
    Certified,
    /// At this level, whatever its certificate: the plain estimator (its
    /// mean is what the unbiasedness tests check).
    AtLevel(usize),
}

/// What one head's call did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadRecord {
    /// The level stopped at; `None` when no level certified and the head
    /// fell back to exact attention.
    pub level: Option<usize>,
    /// Pool keys (the exact set is not counted).
    pub pool: usize,
    /// Pool keys refined, scored exactly, and whose values were read.
    pub refined: usize,
    pub scored: usize,
    pub values_read: usize,
    /// The level's certificate (none on a fallback, which is exact).
    pub certificate: Option<LevelCertificate>,
    /// The shift `c` (the largest score) and the denominator relative to
    /// it: `D̂` at the level stopped at, or `D` on a fallback.
    pub shift: f64,
    pub denominator: f64,
}

impl HeadRecord {
    pub fn fallback(&self) -> bool {
        self.level.is_none()
    }
}

/// How far a pool key has been read in this call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    Scanned,
    Refined,
    Scored,
}

/// The per-head driver, with its buffers and the tables of its `δ'`.
pub struct HeadAttention {
    params: Params,
    chernoff: Chernoff,
    /// `L = ln(2/δ')` of the Bernstein event.
    log_term: f64,
    sums: LevelSums,
    /// The exact set's scores.
    exact_scores: Vec<f64>,
    /// Per pool key: `p_i ≥ s_i + E_i`, the tightest bound known; `−∞`
    /// once the key is in the sample.
    perturbed: Vec<f32>,
    read: Vec<Read>,
    /// Per level: the sampled light keys (row in `light_rows`, weight) that
    /// become heavy there.
    promotions: Vec<Vec<(u32, f64)>>,
    light_rows: Vec<f32>,
    /// The candidates of the level being processed, and their bounds or
    /// scores, a batch at a time.
    candidates: Vec<u32>,
    batch: Vec<u32>,
    numbers: Vec<f64>,
    value: Vec<f32>,
    output: Vec<f64>,
}

impl HeadAttention {
    pub fn new(params: Params) -> Self {
        let delta = event_budget(params.delta, params.measure, &params.grid);
        Self {
            params,
            chernoff: Chernoff::new(delta),
            log_term: (2.0 / delta).ln(),
            sums: LevelSums::default(),
            exact_scores: Vec::new(),
            perturbed: Vec::new(),
            read: Vec::new(),
            promotions: vec![Vec::new(); params.grid.levels()],
            light_rows: Vec::new(),
            candidates: Vec::new(),
            batch: Vec::new(),
            numbers: Vec::new(),
            value: Vec::new(),
            output: Vec::new(),
        }
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The head's attention output into `out` (`value_dim` numbers).
    pub fn attend(&mut self, keys: &mut impl HeadKeys, stop: Stop, out: &mut [f32]) -> HeadRecord {
        let dim = keys.value_dim();
        let grid = self.params.grid;
        let pool = keys.pool_len();
        let mut record = HeadRecord {
            level: None,
            pool,
            refined: 0,
            scored: 0,
            values_read: 0,
            certificate: None,
            shift: 0.0,
            denominator: 0.0,
        };
        self.exact_scores.clear();
        self.exact_scores.extend((0..keys.exact_len()).map(|i| keys.exact_score(i)));
        let c = self.exact_scores.iter().copied().fold(keys.pool_lower_max(), f64::max);
        record.shift = c;
        self.sums.reset(dim);
        self.value.resize(dim, 0.0);
        self.output.resize(dim, 0.0);
        self.add_exact_set(keys, c);
        self.promotions.iter_mut().for_each(Vec::clear);
        self.light_rows.clear();
        self.perturbed.resize(pool, 0.0);
        keys.perturbed_uppers(&mut self.perturbed);
        self.read.clear();
        self.read.resize(pool, Read::Scanned);
        self.candidates.resize(pool, 0);
        let last = match stop {
            Stop::Certified => grid.last,
            Stop::AtLevel(j) => j.min(grid.last),
        };
        for j in 0..=last {
            self.enter(keys, j, c, &mut record);
            let tau = grid.threshold(j);
            self.sums.output(tau, &mut self.output);
            let inputs = CertificateInputs {
                measure: self.params.measure,
                tau,
                interval: self.chernoff.interval(self.sums.light_count),
                value_norm_max: keys.value_norm_max(),
                log_term: self.log_term,
                output: &self.output,
            };
            let certificate = certify(&self.sums, &inputs);
            if stop == Stop::AtLevel(j) || (stop == Stop::Certified && certificate.meets(self.params.eps)) {
                record.level = Some(j);
                record.certificate = Some(certificate);
                record.denominator = certificate.denominator;
                out.iter_mut().zip(&self.output).for_each(|(o, &x)| *o = x as f32);
                return record;
            }
        }
        self.exact(keys, c, &mut record, out);
        record
    }

    /// Processes level `j`: promotions due at `j`, then the keys whose bound
    /// reaches the level, each read no further than it must be.
    fn enter(&mut self, keys: &mut impl HeadKeys, j: usize, c: f64, record: &mut HeadRecord) {
        let grid = self.params.grid;
        let dim = keys.value_dim();
        for &(row, w) in &self.promotions[j] {
            self.sums.promote(w, &self.light_rows[row as usize * dim..][..dim]);
        }
        let log_tau = grid.log_threshold(j);
        // Far below the level's threshold by more than the entry rule's f64
        // rounding, then rounded down to f32: every key that may enter has
        // `p_i` at or above it.
        let threshold = f32_down(c + log_tau - 1e-9 * (1.0 + c.abs()));
        let n = simd::kernels().select_at_least(&self.perturbed, threshold, &mut self.candidates);
        if n == 0 {
            return;
        }
        // Refine the keys seen for the first time; those whose refined
        // bound falls below the level wait.
        self.batch.clear();
        self.batch.extend(self.candidates[..n].iter().copied().filter(|&i| self.read[i as usize] == Read::Scanned));
        if keys.refines() && !self.batch.is_empty() {
            self.numbers.resize(self.batch.len(), 0.0);
            keys.refine(&self.batch, &mut self.numbers);
            record.refined += self.batch.len();
            for (&i, &bound) in self.batch.iter().zip(&self.numbers) {
                let i = i as usize;
                self.read[i] = Read::Refined;
                self.perturbed[i] = self.perturbed[i].min(f32_up(bound));
            }
        }
        self.batch.clear();
        let (perturbed, candidates) = (&self.perturbed, &self.candidates[..n]);
        self.batch.extend(candidates.iter().copied().filter(|&i| perturbed[i as usize] >= threshold));
        if self.batch.is_empty() {
            return;
        }
        self.numbers.resize(self.batch.len(), 0.0);
        keys.pool_scores(&self.batch, &mut self.numbers);
        for k in 0..self.batch.len() {
            let (i, s) = (self.batch[k] as usize, self.numbers[k]);
            if self.read[i] != Read::Scored {
                self.read[i] = Read::Scored;
                record.scored += 1;
            }
            let e = keys.perturbation(i);
            let entry = grid.level_of(s - c + e);
            debug_assert!(entry.is_none_or(|e| e >= j), "a score above its bound");
            if entry.is_none_or(|e| e > j) {
                // Selected again no earlier than its exact level (less the
                // margin).
                self.perturbed[i] = if entry.is_some() { f32_up(s + e) } else { f32::NEG_INFINITY };
                continue;
            }
            self.perturbed[i] = f32::NEG_INFINITY;
            record.values_read += 1;
            keys.pool_value(i, &mut self.value);
            let w = (s - c).exp();
            match grid.level_of(s - c) {
                Some(heavy) if heavy <= j => self.sums.add_exact(w, &self.value),
                heavy => {
                    self.sums.add_light(&self.value);
                    if let Some(heavy) = heavy {
                        let row = (self.light_rows.len() / dim) as u32;
                        self.light_rows.extend_from_slice(&self.value);
                        self.promotions[heavy].push((row, w));
                    }
                }
            }
        }
    }

    /// The exact set's keys, into the exact part of the sums.
    fn add_exact_set(&mut self, keys: &mut impl HeadKeys, c: f64) {
        for (i, &s) in self.exact_scores.iter().enumerate() {
            keys.exact_value(i, &mut self.value);
            self.sums.add_exact((s - c).exp(), &self.value);
        }
    }

    /// Exact attention over the exact set and the whole pool.
    fn exact(&mut self, keys: &mut impl HeadKeys, c: f64, record: &mut HeadRecord, out: &mut [f32]) {
        let pool = keys.pool_len();
        self.sums.reset(keys.value_dim());
        self.add_exact_set(keys, c);
        self.batch.clear();
        self.batch.extend(0..pool as u32);
        self.numbers.resize(pool, 0.0);
        keys.pool_scores(&self.batch, &mut self.numbers);
        for i in 0..pool {
            keys.pool_value(i, &mut self.value);
            self.sums.add_exact((self.numbers[i] - c).exp(), &self.value);
        }
        record.scored = pool;
        record.values_read = pool;
        record.denominator = self.sums.exact_weight;
        self.sums.output(0.0, &mut self.output);
        out.iter_mut().zip(&self.output).for_each(|(o, &x)| *o = x as f32);
    }
}

/// The least f32 at or above `x` (`+∞` above f32's range).
pub fn f32_up(x: f64) -> f32 {
    let y = x as f32;
    if f64::from(y) < x {
        y.next_up()
    } else {
        y
    }
}

/// The largest f32 at or below `x`.
pub fn f32_down(x: f64) -> f32 {
    let y = x as f32;
    if f64::from(y) > x {
        y.next_down()
    } else {
        y
    }
}
