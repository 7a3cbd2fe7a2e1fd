//! Q2_K × Q8_K: unsigned 2-bit quants (0..4) × activations per 16-element group, scaled by
//! the 4-bit scales; the minimum term from Q8_K's `bsums` and the 4-bit minimums.

use core::arch::x86_64::*;

use super::q6_k::{bsum_total, prepared_16, scaled_total_16};
use super::superblock::{Prepared, SuperBlock};
use super::{load16, load32, IsaOps};
use crate::formats::{f16_to_f32, BlockQ2K, BlockQ8K};

/// The 2-bit quants, elements `32c .. 32c + 32` in vector `c`: half `c / 4`'s bytes
/// shifted down by `2·(c % 4)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quants(x: &BlockQ2K) -> [__m256i; 8] {
    let (qs, _) = x.qs.as_chunks::<32>();
    let three = _mm256_set1_epi8(3);
    let mut q = [_mm256_setzero_si256(); 8];
    for (c, q) in q.iter_mut().enumerate() {
        let shifted = _mm256_srl_epi16(load32(&qs[c / 4]), _mm_cvtsi32_si128(2 * (c % 4) as i32));
        *q = _mm256_and_si256(shifted, three);
    }
    q
}

/// The sixteen 4-bit scales and the sixteen 4-bit minimums, one a byte.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales_mins(x: &BlockQ2K) -> (__m128i, __m128i) {
    let packed = load16(&x.scales);
    let low = _mm_set1_epi8(0x0f);
    (_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low))
}

impl SuperBlock for BlockQ2K {
    const WITH_MIN: bool = true;
    const HALF_SCALES: bool = true;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(&self) -> Prepared {
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            let (scales, mins) = scales_mins(self);
            prepared_16(quants(self), scales, mins, 1)
        }
    }
    fn d(&self) -> f32 {
        f16_to_f32(self.d)
    }
    fn dmin(&self) -> f32 {
        f16_to_f32(self.dmin)
    }

    #[inline(always)]
    unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let mut acc = 0f32;
            for (xb, yb) in x.iter().zip(y) {
                let (scales, mins) = scales_mins(xb);
                let sumi = scaled_total_16::<I>(&quants(xb), yb, scales);
                let summ = bsum_total(mins, yb);
                let d = f16_to_f32(xb.d) * yb.d;
                let dm = f16_to_f32(xb.dmin) * yb.d;
                acc += d * sumi as f32 - dm * summ as f32;
            }
            acc
        }
    }
}

super::x86_entries!(superblock, BlockQ2K, BlockQ8K);
