//! Q4_1 × Q8_1: unsigned nibbles × signed activations, minimum through `s`.

use core::arch::x86_64::*;

use super::block32::Block32;
use super::{load32, nibbles32, IsaOps};
use crate::formats::{BlockQ4_1, BlockQ8_1};

impl Block32 for BlockQ4_1 {
    type Act = BlockQ8_1;
    const WITH_MIN: bool = true;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { nibbles32(&x.qs) }
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

super::x86_entries!(block32, BlockQ4_1, BlockQ8_1);
