//! The shared skeleton of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): eight
//! blocks at a time, each block's exact i32 sum from [`Block32::lanes`], the eight sums
//! gathered into one vector, scaled and added to eight f32 lanes — the order
//! `crate::formats` prescribes.

use core::arch::x86_64::*;

use super::{cvt_f16x8, reduce8_ps, reduce8x8, IsaOps};

/// A 32-element weight block and its activation block.
pub(crate) trait Block32: bytemuck::Pod {
    /// The activation block (Q8_0 or Q8_1).
    type Act: bytemuck::Pod;
    /// Whether the block has a minimum (`m`) paired with the activation's `s`.
    const WITH_MIN: bool;

    /// i32 lanes whose total is the block's exact `Σ q·y`.
    ///
    /// # Safety
    /// The CPU must support `I`.
    unsafe fn lanes<I: IsaOps>(x: &Self, y: &Self::Act) -> __m256i;
    /// f16 bits of the weight scale.
    fn d(&self) -> u16;
    /// f16 bits of the weight minimum (if `WITH_MIN`).
    fn m(&self) -> u16 {
        0
    }
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
            group::<I, B, R>(&xs, &y[b0..b0 + 8], b0, 8, &mut acc);
            b0 += 8;
        }
        if b0 < y.len() {
            group::<I, B, R>(&xs, &y[b0..], b0, y.len() - b0, &mut acc);
        }
        acc.map(|a| reduce8_ps(a))
    }
}

/// Adds blocks `b0 .. b0 + k` (`k ≤ 8`, block `b0 + j` into lane `j`) to `acc`.
#[inline(always)]
unsafe fn group<I: IsaOps, B: Block32, const R: usize>(
    xs: &[&[B]; R],
    y: &[B::Act],
    b0: usize,
    k: usize,
    acc: &mut [__m256; R],
) {
    // SAFETY: the caller guarantees the ISA.
    unsafe {
        let y = &y[..k];
        let (mut dy, mut sy) = ([0u16; 8], [0u16; 8]);
        for j in 0..k {
            dy[j] = B::act_d(&y[j]);
            if B::WITH_MIN {
                sy[j] = B::act_s(&y[j]);
            }
        }
        let dy = cvt_f16x8(dy);
        let sy = cvt_f16x8(sy);
        for r in 0..R {
            let x = &xs[r][b0..b0 + k];
            let mut v = [_mm256_setzero_si256(); 8];
            let (mut dx, mut mx) = ([0u16; 8], [0u16; 8]);
            for j in 0..k {
                v[j] = B::lanes::<I>(&x[j], &y[j]);
                dx[j] = x[j].d();
                if B::WITH_MIN {
                    mx[j] = x[j].m();
                }
            }
            let sums = _mm256_cvtepi32_ps(reduce8x8(&v));
            let scale = _mm256_mul_ps(cvt_f16x8(dx), dy);
            let mut t = _mm256_mul_ps(scale, sums);
            if B::WITH_MIN {
                t = _mm256_add_ps(t, _mm256_mul_ps(cvt_f16x8(mx), sy));
            }
            acc[r] = _mm256_add_ps(acc[r], t);
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
