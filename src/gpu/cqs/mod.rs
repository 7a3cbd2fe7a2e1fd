//! Stream-CQSA: exact attention for calls the device cannot hold, by cyclic
//! quorum sets.
//!
//! An attention call whose working memory (Q, K, V, outputs and statistics,
//! [`working_bytes`]) exceeds what the device allows — its memory, wgpu's
//! binding and buffer limits, or a budget given with `--gpu-mem-budget` — is
//! cut into pieces ([`plan`]): seven subsequences of three chunks each, which
//! together compute every query–key pair exactly once, each piece a third or
//! so of the tokens at 3/7 of the length. A piece that still does not fit is
//! cut the same way again, to any depth. Each piece runs the `partial` entry
//! of the tiled attention shader ([`kernel`]), which skips the tiles its mask
//! leaves empty and returns unnormalised outputs with each row's maximum and
//! sum; the host merges them with the max shift ([`merge`]) into the exact
//! softmax attention, to f32 rounding.
//!
//! The schedule is the seed's single-device one with its OOM guardrail. The
//! call's Q, K, V and the f32 accumulator stay in host memory; only the
//! pieces in flight are on the device, at most `n_cap` of them. A round takes
//! pieces from the queue while they fit: when one does not (the budget, a
//! buffer past a device limit, or an out-of-memory error caught in a wgpu
//! error scope), it goes back to the queue and `n_cap` drops to the pieces
//! already placed; when it is alone and still does not fit, it is split and
//! its seven children take its place, so depth grows only where it must, and
//! `n_cap` is calibrated again by trying. The queue starts with the whole
//! call (depth 0), so the depth reached is the smallest that fits; the seed's
//! rule that lowers the depth when every piece is resident with room to spare
//! never applies.
//!
//! Each stage is timed and reported ([`CqsReport`]): gathering pieces from
//! the call (host), transfers both ways, the kernels (GPU timestamps where
//! the adapter has them), and merging.

pub mod kernel;
pub mod merge;
pub mod plan;

use std::collections::VecDeque;
use std::time::Instant;

use half::f16;
use rayon::prelude::*;

use self::kernel::{PieceKernel, PieceShape};
use self::merge::Accumulator;
use self::plan::{Block, Mask, Piece, Verdict, BLOCK};
use super::context::{GpuContext, GpuError};
use super::KernelPath;

/// One attention call in host memory: `queries` queries at the last positions
/// of `keys` keys (`keys - queries ..`), as a prefill chunk has them.
pub struct AttentionCall<'a> {
    /// f16 `[queries][n_head][head_dim]`.
    pub q: &'a [f16],
    /// f16 `[keys][n_kv_head][head_dim]`, and V alike.
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub queries: usize,
    pub keys: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub mask: Mask,
    pub scale: f32,
}

impl AttentionCall<'_> {
    /// Position of the first query.
    pub fn pos0(&self) -> usize {
        self.keys - self.queries
    }
}

/// Bytes of one call's (or piece's) working memory on the device: Q, K and V
/// in f16, the f32 outputs, (m, l) per query and head, and the token table
/// and block summaries of a piece.
pub fn working_bytes(queries: usize, keys: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> u64 {
    let (q, kv) = ((queries * n_head * head_dim) as u64, (keys * n_kv_head * head_dim) as u64);
    let tables = (queries + keys) as u64 * 8 + (queries.div_ceil(BLOCK) + keys.div_ceil(BLOCK)) as u64 * 16;
    q * 2 + kv * 2 * 2 + q * 4 + (queries * n_head) as u64 * 8 + tables
}

/// What decomposed calls did, summed over calls.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct CqsReport {
    /// Calls decomposed.
    pub calls: usize,
    /// The deepest piece computed: 0 when a call ran whole.
    pub depth: u32,
    /// Pieces computed.
    pub pieces: usize,
    /// Pieces that did not fit alone and were split.
    pub splits: usize,
    /// Pieces sent back to the queue because others filled the device.
    pub evictions: usize,
    /// Pieces resident at once, at most: the `n_cap` the guardrail settled on.
    pub n_cap: usize,
    /// The largest working memory resident at once, in bytes.
    pub peak_bytes: u64,
    /// The most bytes the device's allocator held while pieces were resident
    /// (everything: weights and pools too), where wgpu reports it.
    pub device_peak_bytes: Option<u64>,
    /// Tiles of the pieces by verdict: clear, fully masked, mixed.
    pub tiles: [u64; 3],
    pub gather_ms: f64,
    pub transfer_ms: f64,
    pub compute_ms: f64,
    pub merge_ms: f64,
}

impl CqsReport {
    /// Adds `other`'s counts and times; depth and sizes are maxima.
    pub fn absorb(&mut self, other: &CqsReport) {
        self.calls += other.calls;
        self.depth = self.depth.max(other.depth);
        self.pieces += other.pieces;
        self.splits += other.splits;
        self.evictions += other.evictions;
        self.n_cap = self.n_cap.max(other.n_cap);
        self.peak_bytes = self.peak_bytes.max(other.peak_bytes);
        self.device_peak_bytes = self.device_peak_bytes.max(other.device_peak_bytes);
        for (a, b) in self.tiles.iter_mut().zip(other.tiles) {
            *a += b;
        }
        self.gather_ms += other.gather_ms;
        self.transfer_ms += other.transfer_ms;
        self.compute_ms += other.compute_ms;
        self.merge_ms += other.merge_ms;
    }
}

impl std::fmt::Display for CqsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [clear, masked, mixed] = self.tiles;
        write!(
            f,
            "{} call(s) decomposed to depth {}: {} pieces ({} splits, {} evictions, n_cap {}), peak {:.1} MiB; \
             tiles {clear} clear, {masked} skipped, {mixed} mixed; gather {:.1} ms, transfer {:.1} ms, \
             compute {:.1} ms, merge {:.1} ms",
            self.calls,
            self.depth,
            self.pieces,
            self.splits,
            self.evictions,
            self.n_cap,
            self.peak_bytes as f64 / (1 << 20) as f64,
            self.gather_ms,
            self.transfer_ms,
            self.compute_ms,
            self.merge_ms
        )
    }
}

/// Why a piece could not be placed on the device.
enum Refusal {
    /// Past the budget, with what was resident.
    Budget,
    /// Past a device limit, or out of memory.
    Device(GpuError),
}

/// A piece on the device: its buffers, shape and query rows.
struct Resident {
    buffers: [wgpu::Buffer; 7],
    shape: PieceShape,
    groups: [u32; 3],
    /// The call's query index of each of the piece's query rows.
    rows: Vec<u32>,
    bytes: u64,
}

/// Decomposed attention on one device, under an optional budget.
pub struct Cqs {
    kernel: PieceKernel,
    head_dim: usize,
    budget: Option<u64>,
}

impl Cqs {
    /// The pieces' kernel for `head_dim` and `group_heads` query heads per KV
    /// head; `budget` bounds one call's working memory in bytes.
    pub fn new(ctx: &GpuContext, head_dim: usize, group_heads: usize, budget: Option<u64>) -> Result<Self, GpuError> {
        let kernel_error =
            |e: super::KernelError| GpuError::Kernel { kernel: "attention partial".into(), reason: e.to_string() };
        KernelPath::Tiled.available(ctx).map_err(kernel_error)?;
        let kernel = PieceKernel::new(&ctx.device, head_dim as u32, group_heads as u32).map_err(kernel_error)?;
        Ok(Self { kernel, head_dim, budget })
    }

    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Whether a whole call of `queries` × `keys` fits the budget.
    pub fn fits(&self, queries: usize, keys: usize, n_head: usize, n_kv_head: usize, head_dim: usize) -> bool {
        self.budget.is_none_or(|b| working_bytes(queries, keys, n_head, n_kv_head, head_dim) <= b)
    }

    /// Computes `call` into `out` (f32 `[queries][n_head][head_dim]`), split as
    /// deep as the device and the budget need.
    pub fn attend(&self, ctx: &GpuContext, call: &AttentionCall, out: &mut [f32]) -> Result<CqsReport, GpuError> {
        let bad = |reason: String| GpuError::Kernel { kernel: "attention partial".into(), reason };
        if call.head_dim != self.head_dim {
            return Err(bad(format!("head dimension {}, the kernel's is {}", call.head_dim, self.head_dim)));
        }
        if call.queries == 0 || call.queries > call.keys {
            return Err(bad(format!("{} queries over {} keys", call.queries, call.keys)));
        }
        if call.mask.window.is_some() && !call.mask.causal || call.mask.window == Some(0) {
            return Err(bad("a window needs a causal mask and at least one position".into()));
        }
        let (q_row, kv_row) = (call.n_head * call.head_dim, call.n_kv_head * call.head_dim);
        if call.q.len() < call.queries * q_row
            || call.k.len() < call.keys * kv_row
            || call.v.len() < call.keys * kv_row
            || out.len() < call.queries * q_row
        {
            return Err(bad("Q, K, V or the output is shorter than the call".into()));
        }
        let mut report = CqsReport { calls: 1, ..CqsReport::default() };
        let mut accumulator = Accumulator::new(call.queries, call.n_head, call.head_dim);
        let mut queue = VecDeque::from([Piece::whole(call.keys)]);
        let mut n_cap = usize::MAX;
        while !queue.is_empty() {
            let mut round: Vec<Resident> = Vec::new();
            let mut resident = 0;
            while round.len() < n_cap {
                let Some(piece) = queue.pop_front() else { break };
                if piece.first_query(call.pos0() as u32) == piece.len() {
                    continue;
                }
                match self.place(ctx, call, &piece, resident, &mut report) {
                    Ok(placed) => {
                        resident += placed.bytes;
                        round.push(placed);
                    }
                    Err(_) if !round.is_empty() => {
                        report.evictions += 1;
                        n_cap = round.len();
                        queue.push_front(piece);
                        break;
                    }
                    Err(refusal) => {
                        let children = piece.split().filter(|c| c.iter().all(|c| c.len() < piece.len()));
                        let Some(children) = children else {
                            return Err(match refusal {
                                Refusal::Device(e) => e,
                                Refusal::Budget => bad(format!(
                                    "a budget of {} bytes holds no piece of {} token(s)",
                                    self.budget.unwrap_or(0),
                                    piece.len()
                                )),
                            });
                        };
                        report.splits += 1;
                        for child in children.into_iter().rev() {
                            queue.push_front(child);
                        }
                        n_cap = usize::MAX;
                    }
                }
            }
            report.n_cap = report.n_cap.max(round.len());
            report.peak_bytes = report.peak_bytes.max(resident);
            let allocated = ctx.device.generate_allocator_report().map(|r| r.total_allocated_bytes);
            report.device_peak_bytes = report.device_peak_bytes.max(allocated);
            self.run_round(ctx, round, &mut accumulator, &mut report)?;
        }
        let started = Instant::now();
        accumulator.finish(&mut out[..call.queries * q_row]);
        report.merge_ms += ms(started);
        Ok(report)
    }

    /// Allocates `piece`'s buffers beside `resident` bytes and uploads its
    /// gathered Q, K, V and tables; refused past the budget or the device.
    fn place(
        &self,
        ctx: &GpuContext,
        call: &AttentionCall,
        piece: &Piece,
        resident: u64,
        report: &mut CqsReport,
    ) -> Result<Resident, Refusal> {
        let first_query = piece.first_query(call.pos0() as u32);
        let (queries, keys) = (piece.len() - first_query, piece.len());
        let bytes = working_bytes(queries, keys, call.n_head, call.n_kv_head, call.head_dim);
        if self.budget.is_some_and(|b| resident + bytes > b) {
            return Err(Refusal::Budget);
        }
        let shape = PieceShape {
            queries: queries as u32,
            keys: keys as u32,
            n_head: call.n_head as u32,
            n_kv_head: call.n_kv_head as u32,
            causal: call.mask.causal,
            window: call.mask.window.unwrap_or(0),
            scale: call.scale,
        };
        let kernel_limit =
            |e: super::KernelError| GpuError::Kernel { kernel: "attention partial".into(), reason: e.to_string() };
        let groups = self.kernel.groups(&shape).map_err(|e| Refusal::Device(kernel_limit(e)))?;
        let (q_row, kv_row) = (call.n_head * call.head_dim, call.n_kv_head * call.head_dim);
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let allocated = (|| -> Result<[wgpu::Buffer; 7], GpuError> {
            Ok([
                ctx.storage::<f16>("piece queries", queries * q_row)?,
                ctx.storage::<f16>("piece keys", keys * kv_row)?,
                ctx.storage::<f16>("piece values", keys * kv_row)?,
                ctx.storage::<f32>("piece outputs", queries * q_row)?,
                ctx.storage::<[u32; 2]>("piece tokens", queries + keys)?,
                ctx.storage::<Block>("piece blocks", queries.div_ceil(BLOCK) + keys.div_ceil(BLOCK))?,
                ctx.storage::<[f32; 2]>("piece statistics", queries * call.n_head)?,
            ])
        })();
        let out_of_memory = pollster::block_on(scope.pop());
        let buffers = allocated.map_err(Refusal::Device)?;
        if let Some(e) = out_of_memory {
            return Err(Refusal::Device(GpuError::Device { adapter: ctx.info.name.clone(), reason: e.to_string() }));
        }

        let started = Instant::now();
        let positions = &piece.positions;
        let gather = |src: &[f16], row: usize, tokens: &[u32], offset: usize| -> Vec<f16> {
            let mut out = vec![f16::ZERO; tokens.len() * row];
            out.par_chunks_mut(row).zip(tokens).for_each(|(o, &p)| {
                let at = (p as usize - offset) * row;
                o.copy_from_slice(&src[at..at + row]);
            });
            out
        };
        let q = gather(call.q, q_row, &positions[first_query..], call.pos0());
        let k = gather(call.k, kv_row, positions, 0);
        let v = gather(call.v, kv_row, positions, 0);
        let tokens: Vec<[u32; 2]> =
            (first_query..keys).chain(0..keys).map(|i| [positions[i], piece.groups[i]]).collect();
        let query_blocks = piece.blocks(first_query..keys);
        let key_blocks = piece.blocks(0..keys);
        for qb in &query_blocks {
            for kb in &key_blocks {
                report.tiles[match call.mask.classify(qb, kb) {
                    Verdict::Clear => 0,
                    Verdict::Masked => 1,
                    Verdict::Mixed => 2,
                }] += 1;
            }
        }
        let blocks: Vec<Block> = query_blocks.into_iter().chain(key_blocks).collect();
        report.gather_ms += ms(started);

        let started = Instant::now();
        ctx.write(&buffers[0], 0, &q);
        ctx.write(&buffers[1], 0, &k);
        ctx.write(&buffers[2], 0, &v);
        ctx.write(&buffers[4], 0, &tokens);
        ctx.write(&buffers[5], 0, &blocks);
        report.transfer_ms += ms(started);
        let rows = positions[first_query..].iter().map(|&p| p - call.pos0() as u32).collect();
        report.pieces += 1;
        report.depth = report.depth.max(piece.depth);
        Ok(Resident { buffers, shape, groups, rows, bytes })
    }

    /// Runs the pieces of one round, reads their results back and merges
    /// them; their buffers are freed after.
    fn run_round(
        &self,
        ctx: &GpuContext,
        round: Vec<Resident>,
        accumulator: &mut Accumulator,
        report: &mut CqsReport,
    ) -> Result<(), GpuError> {
        if round.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut batch = ctx.batch();
        batch.mark();
        for piece in &round {
            let [q, k, v, o, tokens, blocks, stats] = &piece.buffers;
            let bind = self.kernel.bind(&ctx.device, &[q, k, v, o, tokens, blocks, stats]);
            batch.record("attention partial", |pass| self.kernel.dispatch(pass, &bind, &piece.shape, piece.groups));
        }
        batch.mark();
        let gpu_ms = batch.submit_timed()?;
        let wall = ms(started);
        let compute = gpu_ms.map_or(wall, |t| t.iter().sum());
        report.compute_ms += compute;
        // Uploads go with the submission: what the kernels did not take.
        report.transfer_ms += (wall - compute).max(0.0);
        for piece in round {
            let (queries, n_head) = (piece.shape.queries as usize, piece.shape.n_head as usize);
            let started = Instant::now();
            let acc: Vec<f32> = ctx.read_once(&piece.buffers[3], 0, queries * n_head * self.head_dim)?;
            let stats: Vec<[f32; 2]> = ctx.read_once(&piece.buffers[6], 0, queries * n_head)?;
            report.transfer_ms += ms(started);
            let started = Instant::now();
            accumulator.merge(&piece.rows, &acc, &stats);
            report.merge_ms += ms(started);
        }
        Ok(())
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
