//! The key sketch's scan: bounds on the scores of a page of keys from their
//! 4-bit (or 2-bit) codes, for certified attention's candidate generation.
//!
//! sift's key sketch (`src/kv/sketch.rs`, where the bounds are derived) keeps
//! per channel `c` of a page a minimum and a step, and per key `i` a code
//! `h_ic` of `b` bits, packed lowest bits first, `8 / b` codes to a byte. A
//! query becomes i8 weights `â_c` with `q_c·step_c ≈ α·â_c`, and every key's
//! bounds are then one integer dot product and one multiply-add:
//!
//! ```text
//! I_i = Σ_c â_c·h_ic        lower_i = β·I_i + C₋        upper_i = β·I_i + C₊
//! ```
//!
//! with `β`, `C₋` and `C₊` set up once per page and query ([`SketchQuery`]).
//! This module computes the `I_i` and the bounds for every key of a run of
//! rows and for several queries at once: the query heads that share one KV
//! head scan its codes once, each row loaded once for all of them.
//!
//! # The weights' order
//!
//! A code byte holds `f = 8 / b` codes, channels `f·m .. f·m + f` of byte
//! `m`. The weights are split the same way, into `f` *planes* of one weight
//! per code byte: plane `j` holds the weights of field `j` of every byte
//! ([`SketchLayout::weight_slot`]), so that a vector of code bytes, shifted
//! and masked to field `j`, meets a vector of weights loaded straight from
//! plane `j`. Channels past `dim` (in a row's last byte) have weight 0.
//!
//! # Exactness
//!
//! The integer dot is exact on every table: `|I_i| ≤ 128·15·dim` fits an i32
//! for the dimensions allowed (at most 2^20), the x86 products of a code byte
//! and a weight never saturate (see `x86/sketch.rs`), and integer sums do not
//! depend on their order. The bounds are `fl(fl(β·fl(I)) + C)` in f32, the
//! same three roundings on every table, so every table gives the same bits.

use crate::Kernels;

/// The keys' part of the scan layout: `dim` codes of `bits` bits (2 or 4) a
/// row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SketchLayout {
    /// Codes (channels) per row.
    pub dim: usize,
    /// Bits per code: 2 or 4.
    pub bits: u32,
}

impl SketchLayout {
    /// Codes per byte.
    pub fn fields(&self) -> usize {
        8 / self.bits as usize
    }

    /// Bytes of one row's codes.
    pub fn row_bytes(&self) -> usize {
        (self.dim * self.bits as usize).div_ceil(8)
    }

    /// Weights a query needs: one per code field of a row's bytes.
    pub fn weights_len(&self) -> usize {
        self.fields() * self.row_bytes()
    }

    /// Where channel `c`'s weight goes among a query's weights (see the
    /// module's note on their order).
    pub fn weight_slot(&self, c: usize) -> usize {
        let fields = self.fields();
        (c % fields) * self.row_bytes() + c / fields
    }

    #[track_caller]
    fn check(&self) {
        assert!(self.bits == 2 || self.bits == 4, "the scan reads 2- or 4-bit codes, not {}-bit", self.bits);
        assert!(self.dim > 0 && self.dim <= 1 << 20, "rows of {} codes", self.dim);
    }
}

/// Rows of key codes, end to end, as the scan reads them.
#[derive(Clone, Copy, Debug)]
pub struct SketchCodes<'a> {
    /// Codes per row and their width.
    pub layout: SketchLayout,
    /// The codes, each row in [`SketchLayout::row_bytes`] bytes.
    pub codes: &'a [u8],
}

impl SketchCodes<'_> {
    /// The number of rows, after checking that the codes are whole rows.
    #[track_caller]
    fn rows(&self) -> usize {
        self.layout.check();
        let len = self.layout.row_bytes();
        assert!(self.codes.len().is_multiple_of(len), "{} bytes are not whole rows of {len}", self.codes.len());
        self.codes.len() / len
    }
}

/// One query prepared for scanning one page: its weights in the planes'
/// order ([`SketchLayout::weight_slot`]) and the constants that turn an
/// integer dot `I` into bounds `β·I + C±`.
#[derive(Clone, Copy, Debug)]
pub struct SketchQuery<'a> {
    /// [`SketchLayout::weights_len`] weights, plane after plane.
    pub weights: &'a [i8],
    /// `β`: a bound's change per unit of the integer dot.
    pub beta: f32,
    /// `C₋`, the lower bound's constant.
    pub lower: f32,
    /// `C₊`, the upper bound's constant.
    pub upper: f32,
}

impl SketchQuery<'_> {
    /// The bounds of a key whose integer dot is `dot`: the f32 operations
    /// of every table.
    #[inline(always)]
    pub fn bounds(&self, dot: i32) -> Bounds {
        let x = self.beta * dot as f32;
        Bounds { lower: x + self.lower, upper: x + self.upper }
    }
}

/// The 8-bit bound's constants of one query and page: for the integer dots
/// `I8` of the 8-bit codes with the weights and `J8` with the residual
/// weights, `x = fl(fl(α·fl(I8)) + fl(α₂·fl(J8)))` and the bounds `x + C8±`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FineConstants {
    /// `α`: the weights' step.
    pub alpha: f32,
    /// `α₂`: the residual weights' step.
    pub alpha2: f32,
    /// `C8₋`.
    pub lower: f32,
    /// `C8₊`.
    pub upper: f32,
}

impl FineConstants {
    /// The bounds of a key whose 8-bit codes' integer dots are `dot` (with
    /// the weights) and `residual` (with the residual weights): the f32
    /// operations of every table.
    #[inline(always)]
    pub fn bounds(&self, dot: i64, residual: i64) -> Bounds {
        let x = self.alpha * dot as f32 + self.alpha2 * residual as f32;
        Bounds { lower: x + self.lower, upper: x + self.upper }
    }
}

/// One query prepared for refining a page whose sketch keeps 8-bit codes,
/// as 4 scanned bits (the coarse codes) over 4 fine ones: the scan's query,
/// its residual weights (in the same planes' order) and the 8-bit bound's
/// constants.
#[derive(Clone, Copy, Debug)]
pub struct RefineQuery<'a> {
    /// The scan's weights and constants, for the coarse codes.
    pub scan: SketchQuery<'a>,
    /// The residual weights `r̂_c`, as many as the weights.
    pub residuals: &'a [i8],
    /// The 8-bit bound's constants.
    pub fine: FineConstants,
}

impl RefineQuery<'_> {
    /// A key's refined bounds and the scan's, from its integer dots: `coarse`
    /// (coarse codes with the weights), `code` and `residual` (8-bit codes
    /// with the weights and with the residual weights). The refined bounds
    /// lie within the scan's: refining never loosens.
    #[inline(always)]
    pub fn bounds(&self, coarse: i32, code: i64, residual: i64) -> RefinedBounds {
        let scanned = self.scan.bounds(coarse);
        let fine = self.fine.bounds(code, residual);
        let refined = Bounds { lower: fine.lower.max(scanned.lower), upper: fine.upper.min(scanned.upper) };
        RefinedBounds { refined, scanned }
    }
}

/// A key's bounds from all 8 bits of its codes and from the scanned 4.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RefinedBounds {
    /// From the 8-bit codes, within the scan's.
    pub refined: Bounds,
    /// The scan's, from the coarse codes alone ([`SketchQuery::bounds`]).
    pub scanned: Bounds,
}

/// The [`RefinedBounds`] of a page's rows for a group of queries, a slice
/// per field, so that a caller reads the one it needs end to end: query
/// `h`'s bounds of row `i` of `n` are at `h · n + i` in each.
pub struct RefinedRows<'a> {
    /// `refined.lower`.
    pub lower: &'a mut [f32],
    /// `refined.upper`.
    pub upper: &'a mut [f32],
    /// `scanned.lower`.
    pub scanned_lower: &'a mut [f32],
    /// `scanned.upper`.
    pub scanned_upper: &'a mut [f32],
}

impl<'a> RefinedRows<'a> {
    /// The four fields in four equal parts of `buffer`, in the order of
    /// the struct's.
    ///
    /// # Panics
    /// If `buffer`'s length is not a multiple of 4.
    pub fn of(buffer: &'a mut [f32]) -> Self {
        assert!(buffer.len().is_multiple_of(4), "four fields of {} numbers", buffer.len() as f64 / 4.0);
        let (lower, rest) = buffer.split_at_mut(buffer.len() / 4);
        let (upper, rest) = rest.split_at_mut(lower.len());
        let (scanned_lower, scanned_upper) = rest.split_at_mut(lower.len());
        Self { lower, upper, scanned_lower, scanned_upper }
    }

    /// The bounds at `range` of every field.
    pub fn slice(&mut self, range: core::ops::Range<usize>) -> RefinedRows<'_> {
        RefinedRows {
            lower: &mut self.lower[range.clone()],
            upper: &mut self.upper[range.clone()],
            scanned_lower: &mut self.scanned_lower[range.clone()],
            scanned_upper: &mut self.scanned_upper[range],
        }
    }

    /// Bounds per field.
    pub fn len(&self) -> usize {
        self.lower.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.lower.is_empty()
    }

    /// Whether every field has as many bounds.
    fn is_even(&self) -> bool {
        let n = self.len();
        self.upper.len() == n && self.scanned_lower.len() == n && self.scanned_upper.len() == n
    }

    /// Writes the bounds at `k`.
    #[inline(always)]
    pub fn set(&mut self, k: usize, b: RefinedBounds) {
        (self.lower[k], self.upper[k]) = (b.refined.lower, b.refined.upper);
        (self.scanned_lower[k], self.scanned_upper[k]) = (b.scanned.lower, b.scanned.upper);
    }

    /// The bounds at `k`.
    pub fn get(&self, k: usize) -> RefinedBounds {
        RefinedBounds {
            refined: Bounds { lower: self.lower[k], upper: self.upper[k] },
            scanned: Bounds { lower: self.scanned_lower[k], upper: self.scanned_upper[k] },
        }
    }
}

/// The per-channel terms of a sketch query's set-up, summed over the
/// channels: what `sift`'s key sketch turns into the bounds' constants (it
/// derives them). With `a_c = q_c·step_c`, weights `â_c = round(a_c/α)`,
/// `δ_c = a_c − α·â_c`, residuals `r̂_c = round(δ_c/α₂)` and
/// `ε_c = δ_c − α₂·r̂_c`:
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrepareSums {
    /// `Σ q_c·min_c`.
    pub centre: f32,
    /// `Σ a_c`.
    pub a: f32,
    /// `Σ |a_c|`.
    pub a_abs: f32,
    /// `Σ max(δ_c, 0)`.
    pub above: f32,
    /// `Σ max(−δ_c, 0)`.
    pub below: f32,
    /// `Σ max(ε_c, 0)`.
    pub residual_above: f32,
    /// `Σ max(−ε_c, 0)`.
    pub residual_below: f32,
    /// `Σ |q_c·min_c|`.
    pub centre_abs: f32,
    /// `Σ (|a_c| + |α·â_c|)`.
    pub scaled_abs: f32,
    /// `Σ |q_c|·(|min_c| + 255·step_c)`.
    pub dot: f32,
    /// `Σ |â_c|`.
    pub weights: f32,
    /// `Σ |r̂_c|`.
    pub residuals: f32,
}

/// The set-up's scales from `max_c |a_c|`: `α = max/127`, `α₂ = α/248` (so
/// that `|δ| ≤ α/2` fits 127 steps of it), and their inverses (0 where an
/// inverse would not be finite: the weights are then 0, which is valid).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrepareScales {
    /// `α`: the weights' step.
    pub alpha: f32,
    /// `α₂`: the residuals' step.
    pub alpha2: f32,
    inverse: f32,
    inverse2: f32,
}

impl PrepareScales {
    pub(crate) fn of(a_max: f32) -> Self {
        let alpha = a_max / 127.0;
        let alpha2 = alpha / 248.0;
        let invert = |x: f32| {
            let inverse = 1.0 / x;
            if x > 0.0 && inverse.is_finite() {
                inverse
            } else {
                0.0
            }
        };
        Self { alpha, alpha2, inverse: invert(alpha), inverse2: invert(alpha2) }
    }

    pub(crate) fn inverse(&self) -> f32 {
        self.inverse
    }

    pub(crate) fn inverse2(&self) -> f32 {
        self.inverse2
    }
}

/// Lanes of the set-up's sums: channel `c` adds to lane `c mod 16`, and the
/// lanes are reduced pairwise (`l` with `l + 8`, then `+ 4`, `+ 2`, `+ 1`),
/// the same on every table.
pub(crate) const PREPARE_LANES: usize = 16;

/// Adding and taking away 1.5·2^23 rounds to the nearest integer (ties to
/// even) for |x| < 2^22: f32 has no bits left below 1 there.
pub(crate) const ROUND: f32 = 12_582_912.0;

/// `x` if above 0, else 0 (as `maxps(x, 0)`: +0 for −0).
#[inline(always)]
pub(crate) fn positive(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// `x` within `[−127, 127]` (as `maxps(minps(x, 127), −127)`).
#[inline(always)]
pub(crate) fn clamp127(x: f32) -> f32 {
    let x = if x < 127.0 { x } else { 127.0 };
    if x > -127.0 {
        x
    } else {
        -127.0
    }
}

/// The sixteen lanes of each of the twelve sums reduced in the tables'
/// order.
pub(crate) fn reduce_prepare(lanes: &[[f32; 8]; 12]) -> PrepareSums {
    let sums = lanes.map(|l| {
        let l4: [f32; 4] = core::array::from_fn(|j| l[j] + l[j + 4]);
        let l2: [f32; 2] = core::array::from_fn(|j| l4[j] + l4[j + 2]);
        l2[0] + l2[1]
    });
    let [centre, a, a_abs, above, below, residual_above, residual_below, centre_abs, scaled_abs, dot, weights, residuals] =
        sums;
    PrepareSums {
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
    }
}

/// Lower and upper bounds on a score.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bounds {
    /// At most the score.
    pub lower: f32,
    /// At least the score.
    pub upper: f32,
}

/// The integer dots of a block of rows with a group of queries: the part of
/// the scan each table writes with its own instructions.
pub(crate) trait BlockDots {
    /// `out[g][r] = Σ_j Σ_m weights[g][j·len + m] · field_j(row_r[m])`, `len`
    /// the row bytes, `row_r` row `rows[r]` of `codes` (codes of `BITS` bits),
    /// `field_j` of a byte its `j`-th code.
    ///
    /// # Safety
    /// The CPU must support the table's ISA; every row index is below the
    /// number of rows, and every query has [`SketchLayout::weights_len`]
    /// weights.
    unsafe fn dots<const BITS: u32, const G: usize, const R: usize>(
        codes: &SketchCodes,
        weights: [&[i8]; G],
        rows: [usize; R],
    ) -> [[i32; R]; G];
}

/// Rows per block of the scan: a page.
const BLOCK: usize = 64;

/// Calls `emit(query, dots, out)` for every query with its integer dots
/// against rows `row_of(0..rows)` of `codes` and its own `rows`-long part of
/// `out`, a block of rows at a time.
///
/// # Safety
/// As [`BlockDots::dots`]; the caller has checked the layout, the number of
/// weights of every query, that every `row_of(k)` is a row of `codes`, and
/// that `out` holds `rows` items per query.
#[inline(always)]
unsafe fn scan<D: BlockDots, T>(
    codes: &SketchCodes,
    queries: &[SketchQuery],
    rows: usize,
    row_of: impl Fn(usize) -> usize + Copy,
    out: &mut [T],
    emit: impl Fn(&SketchQuery, &[i32], &mut [T]) + Copy,
) {
    if rows == 0 {
        return;
    }
    let mut queries = queries.iter().zip(out.chunks_exact_mut(rows));
    // SAFETY (every arm): the caller's guarantees are passed on.
    loop {
        match (queries.len(), codes.layout.bits) {
            (0, _) => break,
            (1, 4) => unsafe { scan_group::<D, T, 4, 1, 8>(codes, &mut queries, rows, row_of, emit) },
            (2 | 3, 4) => unsafe { scan_group::<D, T, 4, 2, 4>(codes, &mut queries, rows, row_of, emit) },
            (_, 4) => unsafe { scan_group::<D, T, 4, 4, 2>(codes, &mut queries, rows, row_of, emit) },
            (1, _) => unsafe { scan_group::<D, T, 2, 1, 8>(codes, &mut queries, rows, row_of, emit) },
            (2 | 3, _) => unsafe { scan_group::<D, T, 2, 2, 4>(codes, &mut queries, rows, row_of, emit) },
            (_, _) => unsafe { scan_group::<D, T, 2, 4, 2>(codes, &mut queries, rows, row_of, emit) },
        }
    }
}

/// [`scan`] of the next `G` queries, `R` rows at a time.
///
/// # Safety
/// As [`scan`]; at least `G` queries are left.
#[inline(always)]
unsafe fn scan_group<'a, 'q: 'a, D: BlockDots, T: 'a, const BITS: u32, const G: usize, const R: usize>(
    codes: &SketchCodes,
    queries: &mut impl Iterator<Item = (&'a SketchQuery<'q>, &'a mut [T])>,
    rows: usize,
    row_of: impl Fn(usize) -> usize,
    emit: impl Fn(&SketchQuery, &[i32], &mut [T]),
) {
    let mut group: [_; G] = core::array::from_fn(|_| queries.next().expect("a whole group is left"));
    let weights = group.each_ref().map(|(q, _)| q.weights);
    for first in (0..rows).step_by(BLOCK) {
        let block = first..rows.min(first + BLOCK);
        let mut dots = [[0i32; BLOCK]; G];
        for j in block.clone().step_by(R) {
            // Past the last row, the block repeats it (and drops its dots).
            let at = core::array::from_fn(|r| row_of((j + r).min(rows - 1)));
            // SAFETY: the caller's guarantees are passed on; every row is in bounds.
            let block_dots = unsafe { D::dots::<BITS, G, R>(codes, weights, at) };
            for (dots, block_dots) in dots.iter_mut().zip(block_dots) {
                for (r, dot) in block_dots.into_iter().enumerate().take(block.end - j) {
                    dots[j - first + r] = dot;
                }
            }
        }
        for ((query, out), dots) in group.iter_mut().zip(&dots) {
            emit(query, &dots[..block.len()], &mut out[block.clone()]);
        }
    }
}

/// The integer dots of every query with every row into `out`, query after
/// query.
///
/// # Safety
/// As [`scan`].
#[inline(always)]
pub(crate) unsafe fn scan_dots<D: BlockDots>(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [i32]) {
    let rows = out.len() / queries.len().max(1);
    // SAFETY: the caller's guarantees are passed on.
    unsafe { scan::<D, i32>(codes, queries, rows, |r| r, out, |_, dots, out| out.copy_from_slice(dots)) }
}

/// The integer dots of every query with rows `rows` of `codes` into `out`,
/// query after query.
///
/// # Safety
/// As [`scan`]; every row listed is a row of `codes`.
#[inline(always)]
pub(crate) unsafe fn scan_dots_at<D: BlockDots>(
    codes: &SketchCodes,
    queries: &[SketchQuery],
    rows: &[u32],
    out: &mut [i32],
) {
    let copy = |_: &SketchQuery, dots: &[i32], out: &mut [i32]| out.copy_from_slice(dots);
    // SAFETY: the caller's guarantees are passed on.
    unsafe { scan::<D, i32>(codes, queries, rows.len(), |k| rows[k] as usize, out, copy) }
}

/// The bounds of every query's score with every row into `out`, query after
/// query.
///
/// # Safety
/// As [`scan`].
#[inline(always)]
pub(crate) unsafe fn scan_bounds<D: BlockDots>(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [Bounds]) {
    let rows = out.len() / queries.len().max(1);
    let emit = |query: &SketchQuery, dots: &[i32], out: &mut [Bounds]| {
        for (o, &dot) in out.iter_mut().zip(dots) {
            *o = query.bounds(dot);
        }
    };
    // SAFETY: the caller's guarantees are passed on.
    unsafe { scan::<D, Bounds>(codes, queries, rows, |r| r, out, emit) }
}

/// The portable table's integer dots: plain loops.
pub(crate) struct Portable;

impl BlockDots for Portable {
    #[inline(always)]
    unsafe fn dots<const BITS: u32, const G: usize, const R: usize>(
        codes: &SketchCodes,
        weights: [&[i8]; G],
        rows: [usize; R],
    ) -> [[i32; R]; G] {
        let len = codes.layout.row_bytes();
        let mask = (1u8 << BITS) - 1;
        let mut out = [[0; R]; G];
        for (out, weights) in out.iter_mut().zip(weights) {
            for (out, &r) in out.iter_mut().zip(&rows) {
                let row = &codes.codes[r * len..][..len];
                for (j, plane) in weights.chunks_exact(len).enumerate() {
                    let shift = BITS as usize * j;
                    *out += row
                        .iter()
                        .zip(plane)
                        .map(|(&b, &w)| i32::from((b >> shift) & mask) * i32::from(w))
                        .sum::<i32>();
                }
            }
        }
        out
    }
}

/// The refinement of every row of a page for every query, from the integer
/// dots of the coarse and the fine codes (4-bit fields each) with the
/// weights and the residual weights: the 8-bit dot is `16·coarse + fine`.
/// The portable table's form (the x86 tables read each row once for all
/// the queries: `x86/sketch.rs`).
///
/// # Safety
/// As [`scan`]; the fine codes have the coarse codes' layout, rows and
/// width (4 bits), and every field of `out` holds as many bounds per query
/// as there are rows.
#[inline(always)]
pub(crate) unsafe fn refine_composed<D: BlockDots>(
    coarse: &SketchCodes,
    fine: &SketchCodes,
    queries: &[RefineQuery],
    out: &mut RefinedRows,
) {
    /// Queries refined together: their weights and residuals make sixteen
    /// weight sets at most.
    const GROUP: usize = 8;
    let rows = out.len() / queries.len().max(1);
    if rows == 0 {
        return;
    }
    let empty = SketchQuery { weights: &[], beta: 0.0, lower: 0.0, upper: 0.0 };
    let mut views = [empty; 2 * GROUP];
    let mut dots = [0i32; 4 * 2 * GROUP * BLOCK];
    for (group, queries) in queries.chunks(GROUP).enumerate() {
        let n = queries.len();
        for (k, query) in queries.iter().enumerate() {
            views[k] = query.scan;
            views[n + k] = SketchQuery { weights: query.residuals, ..query.scan };
        }
        for first in (0..rows).step_by(BLOCK) {
            let block = rows.min(first + BLOCK) - first;
            let len = n * block;
            let (coarse_dots, fine_dots) = dots[..4 * len].split_at_mut(2 * len);
            let at: [u32; BLOCK] = core::array::from_fn(|r| (first + r) as u32);
            // SAFETY: the caller's guarantees are passed on; every row is in bounds.
            unsafe {
                scan_dots_at::<D>(coarse, &views[..2 * n], &at[..block], coarse_dots);
                scan_dots_at::<D>(fine, &views[..2 * n], &at[..block], fine_dots);
            }
            // The 8-bit code is the 4 scanned bits above the 4 fine ones.
            let code_dot = |k: usize| 16 * i64::from(dots[k]) + i64::from(dots[2 * len + k]);
            for (h, query) in queries.iter().enumerate() {
                for r in 0..block {
                    let k = h * block + r;
                    let at = (group * GROUP + h) * rows + first + r;
                    out.set(at, query.bounds(dots[k], code_dot(k), code_dot(len + k)));
                }
            }
        }
    }
}

/// `out[i]` = how many of `thresholds` `values[i]` does not reach
/// (`v < t` or unordered: NaN reaches none), counted one threshold after
/// another.
#[inline(always)]
pub(crate) fn first_levels_rest(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
    for (level, &v) in out.iter_mut().zip(values) {
        *level = thresholds.iter().map(|&t| u8::from(v.partial_cmp(&t).is_none_or(|o| o.is_lt()))).sum();
    }
}

/// The portable table's entries.
pub(crate) mod portable {
    use super::*;

    /// Table entry: [`Kernels::sketch_prepare`] (lengths checked by the caller).
    pub(crate) fn prepare(
        q: &[f32],
        min: &[f32],
        step: &[f32],
        weights: &mut [i8],
        residuals: &mut [i8],
    ) -> (PrepareScales, PrepareSums) {
        let a_max = q.iter().zip(step).fold(0.0f32, |m, (&q, &s)| {
            let a = (q * s).abs();
            if a > m {
                a
            } else {
                m
            }
        });
        let scales = PrepareScales::of(a_max);
        let PrepareScales { alpha, alpha2, inverse, inverse2 } = scales;
        let mut lanes = [[0.0f32; PREPARE_LANES]; 12];
        for c in 0..q.len() {
            let (q, min, step) = (q[c], min[c], step[c]);
            let a = q * step;
            let w = clamp127(((a * inverse) + ROUND) - ROUND);
            let delta = a - alpha * w;
            let r = clamp127(((delta * inverse2) + ROUND) - ROUND);
            let residual = delta - alpha2 * r;
            let centre = q * min;
            (weights[c], residuals[c]) = (w as i8, r as i8);
            let terms = [
                centre,
                a,
                a.abs(),
                positive(delta),
                positive(-delta),
                positive(residual),
                positive(-residual),
                centre.abs(),
                a.abs() + (alpha * w).abs(),
                q.abs() * (min.abs() + 255.0 * step),
                w.abs(),
                r.abs(),
            ];
            for (lane, term) in lanes.iter_mut().zip(terms) {
                lane[c % PREPARE_LANES] += term;
            }
        }
        let halves = lanes.map(|l| core::array::from_fn(|j| l[j] + l[j + 8]));
        (scales, reduce_prepare(&halves))
    }

    /// Table entry: [`scan_dots`] (lengths checked by the caller).
    pub(crate) fn dots(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [i32]) {
        // SAFETY: `Portable` uses no ISA-specific instructions.
        unsafe { scan_dots::<Portable>(codes, queries, out) }
    }

    /// Table entry: [`scan_dots_at`] (lengths and rows checked by the caller).
    pub(crate) fn dots_at(codes: &SketchCodes, queries: &[SketchQuery], rows: &[u32], out: &mut [i32]) {
        // SAFETY: as above.
        unsafe { scan_dots_at::<Portable>(codes, queries, rows, out) }
    }

    /// Table entry: [`refine_composed`] (lengths checked by the caller).
    pub(crate) fn refine_page(
        coarse: &SketchCodes,
        fine: &SketchCodes,
        queries: &[RefineQuery],
        out: &mut RefinedRows,
    ) {
        // SAFETY: as above.
        unsafe { refine_composed::<Portable>(coarse, fine, queries, out) }
    }

    /// Table entry: [`super::first_levels_rest`] over every number.
    pub(crate) fn levels(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
        first_levels_rest(values, thresholds, out)
    }

    /// Table entry: [`scan_bounds`] (lengths checked by the caller).
    pub(crate) fn bounds(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [Bounds]) {
        // SAFETY: as above.
        unsafe { scan_bounds::<Portable>(codes, queries, out) }
    }
}

/// The key sketch's scan (see [`crate::sketch`]).
impl Kernels {
    /// `out[h · n + i] = Σ_c â_hc · h_ic`: the integer dot of query `h`'s
    /// weights with row `i` of the `n` rows of `codes`, exact.
    ///
    /// # Panics
    /// If the codes are not 2 or 4 bits, not whole rows of `1..=2^20` codes,
    /// a query has other than [`SketchLayout::weights_len`] weights, or `out`
    /// does not hold `n` numbers per query.
    pub fn sketch_dots(&self, codes: &SketchCodes, queries: &[SketchQuery], out: &mut [i32]) {
        check_scan(codes, queries, out.len());
        // SAFETY: lengths checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.dots)(codes, queries, out) }
    }

    /// The set-up of a query `q` for a page of codes whose channels have
    /// minima `min` and steps `step`: the i8 weights and residuals in
    /// channel order, the scales, and the sums of the per-channel terms
    /// ([`PrepareSums`]), in f32, the same bits on every table.
    ///
    /// # Panics
    /// If the four lengths differ.
    pub fn sketch_prepare(
        &self,
        q: &[f32],
        min: &[f32],
        step: &[f32],
        weights: &mut [i8],
        residuals: &mut [i8],
    ) -> (PrepareScales, PrepareSums) {
        let n = q.len();
        assert!(min.len() == n && step.len() == n, "a minimum and a step per channel of the query");
        assert!(weights.len() == n && residuals.len() == n, "a weight and a residual per channel");
        // SAFETY: lengths checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.prepare)(q, min, step, weights, residuals) }
    }

    /// `out[h · n + k] = Σ_c â_hc · h_{rows[k], c}`: [`Kernels::sketch_dots`]
    /// at the `n` rows listed (in any order, repeats allowed), as the
    /// refinement of a few candidate keys reads them.
    ///
    /// # Panics
    /// As [`Kernels::sketch_dots`], and if a row listed is not one of the codes'.
    pub fn sketch_dots_at(&self, codes: &SketchCodes, queries: &[SketchQuery], rows: &[u32], out: &mut [i32]) {
        let n = codes.rows();
        assert!(rows.iter().all(|&r| (r as usize) < n), "a row listed is past the {n} rows");
        check_queries(codes, queries);
        assert_eq!(out.len(), rows.len() * queries.len(), "{} queries by {} rows", queries.len(), rows.len());
        // SAFETY: lengths and rows checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.dots_at)(codes, queries, rows, out) }
    }

    /// `out`'s bounds at `h · n + i`: query `h`'s bounds on its score of row `i` of the
    /// `n` rows of a page whose 8-bit codes are kept as `coarse` (the top 4
    /// bits, as the scan reads them) over `fine` (the low 4 bits, in the
    /// same layout): [`RefineQuery::bounds`] of the row's exact integer
    /// dots, the scan's bounds with them. Each row's codes are read once for
    /// every query.
    ///
    /// # Panics
    /// If the codes are not 4-bit, not whole rows of `1..=2^16` codes, the
    /// fine codes differ in layout or rows, a query has other than
    /// [`SketchLayout::weights_len`] weights or residuals, or a field of
    /// `out` does not hold `n` bounds per query.
    pub fn sketch_refine_page(
        &self,
        coarse: &SketchCodes,
        fine: &SketchCodes,
        queries: &[RefineQuery],
        out: &mut RefinedRows,
    ) {
        let rows = coarse.rows();
        assert!(coarse.layout.bits == 4 && coarse.layout.dim <= 1 << 16, "refining {:?}", coarse.layout);
        assert_eq!(fine.layout, coarse.layout, "the fine codes in the coarse codes' layout");
        assert_eq!(fine.rows(), rows, "as many fine rows as coarse ones");
        let weights = coarse.layout.weights_len();
        assert!(
            queries.iter().all(|q| q.scan.weights.len() == weights && q.residuals.len() == weights),
            "every query needs {weights} weights and residuals"
        );
        assert!(out.is_even(), "as many bounds in every field");
        assert_eq!(out.len(), rows * queries.len(), "{} queries by {rows} rows", queries.len());
        // SAFETY: lengths checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.refine_page)(coarse, fine, queries, out) }
    }

    /// Writes to `out[i]`, for thresholds that do not rise, the first
    /// level `j` with `values[i] ≥ thresholds[j]` (`thresholds.len()` where
    /// none is reached, NaN reaching none): the level at which a pool key
    /// whose perturbed score bound is `values[i]` can first enter, which
    /// certified attention sorts its keys by. (For thresholds in any order
    /// it is the count of those not reached.)
    ///
    /// # Panics
    /// If `out` and `values` differ in length, or there are 256 thresholds
    /// or more.
    pub fn first_levels(&self, values: &[f32], thresholds: &[f32], out: &mut [u8]) {
        assert_eq!(out.len(), values.len(), "a level per number");
        assert!(thresholds.len() < 256, "{} thresholds: a level must fit a byte", thresholds.len());
        // SAFETY: lengths checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.levels)(values, thresholds, out) }
    }

    /// `out[h · n + i]` = query `h`'s [`SketchQuery::bounds`] of its integer
    /// dot with row `i` (as [`Kernels::sketch_dots`] gives it), for the
    /// queries of one KV head, which read each row once for all of them.
    ///
    /// # Panics
    /// As [`Kernels::sketch_dots`].
    pub fn sketch_scan(&self, codes: &SketchCodes, queries: &[SketchQuery], out: &mut [Bounds]) {
        check_scan(codes, queries, out.len());
        // SAFETY: lengths checked above; the table's ISA is supported (see `dispatch`).
        unsafe { (self.sketch.bounds)(codes, queries, out) }
    }
}

#[track_caller]
fn check_scan(codes: &SketchCodes, queries: &[SketchQuery], out: usize) {
    let rows = codes.rows();
    check_queries(codes, queries);
    assert_eq!(out, rows * queries.len(), "{} queries by {rows} rows", queries.len());
}

#[track_caller]
fn check_queries(codes: &SketchCodes, queries: &[SketchQuery]) {
    let weights = codes.layout.weights_len();
    assert!(queries.iter().all(|q| q.weights.len() == weights), "every query needs {weights} weights");
}
