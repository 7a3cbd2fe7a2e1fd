//! The sketch scan's integer dots on AVX2, AVX-VNNI and AVX-512 VNNI, one body over
//! [`IsaOps::dp`]: 32 code bytes at a time, each field of them (the low and
//! high nibbles of 4-bit codes, the four bit pairs of 2-bit ones) shifted and
//! masked into bytes and multiplied with the matching plane of weights.
//!
//! On AVX2, `dp` is `vpmaddubsw` (u8 × i8, adjacent pairs summed into i16
//! with saturation) and `vpmaddwd` by ones. The codes are below 16 and the
//! weights at least −128, so a pair sums to at most 2·15·128 = 3840 in
//! magnitude: far from i16's 32767, no saturation. On AVX-512 VNNI `dp` is
//! (and AVX-VNNI, its VEX form) `vpdpbusd`, which sums four products into
//! i32 without saturating at all.
//! The ymm form serves both: Zen 4 runs zmm operations as two ymm halves.
//!
//! The refinement of a whole page ([`refine_fused`]) reads each row's coarse
//! and fine bytes once for all its queries. The VNNI tables join each coarse
//! byte with its fine byte into the two 8-bit codes they hold, so that one
//! chain of byte products per query gives the 8-bit dot (the codes reach
//! 255, which `vpdpbusd` takes and `vpmaddubsw` would saturate on). AVX2
//! keeps the 4-bit fields apart, four chains of `vpmaddubsw` summed in i16
//! lanes over up to four vectors before one `vpmaddwd` widens them, and
//! composes the 8-bit dot as `16·coarse + fine` ([`RefineBytes`]).

use core::arch::x86_64::*;

use super::{load32, reduce8x8, Avx2, Avx512, AvxVnni, IsaOps};
use crate::dispatch::SketchKernels;
use crate::sketch::{
    reduce_prepare, BlockDots, Bounds, PrepareScales, PrepareSums, RefineQuery, RefinedRows, SketchCodes, SketchQuery,
    ROUND,
};

/// Bytes of codes per vector.
const VECTOR: usize = 32;

impl<I: IsaOps> BlockDots for I {
    #[inline(always)]
    unsafe fn dots<const BITS: u32, const G: usize, const R: usize>(
        codes: &SketchCodes,
        weights: [&[i8]; G],
        rows: [usize; R],
    ) -> [[i32; R]; G] {
        const { assert!(G * R == 8, "a block's dots fill one vector of eight") };
        let len = codes.layout.row_bytes();
        let rows = rows.map(|r| &codes.codes[r * len..][..len]);
        // SAFETY: the caller's ISA guarantee covers every intrinsic below.
        unsafe {
            let mut acc = [[_mm256_setzero_si256(); R]; G];
            let mut m = 0;
            while m + VECTOR <= len {
                accumulate::<I, BITS, G, R>(&mut acc, rows.map(|row| &row[m..]), weights.map(|w| &w[m..]), len);
                m += VECTOR;
            }
            if m < len {
                // The last bytes and their weights, padded with zeros.
                let tail_rows = rows.map(|row| padded::<u8, VECTOR>(&row[m..]));
                let tail_weights = weights.map(|w| {
                    let mut planes = [0i8; 4 * VECTOR];
                    for (plane, w) in planes.chunks_exact_mut(VECTOR).zip(w.chunks_exact(len)) {
                        plane[..len - m].copy_from_slice(&w[m..]);
                    }
                    planes
                });
                let tail_rows = tail_rows.each_ref().map(|r| &r[..]);
                let tail_weights = tail_weights.each_ref().map(|w| &w[..]);
                accumulate::<I, BITS, G, R>(&mut acc, tail_rows, tail_weights, VECTOR);
            }
            let mut flat = [_mm256_setzero_si256(); 8];
            for (g, acc) in acc.iter().enumerate() {
                flat[g * R..][..R].copy_from_slice(acc);
            }
            let sums: [i32; 8] = bytemuck::cast(reduce8x8(&flat));
            core::array::from_fn(|g| core::array::from_fn(|r| sums[g * R + r]))
        }
    }
}

/// `x` followed by zeros up to `N` items.
#[inline(always)]
fn padded<T: Copy + Default, const N: usize>(x: &[T]) -> [T; N] {
    let mut out = [T::default(); N];
    out[..x.len()].copy_from_slice(x);
    out
}

/// Adds to `acc[g][r]` the products of the first [`VECTOR`] code bytes of
/// `rows[r]` with the first [`VECTOR`] weights of each plane of
/// `weights[g]`, the planes `stride` apart.
///
/// # Safety
/// The CPU must support the ISA; every row has [`VECTOR`] bytes, every
/// plane as many weights.
#[inline(always)]
unsafe fn accumulate<I: IsaOps, const BITS: u32, const G: usize, const R: usize>(
    acc: &mut [[__m256i; R]; G],
    rows: [&[u8]; R],
    weights: [&[i8]; G],
    stride: usize,
) {
    // SAFETY: the caller's ISA guarantee covers every intrinsic below.
    unsafe {
        let mask = _mm256_set1_epi8(((1u32 << BITS) - 1) as i8);
        for j in 0..(8 / BITS) as usize {
            let shift = _mm_cvtsi32_si128((BITS as usize * j) as i32);
            let mut w = [_mm256_setzero_si256(); G];
            for (w, weights) in w.iter_mut().zip(&weights) {
                *w = load32(first::<i8>(&weights[j * stride..]));
            }
            for (r, row) in rows.iter().enumerate() {
                // Shifting 16-bit lanes moves the next byte's bits into the
                // top of this one's, where the mask drops them.
                let field = _mm256_and_si256(_mm256_srl_epi16(load32(first::<u8>(row)), shift), mask);
                for (acc, w) in acc.iter_mut().zip(&w) {
                    acc[r] = I::dp(acc[r], field, *w);
                }
            }
        }
    }
}

/// Rows refined together: one vector of dots per query and kind of dot.
const REFINED_ROWS: usize = 8;

/// The most whole vectors of a row [`refine_fused`] keeps weights for (256
/// code bytes, 512 channels of 4 bits, besides a last part-vector); longer
/// rows take the portable composition, with the table's dots and the same
/// bits.
const ROW_VECTORS: usize = 8;

/// The three integer dots of a row the refinement needs, per query: the
/// coarse codes with the weights, the 8-bit codes with the weights, and the
/// 8-bit codes with the residual weights.
type RowDots<const G: usize> = [[__m256i; 3]; G];

/// [`crate::sketch::refine_composed`]'s bounds, each row's code bytes read
/// once for all the queries: per row and [`VECTOR`] code bytes, the
/// table's [`RefineBytes`] add the row's three dots for each query;
/// [`REFINED_ROWS`] rows' dots are reduced together, their bounds computed
/// in f32 vectors with the operations of [`RefineQuery::bounds`] and stored
/// a vector per field.
///
/// # Safety
/// The CPU must support the ISA; the lengths are as
/// `Kernels::sketch_refine_page` checks.
#[inline(always)]
unsafe fn refine_fused<I: RefineBytes>(
    coarse: &SketchCodes,
    fine: &SketchCodes,
    queries: &[RefineQuery],
    out: &mut RefinedRows,
) {
    let rows = out.len() / queries.len().max(1);
    if rows == 0 {
        return;
    }
    if coarse.layout.row_bytes() / VECTOR > ROW_VECTORS {
        // SAFETY: the caller's guarantees are those of the portable form.
        return unsafe { crate::sketch::refine_composed::<I>(coarse, fine, queries, out) };
    }
    let mut first = 0;
    while first < queries.len() {
        let left = &queries[first..];
        // SAFETY (every arm): the caller's guarantees are passed on.
        first += match left.len() {
            1 => unsafe { refine_group::<I, 1>(coarse, fine, left, first, out, rows) },
            2 => unsafe { refine_group::<I, 2>(coarse, fine, left, first, out, rows) },
            3 => unsafe { refine_group::<I, 3>(coarse, fine, left, first, out, rows) },
            _ => unsafe { refine_group::<I, 4>(coarse, fine, left, first, out, rows) },
        };
    }
}

/// [`refine_fused`] of the first `G` of `queries`, the queries from
/// `first_query` on: returns `G`.
///
/// # Safety
/// As [`refine_fused`]; at least `G` queries are given.
#[inline(always)]
unsafe fn refine_group<I: RefineBytes, const G: usize>(
    coarse: &SketchCodes,
    fine: &SketchCodes,
    queries: &[RefineQuery],
    first_query: usize,
    out: &mut RefinedRows,
    rows: usize,
) -> usize {
    let group: [&RefineQuery; G] = core::array::from_fn(|g| &queries[g]);
    let len = coarse.layout.row_bytes();
    let whole = len / VECTOR * VECTOR;
    // SAFETY: the caller's ISA guarantee.
    let zero = unsafe { _mm256_setzero_si256() };
    // Per query, its four planes (weights even and odd, residuals even and
    // odd).
    let planes: [[&[i8]; 4]; G] = group.map(|q| {
        let (w, r) = (q.scan.weights, q.residuals);
        [&w[..len], &w[len..2 * len], &r[..len], &r[len..2 * len]]
    });
    // The planes' whole vectors, loaded once for the page: reading them
    // from the queries' slices for every row cost a pointer and a bounds
    // check per load.
    let weights: [[[__m256i; 4]; G]; ROW_VECTORS] = core::array::from_fn(|k| {
        let at = k * VECTOR;
        core::array::from_fn(|g| {
            core::array::from_fn(|j| if at + VECTOR <= whole { load32(first::<i8>(&planes[g][j][at..])) } else { zero })
        })
    });
    // The planes' last bytes padded with zeros, where rows end past their
    // last whole vector.
    let tails: Option<[[__m256i; 4]; G]> =
        (whole < len).then(|| planes.map(|p| p.map(|plane| load32(&padded::<i8, VECTOR>(&plane[whole..])))));
    // Every block writes every row's dots (past the last row, the last
    // row's again), so the array is cleared once, not once a block.
    let mut dots = [[[zero; REFINED_ROWS]; 3]; G];
    for start in (0..rows).step_by(REFINED_ROWS) {
        for r in 0..REFINED_ROWS {
            // Past the last row, the block repeats it (and drops its bounds).
            let row = (start + r).min(rows - 1);
            let (c, f) = (&coarse.codes[row * len..][..len], &fine.codes[row * len..][..len]);
            let mut acc: RowDots<G> = [[zero; 3]; G];
            let mut partial: PartialDots<G> = [[zero; 4]; G];
            // SAFETY: the caller's ISA guarantee; every load is of a whole vector.
            unsafe {
                for (k, m) in (0..whole).step_by(VECTOR).enumerate() {
                    let (c, f) = (load32(first::<u8>(&c[m..])), load32(first::<u8>(&f[m..])));
                    I::add_bytes::<G>(&mut partial, c, f, &weights[k]);
                    if (k + 1) % I::SPAN == 0 {
                        I::widen::<G>(&mut partial, &mut acc);
                    }
                }
                if let Some(tails) = &tails {
                    let (c, f) = (padded::<u8, VECTOR>(&c[whole..]), padded::<u8, VECTOR>(&f[whole..]));
                    I::add_bytes::<G>(&mut partial, load32(&c), load32(&f), tails);
                }
                I::widen::<G>(&mut partial, &mut acc);
            }
            for (dots, acc) in dots.iter_mut().zip(acc) {
                for (dots, acc) in dots.iter_mut().zip(acc) {
                    dots[r] = acc;
                }
            }
        }
        let block = (rows - start).min(REFINED_ROWS);
        for (g, (query, dots)) in group.iter().zip(&dots).enumerate() {
            // SAFETY: the caller's ISA guarantee.
            let bounds = unsafe { refined_bounds(query, dots.each_ref().map(|d| reduce8x8(d))) };
            let at = (first_query + g) * rows + start;
            let fields = [&mut *out.lower, &mut *out.upper, &mut *out.scanned_lower, &mut *out.scanned_upper];
            for (field, lanes) in fields.into_iter().zip(&bounds) {
                match field[at..].first_chunk_mut::<REFINED_ROWS>() {
                    Some(whole) if block == REFINED_ROWS => *whole = *lanes,
                    _ => field[at..at + block].copy_from_slice(&lanes[..block]),
                }
            }
        }
    }
    G
}

/// Per query, a row's partial sums as a table's [`RefineBytes`] keep them
/// between widenings.
type PartialDots<const G: usize> = [[__m256i; 4]; G];

/// How a table adds a row's code bytes to its three dots per query
/// ([`RowDots`]: coarse codes with the weights, 8-bit codes with the
/// weights and with the residual weights): into partial sums, which
/// [`RefineBytes::widen`] adds to the dots at least every
/// [`RefineBytes::SPAN`] vectors of bytes, and at the row's end.
trait RefineBytes: IsaOps {
    /// Vectors of code bytes the partial sums hold without overflowing.
    const SPAN: usize;

    /// Adds one vector of a row's code bytes, coarse `c` and fine `f`, with
    /// each query's planes `[weights even, weights odd, residuals even,
    /// residuals odd]` at those bytes, to `partial`.
    ///
    /// # Safety
    /// The CPU must support the ISA.
    unsafe fn add_bytes<const G: usize>(
        partial: &mut PartialDots<G>,
        c: __m256i,
        f: __m256i,
        weights: &[[__m256i; 4]; G],
    );

    /// Adds `partial` to `acc` and clears it.
    ///
    /// # Safety
    /// The CPU must support the ISA.
    unsafe fn widen<const G: usize>(partial: &mut PartialDots<G>, acc: &mut RowDots<G>);
}

impl RefineBytes for Avx2 {
    /// A `vpmaddubsw` lane is at most 2·15·128 = 3840 in magnitude (4-bit
    /// codes, weights from −128): two a vector and chain, over four vectors,
    /// 30,720, within an i16.
    const SPAN: usize = 4;

    /// Four chains in i16 lanes: coarse and fine nibbles, each with the
    /// weights and with the residual weights.
    #[inline(always)]
    unsafe fn add_bytes<const G: usize>(
        partial: &mut PartialDots<G>,
        c: __m256i,
        f: __m256i,
        weights: &[[__m256i; 4]; G],
    ) {
        // SAFETY: the caller's ISA guarantee covers every intrinsic below.
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let nibbles = |x| (_mm256_and_si256(x, low), _mm256_and_si256(_mm256_srli_epi16::<4>(x), low));
            let (c_even, c_odd) = nibbles(c);
            let (f_even, f_odd) = nibbles(f);
            let pair = |sum, even, odd, w_even, w_odd| {
                let products = _mm256_add_epi16(_mm256_maddubs_epi16(even, w_even), _mm256_maddubs_epi16(odd, w_odd));
                _mm256_add_epi16(sum, products)
            };
            for (p, [w_even, w_odd, r_even, r_odd]) in partial.iter_mut().zip(weights) {
                p[0] = pair(p[0], c_even, c_odd, *w_even, *w_odd);
                p[1] = pair(p[1], f_even, f_odd, *w_even, *w_odd);
                p[2] = pair(p[2], c_even, c_odd, *r_even, *r_odd);
                p[3] = pair(p[3], f_even, f_odd, *r_even, *r_odd);
            }
        }
    }

    /// Widens the chains to i32 and composes the 8-bit dots, `16·coarse +
    /// fine`.
    #[inline(always)]
    unsafe fn widen<const G: usize>(partial: &mut PartialDots<G>, acc: &mut RowDots<G>) {
        // SAFETY: the caller's ISA guarantee covers every intrinsic below.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            for (p, acc) in partial.iter_mut().zip(acc) {
                let [coarse, fine, coarse_residual, fine_residual] = p.map(|p| _mm256_madd_epi16(p, ones));
                let code = |coarse, fine| _mm256_add_epi32(_mm256_slli_epi32::<4>(coarse), fine);
                acc[0] = _mm256_add_epi32(acc[0], coarse);
                acc[1] = _mm256_add_epi32(acc[1], code(coarse, fine));
                acc[2] = _mm256_add_epi32(acc[2], code(coarse_residual, fine_residual));
                *p = [_mm256_setzero_si256(); 4];
            }
        }
    }
}

/// [`RefineBytes`] for the tables whose `dp` takes 8-bit codes exactly
/// ([`IsaOps::BYTE_DP`]): the coarse nibbles and the two 8-bit codes of each
/// byte (coarse nibble above fine nibble) meet each query's planes, three
/// chains of `dp` in i32 lanes, which never need widening.
macro_rules! byte_dp_refine {
    ($($I:ty),*) => {$(
        impl RefineBytes for $I {
            const SPAN: usize = usize::MAX;

            #[inline(always)]
            unsafe fn add_bytes<const G: usize>(
                partial: &mut PartialDots<G>,
                c: __m256i,
                f: __m256i,
                weights: &[[__m256i; 4]; G],
            ) {
                const { assert!(<$I>::BYTE_DP, "8-bit codes need exact byte products") };
                // SAFETY: the caller's ISA guarantee covers every intrinsic below.
                unsafe {
                    let (low, high) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0xf0u8 as i8));
                    // The coarse codes of the even and odd channels.
                    let coarse_even = _mm256_and_si256(c, low);
                    let coarse_odd = _mm256_and_si256(_mm256_srli_epi16::<4>(c), low);
                    // Their 8-bit codes: coarse nibble above fine nibble.
                    let even =
                        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16::<4>(c), high), _mm256_and_si256(f, low));
                    let odd =
                        _mm256_or_si256(_mm256_and_si256(c, high), _mm256_and_si256(_mm256_srli_epi16::<4>(f), low));
                    for (p, [w_even, w_odd, r_even, r_odd]) in partial.iter_mut().zip(weights) {
                        p[0] = <$I>::dp(<$I>::dp(p[0], coarse_even, *w_even), coarse_odd, *w_odd);
                        p[1] = <$I>::dp(<$I>::dp(p[1], even, *w_even), odd, *w_odd);
                        p[2] = <$I>::dp(<$I>::dp(p[2], even, *r_even), odd, *r_odd);
                    }
                }
            }

            #[inline(always)]
            unsafe fn widen<const G: usize>(partial: &mut PartialDots<G>, acc: &mut RowDots<G>) {
                // SAFETY: the caller's ISA guarantee covers every intrinsic below.
                unsafe {
                    for (p, acc) in partial.iter_mut().zip(acc) {
                        for (acc, p) in acc.iter_mut().zip(p.iter_mut()) {
                            *acc = _mm256_add_epi32(*acc, *p);
                            *p = _mm256_setzero_si256();
                        }
                    }
                }
            }
        }
    )*};
}
byte_dp_refine!(AvxVnni, Avx512);

/// [`RefineQuery::bounds`] of eight rows, from their dots `[coarse, 8-bit,
/// 8-bit residual]`, in f32 vectors with the same operations: the rows'
/// refined lower and upper bounds, then the scan's.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn refined_bounds(query: &RefineQuery, dots: [__m256i; 3]) -> [[f32; REFINED_ROWS]; 4] {
    // SAFETY: the caller's ISA guarantee covers every intrinsic below.
    unsafe {
        let splat = _mm256_set1_ps;
        let [coarse, code, residual] = dots.map(|d| _mm256_cvtepi32_ps(d));
        let x = _mm256_mul_ps(splat(query.scan.beta), coarse);
        let (scanned_lower, scanned_upper) =
            (_mm256_add_ps(x, splat(query.scan.lower)), _mm256_add_ps(x, splat(query.scan.upper)));
        let fine = query.fine;
        let x = _mm256_add_ps(_mm256_mul_ps(splat(fine.alpha), code), _mm256_mul_ps(splat(fine.alpha2), residual));
        let (lower, upper) = (_mm256_add_ps(x, splat(fine.lower)), _mm256_add_ps(x, splat(fine.upper)));
        [_mm256_max_ps(lower, scanned_lower), _mm256_min_ps(upper, scanned_upper), scanned_lower, scanned_upper]
            .map(bytemuck::cast)
    }
}

/// The first [`VECTOR`] items of `x`, which has them.
#[inline(always)]
fn first<T>(x: &[T]) -> &[T; VECTOR] {
    x.first_chunk().expect("a whole vector is left")
}

/// Defines the module `$module` of the scan's table entries on `$I`,
/// compiled for `$features`.
macro_rules! sketch_entries {
    ($module:ident, $I:ty, $features:literal) => {
        mod $module {
            use super::*;

            /// # Safety
            /// The CPU must support the features; lengths as `Kernels::sketch_dots` checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn dots(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [i32]) {
                // SAFETY: this function enables the features.
                unsafe { crate::sketch::scan_dots::<$I>(codes, queries, out) }
            }

            /// # Safety
            /// The CPU must support the features; lengths and rows as `Kernels::sketch_dots_at` checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn dots_at(codes: &SketchCodes, queries: &[SketchQuery], rows: &[u32], out: &mut [i32]) {
                // SAFETY: this function enables the features.
                unsafe { crate::sketch::scan_dots_at::<$I>(codes, queries, rows, out) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `Kernels::sketch_scan` checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn bounds(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [Bounds]) {
                // SAFETY: this function enables the features.
                unsafe { crate::sketch::scan_bounds::<$I>(codes, queries, out) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `Kernels::sketch_refine_page` checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn refine_page(
                coarse: &SketchCodes,
                fine: &SketchCodes,
                queries: &[RefineQuery],
                out: &mut RefinedRows,
            ) {
                // SAFETY: this function enables the features.
                unsafe { refine_fused::<$I>(coarse, fine, queries, out) }
            }
        }
    };
}

// The feature lists are those `Isa::is_supported` checks.
sketch_entries!(avx2, Avx2, "avx2,fma,f16c");
sketch_entries!(avxvnni, AvxVnni, "avx2,fma,f16c,avxvnni");
sketch_entries!(avx512, Avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

/// `Kernels::first_levels` on AVX2: thirty-two numbers at a time, in four
/// vectors of counts, each threshold broadcast once for all four and its
/// "not reached" mask (all ones, −1) subtracted; the counts packed to bytes.
///
/// # Safety
/// The CPU must support AVX2; `out` holds `values.len()` items and
/// `thresholds` fewer than 256.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn first_levels_avx2(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
    let (chunks, rest) = values.as_chunks::<32>();
    let (outs, rest_out) = out.as_chunks_mut::<32>();
    for (chunk, out) in chunks.iter().zip(outs) {
        // SAFETY: the chunk holds the thirty-two numbers loaded.
        let at = |k: usize| chunk[k..].as_ptr();
        let v = unsafe {
            [_mm256_loadu_ps(at(0)), _mm256_loadu_ps(at(8)), _mm256_loadu_ps(at(16)), _mm256_loadu_ps(at(24))]
        };
        let mut counts = [_mm256_setzero_si256(); 4];
        for &t in thresholds {
            let t = _mm256_set1_ps(t);
            for (count, &v) in counts.iter_mut().zip(&v) {
                let missed = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_NGE_UQ>(v, t));
                *count = _mm256_sub_epi32(*count, missed);
            }
        }
        // Within each 128-bit half the packs interleave their inputs' halves;
        // the permutation puts the four-byte groups back in order.
        let words =
            _mm256_packus_epi16(_mm256_packs_epi32(counts[0], counts[1]), _mm256_packs_epi32(counts[2], counts[3]));
        let bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `out` holds the thirty-two bytes stored.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes) };
    }
    crate::sketch::first_levels_rest(rest, thresholds, rest_out);
}

/// `Kernels::first_levels` on AVX-512: sixty-four numbers at a time, in
/// four vectors of counts, each threshold broadcast once for all four and
/// added under its "not reached" mask; the counts narrowed to bytes.
///
/// # Safety
/// The CPU must support AVX-512F; `out` holds `values.len()` items and
/// `thresholds` fewer than 256.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn first_levels_avx512(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
    let (chunks, rest) = values.as_chunks::<64>();
    let (outs, rest_out) = out.as_chunks_mut::<64>();
    let one = _mm512_set1_epi32(1);
    for (chunk, out) in chunks.iter().zip(outs) {
        // SAFETY: the chunk holds the sixty-four numbers loaded.
        let at = |k: usize| chunk[k..].as_ptr();
        let v = unsafe {
            [_mm512_loadu_ps(at(0)), _mm512_loadu_ps(at(16)), _mm512_loadu_ps(at(32)), _mm512_loadu_ps(at(48))]
        };
        let mut counts = [_mm512_setzero_si512(); 4];
        for &t in thresholds {
            let t = _mm512_set1_ps(t);
            for (count, &v) in counts.iter_mut().zip(&v) {
                *count = _mm512_mask_add_epi32(*count, _mm512_cmp_ps_mask::<_CMP_NGE_UQ>(v, t), *count, one);
            }
        }
        for (k, &count) in counts.iter().enumerate() {
            // SAFETY: `out` holds the sixteen bytes stored at `16·k`.
            unsafe { _mm_storeu_si128(out[16 * k..].as_mut_ptr().cast(), _mm512_cvtepi32_epi8(count)) };
        }
    }
    crate::sketch::first_levels_rest(rest, thresholds, rest_out);
}

/// `|x|` lane by lane.
///
/// # Safety
/// The CPU must support AVX.
#[inline(always)]
unsafe fn abs8(x: __m256) -> __m256 {
    // SAFETY: the caller's ISA guarantee.
    unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), x) }
}

/// `x` rounded to the nearest integer (ties to even) within `[−127, 127]`.
///
/// # Safety
/// The CPU must support AVX.
#[inline(always)]
unsafe fn rounded127(x: __m256) -> __m256 {
    // SAFETY: the caller's ISA guarantee.
    unsafe {
        let round = _mm256_set1_ps(ROUND);
        let x = _mm256_sub_ps(_mm256_add_ps(x, round), round);
        _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(127.0)), _mm256_set1_ps(-127.0))
    }
}

/// The eight channels of one of [`prepare_ymm`]'s chunks.
struct Chunk {
    q: [f32; 8],
    min: [f32; 8],
    step: [f32; 8],
}

impl Chunk {
    /// Channels `c..c + 8`, which `q`, `min` and `step` all have.
    #[inline(always)]
    fn whole((q, min, step): (&[f32], &[f32], &[f32]), c: usize) -> Self {
        let eight = |x: &[f32]| *x[c..].first_chunk::<8>().expect("eight channels");
        Self { q: eight(q), min: eight(min), step: eight(step) }
    }

    /// Channels `c..`, fewer than eight, then zeros.
    fn tail((q, min, step): (&[f32], &[f32], &[f32]), c: usize) -> Self {
        Self { q: padded(&q[c..]), min: padded(&min[c..]), step: padded(&step[c..]) }
    }
}

/// [`prepare_ymm`]'s terms of one chunk of channels added to `acc`; returns
/// the chunk's weights and residuals.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn prepare_chunk(chunk: &Chunk, scales: &PrepareScales, acc: &mut [__m256; 12]) -> ([i8; 8], [i8; 8]) {
    let load = |x: &[f32; 8]| -> __m256 { bytemuck::cast(*x) };
    // SAFETY: the caller's ISA guarantee.
    unsafe {
        let splat = _mm256_set1_ps;
        let (alpha, alpha2) = (splat(scales.alpha), splat(scales.alpha2));
        let (inverse, inverse2) = (splat(scales.inverse()), splat(scales.inverse2()));
        let (sign, zero, top_code) = (splat(-0.0), _mm256_setzero_ps(), splat(255.0));
        let (qv, minv, stepv) = (load(&chunk.q), load(&chunk.min), load(&chunk.step));
        let a = _mm256_mul_ps(qv, stepv);
        let w = rounded127(_mm256_mul_ps(a, inverse));
        let aw = _mm256_mul_ps(alpha, w);
        let delta = _mm256_sub_ps(a, aw);
        let r = rounded127(_mm256_mul_ps(delta, inverse2));
        let residual = _mm256_sub_ps(delta, _mm256_mul_ps(alpha2, r));
        let centre = _mm256_mul_ps(qv, minv);
        let terms = [
            centre,
            a,
            abs8(a),
            _mm256_max_ps(delta, zero),
            _mm256_max_ps(_mm256_xor_ps(sign, delta), zero),
            _mm256_max_ps(residual, zero),
            _mm256_max_ps(_mm256_xor_ps(sign, residual), zero),
            abs8(centre),
            _mm256_add_ps(abs8(a), abs8(aw)),
            _mm256_mul_ps(abs8(qv), _mm256_add_ps(abs8(minv), _mm256_mul_ps(top_code, stepv))),
            abs8(w),
            abs8(r),
        ];
        for (acc, term) in acc.iter_mut().zip(terms) {
            *acc = _mm256_add_ps(*acc, term);
        }
        // Integers within ±127: exact as i32, and as bytes after the
        // saturating packs (which keep them).
        let packed = _mm256_packs_epi32(_mm256_cvtps_epi32(w), _mm256_cvtps_epi32(r));
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
        let bytes: [[i8; 8]; 2] =
            bytemuck::cast(_mm_packs_epi16(_mm256_castsi256_si128(packed), _mm256_extracti128_si256::<1>(packed)));
        (bytes[0], bytes[1])
    }
}

/// `Kernels::sketch_prepare` in ymm registers, for every x86 table: eight
/// channels a vector, chunk `k` adding to the half `k mod 2` of the sixteen
/// lanes, every operation the portable one's (no fused multiply-adds), so
/// the bits are the same. The weights and residuals, integers within
/// ±127, are stored eight at a time as bytes. The two halves' 24 sums are
/// named, not indexed, so that they can stay in registers (where the table
/// has the 32 of AVX-512). The whole chunks run in loops of their own, with
/// no call in them (a short last chunk is copied out, then padded), since
/// a call that any iteration might make keeps every running sum in memory.
///
/// # Safety
/// The CPU must support AVX2; the lengths are equal.
#[inline(always)]
unsafe fn prepare_ymm(
    q: &[f32],
    min: &[f32],
    step: &[f32],
    weights: &mut [i8],
    residuals: &mut [i8],
) -> (PrepareScales, PrepareSums) {
    let n = q.len();
    let whole = n / 8 * 8;
    let inputs = (q, min, step);
    let scaled_max = |most: __m256, q: &[f32; 8], step: &[f32; 8]| {
        // SAFETY: the caller's ISA guarantee.
        unsafe { _mm256_max_ps(abs8(_mm256_mul_ps(bytemuck::cast(*q), bytemuck::cast(*step))), most) }
    };
    // SAFETY: the caller's ISA guarantee.
    let mut most = unsafe { _mm256_setzero_ps() };
    for (q, step) in q.chunks_exact(8).zip(step.chunks_exact(8)) {
        most = scaled_max(most, q.first_chunk().expect("eight"), step.first_chunk().expect("eight"));
    }
    if whole < n {
        most = scaled_max(most, &padded(&q[whole..]), &padded(&step[whole..]));
    }
    let lanes: [f32; 8] = bytemuck::cast(most);
    let a_max = lanes.iter().fold(0.0f32, |m, &a| if a > m { a } else { m });
    let scales = PrepareScales::of(a_max);
    // SAFETY: the caller's ISA guarantee.
    let zero = unsafe { _mm256_setzero_ps() };
    let (mut even, mut odd) = ([zero; 12], [zero; 12]);
    let mut store = |c: usize, (w, r): ([i8; 8], [i8; 8])| {
        *weights[c..].first_chunk_mut::<8>().expect("eight weights") = w;
        *residuals[c..].first_chunk_mut::<8>().expect("eight residuals") = r;
    };
    let pairs = n / 16 * 16;
    for c in (0..pairs).step_by(16) {
        // SAFETY: the caller's ISA guarantee.
        let (first, second) = unsafe {
            let first = prepare_chunk(&Chunk::whole(inputs, c), &scales, &mut even);
            (first, prepare_chunk(&Chunk::whole(inputs, c + 8), &scales, &mut odd))
        };
        store(c, first);
        store(c + 8, second);
    }
    if pairs + 8 <= n {
        // SAFETY: the caller's ISA guarantee.
        store(pairs, unsafe { prepare_chunk(&Chunk::whole(inputs, pairs), &scales, &mut even) });
    }
    if whole < n {
        // The short last chunk: the even half's when it is the pairs' first
        // one over, else the odd half's.
        let acc = if whole == pairs { &mut even } else { &mut odd };
        // SAFETY: the caller's ISA guarantee.
        let (w, r) = unsafe { prepare_chunk(&Chunk::tail(inputs, whole), &scales, acc) };
        let len = n - whole;
        weights[whole..].copy_from_slice(&w[..len]);
        residuals[whole..].copy_from_slice(&r[..len]);
    }
    let mut halves = [[0.0f32; 8]; 12];
    for (half, (&even, &odd)) in halves.iter_mut().zip(even.iter().zip(&odd)) {
        // SAFETY: the caller's ISA guarantee.
        *half = bytemuck::cast(unsafe { _mm256_add_ps(even, odd) });
    }
    (scales, reduce_prepare(&halves))
}

/// Defines `$name`, a table entry over [`prepare_ymm`] compiled for
/// `$features`.
macro_rules! prepare_entry {
    ($(#[$doc:meta])* $name:ident, $features:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the features; the lengths are equal.
        #[target_feature(enable = $features)]
        unsafe fn $name(
            q: &[f32],
            min: &[f32],
            step: &[f32],
            weights: &mut [i8],
            residuals: &mut [i8],
        ) -> (PrepareScales, PrepareSums) {
            // SAFETY: passed on.
            unsafe { prepare_ymm(q, min, step, weights, residuals) }
        }
    };
}

prepare_entry!(
    /// The set-up for the AVX2 and AVX-VNNI tables.
    prepare_avx2,
    "avx2,fma,f16c"
);
prepare_entry!(
    /// The set-up for the AVX-512 table: the same operations, with 32
    /// registers to keep its sums in.
    prepare_avx512,
    "avx2,fma,f16c,avx512f,avx512vl"
);

/// Table entry over [`first_levels_avx2`].
///
/// # Safety
/// As [`first_levels_avx2`].
unsafe fn levels_avx2(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
    // SAFETY: passed on.
    unsafe { first_levels_avx2(values, thresholds, out) }
}

/// Table entry over [`first_levels_avx512`].
///
/// # Safety
/// As [`first_levels_avx512`].
unsafe fn levels_avx512(values: &[f32], thresholds: &[f32], out: &mut [u8]) {
    // SAFETY: passed on.
    unsafe { first_levels_avx512(values, thresholds, out) }
}

/// The AVX2 scan entries.
pub(super) const AVX2: SketchKernels = SketchKernels {
    dots: avx2::dots,
    dots_at: avx2::dots_at,
    bounds: avx2::bounds,
    refine_page: avx2::refine_page,
    levels: levels_avx2,
    prepare: prepare_avx2,
};

/// The AVX-VNNI scan entries.
pub(super) const AVXVNNI: SketchKernels = SketchKernels {
    dots: avxvnni::dots,
    dots_at: avxvnni::dots_at,
    bounds: avxvnni::bounds,
    refine_page: avxvnni::refine_page,
    levels: levels_avx2,
    prepare: prepare_avx2,
};

/// The AVX-512 VNNI scan entries.
pub(super) const AVX512: SketchKernels = SketchKernels {
    dots: avx512::dots,
    dots_at: avx512::dots_at,
    bounds: avx512::bounds,
    refine_page: avx512::refine_page,
    levels: levels_avx512,
    prepare: prepare_avx512,
};
