//! Exact attention: every visible key is read.
//!
//! The arithmetic follows ggml's non-flash attention path, whose results
//! llama.cpp's references were computed with: the query is rounded to f16 for
//! the q·k products (ggml multiplies an f16 cache with f16 operands), the
//! softmax is taken in f32 (normalized by multiplying with the reciprocal of
//! the sum, as ggml does), and the probabilities are rounded to f16 before
//! they weight the f16 values. Sums are in f32.
//!
//! The loops over keys and values are `simd`'s attention kernels, reached
//! through [`super::read`]; this module walks the cache and shares the work
//! among the threads. Exact rows go to
//! the kernels where they lie. The coded pages of the quantized cache modes
//! are read in place by a small batch (a decoding step): the kernels compute
//! each code's level in f32 as they load it, the cache's own reader's number.
//! A batch of [`STAGE_MIN`] tokens or more first dequantizes the coded pages
//! it reads once for all its queries, in parallel, rounded to f16 ([`Staged`]).
//! Splitting a head's rows into stretches changes no result: every score is
//! its own sum, and the weighted values accumulate row after row into the
//! output.
//!
//! The batch's own keys and values are read from the batch, rounded to f16 as
//! the cache stores them, not from the cache, which may already have coded
//! them: a prefill batch attends to itself at full precision, as KIVI's
//! prefill does, and only later batches and decoding steps see its codes.

use std::cell::RefCell;
use std::ops::Range;
use std::thread::LocalKey;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use simd::Kernels;

use super::read::{self, round_to_f16, with_affine, HeadRows, Stretch};
use super::{AttentionBatch, AttentionKind, AttentionPolicy, Certificate, HeadRecord, LayerCall};
use crate::kv::{PagedLayer, Rows, PAGE};

/// Visible positions from which one group's keys are split among the threads,
/// when the batch has too few groups to keep every thread busy (decoding).
const SPLIT_MIN: usize = 512;

/// The most consecutive tokens whose groups attend together in a batch
/// ([`attend_tile`]), reading each stretch of positions from memory once for
/// all of them.
const TILE_TOKENS: usize = 8;

/// Positions a tile reads at a time: their keys (or values) stay in the core's
/// caches while every group of the tile uses them.
const TILE_CHUNK: usize = 4 * PAGE;

/// Tokens from which a batch stages the coded pages it reads. Staging writes
/// every coded row as f16 and reads it back, so it pays only when several
/// queries share the rows; below this, each group reads the codes in place
/// (a decoding step's one token would read every staged row just once).
const STAGE_MIN: usize = 4;

/// The buffers of the thread that runs a group, kept across calls: its
/// queries rounded to f16, its scores (then probabilities) per query head, and
/// the weighted sums of each piece of the visible positions.
#[derive(Default)]
struct GroupScratch {
    queries: Vec<f32>,
    scores: Vec<f32>,
    halves: Vec<f16>,
    sums: Vec<f32>,
}

/// The coded pages a batch reads, dequantized once for all its groups and
/// rounded to f16: `[kv head][page][token][dim]` over whole pages from
/// `first_page`, of which the rows at `positions` are filled where the cache
/// holds them coded (it may keep some of these pages exact).
#[derive(Default)]
struct Staged {
    keys: Vec<f16>,
    values: Vec<f16>,
    first_page: usize,
    pages: usize,
    positions: Range<usize>,
}

// The buffers of a call that runs parallel loops are taken
// out of their thread's slot for the call, never borrowed across it: a thread
// waiting in a parallel loop may run another attention call meanwhile (work
// stealing; another session's, say), which then takes a fresh buffer instead
// of finding this one borrowed.
thread_local! {
    static GROUP: RefCell<GroupScratch> = RefCell::default();
    /// A tile's groups' buffers.
    static TILE: RefCell<Vec<GroupScratch>> = RefCell::default();
    static STAGED: RefCell<Staged> = RefCell::default();
    /// The batch's own keys and values.
    static OWN: RefCell<BatchRows> = RefCell::default();
}

/// Exact attention as a policy: every call dense, every head's certificate
/// zero.
#[derive(Debug, Default, Clone, Copy)]
pub struct Dense;

impl AttentionPolicy for Dense {
    fn kind(&self) -> AttentionKind {
        AttentionKind::Dense
    }

    fn reads_sketch(&self) -> bool {
        false
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        attend(call.batch, call.cache, out);
        record_dense(call, records);
    }
}

/// Appends a record of dense attention for every query head of `call`.
fn record_dense(call: &LayerCall, records: &mut Vec<HeadRecord>) {
    let batch = call.batch;
    let tokens = 0..batch.n_tokens();
    let visible: usize = tokens.clone().map(|t| call.visible(t).len()).sum();
    for kv_head in 0..batch.n_kv_head() {
        let rows = HeadRows::new(call, kv_head);
        let bytes: usize = tokens
            .clone()
            .map(|t| {
                let visible = [call.visible(t)];
                rows.key_bytes(&visible) + rows.value_bytes(&visible)
            })
            .sum();
        records.extend((0..batch.n_gqa).map(|g| HeadRecord {
            layer: call.layer,
            head: kv_head * batch.n_gqa + g,
            certificate: Certificate::DENSE,
            level: None,
            fallback: false,
            visible,
            keys_read: visible,
            bytes_read: bytes as f64 / batch.n_gqa as f64,
            estimate: None,
            audit: None,
        }));
    }
}

/// `out` gets `n_tokens` rows of `n_head * head_dim_v`: for every token and
/// head, softmax(score(q·K)) · V over the positions the cache shows it.
///
/// The work goes by *group*: one token's query heads that share a KV head,
/// which read each key and value once for all of them. A batch's groups run
/// in parallel by tiles of [`TILE_TOKENS`] consecutive tokens, whose groups of
/// one KV head read the positions together ([`attend_tile`]); when there are
/// fewer groups than threads and a group sees many positions (decoding),
/// each group's positions are split among the threads instead.
pub fn attend(batch: &AttentionBatch, cache: &PagedLayer, out: &mut [f32]) {
    let kernels = simd::kernels();
    with_taken(&OWN, |own| {
        own.fill(batch);
        attend_with(kernels, batch, cache, own, out);
    });
}

/// `f` of the calling thread's buffer in `slot`, taken out for the call.
fn with_taken<T: Default, R>(slot: &'static LocalKey<RefCell<T>>, f: impl FnOnce(&mut T) -> R) -> R {
    let mut buffer = slot.take();
    let result = f(&mut buffer);
    slot.set(buffer);
    result
}

/// [`attend`], with the batch's own rows taken in.
fn attend_with(kernels: &Kernels, batch: &AttentionBatch, cache: &PagedLayer, own: &BatchRows, out: &mut [f32]) {
    let n_kv_head = batch.n_head / batch.n_gqa;
    // The batch's first token sees the earliest positions of any.
    let (coded, first) = (cache.coded(), cache.visible(batch.pos0).start);
    let start = coded.start.max(first);
    let end = if own.n_tokens >= STAGE_MIN { coded.end.min(batch.pos0).max(start) } else { start };
    with_taken(&STAGED, |staged| {
        staged.fill(cache, batch, start..end);
        let staged = &*staged;
        let group = |i: usize| {
            let t = i / n_kv_head;
            Group {
                batch,
                cache,
                staged,
                own,
                kv_head: i % n_kv_head,
                queries: &batch.queries[i * batch.n_gqa * batch.head_dim_k..][..batch.n_gqa * batch.head_dim_k],
                visible: cache.visible(batch.pos0 + t),
            }
        };
        let group_len = batch.n_gqa * batch.head_dim_v;
        let n_groups = out.len() / group_len;
        let threads = rayon::current_num_threads();
        let longest = cache.visible(batch.pos0 + own.n_tokens - 1).len();
        if n_groups < threads && longest >= SPLIT_MIN {
            for (i, out) in out.chunks_mut(group_len).enumerate() {
                with_taken(&GROUP, |scratch| group(i).attend(kernels, scratch, out, 2 * threads));
            }
        } else {
            // Tiles enough for every thread; each KV head of a tile is a task of its own, so
            // that a decoding step's one token keeps every thread busy.
            let tile_tokens = TILE_TOKENS.min(own.n_tokens.div_ceil(threads)).max(1);
            let mut tasks: Vec<Vec<(usize, &mut [f32])>> = Vec::new();
            tasks.resize_with(own.n_tokens.div_ceil(tile_tokens) * n_kv_head, Vec::new);
            for (i, out) in out.chunks_mut(group_len).enumerate() {
                let (t, kv_head) = (i / n_kv_head, i % n_kv_head);
                tasks[t / tile_tokens * n_kv_head + kv_head].push((i, out));
            }
            tasks.into_par_iter().for_each(|members| {
                let groups: Vec<_> = members.into_iter().map(|(i, out)| (group(i), out)).collect();
                with_taken(&TILE, |scratch| attend_tile(kernels, groups, scratch));
            });
        }
    });
}

impl Staged {
    /// Dequantizes the rows at `positions` of every KV head's coded pages, a
    /// page per task.
    fn fill(&mut self, cache: &PagedLayer, batch: &AttentionBatch, positions: Range<usize>) {
        let (dim_k, dim_v) = (batch.head_dim_k, batch.head_dim_v);
        let n_kv_head = batch.n_head / batch.n_gqa;
        self.first_page = positions.start / PAGE;
        self.pages = if positions.is_empty() { 0 } else { positions.end.div_ceil(PAGE) - self.first_page };
        self.positions = positions.clone();
        let rows = n_kv_head * self.pages * PAGE;
        self.keys.resize(rows * dim_k, f16::ZERO);
        self.values.resize(rows * dim_v, f16::ZERO);
        let (first_page, pages) = (self.first_page, self.pages);
        let keys = self.keys.par_chunks_mut(PAGE * dim_k);
        keys.zip(self.values.par_chunks_mut(PAGE * dim_v)).enumerate().for_each(|(i, (keys, values))| {
            let (head, page) = (i / pages, first_page + i % pages);
            let rows =
                positions.start.max(page * PAGE) - page * PAGE..positions.end.min(page * PAGE + PAGE) - page * PAGE;
            let (Some(sketch), Some(coded)) = (cache.sketch(head, page), cache.coded_values(head, page)) else {
                return;
            };
            with_affine(|affine| {
                sketch.dequantize_keys(rows.clone(), &mut keys[rows.start * dim_k..rows.end * dim_k], affine);
                coded.dequantize_rows(rows.clone(), &mut values[rows.start * dim_v..rows.end * dim_v], affine);
            });
        });
    }

    /// The staged rows of `head` at `positions` (of a coded page), as
    /// `(keys, values)`, if the batch staged them.
    fn rows(&self, head: usize, positions: Range<usize>, dim_k: usize, dim_v: usize) -> Option<(&[f16], &[f16])> {
        let staged = self.positions.start <= positions.start && positions.end <= self.positions.end;
        (staged && !positions.is_empty()).then(|| {
            let row = |pos: usize| head * self.pages * PAGE + pos - self.first_page * PAGE;
            let rows = row(positions.start)..row(positions.end);
            (&self.keys[rows.start * dim_k..rows.end * dim_k], &self.values[rows.start * dim_v..rows.end * dim_v])
        })
    }
}

/// The batch's keys and values in f16, per KV head: `[head][token][dim]`,
/// so that a head's rows lie end to end.
#[derive(Default)]
struct BatchRows {
    keys: Vec<f16>,
    values: Vec<f16>,
    n_tokens: usize,
    dim_k: usize,
    dim_v: usize,
}

impl BatchRows {
    /// Takes in `batch`'s keys and values, reusing the buffers.
    fn fill(&mut self, batch: &AttentionBatch) {
        let n_tokens = batch.queries.len() / (batch.n_head * batch.head_dim_k);
        let n_kv_head = batch.n_head / batch.n_gqa;
        let by_head = |out: &mut Vec<f16>, rows: &[f32], dim: usize| {
            out.resize(n_tokens * n_kv_head * dim, f16::ZERO);
            for (t, row) in rows.chunks_exact(n_kv_head * dim).take(n_tokens).enumerate() {
                for (h, x) in row.chunks_exact(dim).enumerate() {
                    out[(h * n_tokens + t) * dim..][..dim].convert_from_f32_slice(x);
                }
            }
        };
        by_head(&mut self.keys, batch.keys, batch.head_dim_k);
        by_head(&mut self.values, batch.values, batch.head_dim_v);
        (self.n_tokens, self.dim_k, self.dim_v) = (n_tokens, batch.head_dim_k, batch.head_dim_v);
    }

    /// The keys and values of `tokens` (batch indices) for one KV head.
    fn head(&self, kv_head: usize, tokens: Range<usize>) -> (&[f16], &[f16]) {
        let rows = kv_head * self.n_tokens + tokens.start..kv_head * self.n_tokens + tokens.end;
        (
            &self.keys[rows.start * self.dim_k..rows.end * self.dim_k],
            &self.values[rows.start * self.dim_v..rows.end * self.dim_v],
        )
    }
}

/// One token's query heads that share a KV head, and where their keys and
/// values lie: in the cache before the batch, in the batch from `pos0` on.
struct Group<'a> {
    batch: &'a AttentionBatch<'a>,
    cache: &'a PagedLayer,
    staged: &'a Staged,
    own: &'a BatchRows,
    kv_head: usize,
    /// `n_gqa` rows of `head_dim_k`.
    queries: &'a [f32],
    visible: Range<usize>,
}

impl<'a> Group<'a> {
    /// `out = softmax(scale · q·K) · V` over the visible positions for each
    /// query head (`n_gqa` rows of `head_dim_v`), reading the positions in
    /// up to `pieces` stretches in parallel.
    ///
    /// Each score is its own sum and each piece's weighted sums add row
    /// after row, so one piece reproduces ggml's arithmetic; several add
    /// their sums at the end, in order.
    fn attend(&self, kernels: &Kernels, s: &mut GroupScratch, out: &mut [f32], pieces: usize) {
        let (heads, n) = (self.batch.n_gqa, self.visible.len());
        let piece_len = n.div_ceil(pieces).next_multiple_of(PAGE);
        let piece = |p: usize| {
            let start = self.visible.start + p * piece_len;
            start..self.visible.end.min(start + piece_len)
        };
        s.queries.clear();
        s.queries.extend_from_slice(self.queries);
        round_to_f16(&mut s.queries, &mut s.halves);
        let queries = &s.queries[..];

        // Each piece's scores lie together: `[head][position in the piece]`.
        s.scores.resize(heads * n, 0.0);
        s.scores.par_chunks_mut(heads * piece_len).enumerate().for_each(|(p, scores)| {
            self.score(kernels, queries, piece(p), scores);
        });
        self.softmax(kernels, s, piece_len);

        let dim_v = self.batch.head_dim_v;
        s.sums.resize(n.div_ceil(piece_len) * heads * dim_v, 0.0);
        let probs = &s.scores[..];
        s.sums.par_chunks_mut(heads * dim_v).enumerate().for_each(|(p, sums)| {
            let probs = &probs[p * heads * piece_len..][..heads * piece(p).len()];
            self.weigh(kernels, probs, piece(p), sums);
        });
        let mut sums = s.sums.chunks_exact(heads * dim_v);
        out.copy_from_slice(sums.next().expect("at least one piece"));
        for sums in sums {
            out.iter_mut().zip(sums).for_each(|(o, x)| *o += x);
        }
    }

    /// `scores[h][j]`, the score of `q_h·k_j` ([`super::Scorer`]), for the
    /// keys at `positions`.
    fn score(&self, kernels: &Kernels, queries: &[f32], positions: Range<usize>, scores: &mut [f32]) {
        let n = positions.len();
        self.dots(kernels, queries, positions, scores, n);
        self.batch.scorer.score_all(scores);
    }

    /// `dots[h · stride + j] = q_h·k_j` for the keys at `positions`.
    fn dots(&self, kernels: &Kernels, queries: &[f32], positions: Range<usize>, dots: &mut [f32], stride: usize) {
        let dim = self.batch.head_dim_k;
        let keys = self.stretches(positions, dim, |p| p.0, PagedLayer::key_rows);
        read::score(kernels, dim, queries, keys, dots, stride);
    }

    /// Turns each head's scores into probabilities rounded to f16 (as ggml
    /// does), over the pieces of `piece_len` positions they lie in.
    fn softmax(&self, kernels: &Kernels, s: &mut GroupScratch, piece_len: usize) {
        let (heads, n) = (self.batch.n_gqa, self.visible.len());
        for h in 0..heads {
            let max =
                head_rows(&mut s.scores, heads, piece_len, h).map(|row| max_of(row)).fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = head_rows(&mut s.scores, heads, piece_len, h).map(|row| kernels.softmax_exp(row, max)).sum();
            let inv_sum = 1.0 / sum;
            for row in head_rows(&mut s.scores, heads, piece_len, h) {
                row.iter_mut().for_each(|x| *x *= inv_sum);
            }
        }
        debug_assert_eq!(s.scores.len(), heads * n);
        round_to_f16(&mut s.scores, &mut s.halves);
    }

    /// `sums[h] = Σ_j probs[h][j] · v_j` over the values at `positions`.
    fn weigh(&self, kernels: &Kernels, probs: &[f32], positions: Range<usize>, sums: &mut [f32]) {
        let n = positions.len();
        sums.fill(0.0);
        self.add_weighted(kernels, probs, n, positions, sums);
    }

    /// `sums[h] += Σ_j probs[h · stride + j] · v_j` over the values at
    /// `positions`, row after row.
    fn add_weighted(&self, kernels: &Kernels, probs: &[f32], stride: usize, positions: Range<usize>, sums: &mut [f32]) {
        let dim = self.batch.head_dim_v;
        let values = self.stretches(positions, dim, |p| p.1, PagedLayer::value_rows);
        read::weigh(kernels, dim, probs, stride, values, sums);
    }

    /// The key (or value) rows at `positions` in order, as stretches: the
    /// cache's, coded pages taken from the staging buffer where the batch
    /// staged them, then the batch's own. `dim` is a row's length, `pick`
    /// takes keys or values from a pair, `cached` is the cache's reader.
    fn stretches<C, I>(
        &self,
        positions: Range<usize>,
        dim: usize,
        pick: impl Fn((&'a [f16], &'a [f16])) -> &'a [f16],
        cached: impl FnOnce(&'a PagedLayer, usize, Range<usize>) -> I,
    ) -> impl Iterator<Item = Stretch<'a, C>>
    where
        C: 'a,
        I: Iterator<Item = Rows<'a, C>>,
    {
        let pos0 = self.batch.pos0;
        let clamp = |lo: usize, hi: usize| positions.start.clamp(lo, hi)..positions.end.clamp(lo, hi);
        let (dim_k, dim_v) = (self.batch.head_dim_k, self.batch.head_dim_v);
        let own = clamp(pos0, usize::MAX);
        let own = Stretch::Halves(pick(self.own.head(self.kv_head, own.start - pos0..own.end - pos0)));
        let (staged, head, before) = (self.staged, self.kv_head, clamp(0, pos0));
        let mut next = before.start;
        let cached = cached(self.cache, head, before).map(move |rows| match rows {
            Rows::Exact(rows) => {
                next += rows.len() / dim;
                Stretch::Halves(rows)
            }
            Rows::Coded(coded, rows) => {
                let at = next..next + rows.len();
                next = at.end;
                match staged.rows(head, at, dim_k, dim_v) {
                    Some(pair) => Stretch::Halves(pick(pair)),
                    None => Stretch::Coded(coded, rows),
                }
            }
        });
        cached.chain(std::iter::once(own))
    }
}

/// The groups of one KV head for consecutive tokens of a batch, each with
/// its output (`n_gqa` rows of `head_dim_v`), attending as
/// [`Group::attend`] does in one piece, to the bit, but reading the
/// positions [`TILE_CHUNK`] at a time for every group that sees them: the
/// scores of each group's whole row first (each score its own sum), then
/// each row's softmax, then the weighted values chunk after chunk, which
/// adds every group's rows in position order. A batch's tokens see nearly
/// the same positions, so a chunk's keys and values come from memory once
/// per tile instead of once per token.
fn attend_tile(kernels: &Kernels, mut groups: Vec<(Group, &mut [f32])>, scratch: &mut Vec<GroupScratch>) {
    if scratch.len() < groups.len() {
        scratch.resize_with(groups.len(), GroupScratch::default);
    }
    let (Some(start), Some(end)) =
        (groups.iter().map(|(g, _)| g.visible.start).min(), groups.iter().map(|(g, _)| g.visible.end).max())
    else {
        return;
    };
    let chunks = || (start..end).step_by(TILE_CHUNK).map(move |c| c..end.min(c + TILE_CHUNK));
    // The part of `chunk` that `group` sees, and where it lies in the group's row.
    let within = |group: &Group, chunk: &Range<usize>| {
        let seen = chunk.start.max(group.visible.start)..chunk.end.min(group.visible.end);
        (!seen.is_empty()).then(|| (seen.start - group.visible.start, seen))
    };
    for ((group, _), s) in groups.iter().zip(scratch.iter_mut()) {
        s.queries.clear();
        s.queries.extend_from_slice(group.queries);
        round_to_f16(&mut s.queries, &mut s.halves);
        s.scores.resize(group.batch.n_gqa * group.visible.len(), 0.0);
    }
    for chunk in chunks() {
        for ((group, _), s) in groups.iter().zip(scratch.iter_mut()) {
            if let Some((col, seen)) = within(group, &chunk) {
                group.dots(kernels, &s.queries, seen, &mut s.scores[col..], group.visible.len());
            }
        }
    }
    for ((group, out), s) in groups.iter_mut().zip(scratch.iter_mut()) {
        group.batch.scorer.score_all(&mut s.scores);
        group.softmax(kernels, s, group.visible.len());
        out.fill(0.0);
    }
    for chunk in chunks() {
        for ((group, out), s) in groups.iter_mut().zip(scratch.iter()) {
            if let Some((col, seen)) = within(group, &chunk) {
                group.add_weighted(kernels, &s.scores[col..], group.visible.len(), seen, out);
            }
        }
    }
}

/// The largest of `x` (−∞ for none), sixteen lanes at a time: a fold of one
/// accumulator would wait on each comparison in turn.
fn max_of(x: &[f32]) -> f32 {
    let (chunks, rest) = x.as_chunks::<16>();
    let mut lanes = [f32::NEG_INFINITY; 16];
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = m.max(x);
        }
    }
    lanes.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// The stretch of head `h`'s scores in each piece of `piece_len` positions.
fn head_rows(scores: &mut [f32], heads: usize, piece_len: usize, h: usize) -> impl Iterator<Item = &mut [f32]> {
    scores.chunks_mut(heads * piece_len).map(move |piece| {
        let len = piece.len() / heads;
        &mut piece[h * len..][..len]
    })
}
