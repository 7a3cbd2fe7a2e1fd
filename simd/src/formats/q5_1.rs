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

use super::{f16_to_f32, reduce8, BlockQ8_1};

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

/// The block's 32 unsigned quants.
#[inline(always)]
pub(crate) fn unpack(b: &BlockQ5_1) -> [i8; QK5_1] {
    super::q5_0::unpack5(&b.qs, b.qh)
}

/// Writes `d · q + m` for every element.
pub fn dequantize(blocks: &[BlockQ5_1], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK5_1>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
        let q = unpack(b);
        for j in 0..QK5_1 {
            o[j] = q[j] as f32 * d + m;
        }
    }
}

/// Dot product with a Q8_1 activation row.
pub fn dot(x: &[BlockQ5_1], y: &[BlockQ8_1]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = [0f32; 8];
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        for (k, (xb, yb)) in xc.iter().zip(yc).enumerate() {
            let sumi = super::q8_0::dot_i8_32(&unpack(xb), &yb.qs);
            acc[k] += (f16_to_f32(xb.d) * f16_to_f32(yb.d)) * sumi as f32 + f16_to_f32(xb.m) * f16_to_f32(yb.s);
        }
    }
    reduce8(acc)
}

super::weight_entry_points!(BlockQ5_1, BlockQ8_1);
