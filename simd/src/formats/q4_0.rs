//! Q4_0 (GGML type 2): blocks of 32 elements, 18 bytes.
//!
//! | offset | field          | meaning                                             |
//! |--------|----------------|-----------------------------------------------------|
//! | 0      | `d: f16`       | scale                                               |
//! | 2      | `qs: [u8; 16]` | low nibble of `qs[j]` is element `j`, high nibble is element `j + 16` |
//!
//! Element value: `d · (q − 8)`, `q` in `0..16`. Dot product against Q8_0.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::BlockQ8_0;

/// Elements per block.
pub const QK4_0: usize = 32;

/// One Q4_0 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Packed 4-bit quants.
    pub qs: [u8; QK4_0 / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ4_0>() == 18);

impl super::Block32 for BlockQ4_0 {
    /// The 32 quants as signed values `q − 8`.
    #[inline(always)]
    fn codes(&self) -> [i8; QK4_0] {
        let mut q = [0i8; QK4_0];
        for j in 0..QK4_0 / 2 {
            q[j] = (self.qs[j] & 0x0f) as i8 - 8;
            q[j + 16] = (self.qs[j] >> 4) as i8 - 8;
        }
        q
    }

    fn d(&self) -> f16 {
        self.d
    }
}

/// Writes `d · (q − 8)` for every element.
pub fn dequantize(blocks: &[BlockQ4_0], out: &mut [f32]) {
    super::dequantize_symmetric(blocks, out)
}

/// Dot product with a Q8_0 activation row.
pub fn dot(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    super::dot_symmetric(x, y)
}

super::weight_entry_points!(BlockQ4_0, BlockQ8_0);
