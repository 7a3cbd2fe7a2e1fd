//! IQ3_XXS (GGML type 18): super-blocks of 256 elements (8 sub-blocks of 32), 98 bytes,
//! whose levels come four at a time from a grid of 256 points.
//!
//! | offset | field                    | meaning                                  |
//! |--------|--------------------------|------------------------------------------|
//! | 0      | `d: f16`                 | super-block scale                        |
//! | 2      | `qs: [u8; 64]`           | grid indices, 8 a sub-block: entry `i` of sub-block `j` gives elements `32j + 4i .. 32j + 4i + 4` |
//! | 66     | `scales_signs: [u8; 32]` | a little-endian `u32` a sub-block: bits `7g..7g+7` the signs of elements `8g .. 8g + 7` of it (the eighth's makes the minus signs even), bits 28–31 its scale `s` |
//!
//! Element value: `(d · (2s + 1) / 4) · ±GRID[...]`, the grid's byte for the element,
//! negative where its sign bit is set. Dot product against Q8_K: per super-block
//! `(dx/4 · dy) · Σⱼ (2sⱼ + 1) · Σ q·y`, sums in `i32`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{f16_to_f32, BlockQ8K, QK_K};

/// One IQ3_XXS super-block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ3XXS {
    /// Super-block scale.
    pub d: f16,
    /// Grid indices.
    pub qs: [u8; QK_K / 4],
    /// Sign indices and scales.
    pub scales_signs: [u8; QK_K / 8],
}
const _: () = assert!(core::mem::size_of::<BlockIQ3XXS>() == 98);

impl BlockIQ3XXS {
    /// Sub-block `j`'s word of signs and scale.
    #[inline(always)]
    pub(crate) fn word(&self, j: usize) -> u32 {
        u32::from_le_bytes(self.scales_signs[4 * j..4 * j + 4].try_into().unwrap())
    }

    /// Sub-block `j`'s 32 sign bits, bit `e` set where its element `e` is negative: each
    /// group of 8 elements has 7 stored bits, and its eighth makes the count of minus signs
    /// even (what ggml's table `ksigns_iq2xs` lists).
    #[inline(always)]
    pub(crate) fn signs(&self, j: usize) -> u32 {
        let w = self.word(j);
        // The four 7-bit fields, one a byte.
        let fields = (w & 0x7f) | (w >> 7 & 0x7f) << 8 | (w >> 14 & 0x7f) << 16 | (w >> 21 & 0x7f) << 24;
        // Each byte's parity in its bit 0 (the folds mix bits of one byte where they count).
        let mut parity = fields ^ fields >> 4;
        parity ^= parity >> 2;
        parity ^= parity >> 1;
        fields | (parity & 0x0101_0101) << 7
    }
}

/// The 32 levels of eight grid points (four a point, in the bytes of its word) with their
/// signs (bit `e` of `signs` set where element `e` is negative): a sub-block of IQ3_XXS
/// or IQ3_S.
#[inline(always)]
pub(crate) fn signed_levels(points: [u32; 8], signs: u32) -> [i8; 32] {
    let mut q = [0i8; 32];
    for (i, point) in points.into_iter().enumerate() {
        for (b, level) in point.to_le_bytes().into_iter().enumerate() {
            let e = 4 * i + b;
            q[e] = if signs >> e & 1 == 1 { -(level as i8) } else { level as i8 };
        }
    }
    q
}

impl super::ScaledSuperBlock for BlockIQ3XXS {
    /// `d / 4` (exact), so that the scales are the odd integers `2s + 1`.
    fn d(&self) -> f32 {
        f16_to_f32(self.d) * 0.25
    }

    #[inline(always)]
    fn scales(&self) -> [i32; 8] {
        core::array::from_fn(|j| 2 * (self.word(j) >> 28) as i32 + 1)
    }

    #[inline(always)]
    fn levels(&self) -> [i8; QK_K] {
        let mut q = [0i8; QK_K];
        for (j, q) in q.as_chunks_mut::<32>().0.iter_mut().enumerate() {
            *q = signed_levels(core::array::from_fn(|i| GRID[self.qs[8 * j + i] as usize]), self.signs(j));
        }
        q
    }
}

/// Writes `(d · (2s + 1) / 4) · level` for every element.
pub fn dequantize(blocks: &[BlockIQ3XXS], out: &mut [f32]) {
    super::dequantize_scaled(blocks, out)
}

/// Dot product with a Q8_K activation row.
pub fn dot(x: &[BlockIQ3XXS], y: &[BlockQ8K]) -> f32 {
    super::dot_scaled(x, y)
}

super::weight_entry_points!(BlockIQ3XXS, BlockQ8K);

/// The grid: four levels a point, byte `b` of the word for the point's element `b`
/// (ggml's `iq3xxs_grid`).
#[rustfmt::skip]
pub(crate) const GRID: [u32; 256] = [
    0x04040404, 0x04040414, 0x04040424, 0x04040c0c, 0x04040c1c, 0x04040c3e, 0x04041404, 0x04041414,
    0x04041c0c, 0x04042414, 0x04043e1c, 0x04043e2c, 0x040c040c, 0x040c041c, 0x040c0c04, 0x040c0c14,
    0x040c140c, 0x040c142c, 0x040c1c04, 0x040c1c14, 0x040c240c, 0x040c2c24, 0x040c3e04, 0x04140404,
    0x04140414, 0x04140424, 0x04140c0c, 0x04141404, 0x04141414, 0x04141c0c, 0x04141c1c, 0x04141c3e,
    0x04142c0c, 0x04142c3e, 0x04143e2c, 0x041c040c, 0x041c043e, 0x041c0c04, 0x041c0c14, 0x041c142c,
    0x041c3e04, 0x04240c1c, 0x04241c3e, 0x04242424, 0x04242c3e, 0x04243e1c, 0x04243e2c, 0x042c040c,
    0x042c043e, 0x042c1c14, 0x042c2c14, 0x04341c2c, 0x04343424, 0x043e0c04, 0x043e0c24, 0x043e0c34,
    0x043e241c, 0x043e340c, 0x0c04040c, 0x0c04041c, 0x0c040c04, 0x0c040c14, 0x0c04140c, 0x0c04141c,
    0x0c041c04, 0x0c041c14, 0x0c041c24, 0x0c04243e, 0x0c042c04, 0x0c0c0404, 0x0c0c0414, 0x0c0c0c0c,
    0x0c0c1404, 0x0c0c1414, 0x0c14040c, 0x0c14041c, 0x0c140c04, 0x0c140c14, 0x0c14140c, 0x0c141c04,
    0x0c143e14, 0x0c1c0404, 0x0c1c0414, 0x0c1c1404, 0x0c1c1c0c, 0x0c1c2434, 0x0c1c3434, 0x0c24040c,
    0x0c24042c, 0x0c242c04, 0x0c2c1404, 0x0c2c1424, 0x0c2c2434, 0x0c2c3e0c, 0x0c34042c, 0x0c3e1414,
    0x0c3e2404, 0x14040404, 0x14040414, 0x14040c0c, 0x14040c1c, 0x14041404, 0x14041414, 0x14041434,
    0x14041c0c, 0x14042414, 0x140c040c, 0x140c041c, 0x140c042c, 0x140c0c04, 0x140c0c14, 0x140c140c,
    0x140c1c04, 0x140c341c, 0x140c343e, 0x140c3e04, 0x14140404, 0x14140414, 0x14140c0c, 0x14140c3e,
    0x14141404, 0x14141414, 0x14141c3e, 0x14142404, 0x14142c2c, 0x141c040c, 0x141c0c04, 0x141c0c24,
    0x141c3e04, 0x141c3e24, 0x14241c2c, 0x14242c1c, 0x142c041c, 0x142c143e, 0x142c240c, 0x142c3e24,
    0x143e040c, 0x143e041c, 0x143e0c34, 0x143e242c, 0x1c04040c, 0x1c040c04, 0x1c040c14, 0x1c04140c,
    0x1c04141c, 0x1c042c04, 0x1c04342c, 0x1c043e14, 0x1c0c0404, 0x1c0c0414, 0x1c0c1404, 0x1c0c1c0c,
    0x1c0c2424, 0x1c0c2434, 0x1c14040c, 0x1c14041c, 0x1c140c04, 0x1c14142c, 0x1c142c14, 0x1c143e14,
    0x1c1c0c0c, 0x1c1c1c1c, 0x1c241c04, 0x1c24243e, 0x1c243e14, 0x1c2c0404, 0x1c2c0434, 0x1c2c1414,
    0x1c2c2c2c, 0x1c340c24, 0x1c341c34, 0x1c34341c, 0x1c3e1c1c, 0x1c3e3404, 0x24040424, 0x24040c3e,
    0x24041c2c, 0x24041c3e, 0x24042c1c, 0x24042c3e, 0x240c3e24, 0x24141404, 0x24141c3e, 0x24142404,
    0x24143404, 0x24143434, 0x241c043e, 0x241c242c, 0x24240424, 0x24242c0c, 0x24243424, 0x242c142c,
    0x242c241c, 0x242c3e04, 0x243e042c, 0x243e0c04, 0x243e0c14, 0x243e1c04, 0x2c040c14, 0x2c04240c,
    0x2c043e04, 0x2c0c0404, 0x2c0c0434, 0x2c0c1434, 0x2c0c2c2c, 0x2c140c24, 0x2c141c14, 0x2c143e14,
    0x2c1c0414, 0x2c1c2c1c, 0x2c240c04, 0x2c24141c, 0x2c24143e, 0x2c243e14, 0x2c2c0414, 0x2c2c1c0c,
    0x2c342c04, 0x2c3e1424, 0x2c3e2414, 0x34041424, 0x34042424, 0x34042434, 0x34043424, 0x340c140c,
    0x340c340c, 0x34140c3e, 0x34143424, 0x341c1c04, 0x341c1c34, 0x34242424, 0x342c042c, 0x342c2c14,
    0x34341c1c, 0x343e041c, 0x343e140c, 0x3e04041c, 0x3e04042c, 0x3e04043e, 0x3e040c04, 0x3e041c14,
    0x3e042c14, 0x3e0c1434, 0x3e0c2404, 0x3e140c14, 0x3e14242c, 0x3e142c14, 0x3e1c0404, 0x3e1c0c2c,
    0x3e1c1c1c, 0x3e1c3404, 0x3e24140c, 0x3e24240c, 0x3e2c0404, 0x3e2c0414, 0x3e2c1424, 0x3e341c04,
];
