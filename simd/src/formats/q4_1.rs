//! Q4_1 (GGML type 3): blocks of 32 elements, 20 bytes.
//!
//! | offset | field          | meaning                                             |
//! |--------|----------------|-----------------------------------------------------|
//! | 0      | `d: f16`       | scale                                               |
//! | 2      | `m: f16`       | minimum (offset)                                    |
//! | 4      | `qs: [u8; 16]` | low nibble of `qs[j]` is element `j`, high nibble is element `j + 16` |
//!
//! Element value: `d · q + m`, `q` in `0..16`. Dot product against Q8_1, whose `s`
//! carries the minimum term: per block `(dx·dy)·Σq·y + m·s`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::BlockQ8_1;

/// Elements per block.
pub const QK4_1: usize = 32;

/// One Q4_1 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum.
    pub m: f16,
    /// Packed 4-bit quants.
    pub qs: [u8; QK4_1 / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ4_1>() == 20);

impl super::Block32 for BlockQ4_1 {
    /// The 32 unsigned quants.
    #[inline(always)]
    fn codes(&self) -> [i8; QK4_1] {
        let mut q = [0i8; QK4_1];
        for j in 0..QK4_1 / 2 {
            q[j] = (self.qs[j] & 0x0f) as i8;
            q[j + 16] = (self.qs[j] >> 4) as i8;
        }
        q
    }

    fn d(&self) -> f16 {
        self.d
    }
}

impl super::OffsetBlock32 for BlockQ4_1 {
    fn m(&self) -> f16 {
        self.m
    }
}

/// Writes `d · q + m` for every element.
pub fn dequantize(blocks: &[BlockQ4_1], out: &mut [f32]) {
    super::dequantize_offset(blocks, out)
}

/// Dot product with a Q8_1 activation row.
pub fn dot(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    super::dot_offset(x, y)
}

super::weight_entry_points!(BlockQ4_1, BlockQ8_1);
