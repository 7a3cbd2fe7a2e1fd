//! The shared probe and the index builders' scores, on the GPU.
//!
//! The probe takes r query rows of the chunk, a deterministic mix of three
//! subsets: the most recent positions (the last 64 queries, which are also
//! MInference's estimation window for vertical-slash), positions spaced
//! uniformly over the chunk, and boundary-adjacent ones (the first and last
//! query of evenly spaced query blocks, where a block-granular mask is
//! coarsest). For each it computes the softmax statistics over every key it
//! sees (`shaders/route_row_stats.wgsl`) and then the attention mass of every
//! 64-key block (`block_mass` in `shaders/route_probe.wgsl`): keys pooled in
//! blocks of g = 64, in probability rather than in key space, so that a
//! candidate mask's covered mass is a sum over its blocks. The same pass
//! gives vertical-slash's column and diagonal scores (the recent rows'
//! probabilities summed per key and per offset) and block-sparse's pooled
//! block scores (`route_pool.wgsl`, `route_block_scores.wgsl`). Probabilities
//! are averaged over the query heads of a KV head, which share one mask.

use wgpu::Buffer;

use crate::gpu::attention::{AttentionShape, BLOCK};
use crate::gpu::pipeline::{Access, Pipeline};
use crate::gpu::{Batch, GpuContext, GpuError, Kernel, Shader};

const ROW_STATS: &str = include_str!("../../../shaders/route_row_stats.wgsl");
const DENSE_KEYS: &str = include_str!("../../../shaders/attention_keys_dense.wgsl");
const SPARSE_KEYS: &str = include_str!("../../../shaders/attention_keys_sparse.wgsl");
const PROBE: Shader = Shader { name: "route_probe", source: include_str!("../../../shaders/route_probe.wgsl") };
const POOL: Shader = Shader { name: "route_pool", source: include_str!("../../../shaders/route_pool.wgsl") };
const BLOCK_SCORES: Shader =
    Shader { name: "route_block_scores", source: include_str!("../../../shaders/route_block_scores.wgsl") };

/// Query heads per KV head the row-statistics kernel takes at most.
pub const MAX_GROUP: usize = 8;

/// Which probe rows belong to which subset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subset {
    Recent,
    Uniform,
    Boundary,
}

/// The probe's query rows: absolute positions, recent ones first.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeRows {
    pub positions: Vec<u32>,
    pub subsets: Vec<Subset>,
    /// The first `recent` rows are the chunk's last queries.
    pub recent: usize,
}

impl ProbeRows {
    /// Up to 64 recent rows, `uniform` spaced rows and the first and last rows
    /// of `boundary` evenly spaced query blocks, of the chunk `pos0 .. pos0 + n`
    /// (a position taken once, by the first subset that takes it).
    pub fn new(pos0: u32, n: u32, uniform: u32, boundary: u32) -> Self {
        let end = pos0 + n;
        let recent: Vec<u32> = (end.saturating_sub(BLOCK).max(pos0)..end).rev().collect();
        let mut rows = Self { recent: recent.len(), subsets: vec![Subset::Recent; recent.len()], positions: recent };
        let mut add = |t: u32, subset| {
            if t >= pos0 && t < end && !rows.positions.contains(&t) {
                rows.positions.push(t);
                rows.subsets.push(subset);
            }
        };
        for i in 0..uniform {
            add(pos0 + ((2 * i + 1) as u64 * n as u64 / (2 * uniform as u64)) as u32, Subset::Uniform);
        }
        let (first_block, blocks) = (pos0 / BLOCK, n.div_ceil(BLOCK));
        for i in 0..boundary.min(blocks) {
            let b = first_block + ((2 * i + 1) as u64 * blocks as u64 / (2 * boundary.min(blocks) as u64)) as u32;
            add(b * BLOCK, Subset::Boundary);
            add(b * BLOCK + BLOCK - 1, Subset::Boundary);
        }
        rows
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// What the probe read back for one chunk of one layer.
#[derive(Clone, Debug, Default)]
pub struct Probe {
    pub kv_heads: usize,
    pub rows: usize,
    /// Key blocks of 64 up to the chunk's last query.
    pub key_blocks: usize,
    /// `[kv_head][row][key block]`: the row's attention mass in the block.
    pub block_mass: Vec<f32>,
    /// `[kv_head][key]`: Σ over the recent rows of p(t, key).
    pub column_scores: Vec<f32>,
    /// `[kv_head][offset]`: Σ over the recent rows of p(t, t − offset).
    pub diagonal_scores: Vec<f32>,
    /// `[kv_head][query block of the chunk][key block]`: pooled block scores.
    pub block_scores: Vec<f32>,
    /// Query blocks of the chunk (rows of `block_scores`).
    pub query_blocks: usize,
    /// GPU milliseconds: the probe proper, and the index builders' scores.
    pub probe_ms: f64,
    pub index_ms: f64,
}

impl Probe {
    pub fn mass(&self, h: usize, row: usize) -> &[f32] {
        &self.block_mass[(h * self.rows + row) * self.key_blocks..][..self.key_blocks]
    }
}

/// The probe's kernels for one head dimension.
pub struct ProbeKernels {
    dense_stats: Pipeline,
    sparse_stats: Pipeline,
    block_mass: Kernel,
    column_scores: Kernel,
    diagonal_scores: Kernel,
    pool: Kernel,
    block_scores: Kernel,
    head_dim: u32,
}

/// The uniform parameters of `route_probe.wgsl`, `route_pool.wgsl` and `route_block_scores.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    recent: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
    scale: f32,
    keys: u32,
    src_rows: u32,
    width: u32,
    qb0: u32,
    query_blocks: u32,
}

impl ProbeKernels {
    pub fn new(ctx: &GpuContext, head_dim: u32) -> Result<Self, GpuError> {
        let stats = |keys: &str, buffers: &[Access]| {
            let header = format!("const D: u32 = {head_dim}u;\n{keys}");
            Pipeline::new(&ctx.device, "route row stats", &header, ROW_STATS, buffers)
        };
        let (r, rw) = (Access::Read, Access::ReadWrite);
        Ok(Self {
            dense_stats: stats(DENSE_KEYS, &[r, r, r, rw]),
            sparse_stats: stats(SPARSE_KEYS, &[r, r, r, rw, r, r, r, r]),
            block_mass: ctx.kernel(&PROBE, "block_mass", &[])?,
            column_scores: ctx.kernel(&PROBE, "column_scores", &[])?,
            diagonal_scores: ctx.kernel(&PROBE, "diagonal_scores", &[])?,
            pool: ctx.kernel(&POOL, "pool", &[])?,
            block_scores: ctx.kernel(&BLOCK_SCORES, "block_scores", &[])?,
            head_dim,
        })
    }

    /// Records the softmax statistics `(m, l)` per `[row][query head]` of the
    /// `rows` (absolute positions in the chunk of `shape`) into `stats`, over
    /// every key each row sees, or over the keys of `index` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn row_stats(
        &self,
        batch: &mut Batch,
        ctx: &GpuContext,
        shape: &AttentionShape,
        rows: (&Buffer, u32),
        q16: &Buffer,
        keys: &Buffer,
        stats: &Buffer,
        index: Option<&crate::gpu::attention::IndexBuffers>,
    ) -> Result<(), GpuError> {
        let group = shape.n_head / shape.n_kv_head;
        if group as usize > MAX_GROUP {
            return Err(GpuError::Kernel {
                kernel: "route row stats".into(),
                reason: format!("{group} query heads per KV head; the probe takes {MAX_GROUP} at most"),
            });
        }
        let (pipeline, bind) = match index {
            None => (&self.dense_stats, self.dense_stats.bind(&ctx.device, &[rows.0, q16, keys, stats])),
            Some(i) => (
                &self.sparse_stats,
                self.sparse_stats.bind(
                    &ctx.device,
                    &[rows.0, q16, keys, stats, i.block_offsets, i.blocks, i.column_offsets, i.columns],
                ),
            ),
        };
        let immediates = [shape.n, shape.pos0, shape.n_head, shape.n_kv_head, 0, shape.scale.to_bits(), rows.1];
        batch.record("route row stats", |pass| {
            pipeline.dispatch(pass, &bind, &immediates, [rows.1, shape.n_kv_head, 1])
        });
        Ok(())
    }

    /// Runs the probe for the chunk of `shape` (its f16 queries in `q16`, the
    /// resident keys in `keys`) and reads back what the router needs.
    pub fn run(
        &self,
        ctx: &GpuContext,
        shape: &AttentionShape,
        rows: &ProbeRows,
        q16: &Buffer,
        keys: &Buffer,
    ) -> Result<Probe, GpuError> {
        let (hq, hk) = (shape.n_head as usize, shape.n_kv_head as usize);
        let r = rows.len();
        let kv_len = shape.kv_len() as usize;
        let key_blocks = kv_len.div_ceil(BLOCK as usize);
        let qb0 = shape.pos0 / BLOCK;
        let query_blocks = (shape.kv_len().div_ceil(BLOCK) - qb0) as usize;
        let d = self.head_dim as usize;
        let rows_buffer = ctx.upload("probe rows", &rows.positions)?;
        let stats = ctx.storage::<[f32; 2]>("probe stats", r * hq)?;
        let mass = ctx.storage::<f32>("probe block mass", hk * r * key_blocks)?;
        let columns = ctx.storage::<f32>("probe column scores", hk * kv_len)?;
        let diagonals = ctx.storage::<f32>("probe diagonal scores", hk * kv_len)?;
        let pooled_q = ctx.storage::<f32>("pooled queries", query_blocks * hq * d)?;
        let pooled_k = ctx.storage::<f32>("pooled keys", key_blocks * hk * d)?;
        let scores = ctx.storage::<f32>("block scores", hk * query_blocks * key_blocks)?;
        let params = Params {
            rows: r as u32,
            recent: rows.recent as u32,
            pos0: shape.pos0,
            n_head: shape.n_head,
            n_kv_head: shape.n_kv_head,
            d: self.head_dim,
            scale: shape.scale,
            keys: kv_len as u32,
            qb0,
            query_blocks: query_blocks as u32,
            ..Params::default()
        };
        fn all(b: &Buffer) -> wgpu::BindingResource<'_> {
            b.as_entire_binding()
        }
        let mut batch = ctx.batch();
        batch.mark();
        self.row_stats(&mut batch, ctx, shape, (&rows_buffer, r as u32), q16, keys, &stats, None)?;
        let mass_params = Params { keys: key_blocks as u32, ..params };
        batch.dispatch(
            &self.block_mass,
            &mass_params,
            &[all(&rows_buffer), all(q16), all(keys), all(&stats), all(&mass)],
            [key_blocks as u32, r as u32, hk as u32],
        );
        batch.mark();
        let lines = [kv_len.div_ceil(64) as u32, hk as u32, 1];
        batch.dispatch(
            &self.column_scores,
            &params,
            &[all(&rows_buffer), all(q16), all(keys), all(&stats), all(&columns)],
            lines,
        );
        batch.dispatch(
            &self.diagonal_scores,
            &params,
            &[all(&rows_buffer), all(q16), all(keys), all(&stats), all(&diagonals)],
            lines,
        );
        let q_pool = Params { src_rows: shape.n, width: (hq * d) as u32, ..params };
        let q_groups = [(hq * d).div_ceil(64) as u32, query_blocks as u32, 1];
        batch.dispatch(&self.pool, &q_pool, &[all(q16), all(&pooled_q)], q_groups);
        let k_pool = Params { src_rows: kv_len as u32, width: (hk * d) as u32, ..params };
        batch.dispatch(
            &self.pool,
            &k_pool,
            &[all(keys), all(&pooled_k)],
            [(hk * d).div_ceil(64) as u32, key_blocks as u32, 1],
        );
        let score_params = Params { keys: key_blocks as u32, ..params };
        let score_groups = [key_blocks.div_ceil(64) as u32, query_blocks as u32, hk as u32];
        batch.dispatch(
            &self.block_scores,
            &score_params,
            &[all(&pooled_q), all(&pooled_k), all(&scores)],
            score_groups,
        );
        batch.mark();
        let times = batch.submit_timed()?.unwrap_or_default();
        let probe = Probe {
            kv_heads: hk,
            rows: r,
            key_blocks,
            block_mass: ctx.read(&mass, 0, hk * r * key_blocks)?,
            column_scores: ctx.read(&columns, 0, hk * kv_len)?,
            diagonal_scores: ctx.read(&diagonals, 0, hk * kv_len)?,
            block_scores: ctx.read(&scores, 0, hk * query_blocks * key_blocks)?,
            query_blocks,
            probe_ms: times.first().copied().unwrap_or(0.0),
            index_ms: times.get(1).copied().unwrap_or(0.0),
        };
        for b in [rows_buffer, stats, mass, columns, diagonals, pooled_q, pooled_k, scores] {
            ctx.recycle(b);
        }
        Ok(probe)
    }
}

/// `with_header` for the row-statistics shader, for the validation test.
#[cfg(test)]
pub(crate) fn row_stats_sources() -> Vec<(String, String)> {
    [("dense", DENSE_KEYS), ("sparse", SPARSE_KEYS)]
        .iter()
        .flat_map(|(kind, keys)| {
            [64, 128, 256].map(|d| {
                (
                    format!("route_row_stats {kind} D={d}"),
                    crate::gpu::pipeline::with_header(&format!("const D: u32 = {d}u;\n{keys}"), ROW_STATS),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_rows_mix_recent_uniform_and_boundary_positions() {
        let rows = ProbeRows::new(0, 1000, 4, 2);
        assert_eq!(rows.recent, 64);
        assert_eq!(rows.positions[0], 999);
        assert!(rows.positions[..64].iter().all(|&t| t >= 936));
        let uniform: Vec<u32> =
            rows.positions.iter().zip(&rows.subsets).filter(|(_, s)| **s == Subset::Uniform).map(|(t, _)| *t).collect();
        assert_eq!(uniform, vec![125, 375, 625, 875]);
        let boundary: Vec<u32> = rows
            .positions
            .iter()
            .zip(&rows.subsets)
            .filter(|(_, s)| **s == Subset::Boundary)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(boundary, vec![256, 319, 768, 831]);
        let short = ProbeRows::new(128, 10, 4, 2);
        assert_eq!(short.positions.len(), 10);
    }
}
