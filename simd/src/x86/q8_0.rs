//! Q8_0 × Q8_0: signed×signed bytes (see `signed_block32!`).

use core::arch::x86_64::*;

use super::block32::{signed_block32, Block32};
use super::{load32, IsaOps};
use crate::formats::BlockQ8_0;

/// The block's quants.
#[inline(always)]
fn levels(x: &BlockQ8_0) -> __m256i {
    load32(&x.qs)
}

signed_block32!(BlockQ8_0);

super::x86_entries!(block32, BlockQ8_0, BlockQ8_0);
