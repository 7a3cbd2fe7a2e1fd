//! Q8_K: activation format for the K-quants (Q4_K, Q5_K, Q6_K). Blocks of 256
//! elements, 292 bytes. Never stored in files, so its f32 scale may be 4-byte aligned.
//!
//! | offset | field              | meaning                                  |
//! |--------|--------------------|------------------------------------------|
//! | 0      | `d: f32`           | scale                                    |
//! | 4      | `qs: [i8; 256]`    | element `j` is `d · qs[j]`               |
//! | 260    | `bsums: [i16; 16]` | `bsums[g] = Σ qs[16g .. 16g+16]`         |
//!
//! Quantization follows ggml's `quantize_row_q8_K_ref`: `max` is the element of
//! largest magnitude (the first one on ties, sign kept), `iscale = -127 / max`,
//! `q = min(127, nearest_int(iscale · x))` (round half to even), `d = 1 / iscale`.
//! An all-zero block gets `d = 0` and zero quants.

use bytemuck::{Pod, Zeroable};

use super::QK_K;

/// One Q8_K block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Signed quants.
    pub qs: [i8; QK_K],
    /// Sum of each 16 consecutive quants.
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(core::mem::size_of::<BlockQ8K>() == 292);

/// Writes `d · q` for every element.
pub fn dequantize(blocks: &[BlockQ8K], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        for j in 0..QK_K {
            o[j] = b.d * b.qs[j] as f32;
        }
    }
}

/// ggml's `nearest_int`: round half to even by adding 1.5·2²³, exact for
/// `|x| < 2²²` (quants here are within ±128).
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The sixteen 16-element sums of a block's quants.
#[inline(always)]
pub(crate) fn block_sums(qs: &[i8; QK_K]) -> [i16; QK_K / 16] {
    let mut bsums = [0i16; QK_K / 16];
    for (g, s) in bsums.iter_mut().enumerate() {
        let mut sum = 0i32;
        for k in 0..16 {
            sum += qs[16 * g + k] as i32;
        }
        *s = sum as i16;
    }
    bsums
}

/// Quantizes a row (length a multiple of 256) as ggml's `quantize_row_q8_K_ref`.
pub fn quantize(x: &[f32], out: &mut [BlockQ8K]) {
    let (x, rest) = x.as_chunks::<QK_K>();
    assert!(rest.is_empty() && x.len() == out.len());
    for (xb, ob) in x.iter().zip(out) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *ob = BlockQ8K::zeroed();
            continue;
        }
        let iscale = -127.0 / max;
        for j in 0..QK_K {
            ob.qs[j] = nearest_int(iscale * xb[j]).min(127) as i8;
        }
        ob.bsums = block_sums(&ob.qs);
        ob.d = 1.0 / iscale;
    }
}

super::activation_entry_point!(BlockQ8K);
