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
//!    `s_i − c + E_i ≥ ln τ_j`, so it can only if `p_i ≥ c + ln τ_j`. With
//!    `T_j` that threshold rounded down to f32 (and lowered by far more than
//!    the f64 rounding of the entry rule), the keys are sorted, by
//!    counting, by the first level `j` with `T_j ≤ p_i` ([`Buckets`], a
//!    tier of levels at a time as the walk reaches it; keys that reach no
//!    level are never read), and level `j` looks at its bucket alone, in
//!    ascending key order.
//! 3. **Levels.** Each candidate is refined once (its `p_i` replaced by the
//!    tighter bound), then, if it still reaches `T_j`, scored exactly; if
//!    not, it moves to the bucket of the first level its refined bound
//!    reaches. A key whose exact perturbed log-weight reaches `ln τ_j`
//!    enters the sample, and its value is read; one that does not moves to
//!    the bucket of the level it enters at, known now (or leaves, if it
//!    enters at none), and enters there without another read. It enters as
//!    heavy if `w_i ≥ τ_j`, else as light, to be promoted at the level
//!    where it becomes heavy. Then the level's certificate
//!    ([`super::certificate`]) is computed; the first that meets `ε` is the
//!    answer. (This reads, scores and samples at each level exactly the keys
//!    that selecting every key with `p_i ≥ T_j` anew at every level would,
//!    in the same order, so the sums are the same to the last bit.)
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
    /// Deterministic `p_i ≥ s_i + E_i` for every pool key (`+∞` where
    /// nothing bounds the score).
    fn perturbed_uppers(&self) -> &[f32];
    /// Whether [`Self::refine`] can tighten any key's bound.
    fn refines(&self) -> bool;
    /// Deterministic upper bounds on `s_i + E_i` of the pool keys
    /// `indices` (ascending) into `out`, dearer to get than
    /// [`Self::perturbed_uppers`]'s (`+∞` where there is none).
    fn refine(&mut self, indices: &[u32], out: &mut [f64]);
    /// The scores of the pool keys `indices` (ascending), into `out`.
    fn pool_scores(&mut self, indices: &[u32], out: &mut [f64]);
    fn pool_value(&mut self, i: usize, out: &mut [f32]);
    /// A hint that the values of the pool keys `indices` are read next.
    fn prefetch_values(&mut self, indices: &[u32]) {
        let _ = indices;
    }
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

/// A pool key on its way down the levels, with what is known of it: the
/// walk keeps no state per pool key, so that a level touches only its own
/// candidates, end to end, rather than arrays as long as the pool at
/// scattered places.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    key: u32,
    read: Read,
    /// `p_i ≥ s_i + E_i`, the tightest bound known.
    bound: f32,
    /// The exact score, once `read` says it is scored.
    score: f64,
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
    buckets: Buckets,
    /// Per level: the sampled light keys (row in `light_rows`, weight) that
    /// become heavy there.
    promotions: Vec<Vec<(u32, f64)>>,
    light_rows: Vec<f32>,
    /// The candidates of the level being processed (its bucket), and the
    /// bounds or scores of some of them.
    candidates: Vec<Candidate>,
    batch: Vec<u32>,
    /// The candidates that enter the sample at the level being processed,
    /// and their scores.
    entering: Vec<u32>,
    entering_scores: Vec<f64>,
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
            buckets: Buckets::default(),
            promotions: vec![Vec::new(); params.grid.levels()],
            light_rows: Vec::new(),
            candidates: Vec::new(),
            batch: Vec::new(),
            entering: Vec::new(),
            entering_scores: Vec::new(),
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
        self.buckets.reset(c, &grid);
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

    /// Processes level `j`: promotions due at `j`, then the keys of its
    /// bucket, each read no further than it must be.
    fn enter(&mut self, keys: &mut impl HeadKeys, j: usize, c: f64, record: &mut HeadRecord) {
        let grid = self.params.grid;
        let dim = keys.value_dim();
        for &(row, w) in &self.promotions[j] {
            self.sums.promote(w, &self.light_rows[row as usize * dim..][..dim]);
        }
        self.buckets.take(j, keys.perturbed_uppers(), &mut self.candidates);
        if self.candidates.is_empty() {
            return;
        }
        // Refine the keys seen for the first time.
        self.batch.clear();
        self.batch.extend(self.candidates.iter().filter(|k| k.read == Read::Scanned).map(|k| k.key));
        if keys.refines() && !self.batch.is_empty() {
            self.numbers.resize(self.batch.len(), 0.0);
            keys.refine(&self.batch, &mut self.numbers);
            record.refined += self.batch.len();
            let mut refined = self.numbers.iter();
            for k in self.candidates.iter_mut().filter(|k| k.read == Read::Scanned) {
                let bound = *refined.next().expect("a bound per key refined");
                k.read = Read::Refined;
                k.bound = k.bound.min(f32_up(bound));
            }
        }
        // Score the keys whose bound still reaches the level; the others wait
        // for the level it reaches. (Keys scored already enter here.)
        self.batch.clear();
        let threshold = self.buckets.threshold(j);
        for k in &self.candidates {
            if k.read == Read::Scored {
                continue;
            }
            if k.bound >= threshold {
                self.batch.push(k.key);
            } else {
                self.buckets.postpone(*k, self.buckets.first_level(k.bound));
            }
        }
        self.numbers.resize(self.batch.len(), 0.0);
        if !self.batch.is_empty() {
            keys.pool_scores(&self.batch, &mut self.numbers);
        }
        // In key order: the keys just scored (the batch is in that order)
        // that enter now, and those scored before, due now. Their values are
        // asked for together before any is read: they lie scattered.
        self.entering.clear();
        self.entering_scores.clear();
        let mut scored = 0;
        for k in 0..self.candidates.len() {
            let mut candidate = self.candidates[k];
            if candidate.read == Read::Scored {
                self.entering.push(candidate.key);
                self.entering_scores.push(candidate.score);
            } else if self.batch.get(scored) == Some(&candidate.key) {
                let s = self.numbers[scored];
                scored += 1;
                record.scored += 1;
                let entry = grid.level_of(s - c + keys.perturbation(candidate.key as usize));
                debug_assert!(entry.is_none_or(|e| e >= j), "a score above its bound");
                match entry {
                    Some(e) if e == j => {
                        self.entering.push(candidate.key);
                        self.entering_scores.push(s);
                    }
                    Some(later) => {
                        (candidate.read, candidate.score) = (Read::Scored, s);
                        self.buckets.postpone(candidate, later);
                    }
                    None => {}
                }
            }
        }
        keys.prefetch_values(&self.entering);
        for (&i, &s) in self.entering.iter().zip(&self.entering_scores) {
            let i = i as usize;
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

/// The pool keys sorted by the level at which each is next looked at.
///
/// Level `j`'s threshold is `T_j`, `c + ln τ_j` lowered past the entry
/// rule's rounding and rounded down to f32; the thresholds fall with `j`.
/// A key with bound `p_i` is first looked at on the first level with
/// `T_j ≤ p_i` ([`simd::Kernels::first_levels`]). The keys are sorted by
/// that level a tier of [`TIER`] levels at a time, when the walk first
/// reaches the tier: one pass over the bounds picks the keys whose first
/// level lies in it (`T_last ≤ p_i < T_before`), and counting puts them in
/// order of level (one pass to count, one to place). A head stops a few
/// levels down (on the benchmark's caches and the default model's, at
/// levels 5 to 22 of 40), and most keys' bounds reach only the deep levels
/// it never gets to, so they are compared with two numbers and never
/// sorted. A key the level's reads postpone is [`Self::postpone`]d, with
/// what was learnt of it, to a later level's list.
#[derive(Default)]
struct Buckets {
    /// `T_j` per level.
    thresholds: Vec<f32>,
    /// The levels sorted so far: `0..tiers_end`.
    tiers_end: usize,
    /// The keys of the tier being sorted, their bounds and first levels.
    picked: Vec<u32>,
    picked_bounds: Vec<f32>,
    first: Vec<u8>,
    /// The keys of the levels sorted, by first level, ascending within one:
    /// level `j`'s are `sorted[starts[j]..starts[j + 1]]`.
    sorted: Vec<u32>,
    starts: Vec<u32>,
    /// Where the next key of each level is placed, while sorting.
    cursors: Vec<u32>,
    /// Per level: keys postponed to it, in no order.
    postponed: Vec<Vec<Candidate>>,
}

/// Levels [`Buckets`] sorts at a time.
const TIER: usize = 16;

impl Buckets {
    /// Sets the thresholds for shift `c` and forgets the last call's keys;
    /// the keys are sorted as the walk reaches their levels.
    fn reset(&mut self, c: f64, grid: &Grid) {
        let levels = grid.levels();
        let margin = 1e-9 * (1.0 + c.abs());
        self.thresholds.clear();
        self.thresholds.extend((0..levels).map(|j| f32_down(c + grid.log_threshold(j) - margin)));
        self.postponed.resize_with(levels, Vec::new);
        self.postponed.iter_mut().for_each(Vec::clear);
        self.tiers_end = 0;
        self.sorted.clear();
        self.starts.clear();
        self.starts.push(0);
    }

    /// Sorts the next tier's keys of bounds `bounds` by their first level.
    fn sort_tier(&mut self, bounds: &[f32]) {
        let (start, end) = (self.tiers_end, (self.tiers_end + TIER).min(self.thresholds.len()));
        // First level below `end` (`p ≥ T_{end−1}`), and not below `start`
        // (`p < T_{start−1}`, the least f32 under it or less).
        let floor = self.thresholds[end - 1];
        let ceiling = if start == 0 { f32::INFINITY } else { self.thresholds[start - 1].next_down() };
        let picks = |p: f32| p >= floor && p <= ceiling;
        self.picked.clear();
        self.picked_bounds.clear();
        // A chunk's test is branch-free arithmetic, a bit per key; the keys
        // picked (a few percent, scattered) are then found bit by bit.
        for (k, chunk) in bounds.chunks(64).enumerate() {
            let mut mask = chunk.iter().enumerate().fold(0u64, |m, (i, &p)| m | u64::from(picks(p)) << i);
            while mask != 0 {
                let i = mask.trailing_zeros() as usize;
                self.picked.push((64 * k + i) as u32);
                self.picked_bounds.push(chunk[i]);
                mask &= mask - 1;
            }
        }
        self.first.resize(self.picked.len(), 0);
        simd::kernels().first_levels(&self.picked_bounds, &self.thresholds, &mut self.first);
        // Counts at `starts[j + 1]` (past the sorted levels' `starts`, which end at
        // `starts[start]`), then their sums, then each key placed.
        debug_assert_eq!(self.starts.len(), start + 1, "the sorted levels' starts");
        self.starts.resize(end + 1, 0);
        for &j in &self.first {
            debug_assert!((start..end).contains(&usize::from(j)), "a key picked outside its tier");
            self.starts[usize::from(j) + 1] += 1;
        }
        for j in start + 1..=end {
            self.starts[j] += self.starts[j - 1];
        }
        self.sorted.resize(self.starts[end] as usize, 0);
        self.cursors.clone_from(&self.starts);
        for (&i, &j) in self.picked.iter().zip(&self.first) {
            let slot = &mut self.cursors[usize::from(j)];
            self.sorted[*slot as usize] = i;
            *slot += 1;
        }
        self.tiers_end = end;
    }

    fn threshold(&self, j: usize) -> f32 {
        self.thresholds[j]
    }

    /// The first level `j` with `T_j ≤ p` (`thresholds.len()` for none).
    fn first_level(&self, p: f32) -> usize {
        let mut level = [0];
        simd::kernels().first_levels(&[p], &self.thresholds, &mut level);
        usize::from(level[0])
    }

    /// Level `j`'s keys, ascending, into `out`: those first looked at here
    /// with their bounds from the scan, `bounds` (sorting the tier of `j`
    /// if not yet sorted), merged with those postponed to it (sorted alone;
    /// no key is in both).
    fn take(&mut self, j: usize, bounds: &[f32], out: &mut Vec<Candidate>) {
        while self.tiers_end <= j {
            self.sort_tier(bounds);
        }
        out.clear();
        let first = &self.sorted[self.starts[j] as usize..self.starts[j + 1] as usize];
        let postponed = &mut self.postponed[j];
        postponed.sort_unstable_by_key(|k| k.key);
        let mut postponed = postponed.drain(..).peekable();
        for &key in first {
            while let Some(earlier) = postponed.next_if(|k| k.key < key) {
                out.push(earlier);
            }
            out.push(Candidate { key, read: Read::Scanned, bound: bounds[key as usize], score: 0.0 });
        }
        out.extend(postponed);
    }

    /// `key` waits for level `j` (if a level: `j < thresholds.len()`).
    fn postpone(&mut self, key: Candidate, j: usize) {
        if let Some(list) = self.postponed.get_mut(j) {
            list.push(key);
        }
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

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    use super::*;

    /// What a walk asked of its keys, in order.
    #[derive(Debug, PartialEq)]
    enum Asked {
        Refined(Vec<u32>),
        /// Keys scored for the first time.
        Scored(Vec<u32>),
        Value(usize),
    }

    /// A pool with random scores, perturbations and loose bounds above them,
    /// which logs what it is asked.
    struct Pool {
        exact: Vec<f64>,
        scores: Vec<f64>,
        exponentials: Vec<f64>,
        /// `p_i ≥ s_i + E_i`, and the refined bound (between the two).
        uppers: Vec<f32>,
        refined: Vec<f64>,
        lower_max: f64,
        asked: Vec<Asked>,
        seen: Vec<bool>,
    }

    impl Pool {
        fn new(seed: u64, len: usize) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            let spread = rng.random_range(0.5..6.0);
            let scores: Vec<f64> = (0..len).map(|_| spread * (rng.random::<f64>() - 0.5) * 4.0).collect();
            let exponentials: Vec<f64> = (0..len).map(|_| -(1.0 - rng.random::<f64>()).ln()).collect();
            let slack: Vec<f64> = (0..len).map(|_| rng.random::<f64>() * 3.0).collect();
            let uppers = (0..len).map(|i| f32_up(scores[i] + slack[i] + exponentials[i] + 0.06)).collect();
            let refined = (0..len).map(|i| scores[i] + slack[i] / 4.0 + exponentials[i]).collect();
            let lower_max = (0..len).map(|i| scores[i] - slack[i]).fold(f64::NEG_INFINITY, f64::max);
            let exact = (0..8).map(|_| spread * (rng.random::<f64>() - 0.5)).collect();
            Self { exact, scores, exponentials, uppers, refined, lower_max, asked: Vec::new(), seen: vec![false; len] }
        }

        fn shift(&self) -> f64 {
            self.exact.iter().copied().fold(self.lower_max, f64::max)
        }
    }

    impl HeadKeys for Pool {
        fn value_dim(&self) -> usize {
            2
        }
        fn exact_len(&self) -> usize {
            self.exact.len()
        }
        fn exact_score(&mut self, i: usize) -> f64 {
            self.exact[i]
        }
        fn exact_value(&mut self, i: usize, out: &mut [f32]) {
            out.fill(i as f32);
        }
        fn pool_len(&self) -> usize {
            self.scores.len()
        }
        fn pool_lower_max(&self) -> f64 {
            self.lower_max
        }
        fn perturbed_uppers(&self) -> &[f32] {
            &self.uppers
        }
        fn refines(&self) -> bool {
            true
        }
        fn refine(&mut self, indices: &[u32], out: &mut [f64]) {
            self.asked.push(Asked::Refined(indices.to_vec()));
            for (o, &i) in out.iter_mut().zip(indices) {
                *o = self.refined[i as usize];
            }
        }
        fn pool_scores(&mut self, indices: &[u32], out: &mut [f64]) {
            let fresh: Vec<u32> = indices.iter().copied().filter(|&i| !self.seen[i as usize]).collect();
            fresh.iter().for_each(|&i| self.seen[i as usize] = true);
            if !fresh.is_empty() {
                self.asked.push(Asked::Scored(fresh));
            }
            for (o, &i) in out.iter_mut().zip(indices) {
                *o = self.scores[i as usize];
            }
        }
        fn pool_value(&mut self, i: usize, out: &mut [f32]) {
            self.asked.push(Asked::Value(i));
            out.fill(self.scores[i] as f32);
        }
        fn perturbation(&mut self, i: usize) -> f64 {
            self.exponentials[i]
        }
        fn value_norm_max(&self) -> f64 {
            1e3
        }
    }

    /// What a walk down to level `last` asks under the rule the buckets
    /// replace: at every level, every key not yet in the sample whose bound
    /// reaches the level's threshold is selected anew, refined if seen for
    /// the first time, scored if its bound still reaches the threshold, and
    /// sampled if its exact perturbed log-weight does.
    fn selected_anew(pool: &Pool, last: usize) -> Vec<Asked> {
        let grid = Grid::default();
        let c = pool.shift();
        let len = pool.scores.len();
        let mut p = pool.uppers.clone();
        let (mut refined, mut scored) = (vec![false; len], vec![false; len]);
        let mut asked = Vec::new();
        for j in 0..=last {
            let threshold = f32_down(c + grid.log_threshold(j) - 1e-9 * (1.0 + c.abs()));
            let selected: Vec<usize> = (0..len).filter(|&i| p[i] >= threshold).collect();
            let fresh: Vec<u32> = selected.iter().filter(|&&i| !refined[i]).map(|&i| i as u32).collect();
            for &i in &fresh {
                refined[i as usize] = true;
                p[i as usize] = p[i as usize].min(f32_up(pool.refined[i as usize]));
            }
            if !fresh.is_empty() {
                asked.push(Asked::Refined(fresh));
            }
            let batch: Vec<usize> = selected.into_iter().filter(|&i| p[i] >= threshold).collect();
            let first: Vec<u32> = batch.iter().filter(|&&i| !scored[i]).map(|&i| i as u32).collect();
            if !first.is_empty() {
                asked.push(Asked::Scored(first));
            }
            for i in batch {
                scored[i] = true;
                let (s, e) = (pool.scores[i], pool.exponentials[i]);
                match grid.level_of(s - c + e) {
                    Some(entry) if entry <= j => {
                        p[i] = f32::NEG_INFINITY;
                        asked.push(Asked::Value(i));
                    }
                    Some(_) => p[i] = f32_up(s + e),
                    None => p[i] = f32::NEG_INFINITY,
                }
            }
        }
        asked
    }

    #[test]
    fn buckets_read_and_sample_what_selecting_anew_at_every_level_would() {
        let params = Params::default();
        let mut walk = HeadAttention::new(params);
        let mut out = [0.0; 2];
        let mut levels_reached = 0;
        for seed in 0..40 {
            for last in [3, 12, params.grid.last] {
                let mut pool = Pool::new(seed, 1000 + 37 * seed as usize);
                let want = selected_anew(&pool, last);
                let record = walk.attend(&mut pool, Stop::AtLevel(last), &mut out);
                assert_eq!(record.level, Some(last));
                assert!(pool.asked == want, "seed {seed}, down to level {last}: the walks differ");
                let values = want.iter().filter(|a| matches!(a, Asked::Value(_))).count();
                assert_eq!(record.values_read, values);
                levels_reached += usize::from(values > 0);
            }
        }
        assert!(levels_reached > 100, "the pools sample too little to compare ({levels_reached})");
    }
}
