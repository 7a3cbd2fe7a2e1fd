//! IQ4_NL × Q8_0: the grid's levels looked up from the nibbles with one byte shuffle,
//! then dotted as Q8_0's signed bytes are (see `signed_block32!`).

use core::arch::x86_64::*;

use super::block32::{signed_block32, Block32};
use super::{load16, nibbles32, IsaOps};
use crate::formats::iq4_nl::GRID;
use crate::formats::{BlockIQ4NL, BlockQ8_0};

/// The 32 levels that sixteen bytes of packed indices select, in element order (low
/// nibbles, then high ones).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn levels32(qs: &[u8; 16]) -> __m256i {
    _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(load16(&GRID)), nibbles32(qs))
}

/// The block's 32 levels.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn levels(x: &BlockIQ4NL) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe { levels32(&x.qs) }
}

signed_block32!(BlockIQ4NL);

super::x86_entries!(block32, BlockIQ4NL, BlockQ8_0);
