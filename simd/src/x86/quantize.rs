//! Activation quantizers (Q8_0, Q8_1, Q8_K) with AVX2, bit-identical to the scalar
//! ones: the same f32 operations per element and round-half-even conversion (the
//! default MXCSR mode) where the scalar code uses ggml's `nearest_int`.

use core::arch::x86_64::*;

use super::{hsum_i32, reduce8x8};
use crate::formats::{cast_blocks_mut, f32_to_f16, BlockQ8K, BlockQ8_0, BlockQ8_1, QK_K};

/// Eight floats.
#[inline(always)]
fn load8(p: &[f32; 8]) -> __m256 {
    bytemuck::cast(*p)
}

/// Largest |x| over the vectors.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn abs_max(x: &[[f32; 8]]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for v in x {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(v)));
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 0b01)))
}

/// Packs 32 i32 values (all within i8) into 32 bytes in order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pack_i8(v: [__m256i; 4]) -> [i8; 32] {
    // packs work per 128-bit half; the permute restores element order.
    let w01 = _mm256_packs_epi32(v[0], v[1]);
    let w23 = _mm256_packs_epi32(v[2], v[3]);
    let b = _mm256_packs_epi16(w01, w23);
    bytemuck::cast(_mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)))
}

/// One Q8_0 block: `(d, quants as i32 lanes)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_0_block(x: &[f32; 32]) -> (f32, [__m256i; 4]) {
    let (x8, _) = x.as_chunks::<8>();
    let amax = abs_max(x8);
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    // Conversion rounds half to even (the default MXCSR mode), as ggml's does.
    (d, core::array::from_fn(|k| _mm256_cvtps_epi32(_mm256_mul_ps(load8(&x8[k]), id))))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    let (x, rest) = x.as_chunks::<32>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let (d, q) = q8_0_block(xb);
        ob.d = f32_to_f16(d);
        ob.qs = pack_i8(q);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    let (x, rest) = x.as_chunks::<32>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let (d, q) = q8_0_block(xb);
        let sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        ob.d = f32_to_f16(d);
        ob.s = f32_to_f16(sum as f32 * d);
        ob.qs = pack_i8(q);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    let (x, rest) = x.as_chunks::<QK_K>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let (x8, _) = xb.as_chunks::<8>();
        let amax = abs_max(x8);
        if amax == 0.0 {
            *ob = bytemuck::Zeroable::zeroed();
            continue;
        }
        // The first element of largest magnitude, sign kept.
        let sign = _mm256_set1_ps(-0.0);
        let target = _mm256_set1_ps(amax);
        let mut max = 0.0;
        for v in x8 {
            let hit = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, load8(v)), target);
            let mask = _mm256_movemask_ps(hit);
            if mask != 0 {
                max = v[mask.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        let scale = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        let q: [__m256i; 32] =
            core::array::from_fn(|k| _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(load8(&x8[k]), scale)), cap));
        let (qs, _) = ob.qs.as_chunks_mut::<32>();
        for (j, chunk) in qs.iter_mut().enumerate() {
            *chunk = pack_i8([q[4 * j], q[4 * j + 1], q[4 * j + 2], q[4 * j + 3]]);
        }
        // Group g (16 elements) is vectors 2g and 2g+1.
        let groups: [__m256i; 16] = core::array::from_fn(|g| _mm256_add_epi32(q[2 * g], q[2 * g + 1]));
        let lo = reduce8x8(&core::array::from_fn(|g| groups[g]));
        let hi = reduce8x8(&core::array::from_fn(|g| groups[8 + g]));
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
        ob.bsums = bytemuck::cast(packed);
        ob.d = 1.0 / iscale;
    }
}

/// Table entry (AVX2): Q8_0.
///
/// # Safety
/// AVX2, FMA and F16C must be supported; lengths as `dispatch::QuantFn`.
pub(crate) unsafe fn q8_0_avx2(x: &[f32], out: &mut [u8]) {
    // SAFETY: forwarded precondition.
    unsafe { q8_0(x, cast_blocks_mut(out)) }
}

/// Table entry (AVX2): Q8_1.
///
/// # Safety
/// As [`q8_0_avx2`].
pub(crate) unsafe fn q8_1_avx2(x: &[f32], out: &mut [u8]) {
    // SAFETY: forwarded precondition.
    unsafe { q8_1(x, cast_blocks_mut(out)) }
}

/// Table entry (AVX2): Q8_K.
///
/// # Safety
/// As [`q8_0_avx2`].
pub(crate) unsafe fn q8_k_avx2(x: &[f32], out: &mut [u8]) {
    // SAFETY: forwarded precondition.
    unsafe { q8_k(x, cast_blocks_mut(out)) }
}
