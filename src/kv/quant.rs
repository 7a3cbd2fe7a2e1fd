//! The affine quantizer shared by keys and values.
//!
//! A group of f16 numbers becomes a minimum, a step and one 8-bit code per
//! number; narrower codes are the top bits of the 8-bit ones. A `b`-bit code
//! `h` names the `2^(8-b)` 8-bit codes it is the top bits of, and is read back
//! as their midpoint: `min + step·(h·2^(8-b) + (2^(8-b) - 1)/2)`.
//!
//! Two facts make the error exact rather than approximate. The step is
//! `(max - min)/255` rounded *up* to f16, so `min + 255·step` reaches the
//! group's maximum and no code is clipped. And every 8-bit code is the exact
//! nearest one: the minimum, the step and the numbers are all f16, so every
//! `x - (min + step·code)` is exact in f64 and ties are settled exactly. Hence
//! every number lies within `step/2` of its 8-bit level and within
//! `2^(7-b)·step` of its `b`-bit level ([`Bits::half_width`]).
//!
//! Midpoints rather than KIVI's endpoints: four 2-bit levels at 1/8, 3/8, 5/8
//! and 7/8 of the range err by at most 1/8 of it where endpoints err by 1/6.

use std::ops::Range;

use half::f16;
use simd::CodeRows;

/// Channels per value group (each token's values are quantized in groups).
pub const VALUE_GROUP: usize = 32;

/// The width of a code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bits {
    Two = 2,
    Four = 4,
    Eight = 8,
}

impl Bits {
    pub fn get(self) -> usize {
        self as usize
    }

    /// The largest code.
    pub fn max_code(self) -> u8 {
        ((1u16 << self.get()) - 1) as u8
    }

    /// How many 8-bit codes one code of this width stands for.
    pub fn span(self) -> u32 {
        1 << (8 - self.get())
    }

    /// The most a number can differ from its level, in steps: half the
    /// span, since the 8-bit level errs by half a step and the midpoint of
    /// the span lies within `(span - 1)/2` steps of any 8-bit level in it.
    pub fn half_width(self) -> f64 {
        f64::from(self.span()) / 2.0
    }

    /// This code's level as an offset from the minimum, in steps.
    pub fn offset(self, code: u8) -> f64 {
        let span = f64::from(self.span());
        f64::from(code) * span + (span - 1.0) / 2.0
    }

    /// This width's code in an 8-bit one.
    pub fn narrow(self, code8: u8) -> u8 {
        code8 >> (8 - self.get())
    }
}

/// A group's minimum and step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Affine {
    pub min: f16,
    pub step: f16,
}

impl Affine {
    /// The minimum and step of a group of finite numbers.
    pub fn fit(group: impl IntoIterator<Item = f16>) -> Self {
        let (lo, hi) = group.into_iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            debug_assert!(x.is_finite(), "the cache holds finite numbers only");
            (lo.min(x.to_f64()), hi.max(x.to_f64()))
        });
        // `hi - lo` is exact in f64: both are f16.
        Self { min: f16::from_f64(lo), step: f16_up((hi - lo) / 255.0) }
    }

    /// The nearest 8-bit code of `x`, a number of the group.
    pub fn code(self, x: f16) -> u8 {
        let (x, min, step) = (x.to_f64(), self.min.to_f64(), self.step.to_f64());
        if step == 0.0 {
            return 0;
        }
        let mut code = ((x - min) / step).round().clamp(0.0, 255.0);
        // The quotient was rounded; check against the exact residual.
        let residual = x - (min + step * code);
        if residual > step / 2.0 && code < 255.0 {
            code += 1.0;
        } else if residual < -step / 2.0 && code > 0.0 {
            code -= 1.0;
        }
        debug_assert!((x - (min + step * code)).abs() <= step / 2.0);
        code as u8
    }

    /// The number a code of width `bits` stands for.
    pub fn level(self, code: u8, bits: Bits) -> f32 {
        // The product is exact in f32 (11 by 9 significant bits); the sum
        // rounds once.
        self.min.to_f32() + self.step.to_f32() * bits.offset(code) as f32
    }
}

/// The least f16 at or above `x`, a non-negative number within f16's range.
fn f16_up(x: f64) -> f16 {
    let y = f16::from_f64(x);
    if y.to_f64() < x {
        f16::from_bits(y.to_bits() + 1)
    } else {
        y
    }
}

/// Bytes of `n` codes of width `bits`, packed.
pub fn packed_len(n: usize, bits: Bits) -> usize {
    (n * bits.get()).div_ceil(8)
}

/// Puts code `i` of width `bits` into a packed row (lowest bits first); the
/// row's bits for it must be zero.
pub fn pack(row: &mut [u8], i: usize, bits: Bits, code: u8) {
    let per_byte = 8 / bits.get();
    row[i / per_byte] |= code << ((i % per_byte) * bits.get());
}

/// Code `i` of width `bits` from a packed row.
pub fn unpack(row: &[u8], i: usize, bits: Bits) -> u8 {
    let per_byte = 8 / bits.get();
    (row[i / per_byte] >> ((i % per_byte) * bits.get())) & bits.max_code()
}

/// Rows of values, each quantized on its own in groups of [`VALUE_GROUP`]
/// channels (KIVI quantizes values per token).
#[derive(Clone)]
pub struct ValueRows {
    dim: usize,
    bits: Bits,
    /// `rows × groups`.
    groups: Vec<Affine>,
    /// `rows × packed_len(dim)`.
    codes: Vec<u8>,
}

impl ValueRows {
    /// The rows' state as bytes, in the order of a cache file ([`crate::kv::KvCache::write_to`]).
    pub(crate) fn state(&self) -> [&[u8]; 2] {
        [bytemuck::cast_slice(&self.groups), &self.codes]
    }

    /// [`Self::state`], to be read into.
    pub(crate) fn state_mut(&mut self) -> [&mut [u8]; 2] {
        [bytemuck::cast_slice_mut(&mut self.groups), &mut self.codes]
    }

    pub fn new(rows: usize, dim: usize, bits: Bits) -> Self {
        Self {
            dim,
            bits,
            groups: vec![Affine::default(); rows * dim.div_ceil(VALUE_GROUP)],
            codes: vec![0; rows * packed_len(dim, bits)],
        }
    }

    pub fn store(&mut self, row: usize, values: &[f16]) {
        let n_groups = self.dim.div_ceil(VALUE_GROUP);
        let codes = &mut self.codes[row * packed_len(self.dim, self.bits)..][..packed_len(self.dim, self.bits)];
        codes.fill(0);
        for (g, group) in values[..self.dim].chunks(VALUE_GROUP).enumerate() {
            let affine = Affine::fit(group.iter().copied());
            self.groups[row * n_groups + g] = affine;
            for (i, &x) in group.iter().enumerate() {
                pack(codes, g * VALUE_GROUP + i, self.bits, self.bits.narrow(affine.code(x)));
            }
        }
    }

    pub fn dequantize(&self, row: usize, out: &mut [f32]) {
        let n_groups = self.dim.div_ceil(VALUE_GROUP);
        let codes = &self.codes[row * packed_len(self.dim, self.bits)..][..packed_len(self.dim, self.bits)];
        for (g, out) in out[..self.dim].chunks_mut(VALUE_GROUP).enumerate() {
            let affine = self.groups[row * n_groups + g];
            for (i, o) in out.iter_mut().enumerate() {
                *o = affine.level(unpack(codes, g * VALUE_GROUP + i, self.bits), self.bits);
            }
        }
    }

    /// Rows `rows`, rounded to f16 as a staging batch reads them, one after
    /// another into `out`: [`Self::dequantize`]'s numbers, through the SIMD
    /// reader. `affine` is scratch for the rows' minima and steps.
    pub fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f16], affine: &mut Vec<f32>) {
        simd::kernels().levels_f16(&self.code_rows(rows, affine), out);
    }

    /// Rows `rows` as codes for the SIMD kernels, which read them as
    /// [`Self::dequantize`]'s numbers: `affine` is filled with the rows'
    /// minima and steps in f32, which the rows borrow.
    pub fn code_rows<'a>(&'a self, rows: Range<usize>, affine: &'a mut Vec<f32>) -> CodeRows<'a> {
        let (n_groups, len) = (self.dim.div_ceil(VALUE_GROUP), packed_len(self.dim, self.bits));
        let groups = &self.groups[rows.start * n_groups..rows.end * n_groups];
        affine.clear();
        affine.extend(groups.iter().map(|a| a.min.to_f32()));
        affine.extend(groups.iter().map(|a| a.step.to_f32()));
        let (min, step) = affine.split_at(groups.len());
        let codes = &self.codes[rows.start * len..rows.end * len];
        CodeRows { dim: self.dim, codes, bits: self.bits.get() as u32, fine: None, group: VALUE_GROUP, min, step }
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.groups.as_slice()) + self.codes.len()
    }

    /// At least the norm of row `row` as [`Self::dequantize`] reads it, and
    /// as [`Self::dequantize_rows`] does (rounded to f16).
    pub fn norm_bound(&self, row: usize) -> f32 {
        let mut levels = vec![0.0; self.dim];
        self.dequantize(row, &mut levels);
        let f32_norm = norm_bound(levels.iter().map(|&x| f64::from(x)));
        f32_norm.max(norm_bound(levels.iter().map(|&x| f16::from_f32(x).to_f64())))
    }
}

/// At least the Euclidean norm of `xs`, numbers of f32 (so their squares are
/// exact in f64): the sum of at most 2^20 squares and the square root err by
/// well under 2^-30 relative, which the result is raised by, then rounded
/// up to f32.
pub fn norm_bound(xs: impl Iterator<Item = f64>) -> f32 {
    let norm = xs.map(|x| x * x).sum::<f64>().sqrt() * (1.0 + 2f64.powi(-30));
    f32_up(norm)
}

/// The least f32 at or above `x`, a non-negative number.
pub(super) fn f32_up(x: f64) -> f32 {
    let y = x as f32;
    if (y as f64) < x {
        y.next_up()
    } else {
        y
    }
}
