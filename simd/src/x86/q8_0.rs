//! Q8_0 × Q8_0: signed×signed bytes, as `q + 128` from a start of `−128 · Σ y` where the
//! ISA's dot product takes any unsigned byte (VNNI), else through the sign trick.

use core::arch::x86_64::*;

use super::block32::{sign_trick, Block32};
use super::{load32, IsaOps};
use crate::formats::BlockQ8_0;

impl Block32 for BlockQ8_0 {
    type Act = BlockQ8_0;
    const WITH_MIN: bool = false;

    #[inline(always)]
    fn offset<I: IsaOps>() -> u8 {
        if I::BYTE_DP {
            128
        } else {
            0
        }
    }
    #[inline(always)]
    unsafe fn prepare<I: IsaOps>(x: &Self) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            if I::BYTE_DP {
                // q + 128 as an unsigned byte.
                _mm256_xor_si256(load32(&x.qs), _mm256_set1_epi8(i8::MIN))
            } else {
                load32(&x.qs)
            }
        }
    }
    #[inline(always)]
    unsafe fn dp_prepared<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
        // SAFETY: the caller guarantees the ISA.
        unsafe {
            if I::BYTE_DP {
                I::dp(acc, p, y)
            } else {
                let (u, s) = sign_trick(p, y);
                I::dp(acc, u, s)
            }
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

super::x86_entries!(block32, BlockQ8_0, BlockQ8_0);
