//! Q4_K × Q8_K (see `superblock_with_min!`): the 4-bit quants, and the helpers that
//! Q5_K shares.

use core::arch::x86_64::*;

use super::superblock::{Prepared, SuperBlock};
use super::{hsum_i32, load32, reduce8x8, IsaOps};
use crate::formats::q4_k::scales_mins_words;
use crate::formats::{f16_to_f32, BlockQ4K, BlockQ8K};

/// `Σⱼ wⱼ · totalⱼ` for eight unsigned byte weights (the bytes of `w`) and eight
/// sub-block lane vectors.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn scaled_total(v: &[__m256i; 8], w: u64) -> i32 {
    weighted_sum(reduce8x8(v), w)
}

/// `Σⱼ wⱼ · vⱼ` for eight unsigned byte weights (the bytes of `w`) and eight i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn weighted_sum(v: __m256i, w: u64) -> i32 {
    let w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(w as i64));
    hsum_i32(_mm256_mullo_epi32(v, w))
}

/// `bsums[2j] + bsums[2j+1]` in lane `j`: the Q8_K sums per 32-element sub-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn pair_sums(y: &BlockQ8K) -> __m256i {
    _mm256_madd_epi16(load32(&y.bsums), _mm256_set1_epi16(1))
}

/// The 32 activation vectors of a Q8_K block, sub-block `j` in element `j`.
#[inline(always)]
pub(crate) fn activation_vectors(y: &BlockQ8K) -> [__m256i; 8] {
    let (chunks, _) = y.qs.as_chunks::<32>();
    core::array::from_fn(|j| load32(&chunks[j]))
}

/// The 4-bit quants, sub-block `j` in vector `j`: quant group `c` holds sub-block `2c`
/// in its low nibbles and `2c + 1` in its high ones.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quants(x: &BlockQ4K) -> [__m256i; 8] {
    let (qs, _) = x.qs.as_chunks::<32>();
    let low = _mm256_set1_epi8(0x0f);
    let mut q = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let b = load32(&qs[c]);
        q[2 * c] = _mm256_and_si256(b, low);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
    q
}

/// The 6-bit scales and minimums of Q4_K and Q5_K as tile multipliers: scale `j` in i32
/// lane `j`, and minimum `j` in the i16 lanes of `bsums[2j]` and `bsums[2j + 1]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn tile_scales(scales: &[u8; 12]) -> (__m256i, __m256i) {
    let (sc, mn) = scales_mins_words(scales);
    // A byte shuffle of the minimums (in both 128-bit halves); index −128 yields zero.
    let pairs = _mm256_setr_epi8(
        0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128, //
        4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7, -128,
    );
    (_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64)), _mm256_shuffle_epi8(_mm256_set1_epi64x(mn as i64), pairs))
}

super::superblock::superblock_with_min!(BlockQ4K);

super::x86_entries!(superblock, BlockQ4K, BlockQ8K);
