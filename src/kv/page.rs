//! One layer's keys and values in pages of [`PAGE`] tokens, in any of the
//! cache modes.
//!
//! Per KV head, the newest pages are *exact*: f16 rows, as appended. In the
//! f16 mode every page stays exact and, for an attention policy that scans
//! sketches ([`Storage::key_sketch`]), each full one also gets a
//! [`KeySketch`] beside it. In the quantized modes only the newest
//! `residual / PAGE` pages stay exact (so between `residual - PAGE + 1` and
//! `residual` of the newest tokens, as KIVI's residual); when a new page
//! needs their room, the oldest becomes *coded*: its keys per channel over
//! the page (a sketch whose codes are the keys) and its values per token in
//! groups of 32. The first [`SINK`] tokens stay exact all the same, kept
//! aside when page 0 is coded: attention sinks draw much of every head's
//! attention, and the first token's outlying key would otherwise set the
//! per-channel ranges of its whole page (at 2 bits, keeping them cuts the
//! perplexity loss on PG-19 from 15–18% to 4–5%). Exact and coded pages are
//! rings of slots allocated up front: a global layer has room for the whole
//! context, a sliding-window layer for the pages its window and one batch
//! can touch.
//!
//! Keys are stored after RoPE, rotated for the positions they were appended
//! at. The newest positions can be stored again ([`PagedLayer::truncate`],
//! then [`PagedLayer::store`]) as long as they are exact, which a dense
//! rectification of sparsely decoded tokens does ([`crate::rectify`]); a
//! coded page is never re-coded, since its other tokens' exact rows are gone
//! and coding their codes again would round them twice. A later context shift (dropping old tokens and
//! renumbering the rest) would not re-rotate them, which would requantize
//! coded pages: it would record per page how far its tokens were renumbered
//! and rotate the *query* back by that much when scoring the page's keys.
//! Sketch bounds hold for whatever query they are given, so they survive.
//!
//! # What a sparse policy reads
//!
//! [`PagedLayer::key_cover`] splits positions into keys a sketch bounds and
//! keys to read exactly (the sinks, whose rows in page 0's sketch are
//! placeholders, and the pages that have no sketch yet), and
//! [`PagedLayer::value_norm`] bounds the norm of every value a page returns,
//! kept as the values are stored.

use std::fmt;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::str::FromStr;

use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use super::quant::{norm_bound, Bits, ValueRows};
use super::sketch::{KeySketch, PageKeys, PAGE};
use super::CacheShape;

/// Newest tokens the quantized modes keep exact, by default.
pub const RESIDUAL: usize = 128;

/// First tokens the quantized modes keep exact, by default: the attention
/// sinks. The first token takes much of every head's attention, and its
/// outlying key would widen the per-channel ranges of its whole page.
pub const SINK: usize = 4;

/// How the cache stores keys and values (`--kv-cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvMode {
    /// Exact f16 keys and values, plus the key sketch.
    #[default]
    F16,
    Q8,
    Q4,
    Q2,
}

impl KvMode {
    pub const ALL: [KvMode; 4] = [KvMode::F16, KvMode::Q8, KvMode::Q4, KvMode::Q2];

    /// The width of coded keys and values; none in the f16 mode.
    pub fn bits(self) -> Option<Bits> {
        match self {
            KvMode::F16 => None,
            KvMode::Q8 => Some(Bits::Eight),
            KvMode::Q4 => Some(Bits::Four),
            KvMode::Q2 => Some(Bits::Two),
        }
    }

    fn page_keys(self) -> PageKeys {
        self.bits().map_or(PageKeys::Exact, PageKeys::Coded)
    }
}

impl fmt::Display for KvMode {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            KvMode::F16 => "f16",
            KvMode::Q8 => "q8",
            KvMode::Q4 => "q4",
            KvMode::Q2 => "q2",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown KV cache mode '{0}' (expected f16, q8, q4 or q2)")]
pub struct UnknownKvMode(String);

impl FromStr for KvMode {
    type Err = UnknownKvMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvMode::ALL.into_iter().find(|m| m.to_string() == s).ok_or_else(|| UnknownKvMode(s.to_string()))
    }
}

/// How a cache stores its tokens.
#[derive(Clone, Copy, Debug)]
pub struct Storage {
    pub mode: KvMode,
    /// The most recent tokens the quantized modes keep exact: a multiple of
    /// [`PAGE`], at least one page.
    pub residual: usize,
    /// The first tokens the quantized modes keep exact: fewer than
    /// [`PAGE`].
    pub sink: usize,
    /// Whether the f16 mode sketches every full page's keys, for an
    /// attention policy that scans them (the sketch is a quarter of the
    /// page's bytes again). The quantized modes' coded keys are their own
    /// sketch, kept in any case.
    pub key_sketch: bool,
}

impl Default for Storage {
    fn default() -> Self {
        Self { mode: KvMode::F16, residual: RESIDUAL, sink: SINK, key_sketch: false }
    }
}

/// A mode's storage with the other settings at their defaults.
impl From<KvMode> for Storage {
    fn from(mode: KvMode) -> Self {
        Self { mode, ..Self::default() }
    }
}

impl Storage {
    /// Whether the cache keeps a sketch of its keys: the quantized modes
    /// always (their codes), the f16 mode when asked.
    pub fn sketches(&self) -> bool {
        self.mode != KvMode::F16 || self.key_sketch
    }
}

/// Every buffer of `layer` that holds pages once pages before `first_exact` are coded and
/// positions `0..len` stored, as bytes, in the order of a cache file: exact keys and values,
/// the sink, the value norms, the sketches, the coded values. One list for writing (`[]`,
/// shared slices) and reading (`[mut]`).
macro_rules! buffers_in_use {
    ($layer:ident, $first_exact:expr, $len:expr, [$($m:tt)?], $cast:ident, $in_use:ident, $state:ident) => {{
        let [exact, coded, sketched] = $layer.slots_in_use($first_exact, $len);
        let (n, slots) = ($layer.n_kv_head, $layer.slots());
        let rows = [&$($m)? $layer.exact_k, &$($m)? $layer.exact_v].map(|v| bytemuck::$cast(v));
        let rows = rows.into_iter().flat_map(move |rows| $in_use(rows, n, slots[0], exact));
        let sink = [&$($m)? $layer.sink_k, &$($m)? $layer.sink_v].map(|v| bytemuck::$cast(v));
        let norms = [(&$($m)? $layer.exact_norms, slots[0], exact), (&$($m)? $layer.coded_norms, slots[1], coded)];
        let norms =
            norms.into_iter().flat_map(move |(norms, all, used)| $in_use(bytemuck::$cast(norms), n, all, used));
        let sketches = $in_use(&$($m)? $layer.sketches, n, slots[2], sketched).flatten().flat_map(KeySketch::$state);
        let values = $in_use(&$($m)? $layer.values, n, slots[1], coded).flatten().flat_map(ValueRows::$state);
        rows.chain(sink).chain(norms).chain(sketches).chain(values)
    }};
}

#[derive(Clone)]
pub struct PagedLayer {
    mode: KvMode,
    n_kv_head: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    window: Option<usize>,
    /// Ring sizes, in pages.
    exact_slots: usize,
    coded_slots: usize,
    /// `[head][exact slot][token][dim]`.
    exact_k: Vec<f16>,
    exact_v: Vec<f16>,
    /// The first tokens, kept exact once their page is coded:
    /// `[head][token][dim]`; none in the f16 mode.
    sink: usize,
    sink_k: Vec<f16>,
    sink_v: Vec<f16>,
    /// `[head][slot]`: in the f16 mode one per exact slot (none without
    /// [`Storage::key_sketch`]), else one per coded slot (there, the keys
    /// themselves).
    sketches: Vec<KeySketch>,
    /// `[head][coded slot]`; empty in the f16 mode.
    values: Vec<ValueRows>,
    /// Bounds on the norms of the values of each page, as the cache returns
    /// them: `[head][exact slot]` and `[head][coded slot]`.
    exact_norms: Vec<f32>,
    coded_norms: Vec<f32>,
    /// Pages before this one have left the exact slots; the last
    /// `coded_slots` of them are coded, in slot `page % coded_slots`. The
    /// exact ones, up to the one holding position `len - 1`, are in slot
    /// `page % exact_slots`.
    first_exact: usize,
    /// Positions stored: `0..len`.
    len: usize,
}

impl PagedLayer {
    /// A layer of `shape` with an optional sliding `window`, for contexts of
    /// `n_ctx` tokens appended at most `max_batch` at a time.
    pub fn new(storage: Storage, shape: &CacheShape, window: Option<usize>, n_ctx: usize, max_batch: usize) -> Self {
        let Storage { mode, residual, sink, .. } = storage;
        assert!(residual >= PAGE && residual.is_multiple_of(PAGE), "the residual window is whole pages");
        assert!(sink < PAGE, "the sink lies within the first page");
        let all = n_ctx.div_ceil(PAGE);
        // A window and a batch span fewer than `w + max_batch` positions,
        // which touch at most one page more than they fill.
        let pages = window.map_or(all, |w| all.min((w + max_batch).div_ceil(PAGE) + 1));
        let exact_slots = if mode == KvMode::F16 { pages } else { (residual / PAGE).min(pages) };
        let coded_slots = pages - exact_slots;
        let sketch_slots = match mode {
            KvMode::F16 if storage.key_sketch => exact_slots,
            KvMode::F16 => 0,
            _ => coded_slots,
        };
        let n = shape.n_kv_head;
        let sketches = (0..n * sketch_slots).map(|_| KeySketch::new(shape.head_dim_k, mode.page_keys())).collect();
        let sink = if coded_slots == 0 { 0 } else { sink };
        let values = match mode.bits() {
            Some(bits) => (0..n * coded_slots).map(|_| ValueRows::new(PAGE, shape.head_dim_v, bits)).collect(),
            None => Vec::new(),
        };
        Self {
            mode,
            n_kv_head: n,
            head_dim_k: shape.head_dim_k,
            head_dim_v: shape.head_dim_v,
            window,
            exact_slots,
            coded_slots,
            exact_k: zeroed_halves(n * exact_slots * PAGE * shape.head_dim_k),
            exact_v: zeroed_halves(n * exact_slots * PAGE * shape.head_dim_v),
            sink,
            sink_k: zeroed_halves(n * sink * shape.head_dim_k),
            sink_v: zeroed_halves(n * sink * shape.head_dim_v),
            sketches,
            values,
            exact_norms: vec![0.0; n * exact_slots],
            coded_norms: vec![0.0; n * coded_slots],
            first_exact: 0,
            len: 0,
        }
    }

    pub fn mode(&self) -> KvMode {
        self.mode
    }

    /// Writes the layer's state: its two counters, then, as bytes, every buffer's slots that
    /// hold pages (a short prompt in a long context writes a short file).
    pub(crate) fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        for counter in [self.first_exact, self.len] {
            w.write_all(&(counter as u64).to_le_bytes())?;
        }
        let (first_exact, len) = (self.first_exact, self.len);
        buffers_in_use!(self, first_exact, len, [], cast_slice, in_use, state).try_for_each(|bytes| w.write_all(bytes))
    }

    /// Reads what [`Self::write_to`] wrote into a layer built alike, which then holds positions
    /// `0..len`: counters that say otherwise are an error, and so is a short read.
    pub(crate) fn read_from(&mut self, r: &mut impl Read, len: usize) -> io::Result<()> {
        let mut counter = || -> io::Result<usize> {
            let mut bytes = [0; 8];
            r.read_exact(&mut bytes)?;
            Ok(u64::from_le_bytes(bytes) as usize)
        };
        let (first_exact, stored) = (counter()?, counter()?);
        if stored != len || first_exact > len.div_ceil(PAGE) {
            let message = format!("a layer holds {stored} positions from page {first_exact}, not {len}");
            return Err(io::Error::new(io::ErrorKind::InvalidData, message));
        }
        buffers_in_use!(self, first_exact, len, [mut], cast_slice_mut, in_use_mut, state_mut)
            .try_for_each(|bytes| r.read_exact(bytes))?;
        (self.first_exact, self.len) = (first_exact, len);
        Ok(())
    }

    /// Of each head's exact slots, coded slots and sketches, how many hold pages when pages
    /// before `first_exact` have been coded and positions `0..len` stored: a ring that has
    /// wrapped uses all its slots, one that has not the first ones (page `p` sits in slot
    /// `p % slots`).
    fn slots_in_use(&self, first_exact: usize, len: usize) -> [usize; 3] {
        let exact = self.exact_slots.min(len.div_ceil(PAGE));
        let coded = self.coded_slots.min(first_exact);
        let sketches = if self.mode == KvMode::F16 { exact } else { coded };
        [exact, coded, sketches.min(self.slots()[2])]
    }

    /// Each head's exact slots, coded slots and sketches.
    fn slots(&self) -> [usize; 3] {
        [self.exact_slots, self.coded_slots, self.sketches.len() / self.n_kv_head.max(1)]
    }

    /// Stores one token's keys and values (all KV heads, concatenated).
    /// Positions come in order; storing an earlier one forgets it and all
    /// after it, which is possible back to position 0 or within the exact
    /// pages.
    pub fn store(&mut self, pos: usize, keys: &[f32], values: &[f32]) {
        assert!(pos <= self.len, "position {pos} stored before position {}", self.len);
        if pos < self.len {
            self.rewind(pos);
        }
        let (page, t) = (pos / PAGE, pos % PAGE);
        if t == 0 {
            self.open(page);
        }
        let slot = page % self.exact_slots;
        let (dk, dv) = (self.head_dim_k, self.head_dim_v);
        for h in 0..self.n_kv_head {
            let row = (h * self.exact_slots + slot) * PAGE + t;
            self.exact_k[row * dk..][..dk].convert_from_f32_slice(&keys[h * dk..][..dk]);
            let value = &mut self.exact_v[row * dv..][..dv];
            value.convert_from_f32_slice(&values[h * dv..][..dv]);
            let norm = &mut self.exact_norms[h * self.exact_slots + slot];
            *norm = if t == 0 { 0.0 } else { *norm }.max(norm_bound(value.iter().map(|x| x.to_f64())));
        }
        self.len = pos + 1;
        if self.mode == KvMode::F16 && !self.sketches.is_empty() && t == PAGE - 1 {
            for h in 0..self.n_kv_head {
                let keys = page_rows(&self.exact_k, self.exact_slots, h, slot, dk);
                self.sketches[h * self.exact_slots + slot].fill(keys);
            }
        }
    }

    /// The stored positions the layer still holds: all of them but those a
    /// sliding window's ring has let go.
    pub fn held(&self) -> Range<usize> {
        (self.first_exact.saturating_sub(self.coded_slots) * PAGE).min(self.len)..self.len
    }

    /// The stored positions that can be stored again: those of the exact
    /// pages (all of them in the f16 mode of a global layer; a sliding
    /// window's ring and the quantized modes' residual hold the newest).
    pub fn rewritable(&self) -> Range<usize> {
        (self.first_exact * PAGE).min(self.len)..self.len
    }

    /// Forgets positions from `len` on, so that they can be stored anew:
    /// the pages, sketches and value norms then hold what a cache that never
    /// saw them would. Truncating to 0 empties the layer.
    pub fn truncate(&mut self, len: usize) -> Result<(), Settled> {
        self.check_truncate(len)?;
        if len < self.len {
            self.rewind(len);
        }
        Ok(())
    }

    /// Whether [`Self::truncate`] to `len` would succeed.
    pub fn check_truncate(&self, len: usize) -> Result<(), Settled> {
        let first = self.rewritable().start;
        match len > 0 && len < first {
            true => Err(Settled { pos: len, first }),
            false => Ok(()),
        }
    }

    /// The first tokens kept exact when page 0 is coded (none in the f16
    /// mode): in the sketch of page 0 their rows are copies of the next key,
    /// and [`Self::key_rows`] gives them from the sink instead.
    pub fn sink(&self) -> usize {
        self.sink
    }

    /// The positions a query at `pos` attends to: causal, and within the
    /// window on sliding layers.
    pub fn visible(&self, pos: usize) -> Range<usize> {
        let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        first..pos + 1
    }

    /// The key of `head` at `pos`, as attention must read it.
    pub fn key(&self, head: usize, pos: usize, out: &mut [f32]) {
        match self.key_rows(head, pos..pos + 1).next() {
            Some(Rows::Exact(row)) => row.convert_to_f32_slice(&mut out[..self.head_dim_k]),
            Some(Rows::Coded(sketch, rows)) => sketch.dequantize_key(rows.start, out),
            None => unreachable!("one position makes one stretch"),
        }
    }

    /// The value of `head` at `pos`, as attention must read it.
    pub fn value(&self, head: usize, pos: usize, out: &mut [f32]) {
        match self.value_rows(head, pos..pos + 1).next() {
            Some(Rows::Exact(row)) => row.convert_to_f32_slice(&mut out[..self.head_dim_v]),
            Some(Rows::Coded(values, rows)) => values.dequantize(rows.start, out),
            None => unreachable!("one position makes one stretch"),
        }
    }

    /// `head`'s keys at `positions`, in order, as stretches of exact rows
    /// lying end to end and rows of coded pages.
    pub fn key_rows(&self, head: usize, positions: Range<usize>) -> impl Iterator<Item = Rows<'_, KeySketch>> {
        self.rows(head, positions, [&self.exact_k, &self.sink_k], self.head_dim_k, &self.sketches)
    }

    /// `head`'s values at `positions`, as [`Self::key_rows`] gives the keys.
    pub fn value_rows(&self, head: usize, positions: Range<usize>) -> impl Iterator<Item = Rows<'_, ValueRows>> {
        self.rows(head, positions, [&self.exact_v, &self.sink_v], self.head_dim_v, &self.values)
    }

    /// Consecutive exact pages in consecutive slots make one stretch; a ring
    /// that wraps, or a coded page, starts another. `exact` is the ring's
    /// rows and the sink's, which stand in for the first rows of the coded
    /// page 0.
    fn rows<'a, C>(
        &'a self,
        head: usize,
        positions: Range<usize>,
        [exact, sink]: [&'a [f16]; 2],
        dim: usize,
        coded: &'a [C],
    ) -> impl Iterator<Item = Rows<'a, C>> {
        assert!(positions.end <= self.len, "position {} has not been stored", positions.end - 1);
        let mut next = positions.start;
        std::iter::from_fn(move || {
            if next >= positions.end {
                return None;
            }
            let (page, t) = (next / PAGE, next % PAGE);
            if next < self.sink && self.is_coded(0) {
                let end = positions.end.min(self.sink);
                let run = &sink[(head * self.sink + next) * dim..(head * self.sink + end) * dim];
                next = end;
                return Some(Rows::Exact(run));
            }
            if page < self.first_exact {
                let rows = t..PAGE.min(positions.end - page * PAGE);
                next = page * PAGE + rows.end;
                return Some(Rows::Coded(&coded[head * self.coded_slots + self.coded_slot(page)], rows));
            }
            let slot = page % self.exact_slots;
            let end = positions.end.min((page - slot + self.exact_slots) * PAGE);
            let ring = &exact[head * self.exact_slots * PAGE * dim..][..self.exact_slots * PAGE * dim];
            let start = slot * PAGE + t;
            let run = &ring[start * dim..(start + end - next) * dim];
            next = end;
            Some(Rows::Exact(run))
        })
    }

    /// The sketch of `head`'s keys in `page`, once it has one: in the f16
    /// mode every full page (given [`Storage::key_sketch`]), in the others
    /// every coded page. In coded page 0, the rows of the first
    /// [`Self::sink`] keys hold placeholders: [`Self::key_cover`] says which
    /// rows a sketch bounds.
    pub fn sketch(&self, head: usize, page: usize) -> Option<&KeySketch> {
        if self.mode == KvMode::F16 {
            let full = !self.sketches.is_empty() && page >= self.first_exact && (page + 1) * PAGE <= self.len;
            full.then(|| &self.sketches[head * self.exact_slots + page % self.exact_slots])
        } else {
            self.is_coded(page).then(|| &self.sketches[head * self.coded_slots + page % self.coded_slots])
        }
    }

    /// The bytes the layer allocated: exact rows, codes, minima and steps,
    /// sketches (all but a few counters).
    pub fn bytes(&self) -> usize {
        [&self.exact_k, &self.exact_v, &self.sink_k, &self.sink_v].map(|x| x.len()).iter().sum::<usize>()
            * std::mem::size_of::<f16>()
            + self.sketches.iter().map(KeySketch::bytes).sum::<usize>()
            + self.values.iter().map(ValueRows::bytes).sum::<usize>()
    }

    /// `head`'s keys at `positions`, in order, as a sparse policy reads
    /// them: runs of keys whose scores a page's sketch bounds (scan them,
    /// then read the candidates), and runs it must read exactly through
    /// [`Self::key_rows`] — the sinks of a coded page 0 (their rows in its
    /// sketch are placeholders), and the pages without a sketch (the
    /// newest, and in the f16 mode every page unless the storage keeps
    /// sketches). Exact runs never lie side by side.
    pub fn key_cover(&self, head: usize, positions: Range<usize>) -> impl Iterator<Item = KeyCover<'_>> {
        assert!(positions.end <= self.len, "position {} has not been stored", positions.end - 1);
        let mut next = positions.start;
        std::iter::from_fn(move || {
            let start = next;
            if start >= positions.end {
                return None;
            }
            let page = start / PAGE;
            if let Some(sketch) = self.bounding_sketch(head, start) {
                next = positions.end.min((page + 1) * PAGE);
                return Some(KeyCover::Sketched { page, sketch, rows: start - page * PAGE..next - page * PAGE });
            }
            while next < positions.end && self.bounding_sketch(head, next).is_none() {
                // The rest of the page is unbounded too, but for the sinks.
                next = if next < self.sink && self.is_coded(0) { self.sink } else { (next / PAGE + 1) * PAGE };
                next = next.min(positions.end);
            }
            Some(KeyCover::Exact(start..next))
        })
    }

    /// The sketch whose bounds hold for the key of `head` at `pos`, if any.
    fn bounding_sketch(&self, head: usize, pos: usize) -> Option<&KeySketch> {
        let placeholder = pos < self.sink && self.is_coded(0);
        self.sketch(head, pos / PAGE).filter(|_| !placeholder)
    }

    /// At least the norm of every value of `head` that `page` holds, as
    /// [`Self::value`] and [`Self::value_rows`] return it (coded values in
    /// f32 and rounded to f16, the sinks exact): kept as values are stored,
    /// for bounds such as certified attention's `‖v‖ ≤ V_max`. A page part
    /// stored counts the values stored so far.
    ///
    /// # Panics
    /// If `page` holds no stored position or has left the cache.
    pub fn value_norm(&self, head: usize, page: usize) -> f32 {
        assert!(page * PAGE < self.len, "page {page} holds no stored position");
        if page >= self.first_exact {
            self.exact_norms[head * self.exact_slots + page % self.exact_slots]
        } else {
            self.coded_norms[head * self.coded_slots + self.coded_slot(page)]
        }
    }

    /// The bytes of one full page of one head once it has left the residual
    /// window: exact rows (and their sketch, if kept) in the f16 mode, codes
    /// otherwise.
    pub fn page_bytes(storage: Storage, shape: &CacheShape) -> usize {
        let mode = storage.mode;
        let sketch = if storage.sketches() { KeySketch::new(shape.head_dim_k, mode.page_keys()).bytes() } else { 0 };
        match mode.bits() {
            None => sketch + PAGE * (shape.head_dim_k + shape.head_dim_v) * std::mem::size_of::<f16>(),
            Some(bits) => sketch + ValueRows::new(PAGE, shape.head_dim_v, bits).bytes(),
        }
    }

    /// The positions held as codes, oldest first (none in the f16 mode).
    pub fn coded(&self) -> Range<usize> {
        if self.mode == KvMode::F16 {
            return 0..0;
        }
        self.first_exact.saturating_sub(self.coded_slots) * PAGE..self.first_exact * PAGE
    }

    /// The values of `head` in `page`, once it is coded.
    pub fn coded_values(&self, head: usize, page: usize) -> Option<&ValueRows> {
        (self.mode != KvMode::F16 && self.is_coded(page))
            .then(|| &self.values[head * self.coded_slots + page % self.coded_slots])
    }

    /// Forgets positions from `pos` on.
    fn rewind(&mut self, pos: usize) {
        if pos == 0 {
            self.first_exact = 0;
        } else {
            assert!(pos / PAGE >= self.first_exact, "position {pos} is quantized and cannot be rewritten");
        }
        self.len = pos;
        // The norms of the page left part stored count only what it keeps.
        let (page, t) = (pos / PAGE, pos % PAGE);
        let (slot, dv) = (page % self.exact_slots, self.head_dim_v);
        for h in 0..self.n_kv_head {
            let kept = &page_rows(&self.exact_v, self.exact_slots, h, slot, dv)[..t * dv];
            self.exact_norms[h * self.exact_slots + slot] =
                kept.chunks_exact(dv).map(|v| norm_bound(v.iter().map(|x| x.to_f64()))).fold(0.0, f32::max);
        }
    }

    /// Makes room for `page` among the exact pages, coding or dropping the
    /// oldest.
    fn open(&mut self, page: usize) {
        while page >= self.first_exact + self.exact_slots {
            self.retire(self.first_exact);
            self.first_exact += 1;
        }
    }

    /// Codes `page` as it leaves the exact slots: the f16 mode, and a
    /// window too short to need coded pages, simply let it go. Page 0 first
    /// gives its sink tokens to the sink, and its keys are coded with copies
    /// of the first other key in their place, so that the sink's outlying
    /// keys do not widen the page's per-channel ranges.
    fn retire(&mut self, page: usize) {
        if self.mode == KvMode::F16 || self.coded_slots == 0 {
            return;
        }
        let (exact, coded) = (page % self.exact_slots, page % self.coded_slots);
        let (dk, dv) = (self.head_dim_k, self.head_dim_v);
        let sink = if page == 0 { self.sink } else { 0 };
        let mut keys = Vec::new();
        for h in 0..self.n_kv_head {
            let i = h * self.coded_slots + coded;
            let (page_k, page_v) = (
                page_rows(&self.exact_k, self.exact_slots, h, exact, dk),
                page_rows(&self.exact_v, self.exact_slots, h, exact, dv),
            );
            self.sink_k[h * sink * dk..][..sink * dk].copy_from_slice(&page_k[..sink * dk]);
            self.sink_v[h * sink * dv..][..sink * dv].copy_from_slice(&page_v[..sink * dv]);
            if sink > 0 {
                keys.clear();
                keys.extend(page_k[sink * dk..][..dk].iter().cycle().take(sink * dk));
                keys.extend_from_slice(&page_k[sink * dk..]);
            }
            self.sketches[i].fill(if sink > 0 { &keys } else { page_k });
            for (t, row) in page_v.chunks_exact(dv).enumerate() {
                self.values[i].store(t, row);
            }
            let sinks = page_v[..sink * dv].chunks_exact(dv).map(|v| norm_bound(v.iter().map(|x| x.to_f64())));
            let coded = (sink..PAGE).map(|t| self.values[i].norm_bound(t));
            self.coded_norms[i] = sinks.chain(coded).fold(0.0, f32::max);
        }
    }

    fn is_coded(&self, page: usize) -> bool {
        page < self.first_exact && page + self.coded_slots >= self.first_exact
    }

    fn coded_slot(&self, page: usize) -> usize {
        assert!(self.is_coded(page), "page {page} has left the cache");
        page % self.coded_slots
    }
}

/// A position that can no longer be stored anew: its page is coded, or has
/// left a sliding window's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("position {pos} is no longer exact in the cache (only positions from {first} on can be rewritten)")]
pub struct Settled {
    pub pos: usize,
    pub first: usize,
}

/// A run of one head's keys, as [`PagedLayer::key_cover`] gives them.
pub enum KeyCover<'a> {
    /// The keys at positions `page · PAGE + rows`, whose scores the sketch's
    /// bounds (its scan and refinement) hold for; its other rows are to be
    /// ignored.
    Sketched { page: usize, sketch: &'a KeySketch, rows: Range<usize> },
    /// Positions whose keys no sketch bounds: read them exactly.
    Exact(Range<usize>),
}

/// A stretch of one head's keys or values.
pub enum Rows<'a, C> {
    /// Exact rows, end to end.
    Exact(&'a [f16]),
    /// These rows of a coded page.
    Coded(&'a C, Range<usize>),
}

/// `n` zero halves in memory the system commits only as it is written: the
/// cache's rows are written as tokens arrive, so a context costs memory as it
/// fills rather than all at once.
fn zeroed_halves(n: usize) -> Vec<f16> {
    // `vec!` of a zero integer asks the allocator for zeroed memory, which
    // for a large block is fresh pages from the system.
    vec![0u16; n].reinterpret_into()
}

/// The rows of one page of exact `rows` (`[head][slot][token][dim]`).
fn page_rows(rows: &[f16], slots: usize, head: usize, slot: usize, dim: usize) -> &[f16] {
    &rows[(head * slots + slot) * PAGE * dim..][..PAGE * dim]
}

/// The first `used` of the `slots` slots of each of the `heads` parts of a `[head][slot]…`
/// buffer.
fn in_use<T>(buffer: &[T], heads: usize, slots: usize, used: usize) -> impl Iterator<Item = &[T]> {
    let per_head = buffer.len() / heads.max(1);
    let slot = per_head.checked_div(slots).unwrap_or(0);
    buffer.chunks(per_head.max(1)).map(move |head| &head[..used * slot])
}

/// [`in_use`], to be read into.
fn in_use_mut<T>(buffer: &mut [T], heads: usize, slots: usize, used: usize) -> impl Iterator<Item = &mut [T]> {
    let per_head = buffer.len() / heads.max(1);
    let slot = per_head.checked_div(slots).unwrap_or(0);
    buffer.chunks_mut(per_head.max(1)).map(move |head| &mut head[..used * slot])
}
