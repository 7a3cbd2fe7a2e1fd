//! GGML block formats, one module per format.
//!
//! Each module holds the `#[repr(C)]` block struct, `dequantize`, the scalar dot
//! product against the activation type ggml pairs it with, and (for activation
//! formats) `quantize`. x86-64 variants live in the private `x86` module (one file per
//! format, each instantiated for AVX2 and AVX-512) and are reached only through the
//! dispatch table.
//!
//! # Order of float operations
//!
//! Integer kernels must give bit-identical results on every ISA, so the float part is
//! fixed here and every variant reproduces it:
//!
//! * 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): block `b` yields one `f32`
//!   value from its exact `i32` sum (e.g. `sumi as f32 * (dx * dy)`), which is added
//!   to lane `b % 8` of eight `f32` accumulators; the lanes are then folded by
//!   [`reduce8`]. This is what an 8-lane vector accumulator does.
//! * K-quants and the IQ super-blocks: super-block `b` yields one `f32` value from its
//!   exact `i32` sums, and the values are added to one `f32` accumulator in block order.

use bytemuck::Pod;

pub mod bfloat16;
pub mod float16;
pub mod float32;
pub mod iq3_s;
pub mod iq3_xxs;
pub mod iq4_nl;
pub mod iq4_xs;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_1;
pub mod q8_k;

pub use iq3_s::BlockIQ3S;
pub use iq3_xxs::BlockIQ3XXS;
pub use iq4_nl::BlockIQ4NL;
pub use iq4_xs::BlockIQ4XS;
pub use q2_k::BlockQ2K;
pub use q3_k::BlockQ3K;
pub use q4_0::BlockQ4_0;
pub use q4_1::BlockQ4_1;
pub use q4_k::BlockQ4K;
pub use q5_0::BlockQ5_0;
pub use q5_1::BlockQ5_1;
pub use q5_k::BlockQ5K;
pub use q6_k::BlockQ6K;
pub use q8_0::BlockQ8_0;
pub use q8_1::BlockQ8_1;
pub use q8_k::BlockQ8K;

/// Elements in a K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Exact IEEE half → single conversion, branch-free so loops over it vectorize.
#[inline(always)]
pub fn f16_to_f32(h: half::f16) -> f32 {
    f16_bits_to_f32(h.to_bits())
}

/// [`f16_to_f32`] on raw bits.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let bits = if em < 0x0400 {
        // Zero or subnormal: em · 2⁻²⁴ is exact in f32 (and normal there).
        (em as f32 * f32::from_bits(0x3380_0000)).to_bits()
    } else if em >= 0x7c00 {
        // Inf or NaN: exponent 31 → 255, mantissa (payload) kept.
        (em << 13) + (224 << 23)
    } else {
        // Normal: re-bias the exponent by 127 − 15.
        (em << 13) + (112 << 23)
    };
    f32::from_bits(bits | sign)
}

/// Round-to-nearest-even f32 → f16, as ggml's `GGML_FP32_TO_FP16`.
#[inline]
pub fn f32_to_f16(x: f32) -> half::f16 {
    half::f16::from_f32(x)
}

/// Folds eight lane accumulators in the order an 8-lane vector reduction does:
/// high half onto low half, then pairs two apart, then neighbours.
#[inline(always)]
pub fn reduce8(a: [f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// A 32-element weight block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) as its scalar
/// dequantization and dot product see it: a scale and 32 integer codes. Each
/// format's module says only how it packs them; the arithmetic is here, once.
pub(crate) trait Block32 {
    /// The 32 codes in element order: `q − 8` and `q − 16` for Q4_0 and Q5_0,
    /// the stored `q` for the offset formats and Q8_0, the grid's levels for IQ4_NL.
    fn codes(&self) -> [i8; 32];
    /// The scale `d`.
    fn d(&self) -> half::f16;
}

/// A [`Block32`] with a minimum: element value `d · q + m` (Q4_1, Q5_1).
pub(crate) trait OffsetBlock32: Block32 {
    /// The minimum `m`.
    fn m(&self) -> half::f16;
}

/// Writes `d · q` for every element of symmetric blocks.
pub(crate) fn dequantize_symmetric<B: Block32>(blocks: &[B], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<32>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = f16_to_f32(b.d());
        for (o, q) in o.iter_mut().zip(b.codes()) {
            *o = q as f32 * d;
        }
    }
}

/// Writes `d · q + m` for every element of offset blocks.
pub(crate) fn dequantize_offset<B: OffsetBlock32>(blocks: &[B], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<32>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let (d, m) = (f16_to_f32(b.d()), f16_to_f32(b.m()));
        for (o, q) in o.iter_mut().zip(b.codes()) {
            *o = q as f32 * d + m;
        }
    }
}

/// Dot product of symmetric blocks with a Q8_0 activation row, block `b`'s
/// `sumi · (dx · dy)` added to lane `b % 8` (the order the module docs fix).
pub(crate) fn dot_symmetric<B: Block32>(x: &[B], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = [0f32; 8];
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        for (k, (xb, yb)) in xc.iter().zip(yc).enumerate() {
            let sumi = q8_0::dot_i8_32(&xb.codes(), &yb.qs);
            acc[k] += sumi as f32 * (f16_to_f32(xb.d()) * f16_to_f32(yb.d));
        }
    }
    reduce8(acc)
}

/// Dot product of offset blocks with a Q8_1 activation row, whose `s` carries
/// the minimum's term: per block `(dx · dy) · sumi + m · s`, lanes as above.
pub(crate) fn dot_offset<B: OffsetBlock32>(x: &[B], y: &[BlockQ8_1]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = [0f32; 8];
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        for (k, (xb, yb)) in xc.iter().zip(yc).enumerate() {
            let sumi = q8_0::dot_i8_32(&xb.codes(), &yb.qs);
            acc[k] += (f16_to_f32(xb.d()) * f16_to_f32(yb.d)) * sumi as f32 + f16_to_f32(xb.m()) * f16_to_f32(yb.s);
        }
    }
    reduce8(acc)
}

/// A super-block of eight 32-element sub-blocks of signed levels, each sub-block with an
/// integer scale, under one float scale (IQ4_XS, IQ3_XXS, IQ3_S), as its scalar
/// dequantization and dot product see it: element value `(d · scaleⱼ) · q`, dot product
/// `(d·dy) · Σⱼ scaleⱼ · Σ q·y` with the sums in `i32`. Each format's module says how it
/// packs the levels and scales.
pub(crate) trait ScaledSuperBlock {
    /// The float scale `d`.
    fn d(&self) -> f32;
    /// The eight sub-block scales.
    fn scales(&self) -> [i32; 8];
    /// The 256 signed levels in element order.
    fn levels(&self) -> [i8; QK_K];
}

/// Writes `(d · scaleⱼ) · q` for every element of scaled super-blocks.
pub(crate) fn dequantize_scaled<B: ScaledSuperBlock>(blocks: &[B], out: &mut [f32]) {
    let (out, rest) = out.as_chunks_mut::<QK_K>();
    assert!(rest.is_empty() && out.len() == blocks.len());
    for (b, o) in blocks.iter().zip(out) {
        let d = b.d();
        let q = b.levels();
        let (o, _) = o.as_chunks_mut::<32>();
        let (q, _) = q.as_chunks::<32>();
        for (j, scale) in b.scales().into_iter().enumerate() {
            let dl = d * scale as f32;
            for l in 0..32 {
                o[j][l] = dl * q[j][l] as f32;
            }
        }
    }
}

/// Dot product of scaled super-blocks with a Q8_K activation row, one `f32` per
/// super-block added in block order.
pub(crate) fn dot_scaled<B: ScaledSuperBlock>(x: &[B], y: &[BlockQ8K]) -> f32 {
    assert_eq!(x.len(), y.len());
    let mut acc = 0f32;
    for (xb, yb) in x.iter().zip(y) {
        let sumi = q4_k::scaled_sum_32(&xb.levels(), &yb.qs, &xb.scales());
        acc += (xb.d() * yb.d) * sumi as f32;
    }
    acc
}

/// Casts a byte slice to blocks, with a message naming the contract on failure.
#[inline]
#[track_caller]
pub(crate) fn cast_blocks<T: Pod>(bytes: &[u8]) -> &[T] {
    match bytemuck::try_cast_slice(bytes) {
        Ok(b) => b,
        Err(e) => panic!(
            "cannot view {} bytes at {:p} as {}: {e:?} (rows must be a whole number of \
             blocks and {}-byte aligned)",
            bytes.len(),
            bytes.as_ptr(),
            core::any::type_name::<T>(),
            core::mem::align_of::<T>()
        ),
    }
}

/// Mutable [`cast_blocks`].
#[inline]
#[track_caller]
pub(crate) fn cast_blocks_mut<T: Pod>(bytes: &mut [u8]) -> &mut [T] {
    let (len, ptr) = (bytes.len(), bytes.as_ptr());
    match bytemuck::try_cast_slice_mut(bytes) {
        Ok(b) => b,
        Err(e) => panic!(
            "cannot view {len} bytes at {ptr:p} as {}: {e:?} (rows must be a whole number of \
             blocks and {}-byte aligned)",
            core::any::type_name::<T>(),
            core::mem::align_of::<T>()
        ),
    }
}

/// Defines the byte-level entry points the dispatch table stores for a weight format
/// whose module has `dequantize(&[$block], &mut [f32])` and
/// `dot(&[$block], &[$act]) -> f32`.
macro_rules! weight_entry_points {
    ($block:ty, $act:ty) => {
        /// Table entry: [`dot`] on byte rows whose lengths the caller has checked.
        pub(crate) fn dot_bytes(w: &[u8], a: &[u8]) -> f32 {
            dot($crate::formats::cast_blocks::<$block>(w), $crate::formats::cast_blocks::<$act>(a))
        }

        /// Table entry: [`dequantize`] on a byte row whose length the caller has checked.
        pub(crate) fn dequantize_bytes(w: &[u8], out: &mut [f32]) {
            dequantize($crate::formats::cast_blocks::<$block>(w), out)
        }
    };
}
pub(crate) use weight_entry_points;

/// Defines the byte-level quantize entry point for an activation format whose module
/// has `quantize(&[f32], &mut [$block])`.
macro_rules! activation_entry_point {
    ($block:ty) => {
        /// Table entry: [`quantize`] into a byte row whose length the caller has checked.
        pub(crate) fn quantize_bytes(x: &[f32], out: &mut [u8]) {
            quantize(x, $crate::formats::cast_blocks_mut::<$block>(out))
        }
    };
}
pub(crate) use activation_entry_point;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let ours = f16_bits_to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
                // Payload kept (half's software path may quiet it; compare the payload).
                assert_eq!(ours.to_bits() & 0x003f_ffff, (bits as u32 & 0x1ff) << 13);
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn reduce8_order() {
        // Values chosen so that a different association gives a different answer.
        let a = [1e8, 1.0, -1e8, 1.0, 1.0, 0.5, 1.0, 0.25];
        let expect = ((1e8f32 + 1.0) + (-1e8f32 + 1.0)) + ((1.0f32 + 0.5) + (1.0f32 + 0.25));
        assert_eq!(reduce8(a), expect);
    }
}
