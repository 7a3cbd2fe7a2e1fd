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

use core::arch::x86_64::*;

use super::{load32, reduce8x8, Avx2, Avx512, AvxVnni, IsaOps};
use crate::dispatch::SketchKernels;
use crate::sketch::{reduce_prepare, BlockDots, Bounds, PrepareScales, PrepareSums, SketchCodes, SketchQuery, ROUND};

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
        }
    };
}

// The feature lists are those `Isa::is_supported` checks.
sketch_entries!(avx2, Avx2, "avx2,fma,f16c");
sketch_entries!(avxvnni, AvxVnni, "avx2,fma,f16c,avxvnni");
sketch_entries!(avx512, Avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

/// `Kernels::select_at_least` on AVX2: eight comparisons a vector, their
/// mask's set bits written out one by one (the keys selected are few).
///
/// # Safety
/// The CPU must support AVX2; `out` holds at least `values.len()` items.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn select_at_least_avx2(values: &[f32], threshold: f32, out: &mut [u32]) -> usize {
    let (chunks, rest) = values.as_chunks::<8>();
    let t = _mm256_set1_ps(threshold);
    let mut n = 0;
    for (c, chunk) in chunks.iter().enumerate() {
        // SAFETY: the chunk holds the eight numbers loaded.
        let v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let mut mask = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(v, t)) as u32;
        while mask != 0 {
            out[n] = (c * 8) as u32 + mask.trailing_zeros();
            n += 1;
            mask &= mask - 1;
        }
    }
    crate::sketch::select_rest(rest, values.len() - rest.len(), threshold, out, n)
}

/// `Kernels::select_at_least` on AVX-512: sixteen comparisons a vector, the
/// selected indices compressed in a register and stored whole (a store to
/// memory under a compress mask is slow on Zen 4); the store's spare lanes
/// land on items that later ones overwrite, or past the count.
///
/// # Safety
/// The CPU must support AVX-512F; `out` holds at least `values.len()` items.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn select_at_least_avx512(values: &[f32], threshold: f32, out: &mut [u32]) -> usize {
    let (chunks, rest) = values.as_chunks::<16>();
    let t = _mm512_set1_ps(threshold);
    let sixteen = _mm512_set1_epi32(16);
    let mut index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut n = 0;
    for chunk in chunks {
        // SAFETY: the chunk holds the sixteen numbers loaded.
        let v = unsafe { _mm512_loadu_ps(chunk.as_ptr()) };
        let mask = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, t);
        if mask != 0 {
            // SAFETY: `n` is at most the chunk's first index, so the sixteen
            // items stored lie within `out`, which holds `values.len()`.
            unsafe {
                _mm512_storeu_epi32(out[n..n + 16].as_mut_ptr().cast(), _mm512_maskz_compress_epi32(mask, index))
            };
            n += mask.count_ones() as usize;
        }
        index = _mm512_add_epi32(index, sixteen);
    }
    crate::sketch::select_rest(rest, values.len() - rest.len(), threshold, out, n)
}

/// Eight numbers of `x` from `c` on, zeros past its end.
#[inline(always)]
fn lanes8(x: &[f32], c: usize) -> [f32; 8] {
    match x[c..].first_chunk::<8>() {
        Some(lanes) => *lanes,
        None => padded(&x[c..]),
    }
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

/// `Kernels::sketch_prepare` in ymm registers, for every x86 table: eight
/// channels a vector, chunk `k` adding to the half `k mod 2` of the sixteen
/// lanes, every operation the portable one's (no fused multiply-adds), so
/// the bits are the same. The weights and residuals, integers within
/// ±127, are stored eight at a time as bytes.
///
/// # Safety
/// The CPU must support AVX2; the lengths are equal.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prepare_avx2(
    q: &[f32],
    min: &[f32],
    step: &[f32],
    weights: &mut [i8],
    residuals: &mut [i8],
) -> (PrepareScales, PrepareSums) {
    let n = q.len();
    let load = |x: &[f32], c: usize| -> __m256 { bytemuck::cast(lanes8(x, c)) };
    let mut most = _mm256_setzero_ps();
    for c in (0..n).step_by(8) {
        // SAFETY: AVX2 is enabled in this function.
        most = _mm256_max_ps(unsafe { abs8(_mm256_mul_ps(load(q, c), load(step, c))) }, most);
    }
    let lanes: [f32; 8] = bytemuck::cast(most);
    let a_max = lanes.iter().fold(0.0f32, |m, &a| if a > m { a } else { m });
    let scales = PrepareScales::of(a_max);
    let splat = _mm256_set1_ps;
    let (alpha, alpha2) = (splat(scales.alpha), splat(scales.alpha2));
    let (inverse, inverse2) = (splat(scales.inverse()), splat(scales.inverse2()));
    let (sign, zero, top_code) = (splat(-0.0), _mm256_setzero_ps(), splat(255.0));
    let mut acc = [[_mm256_setzero_ps(); 2]; 12];
    for (k, c) in (0..n).step_by(8).enumerate() {
        let (qv, minv, stepv) = (load(q, c), load(min, c), load(step, c));
        // SAFETY: AVX2 is enabled in this function.
        let (terms, w, r) = unsafe {
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
            (terms, w, r)
        };
        for (acc, term) in acc.iter_mut().zip(terms) {
            acc[k % 2] = _mm256_add_ps(acc[k % 2], term);
        }
        // Integers within ±127: exact as i32, and as bytes after the
        // saturating packs (which keep them).
        let packed = _mm256_packs_epi32(_mm256_cvtps_epi32(w), _mm256_cvtps_epi32(r));
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
        let bytes: [i8; 16] =
            bytemuck::cast(_mm_packs_epi16(_mm256_castsi256_si128(packed), _mm256_extracti128_si256::<1>(packed)));
        let len = (n - c).min(8);
        weights[c..c + len].copy_from_slice(&bytes[..len]);
        residuals[c..c + len].copy_from_slice(&bytes[8..8 + len]);
    }
    let halves = acc.map(|[low, high]| bytemuck::cast::<__m256, [f32; 8]>(_mm256_add_ps(low, high)));
    (scales, reduce_prepare(&halves))
}

/// Table entry over [`prepare_avx2`].
///
/// # Safety
/// As [`prepare_avx2`].
unsafe fn prepare_entry(
    q: &[f32],
    min: &[f32],
    step: &[f32],
    weights: &mut [i8],
    residuals: &mut [i8],
) -> (PrepareScales, PrepareSums) {
    // SAFETY: passed on.
    unsafe { prepare_avx2(q, min, step, weights, residuals) }
}

/// Table entry over [`select_at_least_avx2`].
///
/// # Safety
/// As [`select_at_least_avx2`].
unsafe fn select_avx2(values: &[f32], threshold: f32, out: &mut [u32]) -> usize {
    // SAFETY: passed on.
    unsafe { select_at_least_avx2(values, threshold, out) }
}

/// Table entry over [`select_at_least_avx512`].
///
/// # Safety
/// As [`select_at_least_avx512`].
unsafe fn select_avx512(values: &[f32], threshold: f32, out: &mut [u32]) -> usize {
    // SAFETY: passed on.
    unsafe { select_at_least_avx512(values, threshold, out) }
}

/// The AVX2 scan entries.
pub(super) const AVX2: SketchKernels = SketchKernels {
    dots: avx2::dots,
    dots_at: avx2::dots_at,
    bounds: avx2::bounds,
    select: select_avx2,
    prepare: prepare_entry,
};

/// The AVX-VNNI scan entries.
pub(super) const AVXVNNI: SketchKernels = SketchKernels {
    dots: avxvnni::dots,
    dots_at: avxvnni::dots_at,
    bounds: avxvnni::bounds,
    select: select_avx2,
    prepare: prepare_entry,
};

/// The AVX-512 VNNI scan entries.
pub(super) const AVX512: SketchKernels = SketchKernels {
    dots: avx512::dots,
    dots_at: avx512::dots_at,
    bounds: avx512::bounds,
    select: select_avx512,
    prepare: prepare_entry,
};
