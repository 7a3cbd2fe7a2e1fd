//! Q4_0 × Q8_0: nibbles minus 8, then the sign trick; tiles dot the nibbles themselves
//! and subtract `8 · Σ y`.

use core::arch::x86_64::*;

use super::block32::{dot_n, sign_trick, Block32};
use super::{load32, nibbles32, IsaOps};
use crate::formats::{BlockQ4_0, BlockQ8_0};

impl Block32 for BlockQ4_0 {
    type Act = BlockQ8_0;
    const WITH_MIN: bool = false;
    const OFFSET: i8 = 8;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { nibbles32(&x.qs) }
    }
    #[inline(always)]
    unsafe fn lanes<I: IsaOps>(x: &Self, y: &BlockQ8_0) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let q = _mm256_sub_epi8(nibbles32(&x.qs), _mm256_set1_epi8(8));
            let (u, s) = sign_trick(q, load32(&y.qs));
            I::dp(_mm256_setzero_si256(), u, s)
        }
    }
    fn d(&self) -> u16 {
        self.d.to_bits()
    }
    fn act_quants(y: &BlockQ8_0) -> __m256i {
        load32(&y.qs)
    }
    fn act_d(y: &BlockQ8_0) -> u16 {
        y.d.to_bits()
    }
}

/// See [`dot_n`].
#[inline(always)]
unsafe fn kernel<I: IsaOps, const R: usize>(xs: [&[BlockQ4_0]; R], y: &[BlockQ8_0]) -> [f32; R] {
    // SAFETY: forwarded precondition.
    unsafe { dot_n::<I, BlockQ4_0, R>(xs, y) }
}

super::x86_entries!(kernel, block32, BlockQ4_0, BlockQ8_0);
