//! IQ4_XS × Q8_K: each sub-block's levels looked up as IQ4_NL's and dotted as signed
//! bytes ([`signed_bytes`], [`signed_dp`]), the sums scaled by the signed 6-bit scales
//! (see `scaled_superblock!`).

use core::arch::x86_64::*;

use super::iq4_nl::levels32;
use super::superblock::{dot_scaled, prepared_scaled, scaled_superblock, Prepared, SuperBlock};
use super::{nibbles8, signed_bytes, signed_dp, signed_offset, IsaOps};
use crate::formats::{BlockIQ4XS, BlockQ8K};

/// The 256 levels, sub-block `j` in vector `j`, as [`signed_bytes`].
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
unsafe fn levels<I: IsaOps>(x: &BlockIQ4XS) -> [__m256i; 8] {
    let (qs, _) = x.qs.as_chunks::<16>();
    // SAFETY: the caller guarantees the ISA (which has AVX2).
    unsafe {
        let mut q = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            q[j] = signed_bytes::<I>(levels32(&qs[j]));
        }
        q
    }
}

/// The bias of [`levels`].
#[inline(always)]
fn offset<I: IsaOps>() -> i32 {
    i32::from(signed_offset::<I>())
}

/// The eight signed scales `ls − 32`, sub-block `j` in i32 lane `j`: its low 4 bits are
/// nibble `j` of `scales_l`, its high 2 sit at bit `2j` of `scales_h`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockIQ4XS) -> __m256i {
    let high =
        _mm256_srlv_epi32(_mm256_set1_epi32(i32::from(x.scales_h)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    let ls = _mm256_or_si256(nibbles8(x.scales_l), _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    _mm256_sub_epi32(ls, _mm256_set1_epi32(32))
}

scaled_superblock!(BlockIQ4XS, dp: signed_dp);

super::x86_entries!(superblock, BlockIQ4XS, BlockQ8K);
