//! F32 (GGML type 0): plain little-endian IEEE single floats, one element per "block".
//!
//! The dot product is against the f32 activation row. Accumulation uses sixteen `f32`
//! lanes (so it vectorizes), folded pairwise at the end.

/// Lanes of the float dot-product accumulators.
pub(crate) const LANES: usize = 16;

/// Copies the row (dequantization is the identity).
pub fn dequantize(w: &[f32], out: &mut [f32]) {
    out.copy_from_slice(w);
}

/// `Σ w[i]·a[i]` accumulated in f32.
pub fn dot(w: &[f32], a: &[f32]) -> f32 {
    dot_with(w, a, |x| x)
}

/// Float dot product with a per-element widening of the weight, shared by F32, F16 and
/// BF16.
#[inline(always)]
pub(crate) fn dot_with<T: Copy>(w: &[T], a: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    assert_eq!(w.len(), a.len());
    let mut acc = [0f32; LANES];
    let (wc, wr) = w.as_chunks::<LANES>();
    let (ac, ar) = a.as_chunks::<LANES>();
    for (wc, ac) in wc.iter().zip(ac) {
        for k in 0..LANES {
            acc[k] += widen(wc[k]) * ac[k];
        }
    }
    for (k, (&w, &a)) in wr.iter().zip(ar).enumerate() {
        acc[k] += widen(w) * a;
    }
    fold(acc)
}

/// Pairwise fold of the lane accumulators.
#[inline(always)]
pub(crate) fn fold(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0]
}

/// Table entry: dot on byte rows.
pub(crate) fn dot_bytes(w: &[u8], a: &[u8]) -> f32 {
    dot(super::cast_blocks(w), super::cast_blocks(a))
}

/// Table entry: dequantize a byte row.
pub(crate) fn dequantize_bytes(w: &[u8], out: &mut [f32]) {
    // The row may be only 2-byte aligned here; copying bytes needs no alignment.
    bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(w);
}

/// Table entry: the "quantized" f32 activation row is the row's bytes.
pub(crate) fn quantize_bytes(x: &[f32], out: &mut [u8]) {
    out.copy_from_slice(bytemuck::cast_slice(x));
}
