//! Q3_K (GGML type 11): super-blocks of 256 elements (16 sub-blocks of 16), 110 bytes.
//!
//! | offset | field              | meaning                                   |
//! |--------|--------------------|-------------------------------------------|
//! | 0      | `hmask: [u8; 32]`  | third bits of the quants                  |
//! | 32     | `qs: [u8; 64]`     | low 2 bits of the quants                  |
//! | 96     | `scales: [u8; 12]` | sixteen 6-bit scales, packed (see [`scales`]) |
//! | 108    | `d: f16`           | super-block scale                         |
//!
//! Element `128h + 32j + l` (`h` in `0..2`, `j` in `0..4`, `l` in `0..32`) takes its low
//! 2 bits from bits `2j, 2j+1` of `qs[32h + l]` and its third bit from bit `4h + j` of
//! `hmask[l]`; the 3-bit code `u` stands for `u − 4`. Element value:
//! `(d · (sc − 32)) · (u − 4)`. Dot product against Q8_K: per super-block
//! `(dx·dy) · Σ_g (sc_g − 32)·Σ (u − 4)·y`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::q6_k::scaled_sum_16;
use super::{f16_to_f32, BlockQ8K, QK_K};

/// One Q3_K super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    /// Third bits.
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits.
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale.
    pub d: f16,
}
const _: () = assert!(core::mem::size_of::<BlockQ3K>() == 110);

/// The sixteen signed scales `sc − 32`. Scale `g` has its low 4 bits in the low nibble of
/// byte `g` (`g < 8`) or the high nibble of byte `g − 8`, and its top 2 bits in bits
/// `2·(g / 4)`, `2·(g / 4) + 1` of byte `8 + g % 4`.
#[inline(always)]
pub(crate) fn scales(s: &[u8; 12]) -> [i8; 16] {
    core::array::from_fn(|g| {
        let low = if g < 8 { s[g] & 0x0f } else { s[g - 8] >> 4 };
        let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// The 256 unsigned 3-bit codes `u` (standing for `u − 4`) in element order.
#[inline(always)]
pub(crate) fn codes(b: &BlockQ3K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                let low = (b.qs[32 * h + l] >> (2 * j)) & 3;
                let high = (b.hmask[l] >> (4 * h + j)) & 1;
                q[128 * h + 32 * j + l] = low | (high << 2);
            }
        }
    }
    q
}

/// Writes `(d·(sc − 32))·(u − 4)` for every element.
pub fn dequantize(blocks: &[BlockQ3K], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        let sc = scales(&b.scales);
        let q = codes(b);
        let (o, _) = o.as_chunks_mut::<16>();
        let (q, _) = q.as_chunks::<16>();
        for g in 0..16 {
            let dg = d * sc[g] as f32;
            for l in 0..16 {
                o[g][l] = dg * (q[g][l] as i8 - 4) as f32;
            }
        }
    }
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ3K], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let q = codes(xb).map(|u| u as i8 - 4);
        let sumi = scaled_sum_16(&q, &yb.qs, &scales(&xb.scales));
        acc += (f16_to_f32(xb.d) * yb.d) * sumi as f32;
    }
    acc
}

super::weight_entry_points!(BlockQ3K, BlockQ8K);
