//! The key sketch: one page of keys quantized per channel (KIVI), with
//! bounds on `q·k` that certified attention scans instead of the keys.
//!
//! Every channel of a page gets a minimum and a step ([`Affine`]) over the
//! page's [`PAGE`] keys, and every key an 8-bit code per channel. The scan
//! reads only the top 4 bits (2 in the 2-bit cache mode), packed two to a
//! byte per key row; the low 4 bits, kept in a second array, refine a key
//! once the scan has made it a candidate.
//!
//! # The bounds
//!
//! Write `a_c = q_c·step_c`. A code `h` of a level with span `2^t` puts
//! channel `c` of key `i` within `w·step_c` of `min_c + step_c·o(h)`, where
//! `o(h) = 2^t·h + (2^t - 1)/2` and `w` is the level's half-width (half the
//! span for exact keys; less for keys that are themselves codes). Hence
//!
//! ```text
//! q·k_i ∈ Σ q_c·min_c + Σ a_c·o(h_ic) ± w·Σ |a_c|
//! ```
//!
//! The scan evaluates `Σ a_c·h_ic` as an integer dot product `I_i = Σ â_c·h_ic`:
//! `a ≈ α·â` with `â` in i8 (the u8 × i8 shape of `vpdpbusd`), and the
//! rounding `δ = a - α·â` moves the sum by at most `H·Σ max(δ_c, 0)` up and
//! `H·Σ min(δ_c, 0)` down, `H` being the largest code. So each key's bounds
//! are `β·I_i + C±` with `β = 2^t·α`: one integer dot and one multiply-add
//! per key, with `β` and `C±` set up once per page and query.
//!
//! The **refinement** reads the low 4 bits too: the 8-bit code is
//! `16·h + f`, so its integer dot is `16·I_i + Σ â_c·f_ic` (the same weights
//! against the fine plane, [`simd::Kernels::sketch_dots_at`] at the few keys
//! refined), and the bound is the one above with span 1, offset 0, top 255
//! and the half-width of an 8-bit code (½ step for exact keys, 0 for keys
//! that are their 8-bit codes). At 8 bits the weights' rounding `δ` would
//! dominate (`255·Σ|δ_c|` against `½·Σ|a_c|`), so it is itself quantized,
//! `δ_c = α₂·r̂_c + ε_c` with `r̂` in i8 and `α₂ = α/248`, and its share
//! `α₂·Σ r̂_c·h8_ic` is one more pair of integer dots: the bound is
//! `α·I8_i + α₂·J8_i + C8±`, `C8±` split by `255·Σ max(±ε_c, 0)`.
//!
//! The set-up runs in f32 as `simd`'s [`simd::Kernels::sketch_prepare`]
//! (eight channels a vector, the sums in sixteen lanes reduced in a fixed
//! order, the same bits on every table), with no division per channel:
//! `α = max|a_c|/127`, the weights `â_c = round(a_c·(1/α))` by the
//! add-and-subtract of `1.5·2^23`. The
//! floating-point slack, all folded into `C±`:
//!
//! * f32 set-up: every term (`q_c·min_c`, `a_c·o`, `δ_c` or `ε_c` scaled,
//!   `w·|a_c|`) carries at most 5 roundings of its inputs, and the computed
//!   `δ_c` and `ε_c` are within `5u(|a_c| + |α·â_c|)` of the exact
//!   `a_c − α·â_c` and `δ_c − α₂·r̂_c` (`u = 2^-24`);
//!   a sum of `n` terms in any order errs by at most `γ_n ≤ 1.01·n·u` of the
//!   sum of their magnitudes (`n` here counts the weights, the channels
//!   padded with zeros to whole code bytes; the zeros add no rounding).
//!   All of it lies below `5.05·(n + 8)·u·A`, `A`
//!   bounding the magnitudes of every term
//!   (`Σ |q_c·min_c| + G·Σ (|a_c| + |α·â_c|)`, `G` the largest factor a
//!   channel's `a` or `δ` is multiplied by, plus 1); `8·(n + 8)·u·A` is
//!   added, which also covers the rounding of `A` itself.
//! * f32 per key, `fl(fl(β·fl(I)) + C)`: three roundings (six for the
//!   refinement's two products) err by at most `7u·(|β·I| + |C|)`, plus
//!   under `2^-148` in the subnormal range;
//!   `2^-20·(β·I_max + |C|) + 2^-126` is added, enough to cover the growth
//!   of `|C|` by this slack and the roundings of `C`'s own last sums.
//! * The caller's own score: the bounds also hold for `q·k` computed in f32,
//!   in any order and from keys dequantized in f32, because
//!   `γ_{d+2}·Σ |q_c|·max|k_c| ≤ 2(d + 2)·u·Σ |q_c|·(|min_c| + 255·step_c)`
//!   is added as well (twice over, the sum being in f32).
//!
//! Should the magnitudes approach f32's range (2^100), the bounds become
//! infinite, which is still true.
//!
//! # The scan
//!
//! The integer dots and the per-key multiply-adds are `simd`'s sketch scan
//! ([`simd::Kernels::sketch_scan`]: `vpdpbusd` on AVX-512 VNNI,
//! `vpmaddubsw`/`vpmaddwd` on AVX2), which gives the same bits on every
//! table. [`ScanQuery`] keeps its weights in the scan's order (planes of the
//! codes' fields, [`simd::SketchLayout::weight_slot`]), and
//! [`KeySketch::scan_heads`] scans a page for the query heads of one KV head
//! at once, reading each key's codes once for all of them.
//! [`KeySketch::refine_page`] does the same with all 8 bits, giving the
//! scan's bounds and the refined ones from one pass over the coarse and
//! fine codes ([`simd::Kernels::sketch_refine_page`]).

use half::f16;
use half::slice::HalfFloatSliceExt;
use simd::{CodeRows, FineConstants, PrepareSums, RefineQuery, RefinedRows, SketchCodes, SketchLayout, SketchQuery};

use std::ops::Range;

use super::quant::{f32_up, pack, packed_len, unpack, Affine, Bits};

/// Tokens per page.
pub const PAGE: usize = 64;

/// What a page's keys are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKeys {
    /// The exact f16 keys, stored elsewhere; the sketch keeps 8 bits of
    /// each beside them.
    Exact,
    /// The codes themselves, at this width: the key is the code's level.
    Coded(Bits),
}

impl PageKeys {
    /// The bits of every code the sketch keeps.
    fn kept(self) -> Bits {
        match self {
            PageKeys::Exact => Bits::Eight,
            PageKeys::Coded(bits) => bits,
        }
    }

    /// The width the scan reads.
    fn scanned(self) -> Bits {
        match self.kept() {
            Bits::Two => Bits::Two,
            _ => Bits::Four,
        }
    }

    /// How far, in steps, a key lies from the level of its code of width
    /// `bits` (no wider than the kept bits).
    fn half_width(self, bits: Bits) -> f64 {
        match self {
            PageKeys::Exact => bits.half_width(),
            // Both levels are midpoints of nested spans of 8-bit codes.
            PageKeys::Coded(kept) => f64::from(bits.span() - kept.span()) / 2.0,
        }
    }

    /// The least and largest offsets, in steps, a key can sit at.
    fn extent(self) -> (f64, f64) {
        let low = match self {
            PageKeys::Exact => 0.0,
            PageKeys::Coded(kept) => kept.offset(0),
        };
        (low, 255.0 - low)
    }
}

pub use simd::Bounds;

/// One page of keys, sketched.
#[derive(Clone)]
pub struct KeySketch {
    dim: usize,
    keys: PageKeys,
    /// The channels' minima, then their steps.
    affine: Vec<f16>,
    /// Per key row: the scanned bits of every channel's code, packed.
    coarse: Vec<u8>,
    /// Per key row: the low 4 bits of every code, packed; only where all 8
    /// bits are kept.
    fine: Vec<u8>,
}

impl KeySketch {
    /// The sketch's state as bytes, in the order of a cache file ([`crate::kv::KvCache::write_to`]).
    pub(crate) fn state(&self) -> [&[u8]; 3] {
        [bytemuck::cast_slice(&self.affine), &self.coarse, &self.fine]
    }

    /// [`Self::state`], to be read into.
    pub(crate) fn state_mut(&mut self) -> [&mut [u8]; 3] {
        [bytemuck::cast_slice_mut(&mut self.affine), &mut self.coarse, &mut self.fine]
    }

    /// Room for one page of keys of `dim` channels.
    pub fn new(dim: usize, keys: PageKeys) -> Self {
        let fine = if keys.kept() == Bits::Eight { PAGE * packed_len(dim, Bits::Four) } else { 0 };
        Self {
            dim,
            keys,
            affine: vec![f16::ZERO; 2 * dim],
            coarse: vec![0; PAGE * packed_len(dim, keys.scanned())],
            fine: vec![0; fine],
        }
    }

    /// A sketch of `keys`: [`PAGE`] rows of `dim` finite f16 numbers.
    pub fn build(keys: &[f16], dim: usize, kind: PageKeys) -> Self {
        let mut sketch = Self::new(dim, kind);
        sketch.fill(keys);
        sketch
    }

    /// Sketches `keys` ([`PAGE`] rows of `dim`) in place of the page held.
    pub fn fill(&mut self, keys: &[f16]) {
        assert_eq!(keys.len(), PAGE * self.dim, "a sketch covers one whole page");
        let (dim, scanned) = (self.dim, self.keys.scanned());
        for c in 0..dim {
            let affine = Affine::fit(keys.iter().skip(c).step_by(dim).copied());
            (self.affine[c], self.affine[dim + c]) = (affine.min, affine.step);
        }
        self.coarse.fill(0);
        self.fine.fill(0);
        let (coarse_len, fine_len) = (packed_len(dim, scanned), packed_len(dim, Bits::Four));
        for (i, key) in keys.chunks_exact(dim).enumerate() {
            for (c, &x) in key.iter().enumerate() {
                let code = self.channel(c).code(x);
                pack(&mut self.coarse[i * coarse_len..][..coarse_len], c, scanned, scanned.narrow(code));
                if !self.fine.is_empty() {
                    pack(&mut self.fine[i * fine_len..][..fine_len], c, Bits::Four, code & 0xf);
                }
            }
        }
    }

    /// Asks the caches for the sketch's minima, steps and codes, which a
    /// scan reads soon (pages lie apart, where no hardware prefetcher
    /// follows).
    pub fn prefetch(&self) {
        simd::prefetch(&self.affine);
        simd::prefetch(&self.coarse);
        simd::prefetch(&self.fine);
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.affine.as_slice()) + self.coarse.len() + self.fine.len()
    }

    /// Channel `c`'s minimum and step.
    fn channel(&self, c: usize) -> Affine {
        Affine { min: self.affine[c], step: self.affine[self.dim + c] }
    }

    /// Key `i` at all the kept bits: for coded pages, the key itself.
    pub fn dequantize_key(&self, i: usize, out: &mut [f32]) {
        let kept = self.keys.kept();
        for (c, o) in out[..self.dim].iter_mut().enumerate() {
            *o = self.channel(c).level(self.code(i, c, kept), kept);
        }
    }

    /// Keys `rows` at all the kept bits, rounded to f16 as a staging batch
    /// reads them, one after another into `out`: [`Self::dequantize_key`]'s
    /// numbers, through the SIMD reader. `affine` is scratch for the
    /// channels' minima and steps.
    pub fn dequantize_keys(&self, rows: Range<usize>, out: &mut [f16], affine: &mut Vec<f32>) {
        simd::kernels().levels_f16(&self.code_rows(rows, affine), out);
    }

    /// Keys `rows` as codes for the SIMD kernels, which read them as
    /// [`Self::dequantize_key`]'s numbers: `affine` is filled with the
    /// channels' minima and steps in f32, which the rows borrow.
    pub fn code_rows<'a>(&'a self, rows: Range<usize>, affine: &'a mut Vec<f32>) -> CodeRows<'a> {
        let (kept, scanned, dim) = (self.keys.kept(), self.keys.scanned(), self.dim);
        let (coarse_len, fine_len) = (packed_len(dim, scanned), packed_len(dim, Bits::Four));
        affine.resize(2 * dim, 0.0);
        self.affine.convert_to_f32_slice(affine);
        let (min, step) = affine.split_at(dim);
        CodeRows {
            dim,
            codes: &self.coarse[rows.start * coarse_len..rows.end * coarse_len],
            bits: scanned.get() as u32,
            fine: (kept != scanned).then(|| &self.fine[rows.start * fine_len..rows.end * fine_len]),
            group: 1,
            min,
            step,
        }
    }

    /// Code of key `i`, channel `c`, at width `bits` (the scanned or the
    /// kept width).
    fn code(&self, i: usize, c: usize, bits: Bits) -> u8 {
        let scanned = self.keys.scanned();
        let coarse = unpack(&self.coarse[i * packed_len(self.dim, scanned)..], c, scanned);
        if bits == scanned {
            coarse
        } else {
            coarse << 4 | unpack(&self.fine[i * packed_len(self.dim, Bits::Four)..], c, Bits::Four)
        }
    }

    /// Bounds on `q·k_i` for every key of the page from the scanned codes,
    /// into `out[..PAGE]`. `query` must be `q` prepared for this page.
    pub fn scan(&self, query: &ScanQuery, out: &mut [Bounds]) {
        self.scan_heads(std::slice::from_ref(query), &mut out[..PAGE]);
    }

    /// [`Self::scan`] for several queries (the query heads of one KV head),
    /// each prepared for this page: `out[h·PAGE + i]` bounds query `h`'s
    /// score of key `i`. Each key's codes are read once for all of them.
    pub fn scan_heads(&self, queries: &[ScanQuery], out: &mut [Bounds]) {
        const GROUP: usize = 8;
        assert_eq!(out.len(), queries.len() * PAGE, "a page of bounds per query");
        let codes = self.scan_codes(0..PAGE);
        let mut views = [SketchQuery { weights: &[], beta: 0.0, lower: 0.0, upper: 0.0 }; GROUP];
        for (queries, out) in queries.chunks(GROUP).zip(out.chunks_mut(GROUP * PAGE)) {
            for (view, query) in views.iter_mut().zip(queries) {
                *view = query.view();
            }
            simd::kernels().sketch_scan(&codes, &views[..queries.len()], out);
        }
    }

    /// The codes the scan reads of keys `rows`.
    fn scan_codes(&self, rows: Range<usize>) -> SketchCodes<'_> {
        let layout = self.scan_layout();
        SketchCodes { layout, codes: &self.coarse[rows.start * layout.row_bytes()..rows.end * layout.row_bytes()] }
    }

    fn scan_layout(&self) -> SketchLayout {
        SketchLayout { dim: self.dim, bits: self.keys.scanned().get() as u32 }
    }

    /// Bounds on `q·k_i` from all the kept bits (8, unless the keys are
    /// coded narrower), within the scan's bounds: refining never loosens.
    /// `query` must be prepared for this page.
    pub fn refine(&self, query: &ScanQuery, i: usize) -> Bounds {
        let mut out = [Bounds::default()];
        self.refine_heads(std::slice::from_ref(query), &[i as u32], &mut Vec::new(), &mut out);
        out[0]
    }

    /// [`Self::refine`] of keys `rows` for several queries (the query heads
    /// of one KV head), each prepared for this page: `out[h·n + k]` bounds
    /// query `h`'s score of key `rows[k]`, `n = rows.len()`. Each key's
    /// codes are read once for all of them; `dots` is scratch. Where the
    /// sketch keeps no more bits than it scans, these are the scan's bounds.
    pub fn refine_heads(&self, queries: &[ScanQuery], rows: &[u32], dots: &mut Vec<i32>, out: &mut [Bounds]) {
        let kernels = simd::kernels();
        self.refine_with(queries, rows.len(), dots, out, |codes, weights, dots| {
            kernels.sketch_dots_at(codes, weights, rows, dots)
        });
    }

    /// [`Self::refine_heads`] of every key of the page, `out[h·PAGE + i]`:
    /// the rows read in order, as a scan reads them. `scanned` gets the
    /// scan's own bounds ([`Self::scan_heads`]'s, the same bits), which the
    /// refinement computes on the way.
    pub fn refine_page_heads(&self, queries: &[ScanQuery], out: &mut [Bounds], scanned: &mut [Bounds]) {
        assert!(out.len() == queries.len() * PAGE && scanned.len() == out.len(), "a page of bounds per query");
        if !self.refines() {
            self.scan_heads(queries, scanned);
            out.copy_from_slice(scanned);
            return;
        }
        let mut fields = vec![0.0; 4 * out.len()];
        let mut both = RefinedRows::of(&mut fields);
        self.refine_page(queries, &mut both);
        for (k, (o, s)) in out.iter_mut().zip(scanned.iter_mut()).enumerate() {
            let b = both.get(k);
            (*o, *s) = (b.refined, b.scanned);
        }
    }

    /// The bounds of every key of a page that keeps 8-bit codes, from all
    /// of them and from the scanned ones, for several queries (the query
    /// heads of one KV head), each prepared for this page: `out[h·PAGE + i]`
    /// bounds query `h`'s score of key `i` (in each of `out`'s fields). One
    /// pass over the coarse and fine codes for all the queries
    /// ([`simd::Kernels::sketch_refine_page`]); the same bits as
    /// [`Self::refine_heads`] and [`Self::scan_heads`].
    ///
    /// # Panics
    /// If the sketch does not refine ([`Self::refines`]).
    pub fn refine_page(&self, queries: &[ScanQuery], out: &mut RefinedRows) {
        const GROUP: usize = 8;
        assert!(self.refines(), "a page whose sketch keeps 8 bits");
        assert_eq!(out.len(), queries.len() * PAGE, "a page of bounds per query");
        let coarse = self.scan_codes(0..PAGE);
        let fine = SketchCodes { layout: coarse.layout, codes: &self.fine };
        let empty = SketchQuery { weights: &[], beta: 0.0, lower: 0.0, upper: 0.0 };
        let mut views = [RefineQuery { scan: empty, residuals: &[], fine: FineConstants::default() }; GROUP];
        for (k, queries) in queries.chunks(GROUP).enumerate() {
            for (view, query) in views.iter_mut().zip(queries) {
                *view = query.refine_view();
            }
            let at = k * GROUP * PAGE..(k * GROUP + queries.len()) * PAGE;
            simd::kernels().sketch_refine_page(&coarse, &fine, &views[..queries.len()], &mut out.slice(at));
        }
    }

    /// The refinement of `n` keys whose integer dots `dots_of(codes,
    /// weights, out)` writes, weight set after weight set, `n` apiece.
    fn refine_with(
        &self,
        queries: &[ScanQuery],
        n: usize,
        dots: &mut Vec<i32>,
        out: &mut [Bounds],
        dots_of: impl Fn(&SketchCodes, &[SketchQuery], &mut [i32]),
    ) {
        /// Queries refined together: their weights and residuals make one
        /// kernel call's sixteen weight sets at most.
        const GROUP: usize = 8;
        assert_eq!(out.len(), queries.len() * n, "a bound per query and row");
        let coarse = self.scan_codes(0..PAGE);
        let fine = SketchCodes { layout: SketchLayout { dim: self.dim, bits: 4 }, codes: &self.fine };
        let empty = SketchQuery { weights: &[], beta: 0.0, lower: 0.0, upper: 0.0 };
        let mut views = [empty; 2 * GROUP];
        for (queries, out) in queries.chunks(GROUP).zip(out.chunks_mut(GROUP * n)) {
            let len = queries.len() * n;
            if !self.refines() {
                for (view, query) in views.iter_mut().zip(queries) {
                    *view = query.view();
                }
                dots.clear();
                dots.resize(len, 0);
                dots_of(&coarse, &views[..queries.len()], dots);
                for (k, o) in out.iter_mut().enumerate() {
                    *o = views[k / n].bounds(dots[k]);
                }
                continue;
            }
            // Per plane, the weights' dots (query after query), then the residuals'.
            let (weights, residuals) = views.split_at_mut(queries.len());
            for ((w, r), query) in weights.iter_mut().zip(residuals.iter_mut()).zip(queries) {
                (*w, *r) = (query.view(), query.residual_view());
            }
            let both = &views[..2 * queries.len()];
            dots.clear();
            dots.resize(4 * len, 0);
            let (coarse_dots, fine_dots) = dots.split_at_mut(2 * len);
            dots_of(&coarse, both, coarse_dots);
            dots_of(&fine, both, fine_dots);
            // The 8-bit code is the 4 scanned bits above the 4 fine ones.
            let code_dot = |k: usize| 16 * i64::from(dots[k]) + i64::from(dots[2 * len + k]);
            for (k, o) in out.iter_mut().enumerate() {
                *o = queries[k / n].refine_view().bounds(dots[k], code_dot(k), code_dot(len + k)).refined;
            }
        }
    }

    /// Whether [`Self::refine`] reads more bits than the scan.
    pub fn refines(&self) -> bool {
        !self.fine.is_empty()
    }

    /// The bytes [`Self::refine_heads`] reads per key: its scanned and its
    /// fine codes.
    pub fn refinement_bytes(&self) -> usize {
        let row = |bits| packed_len(self.dim, bits);
        row(self.keys.scanned()) + if self.refines() { row(Bits::Four) } else { 0 }
    }

    /// The channels' minima then steps, in f32, in channel order: what
    /// [`Self::weight_order`] puts in the scan's order.
    pub fn affine_f32(&self, out: &mut Vec<f32>) {
        out.resize(2 * self.dim, 0.0);
        self.affine.convert_to_f32_slice(out);
    }

    /// `channels` (one number per channel, or several runs of them end to
    /// end) in the scan's weight order, each run padded with zeros to whole
    /// code bytes ([`simd::SketchLayout::weight_slot`]): how
    /// [`ScanQuery::prepare_with`] takes a query and a page's minima and
    /// steps, so that the weights it computes come out in the order the scan
    /// reads them. Every page of a cache has the same order, so a query is
    /// put in it once.
    pub fn weight_order(&self, channels: &[f32], out: &mut Vec<f32>) {
        let layout = self.scan_layout();
        let (fields, row_bytes) = (layout.fields(), layout.row_bytes());
        out.clear();
        for run in channels.chunks_exact(self.dim) {
            for field in 0..fields {
                out.extend((0..row_bytes).map(|b| run.get(b * fields + field).copied().unwrap_or(0.0)));
            }
        }
    }

    /// An upper bound on `q·k` over every key of the page, from the
    /// channels' ranges alone (a block score, as in Quest).
    ///
    /// The minima and steps are converted [`BOUND_CHANNELS`] at a time, in
    /// vectors, and each channel's terms are added in channel order.
    pub fn page_upper_bound(&self, q: &[f32]) -> f32 {
        let (low, high) = self.keys.extent();
        let (mins, steps) = self.affine.split_at(self.dim);
        let mut sum = Slack::default();
        let (mut min, mut step) = ([0.0f32; BOUND_CHANNELS], [0.0f32; BOUND_CHANNELS]);
        let (q, mins, steps) =
            (q[..self.dim].chunks(BOUND_CHANNELS), mins.chunks(BOUND_CHANNELS), steps.chunks(BOUND_CHANNELS));
        for ((q, mins), steps) in q.zip(mins).zip(steps) {
            let (min, step) = (&mut min[..q.len()], &mut step[..q.len()]);
            mins.convert_to_f32_slice(min);
            steps.convert_to_f32_slice(step);
            for ((&qc, &min), &step) in q.iter().zip(&*min).zip(&*step) {
                let (min, step) = (f64::from(min), f64::from(step));
                let a = f64::from(qc) * step;
                sum.add(f64::from(qc) * min + (a * low).max(a * high));
                sum.widen(qc, min, step);
            }
        }
        sum.bounds(self.dim).upper
    }
}

/// Channels whose minima and steps [`KeySketch::page_upper_bound`] converts
/// together.
const BOUND_CHANNELS: usize = 32;

/// A query prepared for scanning one page: weights in i8 (in the scan's
/// order) and the per-page constants of the module's bound, for the scanned
/// codes and for the 8-bit ones. Reused from page to page.
#[derive(Default)]
pub struct ScanQuery {
    weights: Vec<i8>,
    /// The weights' residuals `r̂_c ≈ δ_c/α₂`, for the refinement.
    residuals: Vec<i8>,
    beta: f32,
    lower: f32,
    upper: f32,
    /// The 8-bit bound's constants (where the sketch keeps 8 bits).
    fine: FineConstants,
}

impl ScanQuery {
    /// Prepares `q` (in channel order) for `sketch`'s page.
    pub fn prepare(&mut self, sketch: &KeySketch, q: &[f32]) {
        assert_eq!(q.len(), sketch.dim, "query and keys differ in size");
        let (mut affine, mut ordered_affine, mut ordered_q) = (Vec::new(), Vec::new(), Vec::new());
        sketch.affine_f32(&mut affine);
        sketch.weight_order(&affine, &mut ordered_affine);
        sketch.weight_order(q, &mut ordered_q);
        self.prepare_with(sketch, &ordered_q, &ordered_affine);
    }

    /// Prepares `q` for `sketch`'s page, whose minima and steps `affine`
    /// holds, both in the scan's weight order ([`KeySketch::weight_order`]
    /// of the query and of [`KeySketch::affine_f32`]; the query heads of a
    /// KV head share the page's). All in f32, each sum in the kernel's 16
    /// lanes; the module's note derives the slack that makes the constants
    /// bounds (the padding's zeros add nothing to any sum).
    pub fn prepare_with(&mut self, sketch: &KeySketch, q: &[f32], affine: &[f32]) {
        let layout = sketch.scan_layout();
        let n = layout.weights_len();
        assert_eq!(q.len(), n, "the query in the scan's order");
        assert_eq!(affine.len(), 2 * n, "a minimum and a step per weight, in the scan's order");
        let (min, step) = affine.split_at(n);
        // Every weight is written by the kernel.
        self.weights.resize(n, 0);
        self.residuals.resize(n, 0);
        let (scales, sums) = simd::kernels().sketch_prepare(q, min, step, &mut self.weights, &mut self.residuals);
        let (alpha, alpha2) = (scales.alpha, scales.alpha2);

        let bits = sketch.keys.scanned();
        let (span, top) = (bits.span() as f32, f32::from(bits.max_code()));
        let (offset, width) = (bits.offset(0) as f32, sketch.keys.half_width(bits) as f32);
        // (Only where all 8 bits are kept: narrower codes have no 8-bit bound.)
        let fine_width = if sketch.refines() { sketch.keys.half_width(Bits::Eight) as f32 } else { 0.0 };
        let PrepareSums {
            centre,
            a,
            a_abs,
            above,
            below,
            residual_above,
            residual_below,
            centre_abs,
            scaled_abs,
            dot,
            weights,
            residuals,
        } = sums;
        let magnitude = centre_abs + scaled_abs * (1.0 + offset + width + span * top + 3.0 * 255.0 + fine_width);
        let (terms, dim) = (n as f32, sketch.dim as f32);
        let set_up = (terms + 8.0) * 2f32.powi(-21) * magnitude + (dim + 2.0) * 2f32.powi(-22) * dot;
        // The scanned codes: β·I + centre + offset·Σa ± (span·top·δ± + width·Σ|a|).
        self.beta = alpha * span;
        let coarse = Constants {
            centre: centre + offset * a,
            above: span * top * above + width * a_abs,
            below: span * top * below + width * a_abs,
            dot_max: self.beta * top * weights,
            set_up,
        };
        (self.lower, self.upper) = coarse.ends();
        // The 8-bit codes: span 1, offset 0, `δ` split once more.
        let fine = Constants {
            centre,
            above: 255.0 * residual_above + fine_width * a_abs,
            below: 255.0 * residual_below + fine_width * a_abs,
            dot_max: 255.0 * (alpha * weights + alpha2 * residuals),
            set_up,
        };
        let (lower, upper) = fine.ends();
        self.fine = FineConstants { alpha, alpha2, lower, upper };
        let finite = [magnitude, dot, self.beta, self.lower, self.upper, lower, upper].iter().all(|x| x.is_finite());
        if !finite || magnitude + dot > 2f32.powi(100) {
            (self.beta, self.lower, self.upper) = (0.0, f32::NEG_INFINITY, f32::INFINITY);
            self.fine = FineConstants { alpha: 0.0, alpha2: 0.0, lower: f32::NEG_INFINITY, upper: f32::INFINITY };
        }
    }

    /// The query as the SIMD scan takes it.
    fn view(&self) -> SketchQuery<'_> {
        SketchQuery { weights: &self.weights, beta: self.beta, lower: self.lower, upper: self.upper }
    }

    /// The residual weights, for the refinement's integer dots.
    fn residual_view(&self) -> SketchQuery<'_> {
        SketchQuery { weights: &self.residuals, ..self.view() }
    }

    /// The query as the SIMD refinement of a page takes it.
    fn refine_view(&self) -> RefineQuery<'_> {
        RefineQuery { scan: self.view(), residuals: &self.residuals, fine: self.fine }
    }
}

/// One bound's constants before rounding: `C± = centre ± above/below`, and
/// what the slack is made of.
struct Constants {
    centre: f32,
    above: f32,
    below: f32,
    /// At least `|β·I|` for every key.
    dot_max: f32,
    /// The set-up's rounding and the caller's f32 dot.
    set_up: f32,
}

impl Constants {
    /// `(C₋, C₊)`, each moved out by the set-up's slack and by that of the
    /// per-key `fl(fl(β·fl(I)) + C)` and of its own sums.
    fn ends(&self) -> (f32, f32) {
        let size = self.centre.abs() + self.above.max(self.below);
        let slack = self.set_up + 2f32.powi(-20) * (self.dot_max + size) + 2f32.powi(-126);
        (self.centre - self.below - slack, self.centre + self.above + slack)
    }
}

/// A sum in f64 with the magnitude of its terms, to be rounded outward to
/// f32 with the slack of the f64 sums and of the caller's f32 dot.
#[derive(Default)]
struct Slack {
    centre: f64,
    magnitude: f64,
    /// `Σ |q_c|·max|k_c|`, for the slack of the caller's f32 dot.
    dot_magnitude: f64,
}

impl Slack {
    fn add(&mut self, x: f64) {
        self.centre += x;
        self.magnitude += x.abs();
    }

    /// Widens for the caller's f32 dot over a channel of minimum `min`
    /// and step `step`.
    fn widen(&mut self, qc: f32, min: f64, step: f64) {
        self.dot_magnitude += (qc as f64).abs() * (min.abs() + 255.0 * step);
    }

    /// The sum rounded outward to f32, with the slack of the f64 sums and
    /// of the caller's f32 dot.
    fn bounds(&self, dim: usize) -> Bounds {
        let dot = 2.0 * (dim as f64 + 2.0) * 2f64.powi(-24) * self.dot_magnitude;
        let set_up = 2f64.powi(-36) * self.magnitude;
        if self.magnitude + dot > 2f64.powi(120) {
            return Bounds { lower: f32::NEG_INFINITY, upper: f32::INFINITY };
        }
        Bounds { lower: f32_down(self.centre - dot - set_up), upper: f32_up(self.centre + dot + set_up) }
    }
}

fn f32_down(x: f64) -> f32 {
    let y = x as f32;
    if (y as f64) > x {
        y.next_down()
    } else {
        y
    }
}
