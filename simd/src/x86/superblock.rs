//! The shared tile skeleton of the K-quants (Q2_K to Q6_K) and the IQ super-blocks
//! (IQ4_XS, IQ3_XXS, IQ3_S) × Q8_K.
//!
//! Per super-block, `dot` computes exact i32 sums — the scaled sum `Σ sc·Σ q·y` (Q6_K's
//! including its `−32 · Σ sc·bsum` offset) and, for Q4_K and Q5_K, the minimum term
//! `Σ m·bsum` — and then one float expression. The tile computes the same integers
//! another way, for eight tokens at once, and evaluates the float expression lane-wise,
//! one token per lane, in the same order.
//!
//! The integers: weights and activations are transposed as in the 32-element tiles
//! (lane `j` of vector `m` holds bytes `4m .. 4m + 4` of sub-block `j`), so eight dot
//! products leave each 32-element sub-block's `Σ q·y` in its own lane; one multiply by
//! the sub-block scales then gives lanes whose total is the scaled sum. (Q6_K's
//! 16-element groups use two such sums, vectors 0–3 and 4–7.) Reducing the tokens'
//! vectors together puts each token's total in its own lane.

use core::arch::x86_64::*;
use core::marker::PhantomData;

use super::q4_k::activation_vectors;
use super::tile::{transpose8x8, Tiles};
use super::{hsum_i32, load32, reduce8x8, IsaOps};
use crate::formats::{cast_blocks, BlockQ8K};

/// Rows and tokens of a tile.
pub(crate) const TILE: (usize, usize) = (TILE_ROWS, TILE_TOKENS);
const TILE_ROWS: usize = crate::dispatch::TILE_ROWS;
const TILE_TOKENS: usize = 64;
/// Tokens per f32 vector: the tokens are handled in groups of this many.
const LANES: usize = 8;
/// Groups of [`LANES`] tokens in a tile.
const GROUPS: usize = TILE_TOKENS / LANES;

/// A super-block unpacked once for all tokens of a tile.
#[derive(Clone, Copy, bytemuck::Zeroable)]
pub(crate) struct Prepared {
    /// The quants as [`SuperBlock::dp_prepared`] takes them (the K-quants' unsigned ones
    /// at most 63): elements `32j .. 32j + 32` in vector `j`.
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

    /// Unpacks the block for ISA `I`.
    ///
    /// # Safety
    /// The CPU must support `I`.
    unsafe fn prepare<I: IsaOps>(&self) -> Prepared;

    /// `acc` plus i32 lanes whose total is `Σ q·y`, for prepared quants `q` and
    /// activation bytes `y` in matching positions.
    ///
    /// # Safety
    /// The CPU must support `I`.
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, q: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { I::dp(acc, q, y) }
    }
    /// The super-block scale.
    fn d(&self) -> f32;
    /// The super-block scale of the minimums (if `WITH_MIN`).
    fn dmin(&self) -> f32 {
        0.0
    }

    /// The dot product of the row `x` with the activation row `y`.
    ///
    /// # Safety
    /// The CPU must support `I`; `x` and `y` have as many blocks.
    unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32;
}

/// `out[r]` = the dot product of weight row `r` with `y`, the rows starting every
/// `stride` bytes of `w` (lengths as `dispatch::DotRowsFn`).
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
pub(crate) unsafe fn dot_rows<I: IsaOps, K: SuperBlock>(w: &[u8], stride: usize, y: &[BlockQ8K], out: &mut [f32]) {
    let len = y.len() * core::mem::size_of::<K>();
    for (r, out) in out.iter_mut().enumerate() {
        let x = cast_blocks::<K>(&w[r * stride..][..len]);
        // SAFETY: the caller guarantees the ISA; the row has `y.len()` blocks.
        *out = unsafe { K::dot::<I>(x, y) };
    }
}

/// The tile kernels of a K-quant `K` (see [`Tiles`] and the module docs).
pub(crate) struct Tiled<K>(PhantomData<K>);

/// One super-block of one activation row, packed.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
pub(crate) struct Packed {
    /// The quants, transposed.
    q: [__m256i; 8],
    bsums: __m256i,
    /// The scale, in element 0.
    d: [f32; 8],
}

impl<K: SuperBlock> Tiles<TILE_ROWS, TILE_TOKENS> for Tiled<K> {
    type W = K;
    type A = BlockQ8K;
    /// Super-block `i` of token `t` is unit `i · T + t`.
    type Packed = Packed;
    type Scratch = ();

    fn packed_len(nb: usize) -> usize {
        nb
    }

    #[inline(always)]
    unsafe fn pack<I: IsaOps>(ys: [&[BlockQ8K]; TILE_TOKENS], tokens: usize, out: &mut [Packed]) {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            for (i, out) in out.chunks_exact_mut(TILE_TOKENS).enumerate() {
                for (packed, y) in out.iter_mut().zip(&ys).take(tokens.next_multiple_of(LANES)) {
                    let y = &y[i];
                    let (qs, _) = y.qs.as_chunks::<32>();
                    let mut v = [_mm256_setzero_si256(); 8];
                    for j in 0..8 {
                        v[j] = load32(&qs[j]);
                    }
                    *packed =
                        Packed { q: transpose8x8(&v), bsums: load32(&y.bsums), d: [y.d, 0., 0., 0., 0., 0., 0., 0.] };
                }
            }
        }
    }

    /// Rows go a few at a time ([`add_superblock`]), tokens eight at a time (the
    /// packed tokens past `tokens` fill the last eight).
    #[inline(always)]
    unsafe fn tile<I: IsaOps>(
        xs: [&[K]; TILE_ROWS],
        packed: &[Packed],
        tokens: usize,
        _: &mut (),
    ) -> [[f32; TILE_TOKENS]; TILE_ROWS] {
        const { assert!(TILE_TOKENS.is_multiple_of(LANES)) };
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); GROUPS]; TILE_ROWS];
            for i in 0..xs[0].len() {
                let packed_tokens = &packed[i * TILE_TOKENS..][..TILE_TOKENS];
                if I::REGISTERS >= 32 {
                    add_superblock::<I, K, 2>(&xs, i, packed_tokens, tokens, &mut acc);
                } else {
                    add_superblock::<I, K, 1>(&xs, i, packed_tokens, tokens, &mut acc);
                }
            }
            let mut out = [[0f32; TILE_TOKENS]; TILE_ROWS];
            for r in 0..TILE_ROWS {
                for h in 0..GROUPS {
                    out[r][LANES * h..][..LANES].copy_from_slice(&bytemuck::cast::<__m256, [f32; LANES]>(acc[r][h]));
                }
            }
            out
        }
    }
}

/// Adds super-block `i` of every row of a tile to the accumulators `acc` (row `r`,
/// tokens `LANES · h ..` in `acc[r][h]`), `P` rows at a time, so that each activation
/// vector loaded serves them all: 2 where the ISA has 32 vector registers, 1 where it
/// has 16 (the `P · LANES` dot products' sums stay in registers).
///
/// # Safety
/// The CPU must support `I`; as [`Tiles::tile`].
#[inline(always)]
unsafe fn add_superblock<I: IsaOps, K: SuperBlock, const P: usize>(
    xs: &[&[K]; TILE_ROWS],
    i: usize,
    packed_tokens: &[Packed],
    tokens: usize,
    acc: &mut [[__m256; GROUPS]; TILE_ROWS],
) {
    const { assert!(TILE_ROWS.is_multiple_of(P)) };
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        for r0 in (0..TILE_ROWS).step_by(P) {
            let mut p = [<Prepared as bytemuck::Zeroable>::zeroed(); P];
            let mut q = [[_mm256_setzero_si256(); 8]; P];
            for k in 0..P {
                p[k] = xs[r0 + k][i].prepare::<I>();
                q[k] = transpose8x8(&p[k].q);
            }
            for h in 0..tokens.div_ceil(LANES) {
                let tokens = &packed_tokens[LANES * h..][..LANES];
                let v = scaled_sums::<I, K, P>(&p, &q, tokens);
                let mut dy = [0f32; LANES];
                for t in 0..LANES {
                    dy[t] = tokens[t].d[0];
                }
                let dy: __m256 = bytemuck::cast(dy);
                for k in 0..P {
                    let xb = &xs[r0 + k][i];
                    let (sums, mins) = &v[k];
                    // As `dot`: acc + ((dx·dy)·sumi − (dminx·dy)·summ), or
                    // acc + (dx·dy)·sumi.
                    let d = _mm256_mul_ps(_mm256_set1_ps(xb.d()), dy);
                    let mut v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(reduce8x8(sums)));
                    if K::WITH_MIN {
                        let dm = _mm256_mul_ps(_mm256_set1_ps(xb.dmin()), dy);
                        v = _mm256_sub_ps(v, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(reduce8x8(mins))));
                    }
                    acc[r0 + k][h] = _mm256_add_ps(acc[r0 + k][h], v);
                }
            }
        }
    }
}

/// For each of `P` prepared rows (`q` their quants, transposed) and each of eight
/// tokens: lanes whose total is the scaled sum (with Q6_K's offset), and lanes whose
/// total is the minimum term.
#[inline(always)]
unsafe fn scaled_sums<I: IsaOps, K: SuperBlock, const P: usize>(
    p: &[Prepared; P],
    q: &[[__m256i; 8]; P],
    tokens: &[Packed],
) -> [([__m256i; LANES], [__m256i; LANES]); P] {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let mut sums = [[_mm256_setzero_si256(); LANES]; P];
        let mut mins = [[_mm256_setzero_si256(); LANES]; P];
        for k in 0..P {
            for t in 0..LANES {
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
            let mut dots = [[_mm256_setzero_si256(); LANES]; P];
            for m in 8 / halves * h..8 / halves * (h + 1) {
                for t in 0..LANES {
                    let y = tokens[t].q[m];
                    for k in 0..P {
                        dots[k][t] = K::dp_prepared::<I>(dots[k][t], q[k][m], y);
                    }
                }
            }
            for k in 0..P {
                for t in 0..LANES {
                    sums[k][t] = _mm256_add_epi32(sums[k][t], _mm256_mullo_epi32(dots[k][t], p[k].scales[h]));
                }
            }
        }
        let mut out = [([_mm256_setzero_si256(); LANES], [_mm256_setzero_si256(); LANES]); P];
        for k in 0..P {
            out[k] = (sums[k], mins[k]);
        }
        out
    }
}

/// `SuperBlock` for the K-quants whose blocks hold `d`, `dmin` and the packed
/// 6-bit scales and minimums (Q4_K, Q5_K); they differ only in how their
/// quants unpack, which the invoking module's `quants` does.
///
/// `dot`: per super-block, eight 32-element sub-block sums gathered into one vector and
/// multiplied by the 6-bit scales; the minimum term from Q8_K's `bsums`.
macro_rules! superblock_with_min {
    ($block:ty) => {
        impl SuperBlock for $block {
            const WITH_MIN: bool = true;
            const HALF_SCALES: bool = false;

            #[inline(always)]
            unsafe fn prepare<I: IsaOps>(&self) -> Prepared {
                // SAFETY: the caller guarantees AVX2.
                unsafe {
                    let (scales, bsum_weights) = tile_scales(&self.scales);
                    Prepared { q: quants(self), scales: [scales; 2], bsum_weights }
                }
            }
            fn d(&self) -> f32 {
                f16_to_f32(self.d)
            }
            fn dmin(&self) -> f32 {
                f16_to_f32(self.dmin)
            }

            #[inline(always)]
            unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32 {
                // SAFETY: the caller guarantees the ISA.
                unsafe {
                    let mut acc = 0f32;
                    for (xb, yb) in x.iter().zip(y) {
                        let yv = activation_vectors(yb);
                        let (sc, mn) = scales_mins_words(&xb.scales);
                        let q = quants(xb);
                        let mut v = [_mm256_setzero_si256(); 8];
                        for j in 0..8 {
                            v[j] = I::dp(_mm256_setzero_si256(), q[j], yv[j]);
                        }
                        let sumi = scaled_total(&v, sc);
                        let summ = weighted_sum(pair_sums(yb), mn);
                        let d = f16_to_f32(xb.d) * yb.d;
                        let dm = f16_to_f32(xb.dmin) * yb.d;
                        acc += d * sumi as f32 - dm * summ as f32;
                    }
                    acc
                }
            }
        }
    };
}
pub(crate) use superblock_with_min;

/// A [`Prepared`] super-block of eight 32-element sub-blocks with one i32 scale each
/// (sub-block `j` in lane `j` of `scales`), from its level bytes `q` biased by `offset`:
/// the activation's `bsums` weighed by `−offset · scaleⱼ` (in both i16 halves of lane `j`,
/// for `bsums[2j]` and `bsums[2j + 1]`) take the bias back out.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn prepared_scaled(q: [__m256i; 8], scales: __m256i, offset: i32) -> Prepared {
    let weights = _mm256_mullo_epi32(scales, _mm256_set1_epi32(-offset));
    let bsum_weights =
        _mm256_or_si256(_mm256_and_si256(weights, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(weights, 16));
    Prepared { q, scales: [scales; 2], bsum_weights }
}

/// The row kernel of the super-blocks [`prepared_scaled`] prepares: per super-block,
/// `Σⱼ scaleⱼ · Σ q·y` less the bias's term, exact in `i32`, then `(dx·dy) · sumi`.
///
/// # Safety
/// The CPU must support `I`; `x` and `y` have as many blocks.
#[inline(always)]
pub(crate) unsafe fn dot_scaled<I: IsaOps, K: SuperBlock>(x: &[K], y: &[BlockQ8K]) -> f32 {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let mut acc = 0f32;
        for (xb, yb) in x.iter().zip(y) {
            let p = xb.prepare::<I>();
            let yv = activation_vectors(yb);
            let mut v = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                v[j] = K::dp_prepared::<I>(_mm256_setzero_si256(), p.q[j], yv[j]);
            }
            let scaled = _mm256_mullo_epi32(reduce8x8(&v), p.scales[0]);
            let sumi = hsum_i32(I::dp16(scaled, p.bsum_weights, load32(&yb.bsums)));
            acc += (xb.d() * yb.d) * sumi as f32;
        }
        acc
    }
}

/// `SuperBlock` for the super-blocks of eight 32-element sub-blocks of signed levels with
/// an integer scale each (IQ4_XS, IQ3_XXS, IQ3_S): the invoking module's `levels::<I>`
/// gives the level bytes as the dot takes them, `offset::<I>()` their bias and `scales`
/// the scales in i32 lanes; the float scale is the format's
/// [`ScaledSuperBlock::d`](crate::formats::ScaledSuperBlock::d). The dot is `I::dp`
/// (levels biased to unsigned bytes that no pair of products can overflow an i16 with),
/// or the named function.
macro_rules! scaled_superblock {
    ($block:ty $(, dp: $dp:ident)?) => {
        impl SuperBlock for $block {
            const WITH_MIN: bool = false;
            const HALF_SCALES: bool = false;

            #[inline(always)]
            unsafe fn prepare<I: IsaOps>(&self) -> Prepared {
                // SAFETY: the caller guarantees the ISA (which has AVX2).
                unsafe { prepared_scaled(levels::<I>(self), scales(self), offset::<I>()) }
            }
            fn d(&self) -> f32 {
                <Self as $crate::formats::ScaledSuperBlock>::d(self)
            }
            $(
                #[inline(always)]
                unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, q: __m256i, y: __m256i) -> __m256i {
                    // SAFETY: the caller guarantees the ISA.
                    unsafe { $dp::<I>(acc, q, y) }
                }
            )?
            #[inline(always)]
            unsafe fn dot<I: IsaOps>(x: &[Self], y: &[BlockQ8K]) -> f32 {
                // SAFETY: the caller guarantees the ISA.
                unsafe { dot_scaled::<I, Self>(x, y) }
            }
        }
    };
}
pub(crate) use scaled_superblock;
