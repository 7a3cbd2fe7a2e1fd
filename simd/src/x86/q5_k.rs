//! Q5_K × Q8_K: as Q4_K, with the fifth bits merged into the nibbles.

use core::arch::x86_64::*;

use super::q4_k::{activation_vectors, pair_sums, scaled_total, tile_scales, weighted_sum};
use super::superblock::{Prepared, SuperBlock};
use super::{load32, IsaOps};
use crate::formats::q4_k::scales_mins_words;
use crate::formats::{f16_to_f32, BlockQ5K, BlockQ8K};

/// The 5-bit quants, sub-block `j` in vector `j`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quants(x: &BlockQ5K) -> [__m256i; 8] {
    let (qs, _) = x.qs.as_chunks::<32>();
    let low = _mm256_set1_epi8(0x0f);
    let bit4 = _mm256_set1_epi8(0x10);
    // Bits 2c and 2c+1 of each qh byte belong to sub-blocks 2c and 2c+1; shift right by
    // 2 per step. (16-bit shifts leak bits between the two bytes only into bits that are
    // never read.)
    let mut h = load32(&x.qh);
    let mut q = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let b = load32(&qs[c]);
        q[2 * c] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        q[2 * c + 1] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(b, 4), low),
            _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4),
        );
        h = _mm256_srli_epi16(h, 2);
    }
    q
}

super::superblock::superblock_with_min!(BlockQ5K);

super::x86_entries!(superblock, BlockQ5K, BlockQ8K);
