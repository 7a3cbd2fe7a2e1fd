//! The shared skeleton of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): eight
//! blocks at a time, each block's exact i32 sum from [`Block32::lanes`], the eight sums
//! gathered into one vector, scaled and added to eight f32 lanes — the order
//! `crate::formats` prescribes.
//!
//! The tile kernel [`tile`] does the same per (row, token) pair, from weight blocks
//! unpacked once per tile ([`Block32::prepare`]) and laid out so that the eight block
//! sums need no horizontal reduction (see [`tile_group`]).

use core::arch::x86_64::*;

use super::tile::transpose8x8;
use super::{cvt_f16x8, reduce8_ps, reduce8x8, IsaOps};

/// Rows and tokens of a [`tile`]: `R` rows share each token's transposed activations,
/// `T` tokens each row's prepared weights.
pub(crate) const TILE: (usize, usize) = (crate::dispatch::TILE_ROWS, 16);
const TILE_ROWS: usize = TILE.0;
const TILE_TOKENS: usize = TILE.1;

/// A 32-element weight block and its activation block.
pub(crate) trait Block32: bytemuck::Pod {
    /// The activation block (Q8_0 or Q8_1).
    type Act: bytemuck::Pod;
    /// Whether the block has a minimum (`m`) paired with the activation's `s`.
    const WITH_MIN: bool;
    /// The bias of [`Block32::prepare`]'s bytes over the quants.
    const OFFSET: i8 = 0;

    /// The block's quants as bytes for [`Block32::dp_prepared`]: `q + OFFSET` as
    /// unsigned bytes of at most 63, or (if `OFFSET` is 0) whatever that function
    /// takes.
    ///
    /// # Safety
    /// The CPU must support `I`.
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i;

    /// `acc` plus i32 lanes whose total is `Σ (q + OFFSET)·y`, for prepared weight bytes
    /// `p` and activation bytes `y` in matching positions.
    ///
    /// # Safety
    /// The CPU must support `I`.
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { I::dp(acc, p, y) }
    }

    /// i32 lanes whose total is the block's exact `Σ q·y`.
    ///
    /// # Safety
    /// The CPU must support `I`.
    #[inline(always)]
    unsafe fn lanes<I: IsaOps>(x: &Self, y: &Self::Act) -> __m256i {
        // Formats with an offset must subtract it, so they override this.
        const { assert!(Self::OFFSET == 0) };
        // SAFETY: the caller guarantees the ISA.
        unsafe { Self::dp_prepared::<I>(_mm256_setzero_si256(), Self::prepare::<I>(x), Self::act_quants(y)) }
    }

    /// f16 bits of the weight scale.
    fn d(&self) -> u16;
    /// f16 bits of the weight minimum (if `WITH_MIN`).
    fn m(&self) -> u16 {
        0
    }
    /// The activation's 32 quants.
    fn act_quants(y: &Self::Act) -> __m256i;
    /// f16 bits of the activation scale.
    fn act_d(y: &Self::Act) -> u16;
    /// f16 bits of the activation's `d · Σ q` (if `WITH_MIN`).
    fn act_s(_y: &Self::Act) -> u16 {
        0
    }
}

/// Dot products of `R` weight rows with one activation row.
///
/// # Safety
/// The CPU must support `I`; every row has `y.len()` blocks.
#[inline(always)]
pub(crate) unsafe fn dot_n<I: IsaOps, B: Block32, const R: usize>(xs: [&[B]; R], y: &[B::Act]) -> [f32; R] {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let full = y.len() / 8 * 8;
        let mut b0 = 0;
        while b0 < full {
            group::<I, B, R>(&xs, &y[b0..b0 + 8], b0, &mut acc);
            b0 += 8;
        }
        if b0 < y.len() {
            group::<I, B, R>(&xs, &y[b0..], b0, &mut acc);
        }
        acc.map(|a| reduce8_ps(a))
    }
}

/// Adds blocks `b0 .. b0 + k` (`k ≤ 8`, block `b0 + j` into lane `j`) to `acc`; `y` holds
/// those `k` activation blocks.
#[inline(always)]
unsafe fn group<I: IsaOps, B: Block32, const R: usize>(xs: &[&[B]; R], y: &[B::Act], b0: usize, acc: &mut [__m256; R]) {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let k = y.len();
        let ys = act_scales::<B>(y);
        for r in 0..R {
            let x = &xs[r][b0..b0 + k];
            let mut v = [_mm256_setzero_si256(); 8];
            for j in 0..k {
                v[j] = B::lanes::<I>(&x[j], &y[j]);
            }
            acc[r] = _mm256_add_ps(acc[r], block_values::<B>(weight_scales(x), ys, reduce8x8(&v)));
        }
    }
}

/// Working memory of [`tile`], kept across the tiles of a `dot_tile` call (so that it is
/// zeroed once per call, not once per tile).
#[derive(Clone, Copy, bytemuck::Zeroable)]
pub(crate) struct Scratch {
    /// The current group of every row and token.
    rows: [Blocks; TILE_ROWS],
    tokens: [Blocks; TILE_TOKENS],
    /// Eight f32 lanes per (row, token) pair, as in [`dot_n`].
    acc: [[__m256; TILE_TOKENS]; TILE_ROWS],
}

/// Up to eight blocks of one row or token, as [`tile_group`] uses them.
#[derive(Clone, Copy, bytemuck::Zeroable)]
struct Blocks {
    /// The quants (weights: prepared), transposed.
    quants: [__m256i; 8],
    /// The scales `d`, and the minimums `m` (weights) or sums `s` (activations), one
    /// lane per block.
    scales: (__m256, __m256),
    /// Activations: where the sums start, `−OFFSET · Σ y`, one lane per block.
    start: __m256i,
}

/// Dot products of [`TILE`]` = (R, T)` weight rows with `T` activation rows
/// (`[row][token]`), each bit-identical to [`dot_n`]'s for that pair.
///
/// # Safety
/// The CPU must support `I`; every row has as many blocks as every activation row.
#[inline(always)]
pub(crate) unsafe fn tile<I: IsaOps, B: Block32>(
    xs: [&[B]; TILE_ROWS],
    ys: [&[B::Act]; TILE_TOKENS],
    scratch: &mut Scratch,
) -> [[f32; TILE_TOKENS]; TILE_ROWS] {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let nb = ys[0].len();
        let full = nb / 8 * 8;
        let mut b0 = 0;
        while b0 < full {
            tile_group::<I, B>(&xs, &ys, b0, 8, scratch);
            b0 += 8;
        }
        if b0 < nb {
            tile_group::<I, B>(&xs, &ys, b0, nb - b0, scratch);
        }
        let mut out = [[0f32; TILE_TOKENS]; TILE_ROWS];
        for r in 0..TILE_ROWS {
            for t in 0..TILE_TOKENS {
                out[r][t] = reduce8_ps(scratch.acc[r][t]);
            }
        }
        out
    }
}

/// [`group`] for a tile: adds blocks `b0 .. b0 + k` (`k ≤ 8`) of every (row, token)
/// pair to the accumulators (the first group, `b0 == 0`, to zero).
///
/// The blocks are transposed: vector `m` holds bytes `4m .. 4m + 4` of block `j` in its
/// i32 lane `j`, for the weights (prepared once per row) and for the activations (once
/// per token). Eight dot products of transposed vectors then leave each block's sum in
/// its own lane, which is the layout [`group`] reduces its lanes to. For formats with
/// an offset, the sums start from `−OFFSET · Σ y`, also computed once per token. The
/// products run 4 rows × 4 tokens at a time, so that each vector loaded serves four.
#[inline(always)]
unsafe fn tile_group<I: IsaOps, B: Block32>(
    xs: &[&[B]; TILE_ROWS],
    ys: &[&[B::Act]; TILE_TOKENS],
    b0: usize,
    k: usize,
    s: &mut Scratch,
) {
    const M: usize = 4;
    const { assert!(TILE_ROWS.is_multiple_of(M) && TILE_TOKENS.is_multiple_of(M)) };
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        for (token, y) in s.tokens.iter_mut().zip(ys) {
            let y = &y[b0..b0 + k];
            let mut v = [_mm256_setzero_si256(); 8];
            for j in 0..k {
                v[j] = B::act_quants(&y[j]);
            }
            token.quants = transpose8x8(&v);
            token.scales = act_scales::<B>(y);
            if B::OFFSET != 0 {
                let mut offset = _mm256_setzero_si256();
                for m in 0..8 {
                    offset = I::dp(offset, _mm256_set1_epi8(B::OFFSET), token.quants[m]);
                }
                token.start = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
            }
        }
        for (row, x) in s.rows.iter_mut().zip(xs) {
            let x = &x[b0..b0 + k];
            let mut p = [_mm256_setzero_si256(); 8];
            for j in 0..k {
                p[j] = B::prepare::<I>(&x[j]);
            }
            row.quants = transpose8x8(&p);
            row.scales = weight_scales(x);
        }
        for r0 in (0..TILE_ROWS).step_by(M) {
            for t0 in (0..TILE_TOKENS).step_by(M) {
                let mut sums = [[_mm256_setzero_si256(); M]; M];
                for i in 0..M {
                    for j in 0..M {
                        sums[i][j] = s.tokens[t0 + j].start;
                    }
                }
                for m in 0..8 {
                    for j in 0..M {
                        let y = s.tokens[t0 + j].quants[m];
                        for i in 0..M {
                            sums[i][j] = B::dp_prepared::<I>(sums[i][j], s.rows[r0 + i].quants[m], y);
                        }
                    }
                }
                for i in 0..M {
                    for j in 0..M {
                        let v = block_values::<B>(s.rows[r0 + i].scales, s.tokens[t0 + j].scales, sums[i][j]);
                        let acc = &mut s.acc[r0 + i][t0 + j];
                        *acc = _mm256_add_ps(if b0 == 0 { _mm256_setzero_ps() } else { *acc }, v);
                    }
                }
            }
        }
    }
}

/// The scales `d` and sums `s` of up to eight activation blocks, one lane each (zero
/// past the end).
#[inline(always)]
unsafe fn act_scales<B: Block32>(y: &[B::Act]) -> (__m256, __m256) {
    let (mut d, mut s) = ([0u16; 8], [0u16; 8]);
    for (j, y) in y.iter().enumerate() {
        d[j] = B::act_d(y);
        if B::WITH_MIN {
            s[j] = B::act_s(y);
        }
    }
    // SAFETY: the caller guarantees an ISA, and each has F16C.
    unsafe { (cvt_f16x8(d), cvt_f16x8(s)) }
}

/// The scales `d` and minimums `m` of up to eight weight blocks, one lane each (zero
/// past the end).
#[inline(always)]
unsafe fn weight_scales<B: Block32>(x: &[B]) -> (__m256, __m256) {
    let (mut d, mut m) = ([0u16; 8], [0u16; 8]);
    for (j, x) in x.iter().enumerate() {
        d[j] = x.d();
        if B::WITH_MIN {
            m[j] = x.m();
        }
    }
    // SAFETY: the caller guarantees an ISA, and each has F16C.
    unsafe { (cvt_f16x8(d), cvt_f16x8(m)) }
}

/// The f32 value of each of up to eight blocks, one lane each: `(dx·dy)·sum`, plus
/// `mx·sy` for formats with a minimum, from the weight scales `(dx, mx)`, the activation
/// scales `(dy, sy)` and the blocks' exact sums `Σ q·y`.
#[inline(always)]
unsafe fn block_values<B: Block32>((dx, mx): (__m256, __m256), (dy, sy): (__m256, __m256), sums: __m256i) -> __m256 {
    // SAFETY: the caller guarantees an ISA, and each has AVX2.
    unsafe {
        let v = _mm256_mul_ps(_mm256_mul_ps(dx, dy), _mm256_cvtepi32_ps(sums));
        if B::WITH_MIN {
            _mm256_add_ps(v, _mm256_mul_ps(mx, sy))
        } else {
            v
        }
    }
}

/// Sign trick for signed×signed bytes: `(|x|, y·sign(x))`, so that an unsigned×signed
/// dot gives `Σ x·y`. Needs `|y| ≤ 127` (activations from our quantizers are).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn sign_trick(x: __m256i, y: __m256i) -> (__m256i, __m256i) {
    (_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}
