//! The pattern library with its budget grids, each candidate's mask built
//! from the probe's scores, and its mass estimate and risk.
//!
//! A candidate is a pattern and a budget in the pattern's own units:
//! A-shape (sink blocks, local blocks), vertical-slash (columns, diagonals),
//! block-sparse (key blocks per query block). Its mask for one KV head comes
//! from the index builders' scores (top columns and diagonals of the recent
//! queries, top pooled blocks per query block); its mass estimate m̂ is the
//! probe's: for each probe row, the block masses of the blocks the mask lists
//! for the row's query block, plus the mass of its single columns, which the
//! probe resolves only on its recent rows (their column scores stand in for
//! every row). m̂ is the mean of the three probe subsets' means, and the
//! disagreement u their spread (largest minus smallest), so R = 1 − m̂ + α·u.

use super::index::Mask;
use super::probe::{Probe, ProbeRows, Subset};
use crate::gpu::attention::BLOCK;

/// A pattern of the library.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Dense,
    #[serde(rename = "ashape")]
    AShape,
    #[serde(rename = "vslash")]
    VerticalSlash,
    #[serde(rename = "blocksparse")]
    BlockSparse,
}

impl Pattern {
    pub const SPARSE: [Pattern; 3] = [Pattern::AShape, Pattern::VerticalSlash, Pattern::BlockSparse];

    pub fn name(self) -> &'static str {
        match self {
            Pattern::Dense => "dense",
            Pattern::AShape => "ashape",
            Pattern::VerticalSlash => "vslash",
            Pattern::BlockSparse => "blocksparse",
        }
    }

    /// The budget grid: A-shape (1 sink block, 4 to 64 local blocks: MInference's
    /// default is 128 + 3968 keys, 64 blocks), vertical-slash (columns,
    /// diagonals) up to MInference's most common (1000, 6096), block-sparse
    /// 4 to 100 blocks (MInference: 100).
    pub fn budgets(self) -> &'static [[u32; 2]] {
        match self {
            Pattern::Dense => &[[0, 0]],
            Pattern::AShape => &[[1, 4], [1, 8], [1, 16], [1, 32], [1, 64]],
            Pattern::VerticalSlash => &[[16, 64], [64, 256], [256, 1024], [1000, 2048], [1000, 6096]],
            Pattern::BlockSparse => &[[4, 0], [8, 0], [16, 0], [32, 0], [64, 0], [100, 0]],
        }
    }

    /// The budget's numbers that mean something for this pattern.
    pub fn budget_units(self, budget: [u32; 2]) -> Vec<usize> {
        match self {
            Pattern::Dense => vec![],
            Pattern::BlockSparse => vec![budget[0] as usize],
            _ => budget.iter().map(|&b| b as usize).collect(),
        }
    }
}

impl std::str::FromStr for Pattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Pattern::Dense, Pattern::AShape, Pattern::VerticalSlash, Pattern::BlockSparse]
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown pattern '{s}'"))
    }
}

/// A pattern with a budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Candidate {
    pub pattern: Pattern,
    pub budget: [u32; 2],
}

impl Candidate {
    pub const DENSE: Candidate = Candidate { pattern: Pattern::Dense, budget: [0, 0] };

    /// Every candidate of the library, dense first.
    pub fn library() -> Vec<Candidate> {
        std::iter::once(Self::DENSE)
            .chain(
                Pattern::SPARSE
                    .iter()
                    .flat_map(|&p| p.budgets().iter().map(move |&b| Candidate { pattern: p, budget: b })),
            )
            .collect()
    }

    /// This candidate's mask for KV head `h` of `probe`'s chunk, whose first
    /// query block is `qb0`.
    pub fn mask(&self, probe: &Probe, h: usize, qb0: usize) -> Mask {
        match self.pattern {
            Pattern::Dense => Mask::Dense,
            Pattern::AShape => Mask::AShape { sink_blocks: self.budget[0], local_blocks: self.budget[1] },
            Pattern::VerticalSlash => {
                let keys = probe.column_scores.len() / probe.kv_heads;
                let mut columns = top(&probe.column_scores[h * keys..][..keys], self.budget[0] as usize);
                let mut diagonals = top(&probe.diagonal_scores[h * keys..][..keys], self.budget[1] as usize);
                columns.sort_unstable();
                diagonals.sort_unstable();
                Mask::VerticalSlash { columns, diagonals }
            }
            Pattern::BlockSparse => {
                let kb = probe.key_blocks;
                let mut blocks = vec![Vec::new(); qb0];
                for b in 0..probe.query_blocks {
                    let scores = &probe.block_scores[(h * probe.query_blocks + b) * kb..][..kb];
                    let causal = &scores[..=(qb0 + b).min(kb - 1)];
                    let mut chosen = top(causal, self.budget[0] as usize);
                    chosen.sort_unstable();
                    blocks.push(chosen);
                }
                Mask::BlockSparse { blocks }
            }
        }
    }
}

/// The indices of the `k` largest of `scores` (all of them when fewer).
fn top(scores: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    if k < order.len() {
        order.select_nth_unstable_by(k, |&a, &b| scores[b as usize].total_cmp(&scores[a as usize]));
        order.truncate(k);
    }
    order
}

/// What the probe says of one candidate for one KV head.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// m̂: the mean of the subsets' mean covered masses.
    pub mass: f64,
    /// u: the largest minus the smallest subset mean.
    pub disagreement: f64,
}

impl Estimate {
    /// R = 1 − m̂ + α·u.
    pub fn risk(&self, alpha: f64) -> f64 {
        1.0 - self.mass + alpha * self.disagreement
    }
}

/// The probe's estimate of the mass `mask` keeps for KV head `h`.
pub fn estimate(mask: &Mask, probe: &Probe, rows: &ProbeRows, h: usize) -> Estimate {
    if *mask == Mask::Dense {
        return Estimate { mass: 1.0, disagreement: 0.0 };
    }
    let keys = probe.column_scores.len() / probe.kv_heads;
    let columns = &probe.column_scores[h * keys..][..keys];
    let (mut blocks, mut single, mut seen) = (Vec::new(), Vec::new(), Vec::new());
    let mut sums = [(0.0f64, 0usize); 3];
    let mut last_block = u32::MAX;
    for (r, (&t, &subset)) in rows.positions.iter().zip(&rows.subsets).enumerate() {
        if t / BLOCK != last_block {
            last_block = t / BLOCK;
            mask.keys(last_block, &mut blocks, &mut single, &mut seen);
        }
        let mass = probe.mass(h, r);
        let in_blocks: f64 = blocks.iter().map(|&kb| mass[kb as usize] as f64).sum();
        let in_columns: f64 = single.iter().filter(|&&j| j <= t).map(|&j| columns[j as usize] as f64).sum::<f64>()
            / rows.recent.max(1) as f64;
        let at = match subset {
            Subset::Recent => 0,
            Subset::Uniform => 1,
            Subset::Boundary => 2,
        };
        sums[at].0 += (in_blocks + in_columns).min(1.0);
        sums[at].1 += 1;
    }
    let means: Vec<f64> = sums.iter().filter(|(_, n)| *n > 0).map(|(s, n)| s / *n as f64).collect();
    let mass = means.iter().sum::<f64>() / means.len().max(1) as f64;
    let spread =
        means.iter().cloned().fold(f64::NEG_INFINITY, f64::max) - means.iter().cloned().fold(f64::INFINITY, f64::min);
    Estimate { mass, disagreement: if means.is_empty() { 0.0 } else { spread } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_picks_the_largest() {
        let mut t = top(&[0.1, 0.5, 0.3, 0.9], 2);
        t.sort();
        assert_eq!(t, vec![1, 3]);
        assert_eq!(top(&[1.0], 5), vec![0]);
    }

    #[test]
    fn the_estimate_sums_the_listed_blocks_per_subset() {
        // One KV head, 3 key blocks; two probe rows in query block 2, one
        // recent and one uniform.
        let probe = Probe {
            kv_heads: 1,
            rows: 2,
            key_blocks: 3,
            block_mass: vec![0.5, 0.1, 0.4, 0.2, 0.2, 0.6],
            column_scores: vec![0.0; 192],
            diagonal_scores: vec![0.0; 192],
            ..Probe::default()
        };
        let rows = ProbeRows { positions: vec![191, 150], subsets: vec![Subset::Recent, Subset::Uniform], recent: 1 };
        let mask = Mask::AShape { sink_blocks: 1, local_blocks: 1 };
        let e = estimate(&mask, &probe, &rows, 0);
        assert!((e.mass - 0.85).abs() < 1e-6, "{e:?}");
        assert!((e.disagreement - 0.1).abs() < 1e-6, "{e:?}");
        assert!((e.risk(0.5) - 0.2).abs() < 1e-6);
    }
}
