//! Q5_0 × Q8_0: the unsigned 5-bit values (nibbles plus fifth bits) dotted with the
//! activations, from a start of `−16 · Σ y`.

use core::arch::x86_64::*;

use super::block32::Block32;
use super::{load32, nibbles32, IsaOps};
use crate::formats::{BlockQ5_0, BlockQ8_0};

impl Block32 for BlockQ5_0 {
    type Act = BlockQ8_0;
    const WITH_MIN: bool = false;

    #[inline(always)]
    fn offset<I: IsaOps>() -> u8 {
        16
    }
    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe { I::add_where(nibbles32(&x.qs), x.qh, _mm256_set1_epi8(0x10)) }
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

super::x86_entries!(block32, BlockQ5_0, BlockQ8_0);
