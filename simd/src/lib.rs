//! sift's compute kernels: GGML's quantized block formats, their dequantization,
//! dot products of one weight row against one quantized activation row (or of many rows
//! against many, a tile at a time: [`Kernels::dot_tile`]), and attention
//! over an f16 key/value cache ([`Kernels::scores_f16`], [`Kernels::softmax_exp`],
//! [`Kernels::add_weighted_f16`]) or over its quantized rows in place
//! ([`Kernels::scores_coded`], [`Kernels::add_weighted_coded`]), which
//! [`Kernels::levels_f16`] also reads back into f16.
//!
//! # Contract
//!
//! * **Formats are GGML's, byte for byte.** Every block struct in [`formats`] has the
//!   exact size and bit packing of its `ggml` counterpart, so a `&[u8]` slice of a
//!   memory-mapped GGUF tensor is used in place. Weight blocks have alignment 1 or 2
//!   (their sizes are all even), so a row that starts 2-byte aligned can be cast.
//! * **Activation rows are quantized the way ggml's reference code does it**
//!   (`quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`), and
//!   each weight type is paired with the activation type ggml pairs it with
//!   ([`WeightType::activation`]). F32, F16 and BF16 weights are dotted against the
//!   f32 activation row itself.
//! * **Accumulation is exact where ggml's is.** Quantized kernels accumulate each
//!   block (or sub-block) in `i32` and combine blocks in `f32`; float kernels
//!   accumulate in `f32`. Every ISA variant of an integer kernel returns *bit-identical*
//!   results to the scalar one: blocks are combined in one fixed order that every
//!   variant reproduces (see [`formats`]).
//! * **One table, chosen once.** [`kernels()`] returns the table for the best ISA this
//!   CPU supports (or the one forced by `SIFT_ISA` or [`select_isa`]); every caller goes
//!   through it. Tests build other tables with [`Kernels::for_isa`].
//! * **Activation rows must come from [`Kernels::quantize_activation`]** (any ISA's: they
//!   are byte-identical). The x86 kernels rely on its quants lying in `-127..=127`.
//! * Panics happen only for caller contract violations (wrong lengths, misaligned
//!   buffers), never because of data values. NaN or infinite inputs give unspecified
//!   (but non-panicking) results.
//!
//! Note on matching llama.cpp: the quantizers follow ggml's *reference* code. ggml's own
//! x86 AVX2 `quantize_row_q8_0`/`q8_1` differ slightly (they multiply by `127/amax` and
//! round half to even), so on x86 llama.cpp's Q8_0/Q8_1 activations can differ from
//! these by one quant step in rare elements; Q8_K matches on every platform (ggml uses
//! the reference there). F16/BF16 weights see f32 activations here, where ggml rounds
//! the activations to f16/bf16 first.
//!
//! Buffers: activation rows (`act_row`, the `out` of
//! [`Kernels::quantize_activation`]) must be 4-byte aligned for [`ActivationType::F32`]
//! and [`ActivationType::Q8_K`] and 2-byte aligned for the others; weight rows must be
//! 4-byte aligned for F32 and 2-byte aligned for everything else.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Block kernels index fixed-size arrays by position on purpose: it mirrors the
// layouts and is what LLVM vectorizes best.
#![allow(clippy::needless_range_loop)]
// The docs are read with private items (`cargo doc --document-private-items`):
// a module's notes name its private helpers.
#![allow(rustdoc::private_intra_doc_links)]

mod attention;
mod dispatch;
pub mod formats;
mod sketch;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attention::prefetch;
pub use dispatch::{kernels, select_isa, CodeRows, Isa, Kernels, ParseIsaError, SelectIsaError};
pub use sketch::{
    Bounds, FineConstants, PrepareScales, PrepareSums, RefineQuery, RefinedBounds, RefinedRows, SketchCodes,
    SketchLayout, SketchQuery,
};

/// Element type of a weight tensor, named and numbered as GGML does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum WeightType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16 (the top half of an f32).
    BF16,
    /// 32-element blocks: f16 scale, 4-bit quants with an implicit offset of 8.
    Q4_0,
    /// 32-element blocks: f16 scale and minimum, 4-bit unsigned quants.
    Q4_1,
    /// 32-element blocks: f16 scale, 5-bit quants with an implicit offset of 16.
    Q5_0,
    /// 32-element blocks: f16 scale and minimum, 5-bit unsigned quants.
    Q5_1,
    /// 32-element blocks: f16 scale, 8-bit signed quants.
    Q8_0,
    /// 256-element super-blocks of 16×16: 4-bit scales and mins, 2-bit quants.
    Q2_K,
    /// 256-element super-blocks of 16×16: 6-bit scales, 3-bit quants.
    Q3_K,
    /// 256-element super-blocks of 8×32: 6-bit scales and mins, 4-bit quants.
    Q4_K,
    /// 256-element super-blocks of 8×32: 6-bit scales and mins, 5-bit quants.
    Q5_K,
    /// 256-element super-blocks of 16×16: 8-bit scales, 6-bit quants.
    Q6_K,
    /// 32-element blocks: f16 scale, 4-bit indices into a non-linear grid of levels.
    IQ4_NL,
    /// 256-element super-blocks of 8×32: 6-bit scales, 4-bit indices into IQ4_NL's grid.
    IQ4_XS,
    /// 256-element super-blocks of 8×32: 4-bit scales, 8-bit indices into a grid of
    /// 4-level points, 7 bits of signs per 8 elements.
    IQ3_XXS,
    /// 256-element super-blocks of 8×32: 4-bit scales, 9-bit indices into a grid of
    /// 4-level points, a sign bit per element.
    IQ3_S,
}

impl WeightType {
    /// Every weight type, in a fixed order (the dispatch table's index order).
    pub const ALL: [WeightType; 17] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q8_0,
        WeightType::Q2_K,
        WeightType::Q3_K,
        WeightType::Q4_K,
        WeightType::Q5_K,
        WeightType::Q6_K,
        WeightType::IQ4_NL,
        WeightType::IQ4_XS,
        WeightType::IQ3_XXS,
        WeightType::IQ3_S,
    ];

    /// The weight type for a GGML type id (`ggml_type`), if sift supports it.
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// GGML's numeric type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q5_0 => 6,
            WeightType::Q5_1 => 7,
            WeightType::Q8_0 => 8,
            WeightType::Q2_K => 10,
            WeightType::Q3_K => 11,
            WeightType::Q4_K => 12,
            WeightType::Q5_K => 13,
            WeightType::Q6_K => 14,
            WeightType::IQ4_NL => 20,
            WeightType::IQ4_XS => 23,
            WeightType::IQ3_XXS => 18,
            WeightType::IQ3_S => 21,
            WeightType::BF16 => 30,
        }
    }

    /// GGML's name for the type ("Q4_K", "F16", ...).
    pub fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "F32",
            WeightType::F16 => "F16",
            WeightType::BF16 => "BF16",
            WeightType::Q4_0 => "Q4_0",
            WeightType::Q4_1 => "Q4_1",
            WeightType::Q5_0 => "Q5_0",
            WeightType::Q5_1 => "Q5_1",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Q2_K => "Q2_K",
            WeightType::Q3_K => "Q3_K",
            WeightType::Q4_K => "Q4_K",
            WeightType::Q5_K => "Q5_K",
            WeightType::Q6_K => "Q6_K",
            WeightType::IQ4_NL => "IQ4_NL",
            WeightType::IQ4_XS => "IQ4_XS",
            WeightType::IQ3_XXS => "IQ3_XXS",
            WeightType::IQ3_S => "IQ3_S",
        }
    }

    /// Elements per block: 1 for the float types, 32 or 256 for the quantized ones.
    pub fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
            | WeightType::Q8_0
            | WeightType::IQ4_NL => 32,
            WeightType::Q2_K
            | WeightType::Q3_K
            | WeightType::Q4_K
            | WeightType::Q5_K
            | WeightType::Q6_K
            | WeightType::IQ4_XS
            | WeightType::IQ3_XXS
            | WeightType::IQ3_S => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use core::mem::size_of;
        use formats::*;
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q4_0 => size_of::<BlockQ4_0>(),
            WeightType::Q4_1 => size_of::<BlockQ4_1>(),
            WeightType::Q5_0 => size_of::<BlockQ5_0>(),
            WeightType::Q5_1 => size_of::<BlockQ5_1>(),
            WeightType::Q8_0 => size_of::<BlockQ8_0>(),
            WeightType::Q2_K => size_of::<BlockQ2K>(),
            WeightType::Q3_K => size_of::<BlockQ3K>(),
            WeightType::Q4_K => size_of::<BlockQ4K>(),
            WeightType::Q5_K => size_of::<BlockQ5K>(),
            WeightType::Q6_K => size_of::<BlockQ6K>(),
            WeightType::IQ4_NL => size_of::<BlockIQ4NL>(),
            WeightType::IQ4_XS => size_of::<BlockIQ4XS>(),
            WeightType::IQ3_XXS => size_of::<BlockIQ3XXS>(),
            WeightType::IQ3_S => size_of::<BlockIQ3S>(),
        }
    }

    /// Bytes in a row of `n` elements; `None` if `n` is not a whole number of blocks
    /// or the size overflows `usize`.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// The activation format this weight type's dot product consumes (ggml's
    /// `vec_dot_type`, except that F16 and BF16 take f32 activations).
    pub fn activation(self) -> ActivationType {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => ActivationType::F32,
            WeightType::Q4_1 | WeightType::Q5_1 => ActivationType::Q8_1,
            // The super-block formats.
            _ if self.block_elems() == formats::QK_K => ActivationType::Q8_K,
            _ => ActivationType::Q8_0,
        }
    }

    /// Position in [`WeightType::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl core::fmt::Display for WeightType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// Format of a quantized activation row (the right-hand side of a dot product).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum ActivationType {
    /// The f32 row itself (little-endian bytes, 4-byte aligned).
    F32,
    /// 32-element blocks: f16 scale, 8-bit quants.
    Q8_0,
    /// [`ActivationType::Q8_0`] plus `s = d * sum(qs)` stored as f16.
    Q8_1,
    /// 256-element blocks: f32 scale, 8-bit quants, sums of each 16 quants.
    Q8_K,
}

impl ActivationType {
    /// Every activation type, in a fixed order (the dispatch table's index order).
    pub const ALL: [ActivationType; 4] =
        [ActivationType::F32, ActivationType::Q8_0, ActivationType::Q8_1, ActivationType::Q8_K];

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            ActivationType::F32 => 1,
            ActivationType::Q8_0 | ActivationType::Q8_1 => 32,
            ActivationType::Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use core::mem::size_of;
        match self {
            ActivationType::F32 => 4,
            ActivationType::Q8_0 => size_of::<formats::BlockQ8_0>(),
            ActivationType::Q8_1 => size_of::<formats::BlockQ8_1>(),
            ActivationType::Q8_K => size_of::<formats::BlockQ8K>(),
        }
    }

    /// Bytes in a quantized row of `n` elements.
    ///
    /// # Panics
    /// If `n` is not a multiple of [`block_elems`](Self::block_elems).
    pub fn row_bytes(self, n: usize) -> usize {
        assert!(
            n.is_multiple_of(self.block_elems()),
            "{self:?} rows need a multiple of {} elements, got {n}",
            self.block_elems()
        );
        n / self.block_elems() * self.block_bytes()
    }

    /// Position in [`ActivationType::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}
