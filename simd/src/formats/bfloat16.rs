//! BF16 (GGML type 30): bfloat16, the upper 16 bits of an IEEE single, little-endian,
//! one element per "block". Widening is exact (a 16-bit shift).

use half::bf16;

/// Exact bf16 → f32.
#[inline(always)]
pub fn bf16_to_f32(b: bf16) -> f32 {
    f32::from_bits((b.to_bits() as u32) << 16)
}

/// Widens every element to f32.
pub fn dequantize(w: &[bf16], out: &mut [f32]) {
    assert_eq!(w.len(), out.len());
    for (o, &b) in out.iter_mut().zip(w) {
        *o = bf16_to_f32(b);
    }
}

/// `Σ w[i]·a[i]` accumulated in f32.
pub fn dot(w: &[bf16], a: &[f32]) -> f32 {
    super::float32::dot_with(w, a, bf16_to_f32)
}

super::weight_entry_points!(bf16, f32);
