//! Q6_K (GGML type 14): super-blocks of 256 elements (16 sub-blocks of 16), 210 bytes.
//!
//! | offset | field              | meaning                                 |
//! |--------|--------------------|-----------------------------------------|
//! | 0      | `ql: [u8; 128]`    | low 4 bits of the quants                |
//! | 128    | `qh: [u8; 64]`     | high 2 bits of the quants               |
//! | 192    | `scales: [i8; 16]` | signed 8-bit sub-block scales           |
//! | 208    | `d: f16`           | super-block scale (last, unlike Q4_K)   |
//!
//! Each 128-element half `h` uses `ql[64h..64h+64]` and `qh[32h..32h+32]`; within it,
//! for `l` in `0..32`, elements `l`, `l+32`, `l+64`, `l+96` take their low 4 bits from
//! the low nibble of `ql[l]`, low nibble of `ql[l+32]`, high nibble of `ql[l]`, high
//! nibble of `ql[l+32]`, and their high 2 bits from bits 0–1, 2–3, 4–5, 6–7 of `qh[l]`.
//! Element value: `(d · scales[e / 16]) · (q − 32)`. Dot product against Q8_K:
//! per super-block `(dx·dy) · Σ_g scales[g] · Σ (q−32)·y`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{f16_to_f32, BlockQ8K, QK_K};

/// One Q6_K super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: f16,
}
const _: () = assert!(core::mem::size_of::<BlockQ6K>() == 210);

/// The 256 signed quants `q − 32` in element order.
#[inline(always)]
pub(crate) fn unpack(b: &BlockQ6K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for h in 0..2 {
        let (ql, qh) = (&b.ql[64 * h..64 * h + 64], &b.qh[32 * h..32 * h + 32]);
        let q = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            let hi = qh[l];
            q[l] = ((ql[l] & 0x0f) | ((hi & 0x03) << 4)) as i8 - 32;
            q[l + 32] = ((ql[l + 32] & 0x0f) | (((hi >> 2) & 0x03) << 4)) as i8 - 32;
            q[l + 64] = ((ql[l] >> 4) | (((hi >> 4) & 0x03) << 4)) as i8 - 32;
            q[l + 96] = ((ql[l + 32] >> 4) | (((hi >> 6) & 0x03) << 4)) as i8 - 32;
        }
    }
    q
}

/// Writes `(d·scale)·(q − 32)` for every element.
pub fn dequantize(blocks: &[BlockQ6K], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        let q = unpack(b);
        let (o, _) = o.as_chunks_mut::<16>();
        let (q, _) = q.as_chunks::<16>();
        for g in 0..16 {
            let dg = d * b.scales[g] as f32;
            for l in 0..16 {
                o[g][l] = dg * q[g][l] as f32;
            }
        }
    }
}

/// `Σ_g scales[g] · Σ q·y` over sixteen 16-element sub-blocks.
#[inline(always)]
pub(crate) fn scaled_sum_16(q: &[i8; QK_K], y: &[i8; QK_K], scales: &[i8; 16]) -> i32 {
    let (q, _) = q.as_chunks::<16>();
    let (y, _) = y.as_chunks::<16>();
    let mut s = 0i32;
    for g in 0..16 {
        let mut t = 0i32;
        for l in 0..16 {
            t += q[g][l] as i32 * y[g][l] as i32;
        }
        s += scales[g] as i32 * t;
    }
    s
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let sumi = scaled_sum_16(&unpack(xb), &yb.qs, &xb.scales);
        acc += (f16_to_f32(xb.d) * yb.d) * sumi as f32;
    }
    acc
}

super::weight_entry_points!(BlockQ6K, BlockQ8K);
