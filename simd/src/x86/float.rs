//! F32, F16 and BF16 weights against f32 activations: AVX2 (8 lanes, F16C, four
//! accumulators) and AVX-512 (16 lanes, one accumulator) fused multiply-adds, and on
//! AVX-512 tiles of rows × tokens that sum each pair as the single dot does; F16/BF16
//! dequantization through the hardware conversions. Results agree with the scalar
//! kernels to rounding (they sum in another order).

use core::arch::x86_64::*;

use half::{bf16, f16};

use super::{load16, load32};
use crate::dispatch::{Kernels, WeightKernels};
use crate::formats::cast_blocks;
use crate::WeightType;

/// A weight element type widened to f32 eight or sixteen at a time.
trait Elem: bytemuck::Pod {
    fn widen(self) -> f32;
    /// # Safety
    /// AVX2 + F16C must be enabled.
    unsafe fn load8(p: &[Self; 8]) -> __m256;
    /// # Safety
    /// AVX-512 F/BW must be enabled.
    unsafe fn load16(p: &[Self; 16]) -> __m512;
}

impl Elem for f32 {
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load8(p: &[f32; 8]) -> __m256 {
        bytemuck::cast(*p)
    }
    #[inline(always)]
    unsafe fn load16(p: &[f32; 16]) -> __m512 {
        bytemuck::cast(*p)
    }
}

impl Elem for f16 {
    fn widen(self) -> f32 {
        crate::formats::f16_to_f32(self)
    }
    #[inline(always)]
    unsafe fn load8(p: &[f16; 8]) -> __m256 {
        // SAFETY: caller guarantees F16C.
        unsafe { _mm256_cvtph_ps(load16(p)) }
    }
    #[inline(always)]
    unsafe fn load16(p: &[f16; 16]) -> __m512 {
        // SAFETY: caller guarantees AVX-512F.
        unsafe { _mm512_cvtph_ps(load32(p)) }
    }
}

impl Elem for bf16 {
    fn widen(self) -> f32 {
        crate::formats::bfloat16::bf16_to_f32(self)
    }
    #[inline(always)]
    unsafe fn load8(p: &[bf16; 8]) -> __m256 {
        // SAFETY: caller guarantees AVX2.
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(p)), 16)) }
    }
    #[inline(always)]
    unsafe fn load16(p: &[bf16; 16]) -> __m512 {
        // SAFETY: caller guarantees AVX-512F.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load32(p)), 16)) }
    }
}

/// Scalar tail shared by both widths.
#[inline(always)]
fn tail<T: Elem>(w: &[T], a: &[f32]) -> f32 {
    w.iter().zip(a).map(|(&w, &a)| w.widen() * a).sum()
}

/// # Safety
/// AVX2 + FMA + F16C must be enabled.
#[inline(always)]
unsafe fn dot_avx2<T: Elem>(w: &[T], a: &[f32]) -> f32 {
    // SAFETY: caller guarantees the features.
    unsafe {
        let (wc, wr) = w.as_chunks::<32>();
        let (ac, ar) = a.as_chunks::<32>();
        let mut acc = [_mm256_setzero_ps(); 4];
        for (wc, ac) in wc.iter().zip(ac) {
            let (w8, _) = wc.as_chunks::<8>();
            let (a8, _) = ac.as_chunks::<8>();
            for k in 0..4 {
                acc[k] = _mm256_fmadd_ps(T::load8(&w8[k]), bytemuck::cast(a8[k]), acc[k]);
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        super::reduce8_ps(s) + tail(wr, ar)
    }
}

/// # Safety
/// AVX-512 F/BW/VL (+ AVX2, FMA, F16C) must be enabled.
///
/// The summation order is llama.cpp's on AVX-512 (its F16/F32 products go
/// through tinyBLAS when the length is a multiple of 16: one 16-lane FMA
/// accumulator, then a tree reduction), so that float-weight models give its
/// logits to the last bit or nearly.
#[inline(always)]
unsafe fn dot_avx512<T: Elem>(w: &[T], a: &[f32]) -> f32 {
    // SAFETY: caller guarantees the features.
    unsafe {
        let (wc, wr) = w.as_chunks::<16>();
        let (ac, ar) = a.as_chunks::<16>();
        let mut acc = _mm512_setzero_ps();
        for (w16, a16) in wc.iter().zip(ac) {
            acc = _mm512_fmadd_ps(T::load16(w16), bytemuck::cast(*a16), acc);
        }
        // The remainder (< 16 elements) through the 8-lane path.
        _mm512_reduce_add_ps(acc) + dot_avx2(wr, ar)
    }
}

/// Weight rows and tokens per block of [`dot_tile_avx512`]: eight independent sums.
const TILE_ROWS: usize = 4;
const TILE_TOKENS: usize = 2;

/// `out[t · stride + r] = dot_avx512(w[r], a[t])` for the rows of `n` elements in `w`
/// and `a`: blocks of [`TILE_ROWS`] rows × [`TILE_TOKENS`] tokens keep one accumulator
/// per pair, each summing exactly as [`dot_avx512`] sums it (so every result is that
/// kernel's to the bit), while the pairs' independent chains keep the FMA units busy
/// where a single pair waits on each addition. Rows and tokens beyond whole blocks go
/// through [`dot_avx512`] itself.
///
/// # Safety
/// As [`dot_avx512`]; `w` and `a` hold whole rows of `n > 0` elements and `out` reaches
/// the last token's last row at `stride`.
#[inline(always)]
unsafe fn dot_tile_avx512<T: Elem>(w: &[T], a: &[f32], n: usize, out: &mut [f32], stride: usize) {
    let (rows, tokens) = (w.len() / n, a.len() / n);
    let row = |r: usize| &w[r * n..][..n];
    let act = |t: usize| &a[t * n..][..n];
    let (whole_rows, whole_tokens) = (rows / TILE_ROWS * TILE_ROWS, tokens / TILE_TOKENS * TILE_TOKENS);
    for t0 in (0..whole_tokens).step_by(TILE_TOKENS) {
        for r0 in (0..whole_rows).step_by(TILE_ROWS) {
            let block_rows = core::array::from_fn(|i| row(r0 + i));
            let block_acts = core::array::from_fn(|j| act(t0 + j));
            // SAFETY: the caller's features are passed on.
            let sums = unsafe { dot_block_avx512::<T, TILE_ROWS, TILE_TOKENS>(block_rows, block_acts) };
            for (i, sums) in sums.iter().enumerate() {
                for (j, &sum) in sums.iter().enumerate() {
                    out[(t0 + j) * stride + r0 + i] = sum;
                }
            }
        }
    }
    for t in 0..tokens {
        let ragged = if t < whole_tokens { whole_rows..rows } else { 0..rows };
        for r in ragged {
            // SAFETY: as above.
            out[t * stride + r] = unsafe { dot_avx512(row(r), act(t)) };
        }
    }
}

/// The [`dot_avx512`] of each of `R` weight rows with each of `K` activation rows.
///
/// # Safety
/// As [`dot_avx512`]; all rows have one length.
#[inline(always)]
unsafe fn dot_block_avx512<T: Elem, const R: usize, const K: usize>(
    rows: [&[T]; R],
    acts: [&[f32]; K],
) -> [[f32; K]; R] {
    let rows = rows.map(|w| w.as_chunks::<16>());
    let acts = acts.map(|a| a.as_chunks::<16>());
    // SAFETY: caller guarantees the features.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); K]; R];
        for c in 0..acts[0].0.len() {
            let a: [__m512; K] = core::array::from_fn(|j| bytemuck::cast(acts[j].0[c]));
            for (acc, (body, _)) in acc.iter_mut().zip(&rows) {
                let w = T::load16(&body[c]);
                for (acc, &a) in acc.iter_mut().zip(&a) {
                    *acc = _mm512_fmadd_ps(w, a, *acc);
                }
            }
        }
        core::array::from_fn(|i| {
            core::array::from_fn(|j| _mm512_reduce_add_ps(acc[i][j]) + dot_avx2(rows[i].1, acts[j].1))
        })
    }
}

/// # Safety
/// AVX2 + F16C must be enabled.
#[inline(always)]
unsafe fn dequantize_avx2<T: Elem>(w: &[T], out: &mut [f32]) {
    assert_eq!(w.len(), out.len());
    let (wc, wr) = w.as_chunks::<8>();
    let (oc, or) = out.as_chunks_mut::<8>();
    for (w, o) in wc.iter().zip(oc) {
        // SAFETY: caller guarantees the features.
        *o = bytemuck::cast(unsafe { T::load8(w) });
    }
    for (w, o) in wr.iter().zip(or) {
        *o = w.widen();
    }
}

/// Byte-level entries for one element type.
macro_rules! float_entries {
    ($module:ident, $T:ty) => {
        mod $module {
            use super::*;

            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn dot_avx2(w: &[u8], a: &[u8]) -> f32 {
                // SAFETY: this function enables the features.
                unsafe { super::dot_avx2::<$T>(cast_blocks(w), cast_blocks(a)) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
            pub(super) unsafe fn dot_avx512(w: &[u8], a: &[u8]) -> f32 {
                // SAFETY: this function enables the features.
                unsafe { super::dot_avx512::<$T>(cast_blocks(w), cast_blocks(a)) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
            pub(super) unsafe fn dot_tile_avx512(
                w: &[u8],
                a: &[u8],
                act_len: usize,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let n = act_len / core::mem::size_of::<f32>();
                // SAFETY: this function enables the features; `dot_tile` checked the shapes.
                unsafe { super::dot_tile_avx512::<$T>(cast_blocks(w), cast_blocks(a), n, out, out_stride) }
            }

            // Unused for f32, whose dequantization is a byte copy.
            #[allow(dead_code)]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn dequantize(w: &[u8], out: &mut [f32]) {
                // SAFETY: this function enables the features.
                unsafe { super::dequantize_avx2::<$T>(cast_blocks(w), out) }
            }
        }
    };
}
float_entries!(f32_entries, f32);
float_entries!(f16_entries, f16);
float_entries!(bf16_entries, bf16);

/// Registers the AVX2 float kernels.
pub(super) fn register_avx2(k: &mut Kernels) {
    let f32_old = k.weight(WeightType::F32);
    k.set_weight(WeightType::F32, WeightKernels { dot: f32_entries::dot_avx2, ..f32_old });
    k.set_weight(
        WeightType::F16,
        WeightKernels { dot: f16_entries::dot_avx2, dot_rows: None, dequantize: f16_entries::dequantize },
    );
    k.set_weight(
        WeightType::BF16,
        WeightKernels { dot: bf16_entries::dot_avx2, dot_rows: None, dequantize: bf16_entries::dequantize },
    );
}

/// Registers the AVX-512 float kernels.
pub(super) fn register_avx512(k: &mut Kernels) {
    let f32_old = k.weight(WeightType::F32);
    k.set_weight(WeightType::F32, WeightKernels { dot: f32_entries::dot_avx512, ..f32_old });
    k.set_weight(
        WeightType::F16,
        WeightKernels { dot: f16_entries::dot_avx512, dot_rows: None, dequantize: f16_entries::dequantize },
    );
    k.set_weight(
        WeightType::BF16,
        WeightKernels { dot: bf16_entries::dot_avx512, dot_rows: None, dequantize: bf16_entries::dequantize },
    );
    k.set_tile(WeightType::F32, f32_entries::dot_tile_avx512);
    k.set_tile(WeightType::F16, f16_entries::dot_tile_avx512);
    k.set_tile(WeightType::BF16, bf16_entries::dot_tile_avx512);
}
