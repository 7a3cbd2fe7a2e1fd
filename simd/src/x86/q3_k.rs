//! Q3_K × Q8_K: unsigned 3-bit codes (0..8) × activations per 16-element group, scaled,
//! then `4 · Σ scale·bsum` subtracted for the offset (as Q6_K, whose offset is 32).

use core::arch::x86_64::*;

use super::q6_k::{bsum_total, prepared_16, scaled_total_16};
use super::superblock::{Prepared, SuperBlock};
use super::{load16, load32, IsaOps};
use crate::formats::q3_k::scales as unpack_scales;
use crate::formats::{f16_to_f32, BlockQ3K, BlockQ8K};

/// The unsigned 3-bit codes, elements `32c .. 32c + 32` in vector `c`: half `h = c / 4`'s
/// low bits shifted down by `2·(c % 4)`, the third bit from bit `c` of `hmask`. (16-bit
/// shifts leak bits between the two bytes only into bits that are masked off.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quants(x: &BlockQ3K) -> [__m256i; 8] {
    let (qs, _) = x.qs.as_chunks::<32>();
    let hmask = load32(&x.hmask);
    let (three, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut q = [_mm256_setzero_si256(); 8];
    for (c, q) in q.iter_mut().enumerate() {
        let low = _mm256_srl_epi16(load32(&qs[c / 4]), _mm_cvtsi32_si128(2 * (c % 4) as i32));
        let high = _mm256_and_si256(_mm256_srl_epi16(hmask, _mm_cvtsi32_si128(c as i32)), one);
        *q = _mm256_or_si256(_mm256_and_si256(low, three), _mm256_slli_epi16(high, 2));
    }
    q
}

/// The sixteen signed byte scales `sc − 32`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scales(x: &BlockQ3K) -> __m128i {
    load16(&unpack_scales(&x.scales))
}

super::q6_k::superblock_with_offset!(BlockQ3K, 4);

super::x86_entries!(superblock, BlockQ3K, BlockQ8K);
