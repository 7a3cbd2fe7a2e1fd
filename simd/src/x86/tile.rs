//! Tiles: products of many weight rows with many activation rows, `R` rows × `T` tokens
//! at a time, so that each weight block is unpacked once for a whole tile of tokens
//! rather than once per token, and each activation block once for all rows.
//!
//! A family of formats ([`Tiles`]: the 32-element formats in `block32.rs`, the K-quants
//! in `superblock.rs`) packs `T` activation rows into a layout its tile kernel reads
//! directly, and multiplies `R` weight rows with them. Every result is exactly the value
//! the format's `dot` kernel gives for that (row, token) pair: the kernels sum each
//! block in `i32` (exactly, in any order) and then do the same float operations in the
//! same order. Only the integer work is shared across the tile.

use core::arch::x86_64::*;
use core::cell::Cell;

use super::IsaOps;

/// A family of formats with a tile kernel of `R` rows × `T` tokens.
pub(crate) trait Tiles<const R: usize, const T: usize> {
    /// The weight block.
    type W: bytemuck::Pod;
    /// The activation block.
    type A: bytemuck::Pod;
    /// One unit of packed activations (its size a multiple of 32 bytes, its alignment
    /// at most 32).
    type Packed: bytemuck::Pod;
    /// Working memory of [`Tiles::tile`], kept across the tiles of a call.
    type Scratch: bytemuck::Zeroable;

    /// Units of packed activations per activation row of `nb` blocks.
    fn packed_len(nb: usize) -> usize;

    /// Packs the activation rows `ys` into `out` (`T · packed_len` units); only the
    /// first `tokens` rows (at least one) are needed, and the rest may be skipped.
    ///
    /// # Safety
    /// The CPU must support `I`.
    unsafe fn pack<I: IsaOps>(ys: [&[Self::A]; T], tokens: usize, out: &mut [Self::Packed]);

    /// `[i][j]` = weight row `xs[i]` · the `j`-th activation row that `packed` holds,
    /// for `j < tokens` (other results are unspecified).
    ///
    /// # Safety
    /// The CPU must support `I`; every row has as many blocks as the packed ones, and
    /// `packed` holds what [`Tiles::pack`] wrote for `tokens`.
    unsafe fn tile<I: IsaOps>(
        xs: [&[Self::W]; R],
        packed: &[Self::Packed],
        tokens: usize,
        scratch: &mut Self::Scratch,
    ) -> [[f32; T]; R];
}

/// 32 bytes, aligned for vectors: the unit of the packing buffer.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(32))]
struct Chunk([u8; 32]);

thread_local! {
    /// Each thread's packing buffer: grown to the largest need, never shrunk, so that a
    /// thread allocates only while warming up.
    static PACKED: Cell<Vec<Chunk>> = const { Cell::new(Vec::new()) };
}

/// `out[t * out_stride + r]` = row `r` of `w` · row `t` of `a`, rows of `nb` blocks
/// each, a tile at a time.
///
/// Tokens are the outer loop: each tile of tokens is packed once, and stays in cache
/// while the weight rows stream past. A ragged last tile of rows repeats its last row
/// and drops the copies' results; one of tokens tells the kernels how many are real.
///
/// # Safety
/// The CPU must support `I`; `w` and `a` hold whole rows, at least one each, and `out`
/// reaches every element written.
#[inline(always)]
pub(crate) unsafe fn drive<I: IsaOps, F: Tiles<R, T>, const R: usize, const T: usize>(
    w: &[F::W],
    a: &[F::A],
    nb: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let (n_rows, n_tokens) = (w.len() / nb, a.len() / nb);
    let row = |r: usize| &w[r.min(n_rows - 1) * nb..][..nb];
    let act = |t: usize| &a[t.min(n_tokens - 1) * nb..][..nb];
    let mut buffer = PACKED.take();
    let units = T * F::packed_len(nb);
    let chunks = units * core::mem::size_of::<F::Packed>() / core::mem::size_of::<Chunk>();
    if buffer.len() < chunks {
        buffer.resize(chunks, Chunk([0; 32]));
    }
    let packed: &mut [F::Packed] = bytemuck::cast_slice_mut(&mut buffer[..chunks]);
    let mut scratch = bytemuck::Zeroable::zeroed();
    for t0 in (0..n_tokens).step_by(T) {
        let tokens = T.min(n_tokens - t0);
        // SAFETY: the caller guarantees the ISA.
        unsafe { F::pack::<I>(core::array::from_fn(|j| act(t0 + j)), tokens, packed) };
        for r0 in (0..n_rows).step_by(R) {
            // SAFETY: as above; the rows have `nb` blocks, as the packed ones.
            let res = unsafe { F::tile::<I>(core::array::from_fn(|i| row(r0 + i)), packed, tokens, &mut scratch) };
            let rows = R.min(n_rows - r0);
            for j in 0..tokens {
                let out = &mut out[(t0 + j) * out_stride + r0..][..rows];
                for (i, o) in out.iter_mut().enumerate() {
                    *o = res[i][j];
                }
            }
        }
    }
    PACKED.set(buffer);
}

/// Transposes eight vectors of eight i32 lanes: lane `j` of result `m` is lane `m` of
/// `v[j]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn transpose8x8(v: &[__m256i; 8]) -> [__m256i; 8] {
    // Within 128-bit halves: pairs of rows interleaved, then quads; then the halves.
    let mut pairs = [_mm256_setzero_si256(); 8];
    for i in 0..4 {
        pairs[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        pairs[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    // quads[4h + c] holds column c (of each half) of rows 4h .. 4h + 4.
    let mut quads = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let p = &pairs[4 * h..4 * h + 4];
        quads[4 * h] = _mm256_unpacklo_epi64(p[0], p[2]);
        quads[4 * h + 1] = _mm256_unpackhi_epi64(p[0], p[2]);
        quads[4 * h + 2] = _mm256_unpacklo_epi64(p[1], p[3]);
        quads[4 * h + 3] = _mm256_unpackhi_epi64(p[1], p[3]);
    }
    let mut out = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        out[c] = _mm256_permute2x128_si256(quads[c], quads[4 + c], 0x20);
        out[4 + c] = _mm256_permute2x128_si256(quads[c], quads[4 + c], 0x31);
    }
    out
}
