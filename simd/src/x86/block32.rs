//! The shared skeleton of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): eight
//! blocks at a time, each block's exact i32 sum, the eight sums gathered into one vector,
//! scaled and added to eight f32 lanes — the order `crate::formats` prescribes.
//!
//! Both kernels compute a block's sum the same way: [`Block32::prepare`] turns the
//! weight quants into bytes `q + offset` ([`Block32::offset`]), [`Block32::dp_prepared`]
//! dots them with the activation quants, and the sum starts at `−offset · Σ y`. What
//! depends on the activations alone (their scales, sums and that start) is computed
//! once per activation row ([`RowGroup`]) or tile of tokens ([`Group`]), not once per
//! weight row.
//!
//! The row kernel ([`dot_rows`]) reduces the eight blocks' lanes with [`reduce8x8`]; the
//! tile kernels ([`Tiled`]) dot weight blocks unpacked once per tile
//! ([`Block32::prepare`]) and laid out so that the eight block sums need no horizontal
//! reduction.

use core::arch::x86_64::*;
use core::cell::Cell;
use core::marker::PhantomData;

use super::tile::{transpose8x8, Tiles};
use super::{cvt_f16x8, reduce8_ps, reduce8x8, IsaOps};
use crate::formats::cast_blocks;

/// Rows and tokens of a tile: `R` rows share the packed activations of each group,
/// `T` tokens the prepared weights.
pub(crate) const TILE: (usize, usize) = (TILE_ROWS, TILE_TOKENS);
const TILE_ROWS: usize = crate::dispatch::TILE_ROWS;
const TILE_TOKENS: usize = 64;

/// A 32-element weight block and its activation block.
pub(crate) trait Block32: bytemuck::Pod {
    /// The activation block (Q8_0 or Q8_1).
    type Act: bytemuck::Pod;
    /// Whether the block has a minimum (`m`) paired with the activation's `s`.
    const WITH_MIN: bool;
    /// The bias of [`Block32::prepare`]'s bytes over the quants, on ISA `I`.
    #[inline(always)]
    fn offset<I: IsaOps>() -> u8 {
        0
    }

    /// The block's quants as bytes for [`Block32::dp_prepared`]: `q + offset` as
    /// unsigned bytes (of at most 63 unless `I::BYTE_DP`), or (if the offset is 0)
    /// whatever that function takes.
    ///
    /// # Safety
    /// The CPU must support `I`.
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i;

    /// `acc` plus i32 lanes whose total is `Σ (q + offset)·y`, for prepared weight bytes
    /// `p` and activation bytes `y` in matching positions.
    ///
    /// # Safety
    /// The CPU must support `I`.
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { I::dp(acc, p, y) }
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

/// What the row kernel needs of eight activation blocks besides their quants (zero past
/// the end of the row).
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
pub(crate) struct RowGroup {
    /// The scales `d` and sums `s`, one lane per block.
    d: __m256,
    s: __m256,
    /// Where the blocks' sums start, `−offset · Σ y`, one lane per block.
    start: __m256i,
}

thread_local! {
    /// Each thread's [`RowGroup`]s of the current activation row: grown to the largest
    /// row, never shrunk.
    static ROW_GROUPS: Cell<Vec<RowGroup>> = const { Cell::new(Vec::new()) };
}

/// `out[r]` = the dot product of weight row `r` with `y`, the rows starting every
/// `stride` bytes of `w` (lengths as `dispatch::DotRowsFn`).
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
pub(crate) unsafe fn dot_rows<I: IsaOps, B: Block32>(w: &[u8], stride: usize, y: &[B::Act], out: &mut [f32]) {
    let mut groups = ROW_GROUPS.take();
    groups.clear();
    for y in y.chunks(8) {
        // SAFETY: the caller guarantees the ISA.
        groups.push(unsafe { row_group::<I, B>(y) });
    }
    let len = y.len() * core::mem::size_of::<B>();
    for (r, out) in out.iter_mut().enumerate() {
        let x = cast_blocks::<B>(&w[r * stride..][..len]);
        // SAFETY: as above; the row has `y.len()` blocks.
        *out = unsafe { dot_row::<I, B>(x, y, &groups) };
    }
    ROW_GROUPS.set(groups);
}

/// The [`RowGroup`] of up to eight activation blocks.
#[inline(always)]
unsafe fn row_group<I: IsaOps, B: Block32>(y: &[B::Act]) -> RowGroup {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let (d, s) = act_scales::<B>(y);
        let mut start = _mm256_setzero_si256();
        if B::offset::<I>() != 0 {
            let mut v = [_mm256_setzero_si256(); 8];
            for (v, y) in v.iter_mut().zip(y) {
                *v = I::dp(_mm256_setzero_si256(), _mm256_set1_epi8(B::offset::<I>() as i8), B::act_quants(y));
            }
            start = _mm256_sub_epi32(start, reduce8x8(&v));
        }
        RowGroup { d, s, start }
    }
}

/// One weight row `x` · `y`, whose groups `groups` holds.
#[inline(always)]
unsafe fn dot_row<I: IsaOps, B: Block32>(x: &[B], y: &[B::Act], groups: &[RowGroup]) -> f32 {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let full = y.len() / 8;
        for g in 0..full {
            acc = row_group_add::<I, B, 8>(&x[8 * g..], &y[8 * g..], &groups[g], acc);
        }
        // The last, partial group, block by block count so that each count's loop
        // unrolls.
        let b0 = 8 * full;
        macro_rules! tail {
            ($($k:literal)*) => {
                match y.len() - b0 {
                    $($k => acc = row_group_add::<I, B, $k>(&x[b0..], &y[b0..], &groups[full], acc),)*
                    _ => {}
                }
            };
        }
        tail!(1 2 3 4 5 6 7);
        reduce8_ps(acc)
    }
}

/// `acc` plus the values of the `K` blocks (`K ≤ 8`) that `x` and `y` start with, block
/// `j` in lane `j`; `group` is their [`RowGroup`].
#[inline(always)]
unsafe fn row_group_add<I: IsaOps, B: Block32, const K: usize>(
    x: &[B],
    y: &[B::Act],
    group: &RowGroup,
    acc: __m256,
) -> __m256 {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let (x, y) = (&x[..K], &y[..K]);
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..K {
            v[j] = B::dp_prepared::<I>(_mm256_setzero_si256(), B::prepare::<I>(&x[j]), B::act_quants(&y[j]));
        }
        let mut sums = reduce8x8(&v);
        if B::offset::<I>() != 0 {
            sums = _mm256_add_epi32(sums, group.start);
        }
        _mm256_add_ps(acc, block_values::<B>(weight_scales(x), (group.d, group.s), sums))
    }
}

/// The tile kernels of a 32-element format `B` (see [`Tiles`]).
///
/// Blocks are transposed in groups of eight: vector `m` holds bytes `4m .. 4m + 4` of
/// block `j` in its i32 lane `j`, for the weights (prepared once per row and tile) and
/// for the activations (packed once per token tile). Eight dot products of transposed
/// vectors then leave each block's exact sum in its own lane, which is the layout
/// the row kernel reduces its lanes to, and the same float operations follow.
pub(crate) struct Tiled<B>(PhantomData<B>);

/// Eight blocks (zero past the end of the row) of one activation row, packed; or of one
/// weight row, prepared.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
pub(crate) struct Group {
    /// The quants (weights: prepared), transposed.
    quants: [__m256i; 8],
    /// The scales `d`, and the minimums `m` (weights) or sums `s` (activations), one
    /// lane per block.
    d: __m256,
    m: __m256,
    /// Activations: where the sums start, `−offset · Σ y`, one lane per block.
    start: __m256i,
}

/// Working memory of a tile.
#[derive(Clone, Copy, bytemuck::Zeroable)]
pub(crate) struct Scratch {
    /// The current group of every row.
    rows: [Group; TILE_ROWS],
    /// Eight f32 lanes per (row, token) pair, as in [`dot_rows`].
    acc: [[__m256; TILE_TOKENS]; TILE_ROWS],
}

impl<B: Block32> Tiles<TILE_ROWS, TILE_TOKENS> for Tiled<B> {
    type W = B;
    type A = B::Act;
    /// Group `g` of token `t` is unit `g · T + t`.
    type Packed = Group;
    type Scratch = Scratch;

    fn packed_len(nb: usize) -> usize {
        nb.div_ceil(8)
    }

    #[inline(always)]
    unsafe fn pack<I: IsaOps>(ys: [&[B::Act]; TILE_TOKENS], tokens: usize, out: &mut [Group]) {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let nb = ys[0].len();
            for (g, out) in out.chunks_exact_mut(TILE_TOKENS).enumerate() {
                let (b0, k) = (8 * g, (nb - 8 * g).min(8));
                for (group, y) in out.iter_mut().zip(&ys).take(tokens.next_multiple_of(MICRO)) {
                    let y = &y[b0..b0 + k];
                    let mut v = [_mm256_setzero_si256(); 8];
                    for j in 0..k {
                        v[j] = B::act_quants(&y[j]);
                    }
                    group.quants = transpose8x8(&v);
                    (group.d, group.m) = act_scales::<B>(y);
                    let mut offset = _mm256_setzero_si256();
                    if B::offset::<I>() != 0 {
                        for m in 0..8 {
                            offset = I::dp(offset, _mm256_set1_epi8(B::offset::<I>() as i8), group.quants[m]);
                        }
                    }
                    group.start = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<I: IsaOps>(
        xs: [&[B]; TILE_ROWS],
        packed: &[Group],
        tokens: usize,
        s: &mut Scratch,
    ) -> [[f32; TILE_TOKENS]; TILE_ROWS] {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let nb = xs[0].len();
            // Tokens are computed (and were packed) in whole micro tiles.
            let micro = tokens.next_multiple_of(MICRO);
            let full = nb / 8 * 8;
            let mut b0 = 0;
            while b0 < full {
                tile_group::<I, B>(&xs, &packed[b0 / 8 * TILE_TOKENS..][..micro], b0, 8, s);
                b0 += 8;
            }
            if b0 < nb {
                tile_group::<I, B>(&xs, &packed[b0 / 8 * TILE_TOKENS..][..micro], b0, nb - b0, s);
            }
            // Each pair's lanes folded as `reduce8_ps` does, eight pairs at a time.
            let mut out = [[0f32; TILE_TOKENS]; TILE_ROWS];
            for r in 0..TILE_ROWS {
                for t0 in (0..tokens).step_by(8) {
                    let mut acc = [_mm256_setzero_si256(); 8];
                    for j in 0..8 {
                        acc[j] = _mm256_castps_si256(s.acc[r][t0 + j]);
                    }
                    let lanes = transpose8x8(&acc);
                    let mut half = [_mm256_setzero_ps(); 4];
                    for j in 0..4 {
                        half[j] = _mm256_add_ps(_mm256_castsi256_ps(lanes[j]), _mm256_castsi256_ps(lanes[j + 4]));
                    }
                    let folded = _mm256_add_ps(_mm256_add_ps(half[0], half[2]), _mm256_add_ps(half[1], half[3]));
                    out[r][t0..t0 + 8].copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(folded));
                }
            }
            out
        }
    }
}

/// Tokens of the products in [`tile_group`], and the multiple of them that tiles are
/// packed and computed in.
const MICRO: usize = 4;

/// [`row_group_add`] for a tile: adds blocks `b0 .. b0 + k` (`k ≤ 8`) of every (row, token)
/// pair to the accumulators (the first group, `b0 == 0`, to zero), for the tokens
/// whose blocks `tokens` holds, packed (a multiple of [`MICRO`] of them). The products
/// run a few rows × [`MICRO`] tokens at a time, so that each vector loaded serves
/// several: 4 rows where the ISA has 32 vector registers, 2 where it has 16 (AVX2's
/// two-instruction dot product then keeps its 8 sums and their operands in registers).
#[inline(always)]
unsafe fn tile_group<I: IsaOps, B: Block32>(
    xs: &[&[B]; TILE_ROWS],
    tokens: &[Group],
    b0: usize,
    k: usize,
    s: &mut Scratch,
) {
    // SAFETY (both arms): the caller guarantees the ISA.
    unsafe {
        for (row, x) in s.rows.iter_mut().zip(xs) {
            let x = &x[b0..b0 + k];
            let mut p = [_mm256_setzero_si256(); 8];
            for j in 0..k {
                p[j] = B::prepare::<I>(&x[j]);
            }
            row.quants = transpose8x8(&p);
            (row.d, row.m) = weight_scales(x);
        }
        if I::REGISTERS >= 32 {
            tile_products::<I, B, 4>(tokens, b0, s);
        } else {
            tile_products::<I, B, 2>(tokens, b0, s);
        }
    }
}

/// The products of [`tile_group`], `MR` rows × [`MICRO`] tokens at a time, with the
/// rows' groups prepared in `s`.
#[inline(always)]
unsafe fn tile_products<I: IsaOps, B: Block32, const MR: usize>(tokens: &[Group], b0: usize, s: &mut Scratch) {
    const MT: usize = MICRO;
    const { assert!(TILE_ROWS.is_multiple_of(MR) && TILE_TOKENS.is_multiple_of(MT)) };
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        for r0 in (0..TILE_ROWS).step_by(MR) {
            for t0 in (0..tokens.len()).step_by(MT) {
                let mut sums = [[_mm256_setzero_si256(); MT]; MR];
                for i in 0..MR {
                    for j in 0..MT {
                        sums[i][j] = tokens[t0 + j].start;
                    }
                }
                for m in 0..8 {
                    for j in 0..MT {
                        let y = tokens[t0 + j].quants[m];
                        for i in 0..MR {
                            sums[i][j] = B::dp_prepared::<I>(sums[i][j], s.rows[r0 + i].quants[m], y);
                        }
                    }
                }
                for i in 0..MR {
                    for j in 0..MT {
                        let (row, token) = (&s.rows[r0 + i], &tokens[t0 + j]);
                        let v = block_values::<B>((row.d, row.m), (token.d, token.m), sums[i][j]);
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
    // Gathered in general-purpose registers, four halves to a word: inserted into a
    // vector one by one, they took shuffle slots that the row kernel's reduction needs
    // (and slowed it by a fifth); a vector gather is slower still.
    let (mut d, mut m) = ([0u64; 2], [0u64; 2]);
    for (j, x) in x.iter().enumerate() {
        d[j / 4] |= u64::from(x.d()) << (16 * (j % 4));
        if B::WITH_MIN {
            m[j / 4] |= u64::from(x.m()) << (16 * (j % 4));
        }
    }
    // SAFETY: the caller guarantees an ISA, and each has F16C.
    unsafe { (cvt_f16x8(bytemuck::cast(d)), cvt_f16x8(bytemuck::cast(m))) }
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

/// `Block32` for the formats of signed levels dotted with Q8_0 (Q8_0, IQ4_NL): the
/// invoking module's `levels` gives a block's 32 levels as bytes in element order, which
/// [`signed_bytes`](super::signed_bytes) and [`signed_dp`](super::signed_dp) dot.
macro_rules! signed_block32 {
    ($block:ty) => {
        impl Block32 for $block {
            type Act = BlockQ8_0;
            const WITH_MIN: bool = false;

            #[inline(always)]
            fn offset<I: IsaOps>() -> u8 {
                super::signed_offset::<I>()
            }
            #[inline(always)]
            unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
                // SAFETY: the caller guarantees the ISA.
                unsafe { super::signed_bytes::<I>(levels(x)) }
            }
            #[inline(always)]
            unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
                // SAFETY: the caller guarantees the ISA.
                unsafe { super::signed_dp::<I>(acc, p, y) }
            }
            fn d(&self) -> u16 {
                self.d.to_bits()
            }
            fn act_quants(y: &BlockQ8_0) -> __m256i {
                super::load32(&y.qs)
            }
            fn act_d(y: &BlockQ8_0) -> u16 {
                y.d.to_bits()
            }
        }
    };
}
pub(crate) use signed_block32;
