//! IQ3_S × Q8_K: as IQ3_XXS (its biased levels and bias), with 9-bit grid indices, a
//! stored sign bit per element and 4-bit scales (see `scaled_superblock!`).

use core::arch::x86_64::*;

use super::iq3_xxs::{biased_levels, offset};
use super::superblock::{dot_scaled, prepared_scaled, scaled_superblock, Prepared, SuperBlock};
use super::{nibbles8, IsaOps};
use crate::formats::iq3_s::GRID;
use crate::formats::{BlockIQ3S, BlockQ8K};

/// The 256 biased levels, sub-block `j` in vector `j`.
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
unsafe fn levels<I: IsaOps>(x: &BlockIQ3S) -> [__m256i; 8] {
    let (signs, _) = x.signs.as_chunks::<4>();
    // SAFETY: the caller guarantees the ISA (which has AVX2).
    unsafe {
        let mut q = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            q[j] = biased_levels(core::array::from_fn(|i| GRID[x.index(j, i)]), signs[j]);
        }
        q
    }
}

/// The scales `2s + 1`, `s` nibble `j` of the scale bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockIQ3S) -> __m256i {
    _mm256_add_epi32(_mm256_slli_epi32(nibbles8(x.scales), 1), _mm256_set1_epi32(1))
}

scaled_superblock!(BlockIQ3S);

super::x86_entries!(superblock, BlockIQ3S, BlockQ8K);
