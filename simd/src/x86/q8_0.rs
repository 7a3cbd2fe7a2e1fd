//! Q8_0 × Q8_0: signed×signed bytes through the sign trick.

use core::arch::x86_64::*;

use super::block32::{dot_n, sign_trick, Block32};
use super::{load32, IsaOps};
use crate::formats::BlockQ8_0;

impl Block32 for BlockQ8_0 {
    type Act = BlockQ8_0;
    const WITH_MIN: bool = false;

    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        load32(&x.qs)
    }
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            let (u, s) = sign_trick(p, y);
            I::dp(acc, u, s)
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
unsafe fn kernel<I: IsaOps, const R: usize>(xs: [&[BlockQ8_0]; R], y: &[BlockQ8_0]) -> [f32; R] {
    // SAFETY: forwarded precondition.
    unsafe { dot_n::<I, BlockQ8_0, R>(xs, y) }
}

super::x86_entries!(kernel, block32, BlockQ8_0, BlockQ8_0);
