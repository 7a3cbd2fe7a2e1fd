//! Q2_K (GGML type 10): super-blocks of 256 elements (16 sub-blocks of 16), 84 bytes.
//!
//! | offset | field              | meaning                                              |
//! |--------|--------------------|------------------------------------------------------|
//! | 0      | `scales: [u8; 16]` | sub-block `g`: 4-bit scale in the low nibble, 4-bit minimum in the high one |
//! | 16     | `qs: [u8; 64]`     | 2-bit quants                                         |
//! | 80     | `d: f16`           | super-block scale for the sub-block scales           |
//! | 82     | `dmin: f16`        | super-block scale for the sub-block minimums         |
//!
//! Each 128-element half `h` uses `qs[32h..32h+32]`: element `128h + 32j + l` (`j` in
//! `0..4`, `l` in `0..32`) is bits `2j, 2j+1` of `qs[32h + l]`. Element value:
//! `(d · sc) · q − (dmin · m)`, `q` in `0..4`. Dot product against Q8_K: per super-block
//! `(dx·dy)·Σ_g sc_g·Σ q·y − (dminx·dy)·Σ_g m_g·bsums[g]`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::q6_k::scaled_sum_16;
use super::{f16_to_f32, BlockQ8K, QK_K};

/// One Q2_K super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Sub-block scales (low nibbles) and minimums (high nibbles).
    pub scales: [u8; QK_K / 16],
    /// Packed 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Scale of the sub-block scales.
    pub d: f16,
    /// Scale of the sub-block minimums.
    pub dmin: f16,
}
const _: () = assert!(core::mem::size_of::<BlockQ2K>() == 84);

/// The 256 unsigned 2-bit quants in element order.
#[inline(always)]
pub(crate) fn codes(b: &BlockQ2K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                q[128 * h + 32 * j + l] = ((b.qs[32 * h + l] >> (2 * j)) & 3) as i8;
            }
        }
    }
    q
}

/// The sixteen 4-bit scales and the sixteen 4-bit minimums.
#[inline(always)]
fn scales_mins(b: &BlockQ2K) -> ([i8; 16], [u8; 16]) {
    (b.scales.map(|s| (s & 0x0f) as i8), b.scales.map(|s| s >> 4))
}

/// Writes `(d·sc)·q − dmin·m` for every element.
pub fn dequantize(blocks: &[BlockQ2K], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let (sc, mn) = scales_mins(b);
        let q = codes(b);
        let (o, _) = o.as_chunks_mut::<16>();
        let (q, _) = q.as_chunks::<16>();
        for g in 0..16 {
            let (dg, mg) = (d * sc[g] as f32, dmin * mn[g] as f32);
            for l in 0..16 {
                o[g][l] = dg * q[g][l] as f32 - mg;
            }
        }
    }
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ2K], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let (sc, mn) = scales_mins(xb);
        let sumi = scaled_sum_16(&codes(xb), &yb.qs, &sc);
        let summ: i32 = mn.iter().zip(&yb.bsums).map(|(&m, &s)| m as i32 * s as i32).sum();
        let d = f16_to_f32(xb.d) * yb.d;
        let dm = f16_to_f32(xb.dmin) * yb.d;
        acc += d * sumi as f32 - dm * summ as f32;
    }
    acc
}

super::weight_entry_points!(BlockQ2K, BlockQ8K);
