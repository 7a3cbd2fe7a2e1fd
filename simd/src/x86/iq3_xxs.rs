//! IQ3_XXS × Q8_K: each sub-block's eight grid points set into one vector, their signs
//! expanded from the 7-bit indices, and the levels biased by 64 to unsigned bytes of at
//! most 126, which every ISA's byte dot takes (see `scaled_superblock!`); and the
//! helpers IQ3_S shares.

use core::arch::x86_64::*;

use super::superblock::{dot_scaled, prepared_scaled, scaled_superblock, Prepared, SuperBlock};
use super::{bits32, IsaOps};
use crate::formats::iq3_xxs::GRID;
use crate::formats::{BlockIQ3XXS, BlockQ8K};

/// The bias of the IQ3 formats' level bytes: their levels lie in `−62..=62`.
pub(crate) const BIAS: i32 = 64;

/// The bias of [`levels`], the same on every ISA.
#[inline(always)]
pub(crate) fn offset<I: IsaOps>() -> i32 {
    BIAS
}

/// Eight grid points (four levels each, in the bytes of a word) with the signs of their
/// 32 elements (bit `e` of `signs` for element `e`, set for minus), biased by [`BIAS`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn biased_levels(points: [u32; 8], signs: [u8; 4]) -> __m256i {
    let minus = bits32(signs);
    let [p0, p1, p2, p3, p4, p5, p6, p7] = points.map(|p| p as i32);
    let points = _mm256_setr_epi32(p0, p1, p2, p3, p4, p5, p6, p7);
    // −p where the mask is all ones: (p ^ −1) − (−1).
    let signed = _mm256_sub_epi8(_mm256_xor_si256(points, minus), minus);
    _mm256_add_epi8(signed, _mm256_set1_epi8(BIAS as i8))
}

/// The 256 biased levels, sub-block `j` in vector `j`.
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
unsafe fn levels<I: IsaOps>(x: &BlockIQ3XXS) -> [__m256i; 8] {
    // SAFETY: the caller guarantees the ISA (which has AVX2).
    unsafe {
        let mut q = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            let points = core::array::from_fn(|i| GRID[x.qs[8 * j + i] as usize]);
            q[j] = biased_levels(points, x.signs(j).to_le_bytes());
        }
        q
    }
}

/// The scales `2s + 1`, `s` in the top 4 bits of each sub-block's word.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockIQ3XXS) -> __m256i {
    let words: __m256i = bytemuck::cast(x.scales_signs);
    _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(words, 28), 1), _mm256_set1_epi32(1))
}

scaled_superblock!(BlockIQ3XXS);

super::x86_entries!(superblock, BlockIQ3XXS, BlockQ8K);
