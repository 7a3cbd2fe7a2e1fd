//! Q6_K × Q8_K: unsigned 6-bit quants (0..64) × activations per 16-element group,
//! scaled, then `32 · Σ scale·bsum` subtracted for the offset; and the helpers of the
//! super-blocks of sixteen 16-element groups that Q2_K and Q3_K share.

use core::arch::x86_64::*;

use super::q4_k::activation_vectors;
use super::superblock::{Prepared, SuperBlock};
use super::{hsum_i32, load16, load32, IsaOps};
use crate::formats::{f16_to_f32, BlockQ6K, BlockQ8K};

/// The unsigned 6-bit quants, elements `32j .. 32j + 32` in vector `j`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quants(x: &BlockQ6K) -> [__m256i; 8] {
    let (ql, _) = x.ql.as_chunks::<32>();
    let (qh, _) = x.qh.as_chunks::<32>();
    let low = _mm256_set1_epi8(0x0f);
    let top = _mm256_set1_epi8(0x30);
    let mut q = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let (l0, l1, hb) = (load32(&ql[2 * h]), load32(&ql[2 * h + 1]), load32(&qh[h]));
        // Elements 0-31, 32-63, 64-95, 96-127 of the half; qh bits 0-1, 2-3, 4-5, 6-7
        // moved to bits 4-5.
        q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, top));
        q[4 * h + 3] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
            _mm256_and_si256(_mm256_srli_epi16(hb, 2), top),
        );
    }
    q
}

/// A super-block of sixteen 16-element groups (Q2_K, Q3_K, Q6_K) prepared for the tiles:
/// its unsigned quants `q`, its sixteen signed byte `scales`, and the sixteen byte `weights`
/// of the activation's `bsums` times `factor` (an offset's −32 or −4 times the scales, or
/// the minimums).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn prepared_16(q: [__m256i; 8], scales: __m128i, weights: __m128i, factor: i16) -> Prepared {
    // Group g covers elements 16g .. 16g + 16: sub-block j's halves are groups 2j and 2j + 1.
    let split = _mm_shuffle_epi8(scales, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    let scales = [_mm256_cvtepi8_epi32(split), _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8))];
    let bsum_weights = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(weights), _mm256_set1_epi16(factor));
    Prepared { q, scales, bsum_weights }
}

/// `Σ_g scales[g] · Σ q·y` over the sixteen 16-element groups of a super-block: unsigned
/// quants `q` (elements `32j .. 32j + 32` in vector `j`), sixteen signed byte `scales`.
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
pub(crate) unsafe fn scaled_total_16<I: IsaOps>(q: &[__m256i; 8], y: &BlockQ8K, scales: __m128i) -> i32 {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let yv = activation_vectors(y);
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            v[j] = I::dp(_mm256_setzero_si256(), q[j], yv[j]);
        }
        // Lanes 0-3 of v[i] are group 2i, lanes 4-7 group 2i+1. Two rounds of hadd give
        // [G0 G2 G4 G6 | G1 G3 G5 G7] and [G8 .. G14 | G9 .. G15]; the scales are put in
        // that order: even groups of each vector pair first, then odd ones.
        let g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        let order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        let s = _mm_shuffle_epi8(scales, order);
        let s0 = _mm256_cvtepi8_epi32(s);
        let s1 = _mm256_cvtepi8_epi32(_mm_srli_si128(s, 8));
        hsum_i32(_mm256_add_epi32(_mm256_mullo_epi32(g0, s0), _mm256_mullo_epi32(g1, s1)))
    }
}

/// `Σ_g weights[g] · bsums[g]` for sixteen signed byte weights.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn bsum_total(weights: __m128i, y: &BlockQ8K) -> i32 {
    hsum_i32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(weights), load32(&y.bsums)))
}

/// The sixteen signed byte scales.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockQ6K) -> __m128i {
    load16(&x.scales)
}

/// `SuperBlock` for the K-quants of sixteen 16-element groups with signed byte scales whose
/// unsigned quants stand for `q − offset` (Q6_K: 32, Q3_K: 4); the invoking module's `quants`
/// and `scales` unpack a block.
///
/// `dot`: per super-block, `Σ_g scale·Σ q·y − offset · Σ_g scale·bsum`, exact in `i32`.
macro_rules! superblock_with_offset {
    ($block:ty, $offset:expr) => {
        impl SuperBlock for $block {
            const WITH_MIN: bool = false;
            const HALF_SCALES: bool = true;

            #[inline(always)]
            unsafe fn prepare<I: IsaOps>(&self) -> Prepared {
                // SAFETY: the caller guarantees AVX2.
                unsafe {
                    let scales = scales(self);
                    // The offset: −offset · Σ scale·bsum.
                    prepared_16(quants(self), scales, scales, -$offset)
                }
            }
            fn d(&self) -> f32 {
                f16_to_f32(self.d)
            }

            #[inline(always)]
            unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32 {
                // SAFETY: the caller guarantees the ISA.
                unsafe {
                    let mut acc = 0f32;
                    for (xb, yb) in x.iter().zip(y) {
                        let scales = scales(xb);
                        let sumi = scaled_total_16::<I>(&quants(xb), yb, scales) - $offset * bsum_total(scales, yb);
                        acc += (f16_to_f32(xb.d) * yb.d) * sumi as f32;
                    }
                    acc
                }
            }
        }
    };
}
pub(crate) use superblock_with_offset;

superblock_with_offset!(BlockQ6K, 32);

super::x86_entries!(superblock, BlockQ6K, BlockQ8K);
