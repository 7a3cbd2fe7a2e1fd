//! Q8_1 (GGML type 9): activation format for Q4_1 and Q5_1 weights. Blocks of 32
//! elements, 36 bytes.
//!
//! | offset | field          | meaning                                   |
//! |--------|----------------|-------------------------------------------|
//! | 0      | `d: f16`       | scale                                     |
//! | 2      | `s: f16`       | `d · Σ qs` (f32 product, rounded to f16)  |
//! | 4      | `qs: [i8; 32]` | element `j` is `d · qs[j]`                |
//!
//! `d` and `qs` are exactly Q8_0's; `s` lets the weight's minimum term be applied once
//! per block. Quantization follows ggml's `quantize_row_q8_1_ref`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{f16_to_f32, f32_to_f16, q8_0};

/// Elements per block.
pub const QK8_1: usize = 32;

/// One Q8_1 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f16,
    /// `d · Σ qs`.
    pub s: f16,
    /// Signed quants.
    pub qs: [i8; QK8_1],
}
const _: () = assert!(core::mem::size_of::<BlockQ8_1>() == 36);

/// Writes `d · q` for every element (`s` is redundant and unused).
pub fn dequantize(blocks: &[BlockQ8_1], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK8_1>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d);
        for j in 0..QK8_1 {
            o[j] = b.qs[j] as f32 * d;
        }
    }
}

/// Quantizes a row (length a multiple of 32) as ggml's `quantize_row_q8_1_ref`.
pub fn quantize(x: &[f32], out: &mut [BlockQ8_1]) {
    let (x, rest) = x.as_chunks::<QK8_1>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let (d, qs) = q8_0::quantize_block(xb);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        ob.d = f32_to_f16(d);
        ob.s = f32_to_f16(sum as f32 * d);
        ob.qs = qs;
    }
}

super::activation_entry_point!(BlockQ8_1);
