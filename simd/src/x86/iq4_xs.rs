//! IQ4_XS × Q8_K: each sub-block's levels looked up as IQ4_NL's and dotted as signed
//! bytes ([`signed_bytes`]), the sums scaled by the signed 6-bit scales; where the dot
//! takes `q + 128`, the activation's `bsums` weighed by `−128 · scale` take the offset
//! back out.

use core::arch::x86_64::*;

use super::iq4_nl::levels32;
use super::q4_k::activation_vectors;
use super::superblock::{Prepared, SuperBlock};
use super::{hsum_i32, load32, reduce8x8, signed_bytes, signed_dp, signed_offset, IsaOps};
use crate::formats::{f16_to_f32, BlockIQ4XS, BlockQ8K};

/// The eight signed scales `ls − 32`, sub-block `j` in i32 lane `j`: its low 4 bits sit
/// at bit `4j` of `scales_l` (read as a little-endian u32), its high 2 at bit `2j` of
/// `scales_h`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockIQ4XS) -> __m256i {
    let low = _mm256_srlv_epi32(
        _mm256_set1_epi32(i32::from_le_bytes(x.scales_l)),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    let high =
        _mm256_srlv_epi32(_mm256_set1_epi32(i32::from(x.scales_h)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    let ls = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi32(0x0f)),
        _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4),
    );
    _mm256_sub_epi32(ls, _mm256_set1_epi32(32))
}

impl SuperBlock for BlockIQ4XS {
    const WITH_MIN: bool = false;
    const HALF_SCALES: bool = false;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(&self) -> Prepared {
        // SAFETY: the caller guarantees the ISA (which has AVX2).
        unsafe {
            let (qs, _) = self.qs.as_chunks::<16>();
            let mut q = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                q[j] = signed_bytes::<I>(levels32(&qs[j]));
            }
            let scales = scales(self);
            // −offset · scale in both i16 halves of lane j, for bsums[2j] and bsums[2j + 1].
            let weights = _mm256_mullo_epi32(scales, _mm256_set1_epi32(-i32::from(signed_offset::<I>())));
            let bsum_weights =
                _mm256_or_si256(_mm256_and_si256(weights, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(weights, 16));
            Prepared { q, scales: [scales; 2], bsum_weights }
        }
    }
    fn d(&self) -> f32 {
        f16_to_f32(self.d)
    }
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, q: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { signed_dp::<I>(acc, q, y) }
    }

    /// Per super-block, `Σⱼ scaleⱼ · Σ q·y` (less the offset's term), exact in `i32`, then
    /// `(dx·dy) · sumi`.
    #[inline(always)]
    unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let mut acc = 0f32;
            for (xb, yb) in x.iter().zip(y) {
                let p = xb.prepare::<I>();
                let yv = activation_vectors(yb);
                let mut v = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    v[j] = signed_dp::<I>(_mm256_setzero_si256(), p.q[j], yv[j]);
                }
                let scaled = _mm256_mullo_epi32(reduce8x8(&v), p.scales[0]);
                let sumi = hsum_i32(I::dp16(scaled, p.bsum_weights, load32(&yb.bsums)));
                acc += (f16_to_f32(xb.d) * yb.d) * sumi as f32;
            }
            acc
        }
    }
}

super::x86_entries!(superblock, BlockIQ4XS, BlockQ8K);
