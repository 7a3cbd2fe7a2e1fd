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

use super::q4_k::{min_term, scaled_sum_32, scales_mins, K_SCALE_SIZE};
use super::{f16_to_f32, BlockQ8K, QK_K};

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

/// The 256 unsigned 5-bit quants in element order.
#[inline(always)]
pub(crate) fn unpack(b: &BlockQ5K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            let byte = b.qs[32 * c + l];
            let h = b.qh[l] >> (2 * c);
            q[64 * c + l] = ((byte & 0x0f) | ((h & 1) << 4)) as i8;
            q[64 * c + 32 + l] = ((byte >> 4) | ((h & 2) << 3)) as i8;
        }
    }
    q
}

/// Writes `(d·sc)·q − dmin·m` for every element.
pub fn dequantize(blocks: &[BlockQ5K], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let (sc, mn) = scales_mins(&b.scales);
        let q = unpack(b);
        let (o, _) = o.as_chunks_mut::<32>();
        let (q, _) = q.as_chunks::<32>();
        for j in 0..8 {
            let d1 = d * sc[j] as f32;
            let m1 = dmin * mn[j] as f32;
            for l in 0..32 {
                o[j][l] = d1 * q[j][l] as f32 - m1;
            }
        }
    }
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ5K], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let (sc, mn) = scales_mins(&xb.scales);
        let sumi = scaled_sum_32(&unpack(xb), &yb.qs, &sc);
        let summ = min_term(&mn, &yb.bsums);
        let d = f16_to_f32(xb.d) * yb.d;
        let dm = f16_to_f32(xb.dmin) * yb.d;
        acc += d * sumi as f32 - dm * summ as f32;
    }
    acc
}

super::weight_entry_points!(BlockQ5K, BlockQ8K);
