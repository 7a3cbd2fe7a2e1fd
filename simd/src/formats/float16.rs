//! F16 (GGML type 1): little-endian IEEE half floats, one element per "block".
//!
//! The dot product widens each weight to f32 and accumulates against the f32
//! activation row (ggml instead rounds the activations to f16; sift keeps them f32).

use half::f16;

use super::f16_to_f32;

/// Widens every element to f32.
pub fn dequantize(w: &[f16], out: &mut [f32]) {
    assert_eq!(w.len(), out.len());
    for (o, &h) in out.iter_mut().zip(w) {
        *o = f16_to_f32(h);
    }
}

/// `Σ w[i]·a[i]` accumulated in f32.
pub fn dot(w: &[f16], a: &[f32]) -> f32 {
    super::float32::dot_with(w, a, f16_to_f32)
}

super::weight_entry_points!(f16, f32);
