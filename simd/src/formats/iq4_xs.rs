//! IQ4_XS (GGML type 23): super-blocks of 256 elements (8 sub-blocks of 32), 136 bytes,
//! on IQ4_NL's non-linear grid.
//!
//! | offset | field              | meaning                                         |
//! |--------|--------------------|-------------------------------------------------|
//! | 0      | `d: f16`           | super-block scale                               |
//! | 2      | `scales_h: u16`    | high 2 bits of the eight 6-bit sub-block scales, bits `2j..2j+2` for sub-block `j` |
//! | 4      | `scales_l: [u8; 4]`| low 4 bits of the scales: sub-block `2i` in the low nibble of byte `i`, `2i + 1` in its high nibble |
//! | 8      | `qs: [u8; 128]`    | 4-bit indices, 16 bytes a sub-block, packed as one IQ4_NL block's |
//!
//! Element value: `(d · (ls − 32)) · GRID[q]` with the sub-block's 6-bit `ls`, so a
//! scale in `−32..32`. Dot product against Q8_K: per super-block
//! `(dx·dy) · Σⱼ (lsⱼ − 32) · Σ GRID[q]·y`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::iq4_nl::levels;
use super::{f16_to_f32, BlockQ8K, QK_K};

/// One IQ4_XS super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4XS {
    /// Super-block scale.
    pub d: f16,
    /// High 2 bits of the sub-block scales.
    pub scales_h: u16,
    /// Low 4 bits of the sub-block scales.
    pub scales_l: [u8; QK_K / 64],
    /// Packed 4-bit indices into the grid.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(core::mem::size_of::<BlockIQ4XS>() == 136);

impl super::ScaledSuperBlock for BlockIQ4XS {
    fn d(&self) -> f32 {
        f16_to_f32(self.d)
    }

    /// `ls − 32` for each sub-block.
    #[inline(always)]
    fn scales(&self) -> [i32; 8] {
        core::array::from_fn(|j| {
            let low = (self.scales_l[j / 2] >> (4 * (j % 2))) & 0x0f;
            let high = ((self.scales_h >> (2 * j)) & 3) as u8;
            i32::from(low | high << 4) - 32
        })
    }

    #[inline(always)]
    fn levels(&self) -> [i8; QK_K] {
        let (qs, _) = self.qs.as_chunks::<16>();
        let mut q = [0i8; QK_K];
        for (q, qs) in q.as_chunks_mut::<32>().0.iter_mut().zip(qs) {
            *q = levels(qs);
        }
        q
    }
}

/// Writes `(d · scale) · GRID[q]` for every element.
pub fn dequantize(blocks: &[BlockIQ4XS], out: &mut [f32]) {
    super::dequantize_scaled(blocks, out)
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockIQ4XS], y: &[BlockQ8K]) -> f32 {
    super::dot_scaled(x, y)
}

super::weight_entry_points!(BlockIQ4XS, BlockQ8K);
