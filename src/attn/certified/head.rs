//! One query head's certified attention: levels from the top until a
//! certificate meets `ε`, reading only the keys that can enter.
//!
//! The caller describes the head's keys through [`HeadKeys`]: the exact set
//! (read whatever happens), and the pool, whose keys come with cheap
//! deterministic bounds `l_i ≤ s_i ≤ u_i` on their scores (the 4-bit sketch
//! scan), a tighter upper bound on demand (8-bit refinement), the exact
//! score, the value, and the key's perturbation `E_i`. [`HeadAttention`]
//! then proceeds as follows.
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
//! 2. **Buckets.** A pool key can enter no earlier than the level of its
//!    upper bound, `level_of(u_i − c + E_i)` ([`super::levels`]); keys are
//!    put in one bucket per level (a counting sort), and keys that cannot
//!    reach even `τ_J` are never read.
//! 3. **Levels.** At level `j`, bucket `j`'s keys are refined, then scored
//!    exactly, each step moving a key whose tighter bound shows a later
//!    entry to that level's bucket; a key whose exact perturbed log-weight
//!    reaches `ln τ_j` enters the sample, and its value is read. It enters
//!    as heavy if `w_i ≥ τ_j`, else as light, to be promoted at the level
//!    where it becomes heavy. Then the level's certificate
//!    ([`super::certificate`]) is computed; the first that meets `ε` is the
//!    answer.
//! 4. **Fallback.** If no level certifies, the head's attention is computed
//!    exactly over every visible key, and the record says so.
//!
//! Because the sample at each level is exactly `{i : s_i − c + E_i ≥ ln τ_j}`
//! (bounds only ever postpone a read, never decide an entry), the estimates
//! are those of threshold sampling, and the certificate's guarantee holds
//! for the level the rule stops at: `P(certified and error > ε) ≤ δ`.

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
    /// Deterministic `(l_i, u_i)` with `l_i ≤ s_i ≤ u_i`.
    fn pool_bounds(&self, i: usize) -> (f64, f64);
    /// A deterministic upper bound at most `u_i`, dearer to get, where the
    /// keys have one (`None`: go straight to the exact score).
    fn pool_refined_upper(&mut self, i: usize) -> Option<f64>;
    /// The scores of the pool keys `indices` (ascending), into `out`.
    fn pool_scores(&mut self, indices: &[u32], out: &mut [f64]);
    fn pool_value(&mut self, i: usize, out: &mut [f32]);
    /// `E_i ~ Exp(1)`, independent of everything else.
    fn perturbation(&self, i: usize) -> f64;
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

/// What is known of a pool key's score.
#[derive(Clone, Copy, Debug)]
enum Known {
    /// An upper bound from the scan.
    Scanned(f64),
    /// An upper bound from the refinement.
    Refined(f64),
    /// The score.
    Scored(f64),
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
    known: Vec<Known>,
    buckets: Vec<Vec<u32>>,
    /// Per level: the sampled light keys (row in `light_rows`, weight) that
    /// become heavy there.
    promotions: Vec<Vec<(u32, f64)>>,
    light_rows: Vec<f32>,
    /// Keys to score, and their scores, a batch at a time.
    to_score: Vec<u32>,
    scores: Vec<f64>,
    /// Keys of the level being processed that enter its sample.
    entering: Vec<u32>,
    value: Vec<f32>,
    output: Vec<f64>,
}

impl HeadAttention {
    pub fn new(params: Params) -> Self {
        let delta = event_budget(params.delta, params.measure, &params.grid);
        let levels = params.grid.levels();
        Self {
            params,
            chernoff: Chernoff::new(delta),
            log_term: (2.0 / delta).ln(),
            sums: LevelSums::default(),
            exact_scores: Vec::new(),
            known: Vec::new(),
            buckets: vec![Vec::new(); levels],
            promotions: vec![Vec::new(); levels],
            light_rows: Vec::new(),
            to_score: Vec::new(),
            scores: Vec::new(),
            entering: Vec::new(),
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
        let mut record = HeadRecord {
            level: None,
            pool: keys.pool_len(),
            refined: 0,
            scored: 0,
            values_read: 0,
            certificate: None,
            shift: 0.0,
            denominator: 0.0,
        };
        let c = self.shift(keys);
        record.shift = c;
        self.sums.reset(dim);
        self.value.resize(dim, 0.0);
        self.output.resize(dim, 0.0);
        self.add_exact_set(keys, c);
        self.buckets.iter_mut().for_each(Vec::clear);
        self.promotions.iter_mut().for_each(Vec::clear);
        self.light_rows.clear();
        for (i, known) in self.known.iter().enumerate() {
            if let Some(j) = grid.level_of(upper(*known) - c + keys.perturbation(i)) {
                self.buckets[j].push(i as u32);
            }
        }
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

    /// `c = max(max_X s_i, max_P l_i)`, reading no pool key; fills `known`
    /// for every pool key with its scan bound.
    fn shift(&mut self, keys: &mut impl HeadKeys) -> f64 {
        self.exact_scores.clear();
        self.exact_scores.extend((0..keys.exact_len()).map(|i| keys.exact_score(i)));
        let exact_max = self.exact_scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        self.known.clear();
        self.known.extend((0..keys.pool_len()).map(|i| Known::Scanned(keys.pool_bounds(i).1)));
        (0..keys.pool_len()).map(|i| keys.pool_bounds(i).0).fold(exact_max, f64::max)
    }

    /// Processes bucket `j`: promotions due at `j`, then the keys that may
    /// enter at `j`, each read no further than it must be.
    fn enter(&mut self, keys: &mut impl HeadKeys, j: usize, c: f64, record: &mut HeadRecord) {
        let grid = self.params.grid;
        let dim = keys.value_dim();
        for &(row, w) in &self.promotions[j] {
            self.sums.promote(w, &self.light_rows[row as usize * dim..][..dim]);
        }
        let mut bucket = std::mem::take(&mut self.buckets[j]);
        // Bounds first: a key whose (refined) bound shows a later entry
        // moves on unread; the others are scored in one batch.
        self.to_score.clear();
        self.entering.clear();
        for &i in &bucket {
            let index = i as usize;
            if let Known::Scanned(u) = self.known[index] {
                if let Some(refined) = keys.pool_refined_upper(index) {
                    record.refined += 1;
                    self.known[index] = Known::Refined(refined.min(u));
                }
            }
            let known = self.known[index];
            match known {
                Known::Scored(_) => self.entering.push(i),
                known if self.moves_on(j, i, upper(known) - c + keys.perturbation(index)) => {}
                _ => self.to_score.push(i),
            }
        }
        self.score_batch(keys, record);
        for k in 0..self.to_score.len() {
            let i = self.to_score[k];
            let Known::Scored(s) = self.known[i as usize] else { unreachable!("scored just now") };
            if !self.moves_on(j, i, s - c + keys.perturbation(i as usize)) {
                self.entering.push(i);
            }
        }
        for k in 0..self.entering.len() {
            let i = self.entering[k] as usize;
            let Known::Scored(s) = self.known[i] else { unreachable!("only scored keys enter") };
            record.values_read += 1;
            keys.pool_value(i, &mut self.value);
            let w = (s - c).exp();
            match grid.level_of(s - c) {
                Some(heavy) if heavy == j => self.sums.add_exact(w, &self.value),
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
        bucket.clear();
        self.buckets[j] = bucket;
    }

    /// Whether key `i` of bucket `j`, whose perturbed log-weight is at most
    /// `log_weight`, enters later (or never): then it is put in that level's
    /// bucket. A sound bound never shows an earlier level.
    fn moves_on(&mut self, j: usize, i: u32, log_weight: f64) -> bool {
        let entry = self.params.grid.level_of(log_weight);
        debug_assert!(entry.is_none_or(|e| e >= j), "a score above its bound");
        if entry == Some(j) {
            return false;
        }
        if let Some(later) = entry {
            self.buckets[later].push(i);
        }
        true
    }

    /// Scores the keys of `to_score`, marking them scored; returns the
    /// scores.
    fn score_batch(&mut self, keys: &mut impl HeadKeys, record: &mut HeadRecord) -> &[f64] {
        self.scores.resize(self.to_score.len(), 0.0);
        keys.pool_scores(&self.to_score, &mut self.scores);
        record.scored += self.to_score.len();
        for (&i, &s) in self.to_score.iter().zip(&self.scores) {
            self.known[i as usize] = Known::Scored(s);
        }
        &self.scores
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
        self.sums.reset(keys.value_dim());
        self.add_exact_set(keys, c);
        self.to_score.clear();
        self.to_score
            .extend((0..keys.pool_len() as u32).filter(|&i| !matches!(self.known[i as usize], Known::Scored(_))));
        self.score_batch(keys, record);
        for i in 0..keys.pool_len() {
            let Known::Scored(s) = self.known[i] else { unreachable!("every key is scored") };
            keys.pool_value(i, &mut self.value);
            self.sums.add_exact((s - c).exp(), &self.value);
        }
        record.values_read = keys.pool_len();
        record.denominator = self.sums.exact_weight;
        self.sums.output(0.0, &mut self.output);
        out.iter_mut().zip(&self.output).for_each(|(o, &x)| *o = x as f32);
    }
}

fn upper(known: Known) -> f64 {
    match known {
        Known::Scanned(u) | Known::Refined(u) => u,
        Known::Scored(s) => s,
    }
}
