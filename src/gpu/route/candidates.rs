//! The pattern library with its budget grids, each candidate's mask made
//! from the probe's scores, and its mass estimate and risk.
//!
//! A candidate is a pattern and a budget in the pattern's own units:
//! A-shape (sink blocks, local blocks), vertical-slash (columns, diagonals),
//! block-sparse (key blocks per query block besides the sink block and the
//! diagonal), union (pooled blocks beyond vertical-slash's, diagonals; with
//! the 1,000 best columns). Its mask for one KV head comes from the index builders' scores
//! (the top columns and diagonals of the recent queries, ranked once per head
//! in [`HeadLines`]; the top pooled blocks per query block, ranked on the GPU),
//! as a prefix of those rankings, so making it costs little; its mass estimate m̂ is the
//! probe's: for each probe row, the block masses of the blocks the mask lists
//! for the row's query block, plus the row's own probabilities of the mask's
//! single columns (measured at every probe row for the ranked columns). m̂
//! estimates the mean over the chunk's rows, which is what the certificate
//! bounds and calibration compares it with: the recent rows are all of the
//! chunk's last ones and count at their share of the chunk, the uniform and
//! boundary subsets (the mean of their means) stand for the rest. The
//! disagreement u is the spread of the three subsets' means (largest minus
//! smallest), so R = 1 − m̂ + α·u.

use std::sync::Arc;

use super::index::{BlockSparse, ListedBlocks, Mask, Union, VerticalSlash, Widened};
use super::probe::{Probe, ProbeRows, Subset, COLUMNS, TOP_BLOCKS};
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
    Union,
}

impl Pattern {
    pub const SPARSE: [Pattern; 4] = [Pattern::AShape, Pattern::VerticalSlash, Pattern::BlockSparse, Pattern::Union];

    pub fn name(self) -> &'static str {
        match self {
            Pattern::Dense => "dense",
            Pattern::AShape => "ashape",
            Pattern::VerticalSlash => "vslash",
            Pattern::BlockSparse => "blocksparse",
            Pattern::Union => "union",
        }
    }

    /// Whether the pattern's masks take the GPU's ranked block lists (read
    /// back for every query block once chosen).
    pub fn reads_lists(self) -> bool {
        matches!(self, Pattern::BlockSparse | Pattern::Union)
    }

    /// The budget grid: A-shape (1 sink block, 4 to 64 local blocks: MInference's
    /// default is 128 + 3968 keys, 64 blocks), vertical-slash (columns,
    /// diagonals) up to MInference's most common (1000, 6096), block-sparse
    /// 4 to 800 blocks (MInference: 100; the wider ones for diffuse heads at
    /// long lengths, 800 of 2,048 key blocks at 128K), union (blocks beyond
    /// the diagonals' 100 to 400, diagonals 256 to 2048; always 1,000 columns).
    pub fn budgets(self) -> &'static [[u32; 2]] {
        match self {
            Pattern::Dense => &[[0, 0]],
            Pattern::AShape => &[[1, 4], [1, 8], [1, 16], [1, 32], [1, 64]],
            Pattern::VerticalSlash => {
                &[[16, 64], [64, 256], [256, 1024], [1000, 2048], [1000, 3072], [1000, 4096], [1000, 6096]]
            }
            Pattern::BlockSparse => {
                &[[4, 0], [8, 0], [16, 0], [32, 0], [64, 0], [100, 0], [200, 0], [400, 0], [800, 0]]
            }
            Pattern::Union => {
                &[[100, 256], [200, 256], [400, 256], [100, 1024], [200, 1024], [400, 1024], [200, 2048], [400, 2048]]
            }
        }
    }

    /// The budget's numbers that mean something for this pattern.
    pub fn budget_units(self, budget: [u32; 2]) -> Vec<usize> {
        match self {
            Pattern::Union => vec![budget[0] as usize, COLUMNS, budget[1] as usize],
            Pattern::Dense => vec![],
            Pattern::BlockSparse => vec![budget[0] as usize],
            _ => budget.iter().map(|&b| b as usize).collect(),
        }
    }
}

impl std::str::FromStr for Pattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        std::iter::once(Pattern::Dense)
            .chain(Pattern::SPARSE)
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

    /// This candidate's mask for KV head `h` of `probe`'s chunk, whose ranked
    /// lines are `lines`, as the mass estimate reads it: a block-sparse mask
    /// lists only the query blocks of the probe's rows ([`Self::full_mask`]
    /// lists them all).
    pub fn mask(&self, probe: &Probe, lines: &HeadLines, h: usize) -> Mask {
        let offset = h * probe.probe_blocks.len() * TOP_BLOCKS;
        self.with_lists(lines, probe.top_blocks.clone(), offset, ListedBlocks::Only(probe.probe_blocks.clone()))
    }

    /// The mask, whose ranked block lists (where it has any) are those of the
    /// query blocks `of` in `lists[offset..]`.
    fn with_lists(&self, lines: &HeadLines, lists: Arc<[u32]>, offset: usize, of: ListedBlocks) -> Mask {
        let [a, b] = self.budget.map(|x| x as usize);
        let slash = |columns: usize, diagonals: usize| {
            VerticalSlash::new(
                lines.columns[..columns.min(lines.columns.len())].to_vec(),
                lines.diagonals[..diagonals.min(lines.diagonals.len())].to_vec(),
            )
        };
        match self.pattern {
            Pattern::Dense => Mask::Dense,
            Pattern::AShape => Mask::AShape { sink_blocks: self.budget[0], local_blocks: self.budget[1] },
            Pattern::VerticalSlash => Mask::VerticalSlash(slash(a, b)),
            Pattern::BlockSparse => Mask::BlockSparse(BlockSparse::ranked(lists, offset, TOP_BLOCKS, of, a)),
            Pattern::Union => Mask::Union(Union {
                slash: slash(COLUMNS, b),
                ranked: BlockSparse::ranked(lists, offset, TOP_BLOCKS, of, TOP_BLOCKS),
                extra: a,
            }),
        }
    }

    /// [`Self::mask`] over every query block, which the kernel and the true
    /// mass need: a block-sparse mask reads KV head `h`'s lists from
    /// `head_lists` (as [`Probe::head_lists`] lays them out).
    pub fn full_mask<E>(
        &self,
        probe: &Probe,
        lines: &HeadLines,
        h: usize,
        head_lists: impl FnOnce() -> Result<Arc<[u32]>, E>,
    ) -> Result<Mask, E> {
        Ok(match self.pattern.reads_lists() {
            true => self.with_lists(lines, head_lists()?, 0, ListedBlocks::From(probe.first_query_block as u32)),
            false => self.mask(probe, lines, h),
        })
    }
}

/// One KV head's vertical-slash evidence: the key positions and diagonal
/// offsets with the largest scores, as many as the largest budget takes,
/// best first.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadLines {
    pub columns: Vec<u32>,
    pub diagonals: Vec<u32>,
}

impl HeadLines {
    pub fn new(probe: &Probe, h: usize) -> Self {
        let most = |i: usize| Pattern::VerticalSlash.budgets().iter().map(|b| b[i] as usize).max().unwrap_or(0);
        Self { columns: ranked(probe.columns(h), most(0)), diagonals: ranked(probe.diagonals(h), most(1)) }
    }
}

/// The indices of the `k` largest of `scores` (all of them when fewer), best
/// first, ties by index.
fn ranked(scores: &[f32], k: usize) -> Vec<u32> {
    let all = 0..scores.len() as u32;
    let mut order: Vec<u32> = match k < scores.len() {
        // The k-th largest value first, on the values themselves; then the
        // positions above it, and as many equal to it as there is room for.
        true if k > 0 => {
            let mut values = scores.to_vec();
            let kth = *values.select_nth_unstable_by(scores.len() - k, f32::total_cmp).1;
            let mut order: Vec<u32> = all.clone().filter(|&i| scores[i as usize].total_cmp(&kth).is_gt()).collect();
            let room = k - order.len();
            order.extend(all.filter(|&i| scores[i as usize].total_cmp(&kth).is_eq()).take(room));
            order
        }
        true => Vec::new(),
        false => all.collect(),
    };
    order.sort_unstable_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
    order
}

/// What the probe says of one candidate for one KV head.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// m̂: the covered mass over the chunk's rows, the recent rows at their
    /// share of the chunk and the other subsets' mean for the rest.
    pub mass: f64,
    /// u: the largest minus the smallest subset mean.
    pub disagreement: f64,
    /// ŵ: the covered mass of the recent row (the prompt's last queries,
    /// which read the answer) that keeps least; 1 without recent rows.
    pub worst_recent: f64,
}

impl Estimate {
    /// R = 1 − m̂ + α·u.
    pub fn risk(&self, alpha: f64) -> f64 {
        1.0 - self.mass + alpha * self.disagreement
    }
}

/// The probe's estimate of the mass `mask` keeps for KV head `h`, whose
/// ranked lines are `lines` (a vertical-slash mask's columns are a prefix of
/// them, as [`Candidate::mask`] makes it).
pub fn estimate(mask: &Mask, probe: &Probe, rows: &ProbeRows, h: usize, lines: &HeadLines) -> Estimate {
    if *mask == Mask::Dense {
        return Estimate { mass: 1.0, disagreement: 0.0, worst_recent: 1.0 };
    }
    let mut blocks = Vec::new();
    let mut sums = [(0.0f64, 0usize); 3];
    let mut last_block = u32::MAX;
    let mut worst_recent = 1.0f64;
    // The mask's single columns are a prefix of the ranked ones.
    let columns = &lines.columns[..mask.columns().len()];
    debug_assert!(columns.len() <= COLUMNS);
    // The ranks of the columns the rows of a query block see outside its
    // listed blocks: those before the block (a mask lists its query block
    // whole, so the causal cut inside it drops nothing more).
    let mut single: Vec<usize> = Vec::new();
    let mut listed: Vec<u64> = Vec::new();
    for (r, (&t, &subset)) in rows.positions.iter().zip(&rows.subsets).enumerate() {
        if t / BLOCK != last_block {
            last_block = t / BLOCK;
            mask.blocks(last_block, &mut blocks);
            debug_assert!(columns.is_empty() || blocks.last() == Some(&last_block));
            listed.clear();
            listed.resize(last_block as usize / 64 + 1, 0);
            for &kb in &blocks {
                listed[kb as usize / 64] |= 1 << (kb % 64);
            }
            let outside = |kb: u32| kb < last_block && listed[kb as usize / 64] >> (kb % 64) & 1 == 0;
            single.clear();
            single.extend(columns.iter().enumerate().filter(|&(_, &j)| outside(j / BLOCK)).map(|(i, _)| i));
        }
        let mass = probe.mass(h, r);
        let in_blocks: f64 = blocks.iter().map(|&kb| mass[kb as usize] as f64).sum();
        let in_columns: f64 = match single.is_empty() {
            true => 0.0,
            false => {
                let p = probe.column_mass(h, r);
                single.iter().map(|&i| p[i] as f64).sum()
            }
        };
        let at = match subset {
            Subset::Recent => 0,
            Subset::Uniform => 1,
            Subset::Boundary => 2,
        };
        let covered = (in_blocks + in_columns).min(1.0);
        if subset == Subset::Recent {
            worst_recent = worst_recent.min(covered);
        }
        sums[at].0 += covered;
        sums[at].1 += 1;
    }
    let means: Vec<Option<f64>> = sums.iter().map(|&(s, n)| (n > 0).then(|| s / n as f64)).collect();
    let rest: Vec<f64> = means[1..].iter().flatten().copied().collect();
    let rest = (!rest.is_empty()).then(|| rest.iter().sum::<f64>() / rest.len() as f64);
    let share = rows.recent as f64 / rows.chunk.max(1) as f64;
    let mass = match (means[0], rest) {
        (Some(recent), Some(rest)) => share * recent + (1.0 - share) * rest,
        (Some(m), None) | (None, Some(m)) => m,
        (None, None) => 0.0,
    };
    let present = means.iter().flatten();
    let spread =
        present.clone().fold(f64::NEG_INFINITY, |a, &b| a.max(b)) - present.fold(f64::INFINITY, |a, &b| a.min(b));
    Estimate { mass, disagreement: if spread.is_finite() { spread } else { 0.0 }, worst_recent }
}

/// `mask` (of KV head `h`, whose ranked lines are `lines`) with more key
/// blocks for the query blocks of the probe's recent rows, so that each of
/// those rows keeps at least `target` of its mass as the probe measures it
/// (each row's block masses and its own probabilities of the single columns:
/// the same sums as [`estimate`]). A query block takes the key blocks it
/// does not list in the order of its recent rows' summed mass in them
/// (beyond the single columns already counted there), best first, until no
/// recent row is under `target` or no block is left. Dense is left as it is.
pub fn keep_recent(mask: Mask, probe: &Probe, rows: &ProbeRows, h: usize, lines: &HeadLines, target: f64) -> Mask {
    if mask == Mask::Dense {
        return mask;
    }
    let columns = &lines.columns[..mask.columns().len()];
    let recent = &rows.positions[..rows.recent];
    let mut query_blocks: Vec<u32> = recent.iter().map(|&t| t / BLOCK).collect();
    query_blocks.sort_unstable();
    query_blocks.dedup();
    let mut extra = Vec::new();
    let mut blocks = Vec::new();
    for b in query_blocks {
        mask.blocks(b, &mut blocks);
        let width = b as usize + 1;
        let mut listed = vec![false; width];
        for &kb in &blocks {
            listed[kb as usize] = true;
        }
        let members: Vec<usize> = (0..rows.recent).filter(|&r| recent[r] / BLOCK == b).collect();
        // The single columns outside the listed blocks, by key block: (key
        // block, rank).
        let mut single: Vec<(u32, usize)> = (columns.iter().enumerate())
            .map(|(i, &j)| (j / BLOCK, i))
            .filter(|&(kb, _)| kb < b && !listed[kb as usize])
            .collect();
        single.sort_unstable();
        let columns_in = |kb: u32| {
            let from = single.partition_point(|&(c, _)| c < kb);
            &single[from..from + single[from..].partition_point(|&(c, _)| c == kb)]
        };
        let column_mass =
            |r: usize, of: &[(u32, usize)]| -> f64 { of.iter().map(|&(_, i)| probe.column_mass(h, r)[i] as f64).sum() };
        let mut kept: Vec<f64> = (members.iter())
            .map(|&r| {
                blocks.iter().map(|&kb| probe.mass(h, r)[kb as usize] as f64).sum::<f64>() + column_mass(r, &single)
            })
            .collect();
        let short = |kept: &[f64]| kept.iter().any(|&k| k < target);
        if !short(&kept) {
            continue;
        }
        // What each key block not listed would add, summed over the rows.
        let mut gain = vec![0.0f64; width];
        for &r in &members {
            let mass = probe.mass(h, r);
            for kb in (0..width).filter(|&kb| !listed[kb]) {
                gain[kb] += mass[kb] as f64;
            }
        }
        for &(kb, i) in &single {
            gain[kb as usize] -= members.iter().map(|&r| probe.column_mass(h, r)[i] as f64).sum::<f64>();
        }
        let mut order: Vec<u32> = (0..width as u32).filter(|&kb| !listed[kb as usize]).collect();
        order.sort_unstable_by(|&x, &y| gain[y as usize].total_cmp(&gain[x as usize]).then(x.cmp(&y)));
        let mut added = Vec::new();
        for kb in order {
            if !short(&kept) {
                break;
            }
            added.push(kb);
            let inside = columns_in(kb);
            for (k, &r) in kept.iter_mut().zip(&members) {
                *k += probe.mass(h, r)[kb as usize] as f64 - column_mass(r, inside);
            }
        }
        if !added.is_empty() {
            added.sort_unstable();
            extra.push((b, added));
        }
    }
    if extra.is_empty() {
        mask
    } else {
        Mask::Widened(Widened { base: Box::new(mask), extra })
    }
}

#[cfg(test)]
mod tests {
    use super::super::probe::NO_BLOCK;
    use super::*;

    #[test]
    fn ranked_puts_the_largest_first() {
        assert_eq!(ranked(&[0.1, 0.5, 0.3, 0.9], 2), vec![3, 1]);
        assert_eq!(ranked(&[0.2, 0.5, 0.2], 5), vec![1, 0, 2]);
        assert_eq!(ranked(&[1.0], 5), vec![0]);
        assert_eq!(ranked(&[0.3, 0.7, 0.3, 0.3], 3), vec![1, 0, 2]);
        assert_eq!(ranked(&[0.3, 0.7], 0), Vec::<u32>::new());
    }

    #[test]
    fn the_largest_block_sparse_budget_is_what_the_gpu_selects() {
        let most = Pattern::BlockSparse.budgets().iter().map(|b| b[0] as usize).max();
        assert_eq!(most, Some(TOP_BLOCKS));
    }

    #[test]
    fn the_probe_measures_as_many_columns_as_the_largest_budget_takes() {
        let most = Pattern::VerticalSlash.budgets().iter().map(|b| b[0] as usize).max();
        assert_eq!(most, Some(COLUMNS));
    }

    fn no_lines() -> HeadLines {
        HeadLines { columns: Vec::new(), diagonals: Vec::new() }
    }

    /// A probe of one KV head with two rows over 3 key blocks (192 keys), each row's
    /// block masses given; no column or diagonal scores.
    fn two_rows_over_three_blocks(block_mass: Vec<f32>) -> Probe {
        Probe {
            kv_heads: 1,
            rows: 2,
            key_blocks: 3,
            block_mass,
            column_scores: vec![0.0; 192],
            diagonal_scores: vec![0.0; 192],
            ..Probe::default()
        }
    }

    #[test]
    fn the_estimate_sums_the_listed_blocks_per_subset() {
        // One KV head, 3 key blocks; two probe rows in query block 2, one
        // recent and one uniform.
        let probe = two_rows_over_three_blocks(vec![0.5, 0.1, 0.4, 0.2, 0.2, 0.6]);
        // A chunk of 4 rows: the recent one stands for a quarter of them.
        let rows = ProbeRows {
            positions: vec![191, 150],
            subsets: vec![Subset::Recent, Subset::Uniform],
            recent: 1,
            chunk: 4,
        };
        let mask = Mask::AShape { sink_blocks: 1, local_blocks: 1 };
        let e = estimate(&mask, &probe, &rows, 0, &no_lines());
        assert!((e.mass - (0.25 * 0.9 + 0.75 * 0.8)).abs() < 1e-6, "{e:?}");
        assert!((e.disagreement - 0.1).abs() < 1e-6, "{e:?}");
        assert!((e.risk(0.5) - (1.0 - e.mass + 0.05)).abs() < 1e-6);
        assert!((e.worst_recent - 0.9).abs() < 1e-6, "only recent rows count: {e:?}");
    }

    #[test]
    fn a_recent_row_that_attends_to_a_dropped_block_is_the_worst() {
        // Two recent rows in query block 2; the second puts 0.7 of its mass
        // on key block 1 (a needle), which A-shape [1, 1] drops.
        let probe = two_rows_over_three_blocks(vec![0.5, 0.1, 0.4, 0.1, 0.7, 0.2]);
        let rows = ProbeRows { positions: vec![191, 190], subsets: vec![Subset::Recent; 2], recent: 2, chunk: 2 };
        let e = estimate(&Mask::AShape { sink_blocks: 1, local_blocks: 1 }, &probe, &rows, 0, &no_lines());
        assert!((e.mass - 0.6).abs() < 1e-6, "{e:?}");
        assert!((e.worst_recent - 0.3).abs() < 1e-6, "{e:?}");
    }

    /// Two rows in query block 2 (recent at 191, uniform at 140) over 3 key
    /// blocks, and the head's ranked columns 100, 70, 150, 10 (key blocks 1,
    /// 1, 2, 0) with each row's mass in them.
    fn rows_with_columns() -> (Probe, HeadLines, ProbeRows) {
        let mut probe = two_rows_over_three_blocks(vec![0.3, 0.2, 0.5, 0.1, 0.6, 0.3]);
        probe.column_mass = vec![0.0; 2 * COLUMNS];
        probe.column_mass[..4].copy_from_slice(&[0.05, 0.04, 0.3, 0.2]);
        probe.column_mass[COLUMNS..COLUMNS + 4].copy_from_slice(&[0.25, 0.01, 0.0, 0.1]);
        let lines = HeadLines { columns: vec![100, 70, 150, 10], diagonals: vec![] };
        let rows = ProbeRows {
            positions: vec![191, 140],
            subsets: vec![Subset::Recent, Subset::Uniform],
            recent: 1,
            chunk: 2,
        };
        (probe, lines, rows)
    }

    #[test]
    fn vertical_slash_counts_each_rows_own_column_mass_outside_its_blocks() {
        let (probe, lines, rows) = rows_with_columns();
        // The first three columns and no diagonal: blocks 0 and 2 listed, so
        // columns 100 and 70 are single, 150 is inside block 2.
        let mask = Candidate { pattern: Pattern::VerticalSlash, budget: [3, 0] }.mask(&probe, &lines, 0);
        let e = estimate(&mask, &probe, &rows, 0, &lines);
        // Recent row: 0.3 + 0.5 + 0.05 + 0.04; uniform row: 0.1 + 0.3 + 0.25 + 0.01.
        assert!((e.worst_recent - 0.89).abs() < 1e-6, "{e:?}");
        assert!((e.mass - (0.89 + 0.66) / 2.0).abs() < 1e-6, "{e:?}");
        // A diagonal at offset 64 covers block 1 (and so columns 100 and 70) too.
        let mask = Candidate { pattern: Pattern::VerticalSlash, budget: [3, 1] }.mask(
            &probe,
            &HeadLines { diagonals: vec![64], ..lines.clone() },
            0,
        );
        let e = estimate(&mask, &probe, &rows, 0, &lines);
        assert!((e.worst_recent - 1.0).abs() < 1e-6, "{e:?}");
        assert!((e.mass - 1.0).abs() < 1e-6, "{e:?}");
    }

    #[test]
    fn keeping_the_recent_rows_adds_the_blocks_they_need_to_their_query_block() {
        // The second recent row puts 0.7 of its mass on key block 1, which
        // A-shape [1, 1] drops: kept 0.3.
        let probe = two_rows_over_three_blocks(vec![0.5, 0.1, 0.4, 0.1, 0.7, 0.2]);
        let rows = ProbeRows { positions: vec![191, 190], subsets: vec![Subset::Recent; 2], recent: 2, chunk: 2 };
        let ashape = Mask::AShape { sink_blocks: 1, local_blocks: 1 };
        let kept = keep_recent(ashape.clone(), &probe, &rows, 0, &no_lines(), 0.8);
        let mut blocks = Vec::new();
        kept.blocks(2, &mut blocks);
        assert_eq!(blocks, vec![0, 1, 2]);
        // Other query blocks are the mask's.
        kept.blocks(1, &mut blocks);
        assert_eq!(blocks, vec![0, 1]);
        assert_eq!(kept.visited_keys(0..3), ashape.visited_keys(0..3) + 64.0);
        let e = estimate(&kept, &probe, &rows, 0, &no_lines());
        assert!((e.worst_recent - 1.0).abs() < 1e-6 && (e.mass - 1.0).abs() < 1e-6, "{e:?}");
        // Rows that already keep the target leave the mask as it is.
        assert_eq!(keep_recent(ashape.clone(), &probe, &rows, 0, &no_lines(), 0.3), ashape);
        assert_eq!(keep_recent(Mask::Dense, &probe, &rows, 0, &no_lines(), 1.0), Mask::Dense);
    }

    #[test]
    fn keeping_the_recent_rows_counts_the_columns_a_new_block_takes_in_once() {
        // Vertical-slash [3, 0]: blocks 0 and 2, columns 100 and 70 (block 1)
        // single; the recent row keeps 0.89, 0.09 of it in those columns.
        let (probe, lines, rows) = rows_with_columns();
        let mask = Candidate { pattern: Pattern::VerticalSlash, budget: [3, 0] }.mask(&probe, &lines, 0);
        assert_eq!(keep_recent(mask.clone(), &probe, &rows, 0, &lines, 0.88), mask);
        // Block 1 adds its 0.2 less the 0.09 already counted: 1.0.
        let kept = keep_recent(mask, &probe, &rows, 0, &lines, 0.95);
        let (mut blocks, mut columns) = (Vec::new(), Vec::new());
        kept.keys(2, &mut blocks, &mut columns);
        assert_eq!((blocks, columns), (vec![0, 1, 2], vec![]));
        let e = estimate(&kept, &probe, &rows, 0, &lines);
        assert!((e.worst_recent - 1.0).abs() < 1e-6, "{e:?}");
    }

    #[test]
    fn a_union_counts_its_columns_outside_every_block_it_lists() {
        // As above, with the probe's block list of query block 2 ranking key
        // block 1: the union [1 block, no diagonal] lists it whole, so
        // columns 100 and 70 count once, in it.
        let (mut probe, lines, rows) = rows_with_columns();
        probe.probe_blocks = vec![2].into();
        let mut lists = vec![NO_BLOCK; TOP_BLOCKS];
        lists[0] = 1;
        probe.top_blocks = lists.into();
        let e = |budget| {
            let mask = Candidate { pattern: Pattern::Union, budget }.mask(&probe, &lines, 0);
            estimate(&mask, &probe, &rows, 0, &lines)
        };
        // Every block listed: all of each row's mass, its columns not added again.
        let all = e([1, 0]);
        assert!((all.worst_recent - 1.0).abs() < 1e-6 && (all.mass - 1.0).abs() < 1e-6, "{all:?}");
        // No block beyond the sink and the diagonal: vertical-slash [4, 0]'s estimate.
        let none = e([0, 0]);
        assert!((none.worst_recent - 0.89).abs() < 1e-6, "{none:?}");
        assert!((none.mass - (0.89 + 0.66) / 2.0).abs() < 1e-6, "{none:?}");
    }
}
