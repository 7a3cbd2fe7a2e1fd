//! Q8_0 (GGML type 8): blocks of 32 elements, 34 bytes.
//!
//! | offset | field      | meaning                          |
//! |--------|------------|----------------------------------|
//! | 0      | `d: f16`   | scale                            |
//! | 2      | `qs: [i8; 32]` | element `j` is `d · qs[j]`   |
//!
//! Q8_0 is both a weight format and the activation format for Q4_0, Q5_0 and Q8_0
//! weights. Quantization follows ggml's x86 `quantize_row_q8_0`: `d = amax / 127`
//! stored as f16, `q = round_half_even(x · (127 / amax))` with the unrounded scale.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::f32_to_f16;
use super::q8_k::nearest_int;

/// Elements per block.
pub const QK8_0: usize = 32;

/// One Q8_0 block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Signed quants.
    pub qs: [i8; QK8_0],
}
const _: () = assert!(core::mem::size_of::<BlockQ8_0>() == 34);

impl super::Block32 for BlockQ8_0 {
    fn codes(&self) -> [i8; QK8_0] {
        self.qs
    }

    fn d(&self) -> f16 {
        self.d
    }
}

/// Writes `d · q` for every element.
pub fn dequantize(blocks: &[BlockQ8_0], out: &mut [f32]) {
    super::dequantize_symmetric(blocks, out)
}

/// Exact integer dot product of two 32-element quant arrays.
#[inline(always)]
pub(crate) fn dot_i8_32(x: &[i8; 32], y: &[i8; 32]) -> i32 {
    let mut s = 0i32;
    for j in 0..32 {
        s += x[j] as i32 * y[j] as i32;
    }
    s
}

/// Dot product with a Q8_0 activation row (see the module docs of `formats` for the
/// order of float operations).
pub fn dot(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    super::dot_symmetric(x, y)
}

/// ggml's `MAX(a, b)` (`a > b ? a : b`), which is also what `maxps` computes.
#[inline(always)]
pub(crate) fn max_like_ggml(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Quantizes one 32-element block as ggml does on x86 (whose results llama.cpp's
/// references carry): scale by `127 / amax` and round half to even. ggml's
/// portable reference instead multiplies by `1 / (amax / 127)` and rounds half
/// away from zero, which moves a quant by one step now and then.
#[inline(always)]
pub(crate) fn quantize_block(x: &[f32; QK8_0]) -> (f32, [i8; QK8_0]) {
    let mut amax = 0f32;
    for &v in x {
        amax = max_like_ggml(amax, v.abs());
    }
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut qs = [0i8; QK8_0];
    for j in 0..QK8_0 {
        qs[j] = nearest_int(x[j] * id) as i8;
    }
    (d, qs)
}

/// Quantizes a row (length a multiple of 32) as ggml's `quantize_row_q8_0_ref`.
pub fn quantize(x: &[f32], out: &mut [BlockQ8_0]) {
    let (x, rest) = x.as_chunks::<QK8_0>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let (d, qs) = quantize_block(xb);
        ob.d = f32_to_f16(d);
        ob.qs = qs;
    }
}

super::weight_entry_points!(BlockQ8_0, BlockQ8_0);
super::activation_entry_point!(BlockQ8_0);
