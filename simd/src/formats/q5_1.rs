//! Q5_1 (GGML type 7): blocks of 32 elements, 24 bytes.
//!
//! | offset | field          | meaning                                                  |
//! |--------|----------------|----------------------------------------------------------|
//! | 0      | `d: f16`       | scale                                                    |
//! | 2      | `m: f16`       | minimum (offset)                                         |
//! | 4      | `qh: [u8; 4]`  | little-endian `u32`; bit `j` is the 5th bit of element `j` |
//! | 8      | `qs: [u8; 16]` | low 4 bits, packed as in Q5_0                            |
//!
//! Element value: `d · q + m`, `q` in `0..32`. Dot product against Q8_1 (as Q4_1).

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::BlockQ8_1;

/// Elements per block.
pub const QK5_1: usize = 32;

/// One Q5_1 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Minimum.
    pub m: f16,
    /// Fifth bits, as a little-endian `u32`.
    pub qh: [u8; 4],
    /// Packed low 4 bits.
    pub qs: [u8; QK5_1 / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ5_1>() == 24);

impl super::Block32 for BlockQ5_1 {
    /// The 32 unsigned quants.
    #[inline(always)]
    fn codes(&self) -> [i8; QK5_1] {
        super::q5_0::unpack5(&self.qs, self.qh)
    }

    fn d(&self) -> f16 {
        self.d
    }
}

impl super::OffsetBlock32 for BlockQ5_1 {
    fn m(&self) -> f16 {
        self.m
    }
}

/// Writes `d · q + m` for every element.
pub fn dequantize(blocks: &[BlockQ5_1], out: &mut [f32]) {
    super::dequantize_offset(blocks, out)
}

/// Dot product with a Q8_1 activation row.
pub fn dot(x: &[BlockQ5_1], y: &[BlockQ8_1]) -> f32 {
    super::dot_offset(x, y)
}

super::weight_entry_points!(BlockQ5_1, BlockQ8_1);
