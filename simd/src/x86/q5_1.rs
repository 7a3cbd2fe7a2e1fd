//! Q5_1 × Q8_1: unsigned 5-bit quants × signed activations, minimum through `s`.

use core::arch::x86_64::*;

use super::block32::{dot_n, Block32};
use super::{bits32, load32, nibbles32, IsaOps};
use crate::formats::{BlockQ5_1, BlockQ8_1};

impl Block32 for BlockQ5_1 {
    type Act = BlockQ8_1;
    const WITH_MIN: bool = true;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { _mm256_or_si256(nibbles32(&x.qs), _mm256_and_si256(bits32(x.qh), _mm256_set1_epi8(0x10))) }
    }
    fn d(&self) -> u16 {
        self.d.to_bits()
    }
    fn m(&self) -> u16 {
        self.m.to_bits()
    }
    fn act_quants(y: &BlockQ8_1) -> __m256i {
        load32(&y.qs)
    }
    fn act_d(y: &BlockQ8_1) -> u16 {
        y.d.to_bits()
    }
    fn act_s(y: &BlockQ8_1) -> u16 {
        y.s.to_bits()
    }
}

/// See [`dot_n`].
#[inline(always)]
unsafe fn kernel<I: IsaOps, const R: usize>(xs: [&[BlockQ5_1]; R], y: &[BlockQ8_1]) -> [f32; R] {
    // SAFETY: forwarded precondition.
    unsafe { dot_n::<I, BlockQ5_1, R>(xs, y) }
}

super::x86_entries!(kernel, block32, BlockQ5_1, BlockQ8_1);
