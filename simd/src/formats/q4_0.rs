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

use super::{f16_to_f32, reduce8, BlockQ8_0};

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

/// The block's 32 quants as signed values `q − 8`.
#[inline(always)]
pub(crate) fn unpack(b: &BlockQ4_0) -> [i8; QK4_0] {
    let mut q = [0i8; QK4_0];
    for j in 0..QK4_0 / 2 {
        q[j] = (b.qs[j] & 0x0f) as i8 - 8;
        q[j + 16] = (b.qs[j] >> 4) as i8 - 8;
    }
    q
}

/// Writes `d · (q − 8)` for every element.
pub fn dequantize(blocks: &[BlockQ4_0], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK4_0>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        let q = unpack(b);
        for j in 0..QK4_0 {
            o[j] = q[j] as f32 * d;
        }
    }
}

/// Dot product with a Q8_0 activation row.
pub fn dot(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = [0f32; 8];
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        for (k, (xb, yb)) in xc.iter().zip(yc).enumerate() {
            let sumi = super::q8_0::dot_i8_32(&unpack(xb), &yb.qs);
            acc[k] += sumi as f32 * (f16_to_f32(xb.d) * f16_to_f32(yb.d));
        }
    }
    reduce8(acc)
}

super::weight_entry_points!(BlockQ4_0, BlockQ8_0);
