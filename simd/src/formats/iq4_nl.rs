//! IQ4_NL (GGML type 20): blocks of 32 elements, 18 bytes, on a non-linear grid.
//!
//! | offset | field          | meaning                                             |
//! |--------|----------------|-----------------------------------------------------|
//! | 0      | `d: f16`       | scale                                               |
//! | 2      | `qs: [u8; 16]` | low nibble of `qs[j]` indexes element `j`, high nibble element `j + 16` |
//!
//! Element value: `d · GRID[q]`, `q` in `0..16`: the sixteen signed levels of
//! [`GRID`], denser near zero than a uniform 4-bit code. Dot product against Q8_0, as
//! the symmetric 32-element formats: the levels are the block's integer codes.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::BlockQ8_0;

/// Elements per block.
pub const QK4_NL: usize = 32;

/// The sixteen levels a 4-bit index selects (ggml's `kvalues_iq4nl`), shared by IQ4_XS.
pub const GRID: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// One IQ4_NL block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4NL {
    /// Scale.
    pub d: f16,
    /// Packed 4-bit indices into [`GRID`].
    pub qs: [u8; QK4_NL / 2],
}
const _: () = assert!(core::mem::size_of::<BlockIQ4NL>() == 18);

/// The 32 levels that sixteen bytes of packed indices select: low nibbles first, then
/// high nibbles (the element order of IQ4_NL and of each IQ4_XS sub-block).
#[inline(always)]
pub(crate) fn levels(qs: &[u8; 16]) -> [i8; 32] {
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = GRID[(qs[j] & 0x0f) as usize];
        q[j + 16] = GRID[(qs[j] >> 4) as usize];
    }
    q
}

impl super::Block32 for BlockIQ4NL {
    /// The 32 levels in element order.
    #[inline(always)]
    fn codes(&self) -> [i8; QK4_NL] {
        levels(&self.qs)
    }

    fn d(&self) -> f16 {
        self.d
    }
}

/// Writes `d · GRID[q]` for every element.
pub fn dequantize(blocks: &[BlockIQ4NL], out: &mut [f32]) {
    super::dequantize_symmetric(blocks, out)
}

/// Dot product with a Q8_0 activation row.
pub fn dot(x: &[BlockIQ4NL], y: &[BlockQ8_0]) -> f32 {
    super::dot_symmetric(x, y)
}

super::weight_entry_points!(BlockIQ4NL, BlockQ8_0);
