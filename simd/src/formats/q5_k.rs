//! Q5_K (GGML type 13): super-blocks of 256 elements (8 sub-blocks of 32), 176 bytes.
//!
//! | offset | field              | meaning                                      |
//! |--------|--------------------|----------------------------------------------|
//! | 0      | `d: f16`           | super-block scale for the sub-block scales   |
//! | 2      | `dmin: f16`        | super-block scale for the sub-block minimums |
//! | 4      | `scales: [u8; 12]` | 6-bit scales and mins, packed as in Q4_K     |
//! | 16     | `qh: [u8; 32]`     | 5th bits: bit `j` of `qh[l]` belongs to element `l` of sub-block `j` |
//! | 48     | `qs: [u8; 128]`    | low 4 bits, packed as Q4_K's quants          |
//!
//! Element value: `(d · sc) · q − (dmin · m)`, `q` in `0..32`. Dot product against Q8_K
//! exactly as Q4_K.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::q4_k::{dequantize_scale_min, dot_scale_min, ScaleMinBlock, K_SCALE_SIZE};
use super::{BlockQ8K, QK_K};

/// One Q5_K super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Scale of the sub-block scales.
    pub d: f16,
    /// Scale of the sub-block minimums.
    pub dmin: f16,
    /// Packed 6-bit scales and minimums.
    pub scales: [u8; K_SCALE_SIZE],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Packed low 4 bits.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ5K>() == 176);

impl ScaleMinBlock for BlockQ5K {
    /// The 256 unsigned 5-bit quants in element order.
    #[inline(always)]
    fn codes(&self) -> [i8; QK_K] {
        let mut q = [0i8; QK_K];
        for c in 0..4 {
            for l in 0..32 {
                let byte = self.qs[32 * c + l];
                let h = self.qh[l] >> (2 * c);
                q[64 * c + l] = ((byte & 0x0f) | ((h & 1) << 4)) as i8;
                q[64 * c + 32 + l] = ((byte >> 4) | ((h & 2) << 3)) as i8;
            }
        }
        q
    }

    fn d_dmin(&self) -> (f16, f16) {
        (self.d, self.dmin)
    }

    fn scales(&self) -> &[u8; K_SCALE_SIZE] {
        &self.scales
    }
}

/// Writes `(d·sc)·q − dmin·m` for every element.
pub fn dequantize(blocks: &[BlockQ5K], out: &mut [f32]) {
    dequantize_scale_min(blocks, out)
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ5K], y: &[BlockQ8K]) -> f32 {
    dot_scale_min(x, y)
}

super::weight_entry_points!(BlockQ5K, BlockQ8K);
