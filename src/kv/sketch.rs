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
//! per key, with `β` and `C±` set up once per page and query in f64. The
//! floating-point slack, all folded into `C±`:
//!
//! * f64 set-up: products are exact (f32 × f16) and sums of at most 2^13
//!   terms err by less than `2^-39` of the sum of their magnitudes `A`;
//!   `2^-36·A` is added.
//! * f32 per key, `fl(fl(β·fl(I)) + C)`: three roundings err by at most
//!   `4u·(|β·I| + |C|)` with `u = 2^-24`, plus under `2^-148` in the
//!   subnormal range; `2^-21·(β·I_max + |C|) + 2^-126` is added, enough to
//!   cover the growth of `|C|` by this slack and by its outward rounding.
//! * The caller's own score: the bounds also hold for `q·k` computed in f32,
//!   in any order and from keys dequantized in f32, because
//!   `γ_{d+2}·Σ |q_c|·max|k_c| ≤ 2(d + 2)·u·Σ |q_c|·(|min_c| + 255·step_c)`
//!   is added as well.
//!
//! Should the magnitudes approach f32's range (2^120), the bounds become
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

use half::f16;
use simd::{CodeRows, SketchCodes, SketchLayout, SketchQuery};

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
    channels: Vec<Affine>,
    /// Per key row: the scanned bits of every channel's code, packed.
    coarse: Vec<u8>,
    /// Per key row: the low 4 bits of every code, packed; only where all 8
    /// bits are kept.
    fine: Vec<u8>,
}

impl KeySketch {
    /// Room for one page of keys of `dim` channels.
    pub fn new(dim: usize, keys: PageKeys) -> Self {
        let fine = if keys.kept() == Bits::Eight { PAGE * packed_len(dim, Bits::Four) } else { 0 };
        Self {
            dim,
            keys,
            channels: vec![Affine::default(); dim],
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
        for (c, affine) in self.channels.iter_mut().enumerate() {
            *affine = Affine::fit(keys.iter().skip(c).step_by(dim).copied());
        }
        self.coarse.fill(0);
        self.fine.fill(0);
        let (coarse_len, fine_len) = (packed_len(dim, scanned), packed_len(dim, Bits::Four));
        for (i, key) in keys.chunks_exact(dim).enumerate() {
            for (c, (&x, affine)) in key.iter().zip(&self.channels).enumerate() {
                let code = affine.code(x);
                pack(&mut self.coarse[i * coarse_len..][..coarse_len], c, scanned, scanned.narrow(code));
                if !self.fine.is_empty() {
                    pack(&mut self.fine[i * fine_len..][..fine_len], c, Bits::Four, code & 0xf);
                }
            }
        }
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.channels.as_slice()) + self.coarse.len() + self.fine.len()
    }

    /// Key `i` at all the kept bits: for coded pages, the key itself.
    pub fn dequantize_key(&self, i: usize, out: &mut [f32]) {
        let kept = self.keys.kept();
        for (c, (o, affine)) in out[..self.dim].iter_mut().zip(&self.channels).enumerate() {
            *o = affine.level(self.code(i, c, kept), kept);
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
        affine.clear();
        affine.extend(self.channels.iter().map(|a| a.min.to_f32()));
        affine.extend(self.channels.iter().map(|a| a.step.to_f32()));
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
    /// `query` must be `q` prepared for this page.
    pub fn refine(&self, q: &[f32], query: &ScanQuery, i: usize) -> Bounds {
        let kept = self.keys.kept();
        let w = self.keys.half_width(kept);
        let mut sum = Slack::default();
        for (c, (&qc, affine)) in q.iter().zip(&self.channels).enumerate() {
            let (min, a) = channel(qc, affine);
            sum.add(qc as f64 * min + a * kept.offset(self.code(i, c, kept)));
            sum.widen(w * a.abs());
            sum.widen_f32(qc, affine);
        }
        let coarse = query.bounds(self.integer_dot(query, i));
        let exact = sum.bounds(self.dim, None);
        Bounds { lower: exact.lower.max(coarse.lower), upper: exact.upper.min(coarse.upper) }
    }

    /// An upper bound on `q·k` over every key of the page, from the
    /// channels' ranges alone (a block score, as in Quest).
    pub fn page_upper_bound(&self, q: &[f32]) -> f32 {
        let (low, high) = self.keys.extent();
        let mut sum = Slack::default();
        for (&qc, affine) in q.iter().zip(&self.channels) {
            let (min, a) = channel(qc, affine);
            sum.add(qc as f64 * min + (a * low).max(a * high));
            sum.widen_f32(qc, affine);
        }
        sum.bounds(self.dim, None).upper
    }

    fn integer_dot(&self, query: &ScanQuery, i: usize) -> i32 {
        let mut dot = [0];
        simd::kernels().sketch_dots(&self.scan_codes(i..i + 1), &[query.view()], &mut dot);
        dot[0]
    }
}

/// A channel's minimum and `a_c = q_c·step_c`, exact in f64.
fn channel(qc: f32, affine: &Affine) -> (f64, f64) {
    (affine.min.to_f64(), qc as f64 * affine.step.to_f64())
}

/// A query prepared for scanning one page: weights in i8 (in the scan's
/// order) and the per-page constants of the module's bound. Reused from page
/// to page.
#[derive(Default)]
pub struct ScanQuery {
    weights: Vec<i8>,
    beta: f32,
    lower: f32,
    upper: f32,
}

impl ScanQuery {
    pub fn prepare(&mut self, sketch: &KeySketch, q: &[f32]) {
        assert_eq!(q.len(), sketch.dim, "query and keys differ in size");
        let bits = sketch.keys.scanned();
        let (span, top) = (f64::from(bits.span()), f64::from(bits.max_code()));
        let w = sketch.keys.half_width(bits);
        let a_max = q.iter().zip(&sketch.channels).map(|(&qc, affine)| channel(qc, affine).1.abs()).fold(0.0, f64::max);
        // α is an f32 (the scan multiplies in f32); any value would do, as
        // its rounding is measured in δ below.
        let alpha = (a_max / 127.0) as f32;

        let layout = sketch.scan_layout();
        self.weights.clear();
        self.weights.resize(layout.weights_len(), 0);
        let mut sum = Slack::default();
        let mut i_max = 0.0;
        for (c, (&qc, affine)) in q.iter().zip(&sketch.channels).enumerate() {
            let (min, a) = channel(qc, affine);
            let weight = if alpha > 0.0 { (a / alpha as f64).round().clamp(-127.0, 127.0) } else { 0.0 };
            self.weights[layout.weight_slot(c)] = weight as i8;
            i_max += weight.abs() * top;
            let delta = a - alpha as f64 * weight;
            sum.add(qc as f64 * min + a * bits.offset(0));
            sum.split(span * top * delta);
            sum.widen(w * a.abs());
            sum.widen_f32(qc, affine);
        }
        self.beta = alpha * span as f32;
        let b = sum.bounds(sketch.dim, Some(self.beta as f64 * i_max));
        (self.lower, self.upper) = (b.lower, b.upper);
        if !(self.beta.is_finite() && b.lower.is_finite() && b.upper.is_finite()) {
            (self.beta, self.lower, self.upper) = (0.0, f32::NEG_INFINITY, f32::INFINITY);
        }
    }

    /// The bounds for a key whose integer dot product is `dot`.
    fn bounds(&self, dot: i32) -> Bounds {
        self.view().bounds(dot)
    }

    /// The query as the SIMD scan takes it.
    fn view(&self) -> SketchQuery<'_> {
        SketchQuery { weights: &self.weights, beta: self.beta, lower: self.lower, upper: self.upper }
    }
}

/// An interval `[centre - below, centre + above]` summed in f64, with the
/// magnitude of its terms, to be rounded outward to f32.
#[derive(Default)]
struct Slack {
    centre: f64,
    below: f64,
    above: f64,
    magnitude: f64,
    /// `Σ |q_c|·max|k_c|`, for the slack of the caller's f32 dot.
    dot_magnitude: f64,
}

impl Slack {
    fn add(&mut self, x: f64) {
        self.centre += x;
        self.magnitude += x.abs();
    }

    /// A term known only to lie in `[-r, r]`.
    fn widen(&mut self, r: f64) {
        self.below += r;
        self.above += r;
        self.magnitude += r;
    }

    /// A term known only to lie between 0 and `x` (either sign).
    fn split(&mut self, x: f64) {
        if x > 0.0 {
            self.above += x;
        } else {
            self.below -= x;
        }
        self.magnitude += x.abs();
    }

    fn widen_f32(&mut self, qc: f32, affine: &Affine) {
        let (min, step) = (affine.min.to_f64(), affine.step.to_f64());
        self.dot_magnitude += (qc as f64).abs() * (min.abs() + 255.0 * step);
    }

    /// The interval rounded outward to f32, with the slack of the f64 sums
    /// and of the caller's f32 dot. With `scan = Some(m)` the ends are the
    /// constants `C±` of a scan's `fl(fl(β·fl(I)) + C±)` with `|β·I| ≤ m`,
    /// and carry the slack of its three roundings too.
    fn bounds(&self, dim: usize, scan: Option<f64>) -> Bounds {
        let dot = 2.0 * (dim as f64 + 2.0) * 2f64.powi(-24) * self.dot_magnitude;
        let set_up = 2f64.powi(-36) * self.magnitude;
        let scanned = scan.unwrap_or(0.0);
        if self.magnitude + dot + scanned > 2f64.powi(120) {
            return Bounds { lower: f32::NEG_INFINITY, upper: f32::INFINITY };
        }
        let (lower, upper) = (self.centre - self.below - dot - set_up, self.centre + self.above + dot + set_up);
        let per_key = |c: f64| scan.map_or(0.0, |m| 2f64.powi(-21) * (m + c.abs()) + 2f64.powi(-126));
        Bounds { lower: f32_down(lower - per_key(lower)), upper: f32_up(upper + per_key(upper)) }
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
