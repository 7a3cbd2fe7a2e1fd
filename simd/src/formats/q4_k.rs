//! Q4_K (GGML type 12): super-blocks of 256 elements (8 sub-blocks of 32), 144 bytes.
//!
//! | offset | field            | meaning                                          |
//! |--------|------------------|--------------------------------------------------|
//! | 0      | `d: f16`         | super-block scale for the sub-block scales       |
//! | 2      | `dmin: f16`      | super-block scale for the sub-block minimums     |
//! | 4      | `scales: [u8; 12]` | eight 6-bit scales and eight 6-bit mins, packed (see [`scale_min`]) |
//! | 16     | `qs: [u8; 128]`  | 4-bit quants                                     |
//!
//! The quants come in four 32-byte groups; group `c` holds sub-block `2c` in its low
//! nibbles and sub-block `2c + 1` in its high nibbles (byte `l` of the group → element
//! `l` of each). Element value: `(d · sc) · q − (dmin · m)` with the sub-block's 6-bit
//! `sc`, `m`. Dot product against Q8_K: per super-block
//! `(dx·dy)·Σⱼ scⱼ·Σ q·y − (dminx·dy)·Σⱼ mⱼ·(bsums[2j] + bsums[2j+1])`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{f16_to_f32, BlockQ8K, QK_K};

/// Bytes of packed 6-bit scales and mins in Q4_K and Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// One Q4_K super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Scale of the sub-block scales.
    pub d: f16,
    /// Scale of the sub-block minimums.
    pub dmin: f16,
    /// Packed 6-bit scales and minimums.
    pub scales: [u8; K_SCALE_SIZE],
    /// Packed 4-bit quants.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(core::mem::size_of::<BlockQ4K>() == 144);

/// Scale and minimum of sub-block `j` (ggml's `get_scale_min_k4`): bytes 0–3 hold the
/// low 6 bits of scales 0–3, bytes 4–7 those of mins 0–3; for sub-blocks 4–7 the low
/// 4 bits sit in the nibbles of bytes 8–11 (scale low, min high) and the top 2 bits in
/// the top 2 bits of bytes 0–3 (scales) and 4–7 (mins).
#[inline(always)]
pub fn scale_min(j: usize, s: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// All eight scales and all eight mins, as the bytes of two little-endian `u64`s
/// (scale/min `j` in byte `j`): [`scale_min`] done four sub-blocks at a time with
/// 32-bit masks.
#[inline(always)]
pub fn scales_mins_words(s: &[u8; K_SCALE_SIZE]) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let scales_lo = w0 & LOW6;
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mins_lo = w1 & LOW6;
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    (scales_lo as u64 | (scales_hi as u64) << 32, mins_lo as u64 | (mins_hi as u64) << 32)
}

/// All eight scales and all eight mins.
#[inline(always)]
pub fn scales_mins(s: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = scales_mins_words(s);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// A super-block with 6-bit sub-block scales and minima (Q4_K, Q5_K) as its
/// scalar dequantization and dot product see it; the formats differ only in
/// how they pack the 256 codes.
pub(crate) trait ScaleMinBlock {
    /// The 256 unsigned codes in element order.
    fn codes(&self) -> [i8; QK_K];
    /// The super-block's scale and minimum scale, `d` and `dmin`.
    fn d_dmin(&self) -> (f16, f16);
    /// The packed sub-block scales and minima.
    fn scales(&self) -> &[u8; K_SCALE_SIZE];
}

impl ScaleMinBlock for BlockQ4K {
    /// The 256 unsigned 4-bit quants in element order.
    #[inline(always)]
    fn codes(&self) -> [i8; QK_K] {
        let mut q = [0i8; QK_K];
        for c in 0..4 {
            for l in 0..32 {
                let byte = self.qs[32 * c + l];
                q[64 * c + l] = (byte & 0x0f) as i8;
                q[64 * c + 32 + l] = (byte >> 4) as i8;
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

/// Writes `(d·sc)·q − dmin·m` for every element of Q4_K or Q5_K blocks.
pub(crate) fn dequantize_scale_min<B: ScaleMinBlock>(blocks: &[B], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let (d, dmin) = b.d_dmin();
        let (d, dmin) = (f16_to_f32(d), f16_to_f32(dmin));
        let (sc, mn) = scales_mins(b.scales());
        let q = b.codes();
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

/// Dot product of Q4_K or Q5_K blocks with a Q8_K activation row, one `f32`
/// per super-block added in block order.
pub(crate) fn dot_scale_min<B: ScaleMinBlock>(x: &[B], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let (sc, mn) = scales_mins(xb.scales());
        let sumi = scaled_sum_32(&xb.codes(), &yb.qs, &sc);
        let summ = min_term(&mn, &yb.bsums);
        let (d, dmin) = xb.d_dmin();
        let d = f16_to_f32(d) * yb.d;
        let dm = f16_to_f32(dmin) * yb.d;
        acc += d * sumi as f32 - dm * summ as f32;
    }
    acc
}

/// Writes `(d·sc)·q − dmin·m` for every element.
pub fn dequantize(blocks: &[BlockQ4K], out: &mut [f32]) {
    dequantize_scale_min(blocks, out)
}

/// `Σⱼ mⱼ · (bsums[2j] + bsums[2j+1])`: the minimum term of a 32-sub-block K-quant.
#[inline(always)]
pub(crate) fn min_term(mn: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    let mut s = 0i32;
    for j in 0..8 {
        s += mn[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
    }
    s
}

/// `Σⱼ scⱼ · Σ q·y` over eight 32-element sub-blocks (unsigned scales in Q4_K and Q5_K,
/// signed in IQ4_XS).
#[inline(always)]
pub(crate) fn scaled_sum_32<S: Copy + Into<i32>>(q: &[i8; QK_K], y: &[i8; QK_K], sc: &[S; 8]) -> i32 {
    let (q, _) = q.as_chunks::<32>();
    let (y, _) = y.as_chunks::<32>();
    let mut s = 0i32;
    for j in 0..8 {
        s += sc[j].into() * super::q8_0::dot_i8_32(&q[j], &y[j]);
    }
    s
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    dot_scale_min(x, y)
}

super::weight_entry_points!(BlockQ4K, BlockQ8K);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_unpacking_matches_per_sub_block_rule() {
        let mut seed = 0x1234_5678u32;
        for _ in 0..2000 {
            let mut s = [0u8; K_SCALE_SIZE];
            for b in &mut s {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                *b = (seed >> 24) as u8;
            }
            let (sc, mn) = scales_mins(&s);
            for j in 0..8 {
                assert_eq!((sc[j], mn[j]), scale_min(j, &s), "{s:?} sub-block {j}");
            }
        }
    }
}
