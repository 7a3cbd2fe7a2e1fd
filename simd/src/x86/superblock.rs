//! The shared tile skeleton of the K-quants (Q4_K, Q5_K, Q6_K) × Q8_K.
//!
//! Per super-block, `dot` computes exact i32 sums — the scaled sum `Σ sc·Σ q·y` (Q6_K's
//! including its `−32 · Σ sc·bsum` offset) and, for Q4_K and Q5_K, the minimum term
//! `Σ m·bsum` — and then one float expression. The tile computes the same integers
//! another way, for [`TILE`]`.1` tokens at once, and evaluates the float expression
//! lane-wise, one token per lane, in the same order.
//!
//! The integers: weights and activations are transposed as in the 32-element tiles
//! (lane `j` of vector `m` holds bytes `4m .. 4m + 4` of sub-block `j`), so eight dot
//! products leave each 32-element sub-block's `Σ q·y` in its own lane; one multiply by
//! the sub-block scales then gives lanes whose total is the scaled sum. (Q6_K's
//! 16-element groups use two such sums, vectors 0–3 and 4–7.) Reducing the tokens'
//! vectors together puts each token's total in its own lane.

use core::arch::x86_64::*;

use super::tile::transpose8x8;
use super::{load32, reduce8x8, IsaOps};
use crate::formats::BlockQ8K;

/// Rows and tokens of a [`tile`]: one token per f32 lane.
pub(crate) const TILE: (usize, usize) = (crate::dispatch::TILE_ROWS, 8);
const TILE_ROWS: usize = TILE.0;
const TILE_TOKENS: usize = TILE.1;

/// A super-block unpacked once for all tokens of a tile.
pub(crate) struct Prepared {
    /// Unsigned quants (at most 63): elements `32j .. 32j + 32` in vector `j`.
    pub(crate) q: [__m256i; 8],
    /// i32 scales, sub-block `j` in lane `j`: of its first 16 elements in `scales[0]`,
    /// of its last 16 in `scales[1]` (the same for 32-element sub-blocks).
    pub(crate) scales: [__m256i; 2],
    /// i16 multipliers of the activation's sixteen `bsums`: the offset correction
    /// (added to the scaled sum), or the minimums (the separate minimum term).
    pub(crate) bsum_weights: __m256i,
}

/// A K-quant super-block.
pub(crate) trait SuperBlock: bytemuck::Pod {
    /// Whether the `bsums` term is a minimum term of its own (Q4_K, Q5_K) rather than
    /// part of the scaled sum (Q6_K).
    const WITH_MIN: bool;
    /// Whether the two halves of a sub-block have their own scales (Q6_K).
    const HALF_SCALES: bool;

    /// Unpacks the block.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    unsafe fn prepare(&self) -> Prepared;
    /// The super-block scale.
    fn d(&self) -> f32;
    /// The super-block scale of the minimums (if `WITH_MIN`).
    fn dmin(&self) -> f32 {
        0.0
    }
}

/// Working memory of [`tile`], kept across the tiles of a `dot_tile` call (so that it is
/// zeroed once per call, not once per tile): the current block of every token.
#[derive(Clone, Copy, bytemuck::Zeroable)]
pub(crate) struct Scratch {
    tokens: [Token; TILE_TOKENS],
}

/// One token's activation block, as [`tile`] uses it.
#[derive(Clone, Copy, bytemuck::Zeroable)]
struct Token {
    /// The quants, transposed.
    q: [__m256i; 8],
    bsums: __m256i,
    d: f32,
}

/// Dot products of [`TILE`]` = (R, T)` weight rows with `T` activation rows
/// (`[row][token]`), each bit-identical to the format's `dot` for that pair.
///
/// Rows go two at a time, so that each activation vector loaded serves both.
///
/// # Safety
/// The CPU must support `I`; every row has as many blocks as every activation row.
#[inline(always)]
pub(crate) unsafe fn tile<I: IsaOps, K: SuperBlock>(
    xs: [&[K]; TILE_ROWS],
    ys: [&[BlockQ8K]; TILE_TOKENS],
    scratch: &mut Scratch,
) -> [[f32; TILE_TOKENS]; TILE_ROWS] {
    const { assert!(TILE_TOKENS == 8, "one token per f32 lane") };
    const PAIR: usize = 2;
    const { assert!(TILE_ROWS.is_multiple_of(PAIR)) };
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let tokens = &mut scratch.tokens;
        let mut acc = [_mm256_setzero_ps(); TILE_ROWS];
        for i in 0..ys[0].len() {
            for (token, y) in tokens.iter_mut().zip(&ys) {
                let y = &y[i];
                let (qs, _) = y.qs.as_chunks::<32>();
                let mut v = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    v[j] = load32(&qs[j]);
                }
                *token = Token { q: transpose8x8(&v), bsums: load32(&y.bsums), d: y.d };
            }
            let mut dy = [0f32; TILE_TOKENS];
            for t in 0..TILE_TOKENS {
                dy[t] = tokens[t].d;
            }
            let dy: __m256 = bytemuck::cast(dy);
            for r0 in (0..TILE_ROWS).step_by(PAIR) {
                let mut p = [const { None }; PAIR];
                let mut q = [[_mm256_setzero_si256(); 8]; PAIR];
                for k in 0..PAIR {
                    let prepared = xs[r0 + k][i].prepare();
                    q[k] = transpose8x8(&prepared.q);
                    p[k] = Some(prepared);
                }
                let p = p.map(Option::unwrap);
                // Per row and token: lanes whose total is the scaled sum (with Q6_K's
                // offset), and lanes whose total is the minimum term.
                let mut sums = [[_mm256_setzero_si256(); TILE_TOKENS]; PAIR];
                let mut mins = [[_mm256_setzero_si256(); TILE_TOKENS]; PAIR];
                for k in 0..PAIR {
                    for t in 0..TILE_TOKENS {
                        let bsums = I::dp16(_mm256_setzero_si256(), p[k].bsum_weights, tokens[t].bsums);
                        if K::WITH_MIN {
                            mins[k][t] = bsums;
                        } else {
                            sums[k][t] = bsums;
                        }
                    }
                }
                // The sub-block sums, over vectors 0-7 or (two scales) 0-3 and 4-7.
                let halves = if K::HALF_SCALES { 2 } else { 1 };
                for h in 0..halves {
                    let mut dots = [[_mm256_setzero_si256(); TILE_TOKENS]; PAIR];
                    for m in 8 / halves * h..8 / halves * (h + 1) {
                        for t in 0..TILE_TOKENS {
                            let y = tokens[t].q[m];
                            for k in 0..PAIR {
                                dots[k][t] = I::dp(dots[k][t], q[k][m], y);
                            }
                        }
                    }
                    for k in 0..PAIR {
                        for t in 0..TILE_TOKENS {
                            sums[k][t] = _mm256_add_epi32(sums[k][t], _mm256_mullo_epi32(dots[k][t], p[k].scales[h]));
                        }
                    }
                }
                for k in 0..PAIR {
                    let xb = &xs[r0 + k][i];
                    // As `dot`: acc + ((dx·dy)·sumi − (dminx·dy)·summ), or acc + (dx·dy)·sumi.
                    let d = _mm256_mul_ps(_mm256_set1_ps(xb.d()), dy);
                    let mut v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(reduce8x8(&sums[k])));
                    if K::WITH_MIN {
                        let dm = _mm256_mul_ps(_mm256_set1_ps(xb.dmin()), dy);
                        v = _mm256_sub_ps(v, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(reduce8x8(&mins[k]))));
                    }
                    acc[r0 + k] = _mm256_add_ps(acc[r0 + k], v);
                }
            }
        }
        let mut out = [[0f32; TILE_TOKENS]; TILE_ROWS];
        for r in 0..TILE_ROWS {
            out[r] = bytemuck::cast(acc[r]);
        }
        out
    }
}
