//! Q5_0 × Q8_0: nibbles plus fifth bits, minus 16, then the sign trick; tiles dot the
//! unsigned 5-bit values and subtract `16 · Σ y`.

use core::arch::x86_64::*;

use super::block32::{dot_n, sign_trick, Block32};
use super::{bits32, load32, nibbles32, IsaOps};
use crate::formats::{BlockQ5_0, BlockQ8_0};

impl Block32 for BlockQ5_0 {
    type Act = BlockQ8_0;
    const WITH_MIN: bool = false;
    const OFFSET: i8 = 16;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { _mm256_or_si256(nibbles32(&x.qs), _mm256_and_si256(bits32(x.qh), _mm256_set1_epi8(0x10))) }
    }
    #[inline(always)]
    unsafe fn lanes<I: IsaOps>(x: &Self, y: &BlockQ8_0) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            // q − 16 as a signed byte: a nibble with its fifth bit clear becomes
            // nibble | 0xF0 (= nibble − 16); with it set, it stays nibble (= q − 16).
            let high = _mm256_andnot_si256(bits32(x.qh), _mm256_set1_epi8(0xf0u8 as i8));
            let q = _mm256_or_si256(nibbles32(&x.qs), high);
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
unsafe fn kernel<I: IsaOps, const R: usize>(xs: [&[BlockQ5_0]; R], y: &[BlockQ8_0]) -> [f32; R] {
    // SAFETY: forwarded precondition.
    unsafe { dot_n::<I, BlockQ5_0, R>(xs, y) }
}

super::x86_entries!(kernel, block32, BlockQ5_0, BlockQ8_0);
