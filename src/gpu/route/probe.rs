//! The shared probe and the index builders' scores, on the GPU.
//!
//! The probe takes r query rows of the chunk, a deterministic mix of three
//! subsets: the most recent positions (the last 64 queries, which are also
//! MInference's estimation window for vertical-slash), positions spaced
//! uniformly over the chunk, and boundary-adjacent ones (the first and last
//! query of evenly spaced query blocks, where a block-granular mask is
//! coarsest). Its kernels (`shaders/route_probe.wgsl`) score every key block
//! against all probe rows once, keeping per row and block only the softmax
//! statistics (m, l): combined per row, they give the attention mass of every
//! 64-key block (keys pooled in blocks of g = 64, in probability rather than
//! in key space, so that a candidate mask's covered mass is a sum over its
//! blocks). A second pass over the recent rows alone, now with their row
//! statistics, gives vertical-slash's column and diagonal scores (the recent
//! rows' probabilities summed per key and per offset). Block-sparse's index
//! builder (`shaders/route_blocks.wgsl`) pools queries and keys per block,
//! scores the pooled blocks and selects each query block's best key blocks
//! on the GPU, so what comes back is small: the block masses of the probe
//! rows, the line scores, and the [`TOP_BLOCKS`] key blocks of the query
//! blocks that hold probe rows (what the mass estimates read); the lists of
//! every query block stay on the GPU until a block-sparse mask is chosen
//! ([`Probe::head_lists`]).
//! Once the columns are ranked, [`ProbeKernels::column_masses`] scores the
//! best [`COLUMNS`] of each KV head against every probe row, so that a
//! vertical-slash mask's single columns count at each row's own
//! probabilities, not at the recent rows' (which chose them).
//! Probabilities are averaged over the query heads of a KV head, which share
//! one mask. Both shader files begin with `shaders/route_params.wgsl`, whose
//! `Params` is [`Params`] here.

use std::sync::Arc;

use wgpu::Buffer;

use crate::gpu::attention::{AttentionShape, BLOCK};
use crate::gpu::pipeline::{Access, Pipeline};
use crate::gpu::{Batch, GpuContext, GpuError, Kernel, Readback, Shader};

const ROW_STATS: &str = include_str!("../../../shaders/route_row_stats.wgsl");
const DENSE_KEYS: &str = include_str!("../../../shaders/attention_keys_dense.wgsl");
const SPARSE_KEYS: &str = include_str!("../../../shaders/attention_keys_sparse.wgsl");
const PROBE: Shader = Shader {
    name: "route_probe",
    source: concat!(
        include_str!("../../../shaders/route_params.wgsl"),
        include_str!("../../../shaders/route_probe.wgsl")
    ),
};
const BLOCKS: Shader = Shader {
    name: "route_blocks",
    source: concat!(
        include_str!("../../../shaders/route_params.wgsl"),
        include_str!("../../../shaders/route_blocks.wgsl")
    ),
};

/// The probe's WGSL, whose time the latency profile keeps.
pub(crate) const SOURCES: [&str; 3] = [PROBE.source, BLOCKS.source, ROW_STATS];

/// Key blocks `route_blocks.wgsl` selects per query block (its `TOP`): the
/// largest block-sparse budget.
pub const TOP_BLOCKS: usize = 800;

/// Ranked columns per KV head whose mass `column_mass` measures at every
/// probe row (its `COLUMNS`): the largest vertical-slash budget.
pub const COLUMNS: usize = 1000;

/// The end of a query block's list of selected key blocks shorter than [`TOP_BLOCKS`].
pub const NO_BLOCK: u32 = u32::MAX;

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
    /// Queries in the chunk: the recent rows are all of its last ones, the
    /// others stand for the rest.
    pub chunk: u32,
}

impl ProbeRows {
    /// Up to 64 recent rows, `uniform` spaced rows and the first and last rows
    /// of `boundary` evenly spaced query blocks, of the chunk `pos0 .. pos0 + n`
    /// (a position taken once, by the first subset that takes it).
    pub fn new(pos0: u32, n: u32, uniform: u32, boundary: u32) -> Self {
        let end = pos0 + n;
        let recent: Vec<u32> = (end.saturating_sub(BLOCK).max(pos0)..end).rev().collect();
        let mut rows =
            Self { recent: recent.len(), subsets: vec![Subset::Recent; recent.len()], positions: recent, chunk: n };
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
    /// `[row][query head]`: the row's softmax statistics (m, l) over every key it sees.
    pub row_stats: Vec<[f32; 2]>,
    /// `[kv_head][row][rank]`: p(t, j) of the head's ranked columns j
    /// ([`HeadLines`](super::candidates::HeadLines)), averaged over its query
    /// heads; empty until [`ProbeKernels::column_masses`] runs.
    pub column_mass: Vec<f32>,
    /// `[kv_head][probe block][TOP_BLOCKS]`: for each query block of
    /// `probe_blocks`, the key blocks between the sink block and the
    /// diagonal with the best pooled scores, best first, [`NO_BLOCK`] past
    /// the end of a shorter list.
    pub top_blocks: Arc<[u32]>,
    /// The query blocks that hold probe rows, ascending.
    pub probe_blocks: Arc<[u32]>,
    /// `[kv_head][query block of the chunk][TOP_BLOCKS]`: the same lists for
    /// every query block, on the GPU ([`Self::head_lists`]).
    pub(super) every_block: Option<Buffer>,
    /// Query blocks of the chunk, and the first one's index.
    pub query_blocks: usize,
    pub first_query_block: usize,
    /// GPU milliseconds: the probe proper, and the index builders' scores.
    pub probe_ms: f64,
    pub index_ms: f64,
    /// GPU milliseconds of each kernel, by name.
    pub kernels: Vec<(&'static str, f64)>,
}

impl Probe {
    pub fn mass(&self, h: usize, row: usize) -> &[f32] {
        &self.block_mass[(h * self.rows + row) * self.key_blocks..][..self.key_blocks]
    }

    /// Row `row`'s probabilities of KV head `h`'s ranked columns, best first.
    pub fn column_mass(&self, h: usize, row: usize) -> &[f32] {
        &self.column_mass[(h * self.rows + row) * COLUMNS..][..COLUMNS]
    }

    pub fn columns(&self, h: usize) -> &[f32] {
        let keys = self.column_scores.len() / self.kv_heads;
        &self.column_scores[h * keys..][..keys]
    }

    pub fn diagonals(&self, h: usize) -> &[f32] {
        let keys = self.diagonal_scores.len() / self.kv_heads;
        &self.diagonal_scores[h * keys..][..keys]
    }

    /// KV head `h`'s lists of every query block of the chunk, read from the
    /// GPU: `[query block of the chunk][TOP_BLOCKS]`, laid out as `top_blocks`.
    pub fn head_lists(&self, ctx: &GpuContext, h: usize) -> Result<Arc<[u32]>, GpuError> {
        Ok(self.read_head_lists(ctx, h)?.wait(ctx)?.into())
    }

    /// [`Self::head_lists`] started: what is submitted later does not delay them.
    pub fn read_head_lists(&self, ctx: &GpuContext, h: usize) -> Result<Readback<u32>, GpuError> {
        let Some(lists) = &self.every_block else {
            return Err(GpuError::Readback("the probe's block lists were given back".into()));
        };
        let len = self.query_blocks * TOP_BLOCKS;
        ctx.read_later::<u32>(lists, (h * len * size_of::<u32>()) as u64, len)
    }

    /// Gives the lists of every query block back to `ctx`'s pool.
    pub fn release(&mut self, ctx: &GpuContext) {
        if let Some(b) = self.every_block.take() {
            ctx.recycle(b);
        }
    }
}

/// The probe's kernels for one head dimension.
pub struct ProbeKernels {
    dense_stats: Pipeline,
    sparse_stats: Pipeline,
    tile_stats: Kernel,
    block_mass: Kernel,
    recent_lines: Kernel,
    diagonals: Kernel,
    pool_queries: Kernel,
    pool_keys: Kernel,
    block_scores: Kernel,
    top_blocks: Kernel,
    column_mass: Kernel,
    head_dim: u32,
}

/// `Params` of `shaders/route_params.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
    scale: f32,
    rows: u32,
    recent: u32,
}

/// The probe's kernels in the order they run: the first two are the probe
/// proper, the rest the index builders.
const KERNELS: [&str; 8] = [
    "tile_stats",
    "block_mass",
    "recent_lines",
    "diagonals",
    "pool_queries",
    "pool_keys",
    "block_scores",
    "top_blocks",
];

/// Query blocks `block_scores` takes per workgroup (its `QUERY_TILE`).
const QUERY_TILE: u32 = 8;

impl ProbeKernels {
    pub fn new(ctx: &GpuContext, head_dim: u32) -> Result<Self, GpuError> {
        if head_dim > 256 || !head_dim.is_multiple_of(4) {
            return Err(GpuError::Kernel {
                kernel: "route probe".into(),
                reason: format!("head size {head_dim}: the probe takes multiples of 4 up to 256"),
            });
        }
        let stats = |keys: &str, buffers: &[Access]| {
            let header = format!("const D: u32 = {head_dim}u;\n{keys}");
            Pipeline::new(&ctx.device, "route row stats", &header, ROW_STATS, buffers)
        };
        let (r, rw) = (Access::Read, Access::ReadWrite);
        Ok(Self {
            dense_stats: stats(DENSE_KEYS, &[r, r, r, rw]),
            sparse_stats: stats(SPARSE_KEYS, &[r, r, r, rw, r, r, r, r]),
            tile_stats: ctx.kernel(&PROBE, "tile_stats", &[("HEAD_DIM", head_dim as f64)])?,
            block_mass: ctx.kernel(&PROBE, "block_mass", &[])?,
            recent_lines: ctx.kernel(&PROBE, "recent_lines", &[])?,
            diagonals: ctx.kernel(&PROBE, "diagonals", &[])?,
            pool_queries: ctx.kernel(&BLOCKS, "pool_queries", &[])?,
            pool_keys: ctx.kernel(&BLOCKS, "pool_keys", &[])?,
            block_scores: ctx.kernel(&BLOCKS, "block_scores", &[])?,
            top_blocks: ctx.kernel(&BLOCKS, "top_blocks", &[])?,
            column_mass: ctx.kernel(&PROBE, "column_mass", &[])?,
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

    fn params(&self, shape: &AttentionShape, rows: &ProbeRows) -> Params {
        Params {
            n: shape.n,
            pos0: shape.pos0,
            n_head: shape.n_head,
            n_kv_head: shape.n_kv_head,
            d: self.head_dim,
            scale: shape.scale,
            rows: rows.len() as u32,
            recent: rows.recent as u32,
        }
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
        if hq / hk > MAX_GROUP {
            return Err(GpuError::Kernel {
                kernel: "route probe".into(),
                reason: format!("{} query heads per KV head; the probe takes {MAX_GROUP} at most", hq / hk),
            });
        }
        let r = rows.len();
        let kv_len = shape.kv_len() as usize;
        let key_blocks = kv_len.div_ceil(BLOCK as usize);
        let first_query_block = (shape.pos0 / BLOCK) as usize;
        let query_blocks = key_blocks - first_query_block;
        let quads = self.head_dim as usize / 4;
        let rows_buffer = ctx.upload("probe rows", &rows.positions)?;
        let block_stats = ctx.storage::<[f32; 2]>("probe block stats", hq * r * key_blocks)?;
        let row_stats = ctx.storage::<[f32; 2]>("probe row stats", r * hq)?;
        let mass = ctx.storage::<f32>("probe block mass", hk * r * key_blocks)?;
        let columns = ctx.storage::<f32>("probe column scores", hk * kv_len)?;
        let parts = ctx.storage::<f32>("probe diagonal parts", hk * key_blocks * 2 * BLOCK as usize)?;
        let diagonals = ctx.storage::<f32>("probe diagonal scores", hk * kv_len)?;
        let pooled_q = ctx.storage::<[f32; 4]>("pooled queries", query_blocks * hk * quads)?;
        let pooled_k = ctx.storage::<[f32; 4]>("pooled keys", key_blocks * hk * quads)?;
        let scores = ctx.storage::<f32>("block scores", hk * query_blocks * key_blocks)?;
        let top = ctx.storage::<u32>("top blocks", hk * query_blocks * TOP_BLOCKS)?;
        let params = self.params(shape, rows);
        fn all(b: &Buffer) -> wgpu::BindingResource<'_> {
            b.as_entire_binding()
        }
        let (kb, hk32) = (key_blocks as u32, hk as u32);
        let mut batch = ctx.batch();
        batch.mark();
        let scored = || [all(&rows_buffer), all(q16), all(keys)];
        let lines = [all(&row_stats), all(&columns), all(&parts)];
        let dispatches: [(&Kernel, Vec<wgpu::BindingResource>, [u32; 3]); 8] = [
            (&self.tile_stats, [&scored()[..], &[all(&block_stats)]].concat(), [kb, hk32, 1]),
            (&self.block_mass, vec![all(&block_stats), all(&row_stats), all(&mass)], [r as u32, hk32, 1]),
            (&self.recent_lines, [&scored()[..], &lines[..]].concat(), [kb, hk32, 1]),
            (&self.diagonals, vec![all(&parts), all(&diagonals)], [kv_len.div_ceil(64) as u32, hk32, 1]),
            (&self.pool_queries, vec![all(q16), all(&pooled_q)], [1, query_blocks as u32, hk32]),
            (&self.pool_keys, vec![all(keys), all(&pooled_k)], [1, kb, hk32]),
            (
                &self.block_scores,
                vec![all(&pooled_q), all(&pooled_k), all(&scores)],
                [kb.div_ceil(BLOCK), (query_blocks as u32).div_ceil(QUERY_TILE), hk32],
            ),
            (&self.top_blocks, vec![all(&scores), all(&top)], [query_blocks as u32, hk32, 1]),
        ];
        for (kernel, buffers, groups) in &dispatches {
            batch.dispatch(kernel, &params, buffers, *groups);
            batch.mark();
        }
        drop(dispatches);
        // The lists of the probe rows' query blocks, gathered for the readback.
        let mut probe_blocks: Vec<u32> = rows.positions.iter().map(|t| t / BLOCK).collect();
        probe_blocks.sort_unstable();
        probe_blocks.dedup();
        let gathered = ctx.storage::<u32>("probe blocks' lists", hk * probe_blocks.len() * TOP_BLOCKS)?;
        let list_bytes = (TOP_BLOCKS * size_of::<u32>()) as u64;
        for h in 0..hk {
            for (i, &b) in probe_blocks.iter().enumerate() {
                let from = (h * query_blocks + b as usize - first_query_block) as u64 * list_bytes;
                let to = (h * probe_blocks.len() + i) as u64 * list_bytes;
                batch.copy(&top, from, &gathered, to, list_bytes);
            }
        }
        let times = batch.submit_timed()?.unwrap_or_default();
        let kernels: Vec<(&'static str, f64)> = KERNELS.iter().copied().zip(times.iter().copied()).collect();
        let probe = Probe {
            kv_heads: hk,
            rows: r,
            key_blocks,
            block_mass: ctx.read(&mass, 0, hk * r * key_blocks)?,
            column_scores: ctx.read(&columns, 0, hk * kv_len)?,
            diagonal_scores: ctx.read(&diagonals, 0, hk * kv_len)?,
            row_stats: ctx.read(&row_stats, 0, r * hq)?,
            column_mass: Vec::new(),
            top_blocks: ctx.read::<u32>(&gathered, 0, hk * probe_blocks.len() * TOP_BLOCKS)?.into(),
            probe_blocks: probe_blocks.into(),
            every_block: Some(top),
            query_blocks,
            first_query_block,
            probe_ms: kernels.iter().take(2).map(|k| k.1).sum(),
            index_ms: kernels.iter().skip(2).map(|k| k.1).sum(),
            kernels,
        };
        for b in
            [rows_buffer, block_stats, row_stats, mass, columns, parts, diagonals, pooled_q, pooled_k, scores, gathered]
        {
            ctx.recycle(b);
        }
        Ok(probe)
    }

    /// Fills `probe.column_mass` with every probe row's probability of each
    /// KV head's ranked columns `columns[h]` (at most [`COLUMNS`], best
    /// first), from the probe's row statistics; its GPU time joins the index
    /// builders'.
    #[allow(clippy::too_many_arguments)]
    pub fn column_masses(
        &self,
        ctx: &GpuContext,
        shape: &AttentionShape,
        rows: &ProbeRows,
        q16: &Buffer,
        keys: &Buffer,
        probe: &mut Probe,
        columns: &[&[u32]],
    ) -> Result<(), GpuError> {
        let (hk, r) = (shape.n_kv_head as usize, rows.len());
        let mut ranked = vec![u32::MAX; hk * COLUMNS];
        for (h, list) in columns.iter().enumerate() {
            ranked[h * COLUMNS..][..list.len().min(COLUMNS)].copy_from_slice(&list[..list.len().min(COLUMNS)]);
        }
        let rows_buffer = ctx.upload("probe rows", &rows.positions)?;
        let stats = ctx.upload("probe row stats", &probe.row_stats)?;
        let ranked_buffer = ctx.upload("ranked columns", &ranked)?;
        let mass = ctx.storage::<f32>("column mass", hk * r * COLUMNS)?;
        let buffers = [&rows_buffer, q16, keys, &stats, &ranked_buffer, &mass].map(|b| b.as_entire_binding());
        let mut batch = ctx.batch();
        batch.mark();
        batch.dispatch(
            &self.column_mass,
            &self.params(shape, rows),
            &buffers,
            [COLUMNS.div_ceil(64) as u32, hk as u32, 1],
        );
        batch.mark();
        let ms = batch.submit_timed()?.and_then(|t| t.first().copied()).unwrap_or_default();
        probe.column_mass = ctx.read(&mass, 0, hk * r * COLUMNS)?;
        probe.kernels.push(("column_mass", ms));
        probe.index_ms += ms;
        for b in [rows_buffer, stats, ranked_buffer, mass] {
            ctx.recycle(b);
        }
        Ok(())
    }
}

/// The probe's WGSL modules as compiled, for the validation test.
#[cfg(test)]
pub(crate) fn shader_sources() -> Vec<(String, String)> {
    let mut sources =
        vec![(PROBE.name.to_string(), PROBE.source.to_string()), (BLOCKS.name.to_string(), BLOCKS.source.to_string())];
    sources.extend(row_stats_sources());
    sources
}

/// `with_header` for the row-statistics shader, for the validation test.
#[cfg(test)]
fn row_stats_sources() -> Vec<(String, String)> {
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
