//! The attention kernels of [`crate::attention`] on AVX2 (8 lanes, F16C conversions)
//! and AVX-512 (16 lanes): the vector operations, and the table entries instantiating
//! the generic bodies with them.

use core::arch::x86_64::*;

use half::f16;

use super::{load16, load32};
use crate::attention::{HalfRows, Lanes};
use crate::dispatch::{AttentionKernels, CodeRows};

impl Lanes<8> for __m256 {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller runs with AVX2 enabled (as for every method here).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(x: &[f32; 8]) -> Self {
        bytemuck::cast(*x)
    }
    #[inline(always)]
    unsafe fn load_f16(x: &[f16; 8]) -> Self {
        // SAFETY: F16C is part of the AVX2 table's features.
        unsafe { _mm256_cvtph_ps(load16(x)) }
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 8]) {
        *out = bytemuck::cast(self);
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_add_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_sub_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, m: Self, a: Self) -> Self {
        // SAFETY: FMA is part of the AVX2 table's features.
        unsafe { _mm256_fmadd_ps(self, m, a) }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_min_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_max_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: see `splat`.
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(self), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23))
        }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: see `splat`.
        unsafe { super::reduce8_ps(self) }
    }
    #[inline(always)]
    unsafe fn load_codes(packed: &[u8], bits: u32) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(code_bytes::<8>(packed, bits))) }
    }
    #[inline(always)]
    unsafe fn load_split_codes(coarse: &[u8], fine: &[u8]) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(split_code_bytes::<8>(coarse, fine))) }
    }
    #[inline(always)]
    unsafe fn store_f16(self, out: &mut [f16; 8]) {
        // SAFETY: F16C is part of the AVX2 table's features.
        *out = bytemuck::cast(unsafe { _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self) });
    }
}

impl Lanes<16> for __m512 {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller runs with AVX-512F enabled (as for every method here).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(x: &[f32; 16]) -> Self {
        bytemuck::cast(*x)
    }
    #[inline(always)]
    unsafe fn load_f16(x: &[f16; 16]) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_cvtph_ps(load32(x)) }
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 16]) {
        *out = bytemuck::cast(self);
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_add_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_sub_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, m: Self, a: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_fmadd_ps(self, m, a) }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_min_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_max_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: see `splat`.
        unsafe {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(self), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23))
        }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: see `splat`.
        unsafe { _mm512_reduce_add_ps(self) }
    }
    #[inline(always)]
    unsafe fn load_codes(packed: &[u8], bits: u32) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(code_bytes::<16>(packed, bits))) }
    }
    #[inline(always)]
    unsafe fn load_split_codes(coarse: &[u8], fine: &[u8]) -> Self {
        // SAFETY: see `splat`.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(split_code_bytes::<16>(coarse, fine))) }
    }
    #[inline(always)]
    unsafe fn store_f16(self, out: &mut [f16; 16]) {
        // SAFETY: see `splat`.
        *out = bytemuck::cast(unsafe { _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) });
    }
}

/// The first `L` codes of `bits` bits packed in `packed` (lowest bits first), one a
/// byte in order. Reads the `L · bits / 8` bytes they fill and no more (so no row's
/// last codes take a slower path).
///
/// # Safety
/// The CPU must support AVX2 (both tables' callers run with it).
#[inline(always)]
unsafe fn code_bytes<const L: usize>(packed: &[u8], bits: u32) -> __m128i {
    fn bytes<const N: usize>(packed: &[u8]) -> [u8; N] {
        *packed.first_chunk::<N>().expect("the caller passes every byte of the codes")
    }
    // SAFETY: the caller runs with AVX2 (SSE2 and up).
    let x: __m128i = unsafe {
        match L * bits as usize / 8 {
            2 => _mm_cvtsi32_si128(i32::from(u16::from_le_bytes(bytes(packed)))),
            4 => _mm_cvtsi32_si128(i32::from_le_bytes(bytes(packed))),
            8 => _mm_cvtsi64_si128(i64::from_le_bytes(bytes(packed))),
            _ => bytemuck::cast(bytes::<16>(packed)),
        }
    };
    // SAFETY: the caller runs with AVX2 (SSE2 and up).
    unsafe {
        let field =
            |shift: i32, mask: i8| _mm_and_si128(_mm_srl_epi16(x, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(mask));
        match bits {
            8 => x,
            // Element 2k is the low nibble of byte k, 2k + 1 the high one.
            4 => _mm_unpacklo_epi8(field(0, 0x0f), field(4, 0x0f)),
            // Elements 4k..4k + 4 are the bit pairs of byte k, lowest first.
            2 => _mm_unpacklo_epi16(
                _mm_unpacklo_epi8(field(0, 3), field(2, 3)),
                _mm_unpacklo_epi8(field(4, 3), field(6, 3)),
            ),
            _ => unreachable!("codes are 2, 4 or 8 bits"),
        }
    }
}

/// The first `L` 8-bit codes from their top and low 4 bits, 4-bit codes in `coarse`
/// and `fine`, one a byte in order.
///
/// # Safety
/// As [`code_bytes`].
#[inline(always)]
unsafe fn split_code_bytes<const L: usize>(coarse: &[u8], fine: &[u8]) -> __m128i {
    // SAFETY: the caller runs with AVX2 (SSE2 and up). Codes below 16 shifted by 4
    // stay within their bytes.
    unsafe {
        let (coarse, fine) = (code_bytes::<L>(coarse, 4), code_bytes::<L>(fine, 4));
        _mm_or_si128(_mm_slli_epi16(coarse, 4), fine)
    }
}

/// Defines the module `$module` of table entries instantiating the attention kernels
/// with the vector `$V` of `$L` lanes, compiled for `$features`.
macro_rules! attention_entries {
    ($module:ident, $V:ty, $L:literal, $features:literal) => {
        mod $module {
            use super::*;

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::AddScaledF64Fn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn add_scaled_f64(w: f64, v: &[f32], sum: &mut [f64]) {
                crate::attention::add_scaled_f64(w, v, sum)
            }

            /// # Safety
            /// The CPU must support the features.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn squared_norm_f64(v: &[f32]) -> f64 {
                crate::attention::squared_norm_f64(v)
            }

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::ScoresFn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn scores(dim: usize, queries: &[f32], keys: &[f16], out: &mut [f32], stride: usize) {
                let keys = HalfRows { dim, halves: keys };
                // SAFETY: this function enables the features.
                unsafe { crate::attention::scores::<$V, $L>(queries, keys, out, stride) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::ScoresCodedFn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn scores_coded(queries: &[f32], keys: &CodeRows, out: &mut [f32], stride: usize) {
                // SAFETY: this function enables the features.
                unsafe { crate::attention::scores_coded::<$V, $L>(queries, keys, out, stride) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::LevelsF16Fn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn levels_f16(rows: &CodeRows, out: &mut [f16]) {
                // SAFETY: this function enables the features.
                unsafe { crate::attention::levels_f16::<$V, $L>(rows, out) }
            }

            /// # Safety
            /// The CPU must support the features.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn softmax_exp(x: &mut [f32], max: f32) -> f32 {
                // SAFETY: this function enables the features.
                unsafe { crate::attention::softmax_exp::<$V, $L>(x, max) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::AddWeightedFn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn add_weighted(
                dim: usize,
                weights: &[f32],
                stride: usize,
                values: &[f16],
                out: &mut [f32],
            ) {
                let values = HalfRows { dim, halves: values };
                // SAFETY: this function enables the features.
                unsafe { crate::attention::add_weighted::<$V, $L>(weights, stride, values, out) }
            }

            /// # Safety
            /// The CPU must support the features; lengths as `dispatch::AddWeightedCodedFn`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn add_weighted_coded(
                weights: &[f32],
                stride: usize,
                values: &CodeRows,
                out: &mut [f32],
            ) {
                // SAFETY: this function enables the features.
                unsafe { crate::attention::add_weighted_coded::<$V, $L>(weights, stride, values, out) }
            }
        }
    };
}

// The feature lists are those `Isa::is_supported` checks (AVX-512 needs fewer).
attention_entries!(avx2, __m256, 8, "avx2,fma,f16c");
attention_entries!(avx512, __m512, 16, "avx2,fma,f16c,avx512f,avx512bw,avx512vl");

/// The AVX2 attention entries.
pub(super) const AVX2: AttentionKernels = AttentionKernels {
    scores: avx2::scores,
    softmax_exp: avx2::softmax_exp,
    add_weighted: avx2::add_weighted,
    levels_f16: avx2::levels_f16,
    scores_coded: avx2::scores_coded,
    add_weighted_coded: avx2::add_weighted_coded,
    add_scaled_f64: avx2::add_scaled_f64,
    squared_norm_f64: avx2::squared_norm_f64,
};

/// The AVX-512 attention entries.
pub(super) const AVX512: AttentionKernels = AttentionKernels {
    scores: avx512::scores,
    softmax_exp: avx512::softmax_exp,
    add_weighted: avx512::add_weighted,
    levels_f16: avx512::levels_f16,
    scores_coded: avx512::scores_coded,
    add_weighted_coded: avx512::add_weighted_coded,
    add_scaled_f64: avx512::add_scaled_f64,
    squared_norm_f64: avx512::squared_norm_f64,
};
