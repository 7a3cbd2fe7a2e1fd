//! Q5_0 (GGML type 6): blocks of 32 elements, 22 bytes.
//!
//! | offset | field          | meaning                                                  |
//! |--------|----------------|----------------------------------------------------------|
//! | 0      | `d: f16`       | scale                                                    |
//! | 2      | `qh: [u8; 4]`  | little-endian `u32`; bit `j` is the 5th bit of element `j` |
//! | 6      | `qs: [u8; 16]` | low 4 bits: low nibble of `qs[j]` → element `j`, high nibble → element `j + 16` |
//!
//! Element value: `d · (q − 16)`, `q` in `0..32`. Dot product against Q8_0.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::BlockQ8_0;

/// Elements per block.
pub const QK5_0: usize = 32;

/// One Q5_0 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: f16,
    /// Fifth bits, as a little-endian `u32`.
    pub qh: [u8; 4],
    /// Packed low 4 bits.
    pub qs: [u8; QK5_0 / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ5_0>() == 22);

/// Unpacks 32 five-bit quants (`0..32`) from nibbles and high bits.
#[inline(always)]
pub(crate) fn unpack5(qs: &[u8; 16], qh: [u8; 4]) -> [i8; 32] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = ((qs[j] & 0x0f) | (((qh >> j) & 1) << 4) as u8) as i8;
        q[j + 16] = ((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8) as i8;
    }
    q
}

impl super::Block32 for BlockQ5_0 {
    /// The 32 quants as signed values `q − 16`.
    #[inline(always)]
    fn codes(&self) -> [i8; QK5_0] {
        let mut q = unpack5(&self.qs, self.qh);
        for v in &mut q {
            *v -= 16;
        }
        q
    }

    fn d(&self) -> f16 {
        self.d
    }
}

/// Writes `d · (q − 16)` for every element.
pub fn dequantize(blocks: &[BlockQ5_0], out: &mut [f32]) {
    super::dequantize_symmetric(blocks, out)
}

/// Dot product with a Q8_0 activation row.
pub fn dot(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    super::dot_symmetric(x, y)
}

super::weight_entry_points!(BlockQ5_0, BlockQ8_0);
