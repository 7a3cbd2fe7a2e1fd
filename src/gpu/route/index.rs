//! Sparse masks on the 64 × 64 block grid, and the key lists the sparse
//! attention kernel reads.
//!
//! Every pattern of the library is a [`Mask`]: for each query block of 64
//! positions, the key blocks (64 positions each) its queries attend to, plus
//! single key positions outside those blocks (vertical lines). Every mask
//! keeps key block 0 (the attention sinks) and the query block's own diagonal
//! block, so no query is left without keys. Inside the listed keys the causal
//! mask applies; nothing else is masked. A-shape and vertical-slash are thus
//! the block-granular forms MInference's kernels compute: a diagonal offset
//! `o` selected for a query block covers the key blocks that the keys
//! `t − o` of its 64 queries fall in, which are the same distances
//! ⌊o/64⌋ and ⌈o/64⌉ behind it for every query block. A union is a
//! vertical-slash mask with, per query block, the best pooled blocks that its
//! diagonals leave out (block-sparse's ranked lists).
//!
//! A mask is a description, cheap to make: the router makes one per
//! candidate and reads only the query blocks its probe rows are in; the key
//! lists of every query block are spelt out only for the masks chosen.
//! [`SparseIndex`] lays those out as the kernel reads them
//! (`shaders/attention_keys_sparse.wgsl`): CSR offsets per (KV head, query
//! block) into one list of key blocks and one list of single positions.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use super::probe::NO_BLOCK;
use crate::gpu::attention::{IndexBuffers, KvHeads, BLOCK};
use crate::gpu::{GpuContext, GpuError};

const B: usize = BLOCK as usize;

/// The keys of one KV head, per query block.
#[derive(Clone, Debug, PartialEq)]
pub enum Mask {
    /// Every key block up to the diagonal.
    Dense,
    /// The first `sink_blocks` key blocks and the `local_blocks` up to and
    /// including the diagonal block.
    AShape {
        sink_blocks: u32,
        local_blocks: u32,
    },
    VerticalSlash(VerticalSlash),
    BlockSparse(BlockSparse),
    Union(Union),
    /// A mask with more key blocks for a few query blocks.
    Widened(Widened),
}

/// A mask and, for a few query blocks (those of the probe's recent rows),
/// key blocks it does not list (`RecentRows::Keep`).
#[derive(Clone, Debug, PartialEq)]
pub struct Widened {
    pub base: Box<Mask>,
    /// Per query block, ascending, its added key blocks, ascending.
    pub extra: Vec<(u32, Vec<u32>)>,
}

impl Widened {
    fn extra(&self, b: u32) -> &[u32] {
        self.extra.binary_search_by_key(&b, |e| e.0).map_or(&[][..], |i| &self.extra[i].1)
    }
}

/// A vertical-slash mask and, per query block, the first `extra` blocks of a
/// block-sparse mask's ranked list that the vertical-slash mask does not
/// hold whole: the pooled scores' blocks for the mean row, the recent rows'
/// columns and diagonals for what single rows attend to.
#[derive(Clone, Debug, PartialEq)]
pub struct Union {
    pub slash: VerticalSlash,
    /// Read to its lists' end (its budget is their length).
    pub ranked: BlockSparse,
    pub extra: usize,
}

/// Selected key positions (columns) for every query at or after them, and
/// selected diagonal offsets (`t − j`), each covering the key blocks its band
/// crosses in a query block.
#[derive(Clone, Debug, PartialEq)]
pub struct VerticalSlash {
    /// Ascending.
    pub columns: Vec<u32>,
    /// Ascending.
    pub diagonals: Vec<u32>,
    /// The distinct distances, in key blocks behind the query block, that
    /// the diagonals cover; ascending.
    distances: Vec<u32>,
    /// The same distances as a bit set.
    reach: Vec<u64>,
}

impl VerticalSlash {
    pub fn new(mut columns: Vec<u32>, mut diagonals: Vec<u32>) -> Self {
        columns.sort_unstable();
        columns.dedup();
        diagonals.sort_unstable();
        diagonals.dedup();
        let mut distances: Vec<u32> = diagonals.iter().flat_map(|&o| [o / BLOCK, o.div_ceil(BLOCK)]).collect();
        distances.sort_unstable();
        distances.dedup();
        let mut reach = vec![0u64; distances.last().map_or(0, |&d| d as usize / 64 + 1)];
        for &d in &distances {
            reach[d as usize / 64] |= 1 << (d % 64);
        }
        Self { columns, diagonals, distances, reach }
    }

    /// Whether query block `b` lists key block `kb` (at most `b`) whole: the
    /// sink block, the diagonal block, or one a diagonal covers.
    pub fn covers(&self, b: u32, kb: u32) -> bool {
        let d = (b - kb) as usize;
        kb == 0 || d == 0 || self.reach.get(d / 64).is_some_and(|w| w >> (d % 64) & 1 == 1)
    }

    /// The key blocks query block `b` lists whole, ascending, into `blocks`.
    fn blocks(&self, b: u32, blocks: &mut Vec<u32>) {
        // Ascending distances behind b are descending blocks.
        let behind = self.distances.partition_point(|&d| d <= b);
        blocks.push(0);
        blocks.extend(self.distances[..behind].iter().rev().map(|&d| b - d));
        blocks.push(b);
        blocks.dedup();
    }

    /// How many key blocks query block `b` lists whole.
    fn block_count(&self, b: u32) -> u64 {
        let behind = self.distances.partition_point(|&d| d <= b) as u64;
        let has = |d: u32| self.distances.binary_search(&d).is_ok();
        match b {
            0 => 1,
            _ => behind + u64::from(!has(0)) + u64::from(!has(b)),
        }
    }
}

/// Per query block, selected key blocks: the first `budget` of its list
/// (lists in the probe's layout: best first, [`NO_BLOCK`] past their end).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSparse {
    lists: Arc<[u32]>,
    /// Where the first list starts in `lists`, and the distance from one list
    /// to the next.
    offset: usize,
    stride: usize,
    /// The query blocks the lists are of; the others select nothing.
    of: ListedBlocks,
    budget: usize,
}

/// The query blocks whose lists a [`BlockSparse`] holds, in their order.
#[derive(Clone, Debug, PartialEq)]
pub enum ListedBlocks {
    /// Every query block from this one on.
    From(u32),
    /// These, ascending: the query blocks of the probe's rows, which is all
    /// that a mask's mass estimate reads.
    Only(Arc<[u32]>),
}

impl BlockSparse {
    /// Explicit key blocks per query block from block 0 (blocks past the
    /// diagonal are ignored).
    pub fn new(blocks: &[Vec<u32>]) -> Self {
        let stride = blocks.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let lists: Vec<u32> =
            blocks.iter().flat_map(|b| b.iter().copied().chain(std::iter::repeat(NO_BLOCK)).take(stride)).collect();
        Self { lists: lists.into(), offset: 0, stride, of: ListedBlocks::From(0), budget: stride }
    }

    /// The first `budget` entries of each list in `lists[offset..]`, lists
    /// `stride` apart, of the query blocks `of`.
    pub fn ranked(lists: Arc<[u32]>, offset: usize, stride: usize, of: ListedBlocks, budget: usize) -> Self {
        Self { lists, offset, stride, of, budget: budget.min(stride) }
    }

    /// Query block `b`'s selected key blocks (unordered, at most `budget`).
    fn selected(&self, b: u32) -> impl Iterator<Item = u32> + '_ {
        let at = match &self.of {
            ListedBlocks::From(first) => b.checked_sub(*first).map(|i| i as usize),
            ListedBlocks::Only(blocks) => blocks.binary_search(&b).ok(),
        };
        let list = match at {
            Some(i) if self.offset + (i + 1) * self.stride <= self.lists.len() => {
                &self.lists[self.offset + i * self.stride..][..self.budget]
            }
            _ => &[][..],
        };
        list.iter().copied().take_while(|&kb| kb != NO_BLOCK).filter(move |&kb| kb <= b)
    }
}

impl Mask {
    /// The key blocks and single positions of query block `b` (both ascending,
    /// no position in both), into `blocks` and `columns` (cleared first).
    pub fn keys(&self, b: u32, blocks: &mut Vec<u32>, columns: &mut Vec<u32>) {
        self.blocks(b, blocks);
        columns.clear();
        let last = (b + 1) * BLOCK;
        let listed = self.columns().iter().copied().take_while(|&j| j < last);
        columns.extend(listed.filter(|&j| blocks.binary_search(&(j / BLOCK)).is_err()));
    }

    /// The single columns of the mask (those a query block lists whole
    /// included), ascending.
    pub fn columns(&self) -> &[u32] {
        match self {
            Mask::VerticalSlash(v) | Mask::Union(Union { slash: v, .. }) => &v.columns,
            Mask::Widened(w) => w.base.columns(),
            _ => &[],
        }
    }

    /// The key blocks of query block `b`, ascending, into `blocks` (cleared first).
    pub fn blocks(&self, b: u32, blocks: &mut Vec<u32>) {
        blocks.clear();
        match self {
            Mask::Dense => blocks.extend(0..=b),
            Mask::AShape { sink_blocks, local_blocks } => {
                let local = (b + 1).saturating_sub(*local_blocks);
                blocks.extend(0..(*sink_blocks).min(local));
                blocks.extend(local..=b);
            }
            Mask::VerticalSlash(v) => v.blocks(b, blocks),
            Mask::BlockSparse(s) => {
                blocks.extend(s.selected(b));
                blocks.push(0);
                blocks.push(b);
                blocks.sort_unstable();
                blocks.dedup();
            }
            Mask::Union(u) => {
                u.slash.blocks(b, blocks);
                let extra = u.ranked.selected(b).filter(|&kb| !u.slash.covers(b, kb)).take(u.extra);
                blocks.extend(extra);
                blocks.sort_unstable();
                blocks.dedup();
            }
            Mask::Widened(w) => {
                w.base.blocks(b, blocks);
                blocks.extend_from_slice(w.extra(b));
                blocks.sort_unstable();
                blocks.dedup();
            }
        }
    }

    /// Keys the kernel visits for the query blocks `query_blocks`, counted in
    /// whole blocks and single positions, without listing them: exact but for
    /// the columns, which count whether or not a listed block holds them, and
    /// ranked block lists cut short by their ranking (a union's list may
    /// also run out of blocks its diagonals leave out before `extra`).
    pub fn visited_keys(&self, query_blocks: std::ops::Range<u32>) -> f64 {
        let columns = |b: u32| self.columns().partition_point(|&j| j < (b + 1) * BLOCK) as u64;
        query_blocks.map(|b| (self.block_count(b) * B as u64 + columns(b)) as f64).sum()
    }

    /// How many key blocks query block `b` lists, as [`Self::visited_keys`] counts them.
    fn block_count(&self, b: u32) -> u64 {
        match self {
            Mask::Dense => b as u64 + 1,
            Mask::AShape { sink_blocks, local_blocks } => {
                let local = (b + 1).saturating_sub(*local_blocks);
                ((*sink_blocks).min(local) + b + 1 - local) as u64
            }
            Mask::VerticalSlash(v) => v.block_count(b),
            Mask::BlockSparse(s) => (s.budget as u64).min(b.saturating_sub(1) as u64) + u64::from(b > 0) + 1,
            Mask::Union(u) => {
                let whole = u.slash.block_count(b);
                whole + (u.extra as u64).min(b as u64 + 1 - whole)
            }
            Mask::Widened(w) => w.base.block_count(b) + w.extra(b).len() as u64,
        }
    }

    /// The pattern's name in reports and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Mask::Dense => "dense",
            Mask::AShape { .. } => "ashape",
            Mask::VerticalSlash(_) => "vslash",
            Mask::BlockSparse(_) => "blocksparse",
            Mask::Union(_) => "union",
            Mask::Widened(w) => w.base.name(),
        }
    }
}

/// Query blocks whose lists [`SparseIndex::new`] spells out as one task.
const LIST_RUN: u32 = 64;

/// The key lists of the KV heads a sparse dispatch computes, as the sparse
/// kernel reads them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseIndex {
    pub kv_heads: u32,
    pub query_blocks: u32,
    /// Per KV head, whether it has lists (the others, empty, are computed
    /// elsewhere).
    pub listed: Vec<bool>,
    /// `kv_heads · query_blocks + 1` offsets into `blocks`.
    pub block_offsets: Vec<u32>,
    pub blocks: Vec<u32>,
    /// `kv_heads · query_blocks + 1` offsets into `columns`.
    pub column_offsets: Vec<u32>,
    pub columns: Vec<u32>,
}

impl SparseIndex {
    /// The index of `masks` (one per KV head; `None`: the head is not in the
    /// sparse dispatch, and its lists are empty) over `positions` positions.
    pub fn new(masks: &[Option<&Mask>], positions: u32) -> Self {
        let query_blocks = positions.div_ceil(BLOCK);
        let mut index = Self {
            kv_heads: masks.len() as u32,
            query_blocks,
            listed: masks.iter().map(Option::is_some).collect(),
            block_offsets: vec![0],
            column_offsets: vec![0],
            ..Self::default()
        };
        // The lists of runs of query blocks of each head, with offsets from
        // 0, made in parallel (a head's runs too: a wide mask's thousands of
        // blocks per query block take one core long), then laid end to end.
        let runs = query_blocks.div_ceil(LIST_RUN);
        let pieces: Vec<[Vec<u32>; 4]> = (0..masks.len() as u32 * runs)
            .into_par_iter()
            .map(|piece| {
                let (mask, first) = (masks[(piece / runs) as usize], (piece % runs) * LIST_RUN);
                let (mut blocks, mut columns) = (Vec::new(), Vec::new());
                let mut lists: [Vec<u32>; 4] = Default::default();
                for b in first..(first + LIST_RUN).min(query_blocks) {
                    if let Some(mask) = mask {
                        mask.keys(b, &mut blocks, &mut columns);
                        lists[0].extend_from_slice(&blocks);
                        lists[2].extend_from_slice(&columns);
                    }
                    lists[1].push(lists[0].len() as u32);
                    lists[3].push(lists[2].len() as u32);
                }
                lists
            })
            .collect();
        for [blocks, block_ends, columns, column_ends] in pieces {
            let (b0, c0) = (index.blocks.len() as u32, index.columns.len() as u32);
            index.block_offsets.extend(block_ends.iter().map(|e| b0 + e));
            index.column_offsets.extend(column_ends.iter().map(|e| c0 + e));
            index.blocks.extend_from_slice(&blocks);
            index.columns.extend_from_slice(&columns);
        }
        index
    }

    /// The key blocks and single positions of KV head `h`, query block `b`.
    pub fn keys(&self, h: u32, b: u32) -> (&[u32], &[u32]) {
        let at = (h * self.query_blocks + b) as usize;
        let blocks = &self.blocks[self.block_offsets[at] as usize..self.block_offsets[at + 1] as usize];
        let columns = &self.columns[self.column_offsets[at] as usize..self.column_offsets[at + 1] as usize];
        (blocks, columns)
    }

    /// Whether query `t` of KV head `h` attends to key `j` (causal included).
    pub fn sees(&self, h: u32, t: u32, j: u32) -> bool {
        let (blocks, columns) = self.keys(h, t / BLOCK);
        j <= t && (blocks.binary_search(&(j / BLOCK)).is_ok() || columns.binary_search(&j).is_ok())
    }

    /// The keys the kernel visits for KV head `h`, as a fraction of dense
    /// attention's (both counted in whole blocks and positions).
    pub fn density(&self, h: u32) -> f64 {
        let dense: f64 = (1..=self.query_blocks as u64).map(|b| (b * B as u64) as f64).sum();
        let visited: f64 = (0..self.query_blocks)
            .map(|b| {
                let (blocks, columns) = self.keys(h, b);
                (blocks.len() * B + columns.len()) as f64
            })
            .sum();
        visited / dense
    }

    /// The KV heads with lists: every head, or a set the kernel can name.
    pub fn heads(&self) -> Option<KvHeads> {
        match self.listed.iter().all(|&l| l) {
            true => Some(KvHeads::ALL),
            false => KvHeads::of((0..self.kv_heads).filter(|&h| self.listed[h as usize])),
        }
    }

    /// The four lists on the GPU.
    pub fn upload(&self, ctx: &GpuContext) -> Result<GpuIndex, GpuError> {
        let Some(heads) = self.heads() else {
            return Err(GpuError::Kernel {
                kernel: "sparse attention".into(),
                reason: format!("an index listing {:?} of {} KV heads", self.listed, self.kv_heads),
            });
        };
        Ok(GpuIndex {
            heads,
            block_offsets: ctx.upload("index block offsets", &self.block_offsets)?,
            blocks: ctx.upload("index blocks", &self.blocks)?,
            column_offsets: ctx.upload("index column offsets", &self.column_offsets)?,
            columns: ctx.upload("index columns", &self.columns)?,
            query_blocks: self.query_blocks,
        })
    }
}

/// A [`SparseIndex`] uploaded.
pub struct GpuIndex {
    pub heads: KvHeads,
    pub block_offsets: wgpu::Buffer,
    pub blocks: wgpu::Buffer,
    pub column_offsets: wgpu::Buffer,
    pub columns: wgpu::Buffer,
    pub query_blocks: u32,
}

impl GpuIndex {
    pub fn buffers(&self) -> IndexBuffers<'_> {
        IndexBuffers {
            block_offsets: &self.block_offsets,
            blocks: &self.blocks,
            column_offsets: &self.column_offsets,
            columns: &self.columns,
            query_blocks: self.query_blocks,
            kv_heads: self.heads,
        }
    }

    /// Gives the buffers back to `ctx`'s pool.
    pub fn recycle(self, ctx: &GpuContext) {
        for b in [self.block_offsets, self.blocks, self.column_offsets, self.columns] {
            ctx.recycle(b);
        }
    }
}

/// The largest value-vector norm of each KV head, from f16 values
/// `[positions][kv_heads][d]`.
pub fn value_norm_max(values: &[f16], kv_heads: usize, d: usize) -> Vec<f64> {
    let mut max = vec![0.0f64; kv_heads];
    for (i, row) in values.chunks_exact(d).enumerate() {
        let norm = row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>().sqrt();
        let h = i % kv_heads;
        max[h] = max[h].max(norm);
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(mask: &Mask, b: u32) -> (Vec<u32>, Vec<u32>) {
        let (mut blocks, mut columns) = (Vec::new(), Vec::new());
        mask.keys(b, &mut blocks, &mut columns);
        (blocks, columns)
    }

    #[test]
    fn a_shape_keeps_sinks_and_the_local_band() {
        let mask = Mask::AShape { sink_blocks: 2, local_blocks: 3 };
        assert_eq!(keys(&mask, 10).0, vec![0, 1, 8, 9, 10]);
        assert_eq!(keys(&mask, 1).0, vec![0, 1]);
        assert_eq!(keys(&mask, 0).0, vec![0]);
    }

    #[test]
    fn vertical_slash_covers_the_bands_blocks_and_leaves_columns_outside_them() {
        // Offset 64 in query block 3 (positions 192..256): keys 128..192, block 2
        // only; offset 100: keys 92..156, blocks 1 and 2.
        let mask = Mask::VerticalSlash(VerticalSlash::new(vec![5, 70, 130, 300], vec![64, 100]));
        let (blocks, columns) = keys(&mask, 3);
        assert_eq!(blocks, vec![0, 1, 2, 3]);
        assert_eq!(columns, Vec::<u32>::new());
        let mask = Mask::VerticalSlash(VerticalSlash::new(vec![5, 70, 130, 300], vec![64]));
        assert_eq!(keys(&mask, 3), (vec![0, 2, 3], vec![70]));
        // A band past the first key covers nothing before block 0.
        let mask = Mask::VerticalSlash(VerticalSlash::new(vec![], vec![150]));
        assert_eq!(keys(&mask, 1).0, vec![0, 1]);
        assert_eq!(keys(&mask, 5).0, vec![0, 2, 3, 5]);
    }

    #[test]
    fn block_sparse_takes_the_first_entries_of_ranked_lists() {
        // Two query blocks from block 4 on, lists of 3, best first.
        let lists: Arc<[u32]> = vec![9, 9, 9, 2, 1, 3, 3, NO_BLOCK, NO_BLOCK].into();
        let mask = Mask::BlockSparse(BlockSparse::ranked(lists.clone(), 3, 3, ListedBlocks::From(4), 2));
        assert_eq!(keys(&mask, 4).0, vec![0, 1, 2, 4]);
        assert_eq!(keys(&mask, 5).0, vec![0, 3, 5]);
        assert_eq!(keys(&mask, 3).0, vec![0, 3]);
        let mask = Mask::BlockSparse(BlockSparse::ranked(lists.clone(), 3, 3, ListedBlocks::From(4), 1));
        assert_eq!(keys(&mask, 4).0, vec![0, 2, 4]);
        // The same two lists as those of query blocks 4 and 7 alone.
        let only = ListedBlocks::Only(vec![4, 7].into());
        let mask = Mask::BlockSparse(BlockSparse::ranked(lists, 3, 3, only, 2));
        assert_eq!(keys(&mask, 4).0, vec![0, 1, 2, 4]);
        assert_eq!(keys(&mask, 7).0, vec![0, 3, 7]);
        assert_eq!(keys(&mask, 5).0, vec![0, 5]);
    }

    #[test]
    fn a_union_adds_the_first_ranked_blocks_its_diagonals_leave_out() {
        // Diagonal 64 covers distance 1; query block 6 ranks blocks 5, 3, 2, 1.
        let slash = VerticalSlash::new(vec![70, 140, 200, 260, 400], vec![64]);
        let lists: Vec<Vec<u32>> = (0..7).map(|b| if b == 6 { vec![5, 3, 2, 1] } else { vec![] }).collect();
        let union = |extra| Mask::Union(Union { slash: slash.clone(), ranked: BlockSparse::new(&lists), extra });
        // Block 5 is the diagonal's; 3 and 2 come from the list, so columns
        // 140 and 200 (blocks 2 and 3) are no longer single, 70 and 260 are
        // (400 is in the diagonal block).
        assert_eq!(keys(&union(2), 6), (vec![0, 2, 3, 5, 6], vec![70, 260]));
        assert_eq!(keys(&union(1), 6), (vec![0, 3, 5, 6], vec![70, 140, 260]));
        // Past the list's end nothing more is taken; the count assumes room.
        assert_eq!(keys(&union(9), 6), (vec![0, 1, 2, 3, 5, 6], vec![260]));
        assert_eq!(union(2).visited_keys(6..7), (5 * B + 5) as f64);
        assert_eq!(union(9).visited_keys(6..7), (7 * B + 5) as f64);
        // A query block without a list is vertical-slash's.
        assert_eq!(keys(&union(2), 4), keys(&Mask::VerticalSlash(slash.clone()), 4));
    }

    #[test]
    fn visited_keys_counts_what_the_lists_hold() {
        let lists: Arc<[u32]> = (0..20u32).flat_map(|b| [b / 2, b.saturating_sub(2), 1]).collect::<Vec<_>>().into();
        let masks = [
            Mask::Dense,
            Mask::AShape { sink_blocks: 2, local_blocks: 3 },
            Mask::VerticalSlash(VerticalSlash::new(vec![], vec![0, 64, 100, 700])),
            Mask::BlockSparse(BlockSparse::ranked(lists, 0, 3, ListedBlocks::From(0), 3)),
        ];
        for mask in &masks {
            let (mut blocks, mut columns) = (Vec::new(), Vec::new());
            let listed: f64 = (3..20)
                .map(|b| {
                    mask.keys(b, &mut blocks, &mut columns);
                    (blocks.len() * B + columns.len()) as f64
                })
                .sum();
            let counted = mask.visited_keys(3..20);
            // Block-sparse's ranked lists repeat blocks here, which the count does not know.
            match mask {
                Mask::BlockSparse(_) => assert!(counted >= listed, "{mask:?}: {counted} < {listed}"),
                _ => assert_eq!(counted, listed, "{mask:?}"),
            }
        }
    }

    #[test]
    fn the_index_sees_exactly_the_masks_keys() {
        let a = Mask::BlockSparse(BlockSparse::new(&[vec![], vec![], vec![1], vec![1]]));
        let b = Mask::Dense;
        let index = SparseIndex::new(&[Some(&a), Some(&b)], 200);
        assert_eq!(index.query_blocks, 4);
        assert!(index.sees(0, 150, 70) && !index.sees(0, 199, 150) && index.sees(0, 199, 3));
        assert!(index.sees(1, 199, 150) && !index.sees(1, 150, 151));
        assert!((index.density(1) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_index_lists_every_query_block_of_every_head_across_its_runs() {
        // 300 query blocks: runs of LIST_RUN, the last one short; a head
        // between two others that has no lists.
        let slash = Mask::VerticalSlash(VerticalSlash::new(vec![5, 700, 6000], vec![64, 1000]));
        let ashape = Mask::AShape { sink_blocks: 1, local_blocks: 3 };
        let masks = [Some(&slash), None, Some(&ashape)];
        let index = SparseIndex::new(&masks, 300 * BLOCK - 10);
        assert_eq!(index.block_offsets.len(), 3 * 300 + 1);
        for (h, mask) in masks.iter().enumerate() {
            for b in 0..300 {
                let expected = mask.map_or_else(|| (vec![], vec![]), |m| keys(m, b));
                let (blocks, columns) = index.keys(h as u32, b);
                assert_eq!((blocks.to_vec(), columns.to_vec()), expected, "head {h}, query block {b}");
            }
        }
    }
}
