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
//! `t − o` of its 64 queries fall in.
//!
//! [`SparseIndex`] lays the masks of all KV heads out as the kernel reads them
//! (`shaders/attention_keys_sparse.wgsl`): CSR offsets per (KV head, query
//! block) into one list of key blocks and one list of single positions.

use half::f16;

use crate::gpu::attention::{IndexBuffers, BLOCK};
use crate::gpu::{GpuContext, GpuError};

const B: usize = BLOCK as usize;

/// The keys of one KV head, per query block.
#[derive(Clone, Debug, PartialEq)]
pub enum Mask {
    /// Every key block up to the diagonal.
    Dense,
    /// The first `sink_blocks` key blocks and the `local_blocks` up to and
    /// including the diagonal block.
    AShape { sink_blocks: u32, local_blocks: u32 },
    /// Selected key positions (`columns`) for every query at or after them, and
    /// selected diagonal offsets (`diagonals`, `t − j`), each covering the key
    /// blocks its band crosses in a query block.
    VerticalSlash { columns: Vec<u32>, diagonals: Vec<u32> },
    /// Per query block, the key blocks selected (ascending; block 0 and the
    /// diagonal are added).
    BlockSparse { blocks: Vec<Vec<u32>> },
}

impl Mask {
    /// The key blocks and single positions of query block `b` (both ascending,
    /// no position in both), into `blocks` and `columns` (cleared first).
    /// `seen` is scratch of at least `b + 1` entries.
    pub fn keys(&self, b: u32, blocks: &mut Vec<u32>, columns: &mut Vec<u32>, seen: &mut Vec<bool>) {
        blocks.clear();
        columns.clear();
        let n = b as usize + 1;
        seen.clear();
        seen.resize(n, false);
        seen[0] = true;
        seen[b as usize] = true;
        match self {
            Mask::Dense => seen.fill(true),
            Mask::AShape { sink_blocks, local_blocks } => {
                seen[..(*sink_blocks as usize).min(n)].fill(true);
                seen[n.saturating_sub(*local_blocks as usize)..].fill(true);
            }
            Mask::VerticalSlash { diagonals, .. } => {
                let first = b as i64 * B as i64;
                for &o in diagonals {
                    let (lo, hi) = (first - o as i64, first + B as i64 - 1 - o as i64);
                    if hi < 0 {
                        continue;
                    }
                    seen[(lo.max(0) as usize) / B..=(hi as usize) / B].fill(true);
                }
            }
            Mask::BlockSparse { blocks: chosen } => {
                for &kb in chosen.get(b as usize).map_or(&[][..], Vec::as_slice) {
                    if kb <= b {
                        seen[kb as usize] = true;
                    }
                }
            }
        }
        blocks.extend(seen.iter().enumerate().filter(|(_, s)| **s).map(|(kb, _)| kb as u32));
        if let Mask::VerticalSlash { columns: chosen, .. } = self {
            let last = (b as usize + 1) * B;
            columns.extend(chosen.iter().copied().filter(|&j| (j as usize) < last && !seen[j as usize / B]));
        }
    }

    /// The pattern's name in reports and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Mask::Dense => "dense",
            Mask::AShape { .. } => "ashape",
            Mask::VerticalSlash { .. } => "vslash",
            Mask::BlockSparse { .. } => "blocksparse",
        }
    }
}

/// The key lists of every KV head, as the sparse kernel reads them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseIndex {
    pub kv_heads: u32,
    pub query_blocks: u32,
    /// `kv_heads · query_blocks + 1` offsets into `blocks`.
    pub block_offsets: Vec<u32>,
    pub blocks: Vec<u32>,
    /// `kv_heads · query_blocks + 1` offsets into `columns`.
    pub column_offsets: Vec<u32>,
    pub columns: Vec<u32>,
}

impl SparseIndex {
    /// The index of `masks` (one per KV head) over `positions` positions.
    pub fn new(masks: &[&Mask], positions: u32) -> Self {
        let query_blocks = positions.div_ceil(BLOCK);
        let mut index = Self {
            kv_heads: masks.len() as u32,
            query_blocks,
            block_offsets: vec![0],
            column_offsets: vec![0],
            ..Self::default()
        };
        let (mut blocks, mut columns, mut seen) = (Vec::new(), Vec::new(), Vec::new());
        for mask in masks {
            for b in 0..query_blocks {
                mask.keys(b, &mut blocks, &mut columns, &mut seen);
                index.blocks.extend_from_slice(&blocks);
                index.columns.extend_from_slice(&columns);
                index.block_offsets.push(index.blocks.len() as u32);
                index.column_offsets.push(index.columns.len() as u32);
            }
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

    /// The four lists on the GPU.
    pub fn upload(&self, ctx: &GpuContext) -> Result<GpuIndex, GpuError> {
        Ok(GpuIndex {
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
        let (mut blocks, mut columns, mut seen) = (Vec::new(), Vec::new(), Vec::new());
        mask.keys(b, &mut blocks, &mut columns, &mut seen);
        (blocks, columns)
    }

    #[test]
    fn a_shape_keeps_sinks_and_the_local_band() {
        let mask = Mask::AShape { sink_blocks: 2, local_blocks: 3 };
        assert_eq!(keys(&mask, 10).0, vec![0, 1, 8, 9, 10]);
        assert_eq!(keys(&mask, 1).0, vec![0, 1]);
    }

    #[test]
    fn vertical_slash_covers_the_bands_blocks_and_leaves_columns_outside_them() {
        // Offset 64 in query block 3 (positions 192..256): keys 128..192, block 2
        // only; offset 100: keys 92..156, blocks 1 and 2.
        let mask = Mask::VerticalSlash { columns: vec![5, 70, 130, 300], diagonals: vec![64, 100] };
        let (blocks, columns) = keys(&mask, 3);
        assert_eq!(blocks, vec![0, 1, 2, 3]);
        assert_eq!(columns, Vec::<u32>::new());
        let mask = Mask::VerticalSlash { columns: vec![5, 70, 130, 300], diagonals: vec![64] };
        assert_eq!(keys(&mask, 3), (vec![0, 2, 3], vec![70]));
    }

    #[test]
    fn the_index_sees_exactly_the_masks_keys() {
        let a = Mask::BlockSparse { blocks: vec![vec![], vec![], vec![1], vec![1]] };
        let b = Mask::Dense;
        let index = SparseIndex::new(&[&a, &b], 200);
        assert_eq!(index.query_blocks, 4);
        assert!(index.sees(0, 150, 70) && !index.sees(0, 199, 150) && index.sees(0, 199, 3));
        assert!(index.sees(1, 199, 150) && !index.sees(1, 150, 151));
        assert!((index.density(1) - 1.0).abs() < 1e-12);
    }
}
