//! x86-64 kernels, registered over the scalar table by [`register`].
//!
//! # Scheme
//!
//! One file per format (plus `float.rs` for F32/F16/BF16 and `quantize.rs` for the
//! activation quantizers). Integer kernels are written once, as `#[inline(always)]`
//! functions generic over an [`IsaOps`] implementation that supplies the few
//! instructions that differ: above all the u8×i8 dot product of four-byte groups
//! (`vpmaddubsw`+`vpmaddwd` on AVX2, `vpdpbusd` on AVX-512 VNNI and AVX-VNNI, which also takes
//! unsigned bytes above 128). The [`x86_entries!`]
//! macro then instantiates each kernel inside a `#[target_feature]` entry point per ISA,
//! where LLVM inlines everything and compiles it with that ISA's instructions.
//!
//! Each format also has *tile* kernels for products of many rows with many tokens
//! ([`tile`]): they pack each activation block once for all rows and unpack each weight
//! block once for a tile of tokens. The 32-element formats share theirs in
//! `block32.rs`, the K-quants and the IQ super-blocks in `superblock.rs`.
//!
//! The generic helpers (which have no target features of their own) contain no closures
//! that call intrinsics: such a closure is compiled as a function of its own, without
//! the entry point's features, and its intrinsics are then not inlined. Loops over
//! arrays serve instead.
//!
//! The attention kernels are written once for every table in [`crate::attention`],
//! generic over a vector of f32 lanes; `attention.rs` supplies the AVX2 and AVX-512
//! vectors and instantiates them.
//!
//! Every integer kernel reproduces the scalar kernels' order of float operations (see
//! [`crate::formats`]), so its results are bit-identical to the scalar table's.
//!
//! # Safety
//!
//! The generic helpers are `unsafe fn`s whose only precondition is that the CPU supports
//! the ISA's features; they are called only from the `#[target_feature]` entry points,
//! which the dispatch table registers only after detecting those features. Memory is
//! read through bytemuck casts of fixed-size arrays, never raw pointers.

use core::arch::x86_64::*;

use crate::dispatch::{Kernels, WeightKernels};
use crate::{ActivationType, Isa, WeightType};

mod attention;
mod block32;
mod float;
mod iq3_s;
mod iq3_xxs;
mod iq4_nl;
mod iq4_xs;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod quantize;
mod sketch;
mod superblock;
pub(crate) mod tile;

/// The instructions that differ between the ISAs' integer kernels.
pub(crate) trait IsaOps {
    /// Whether [`IsaOps::dp`] is exact for every unsigned byte `u`.
    const BYTE_DP: bool;
    /// Vector registers the ISA's instructions can name: 16 for the VEX encodings
    /// (AVX2, AVX-VNNI), 32 for AVX-512's. The tile kernels size their blocks of
    /// accumulators by it.
    const REGISTERS: usize;

    /// `acc + Σ u·s` over each group of four bytes (`u` unsigned, `s` signed), one i32
    /// lane per group. Exact as long as `u₀s₀ + u₁s₁` fits in an i16 (AVX2 saturates
    /// there; VNNI does not, see [`IsaOps::BYTE_DP`]); every caller keeps `u ≤ 128` and
    /// `|s| ≤ 127`, or `u ≤ 63`, or has `BYTE_DP`.
    ///
    /// # Safety
    /// The CPU must support the ISA.
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;

    /// `acc + a₀b₀ + a₁b₁` over each pair of i16 lanes, one i32 lane per pair. Exact
    /// unless the sum of the two products overflows an i32.
    ///
    /// # Safety
    /// The CPU must support the ISA.
    unsafe fn dp16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;

    /// `v + b` in each byte `j` for which bit `j` of the little-endian `bits` is set,
    /// `v` in the others.
    ///
    /// # Safety
    /// The CPU must support the ISA.
    unsafe fn add_where(v: __m256i, bits: [u8; 4], b: __m256i) -> __m256i;
}

/// AVX2 + FMA + F16C.
pub(crate) struct Avx2;
/// AVX2 + FMA + F16C + AVX-VNNI.
pub(crate) struct AvxVnni;
/// AVX-512 F/BW/VL + VNNI (and everything [`Avx2`] has).
pub(crate) struct Avx512;

impl IsaOps for Avx2 {
    const BYTE_DP: bool = false;
    const REGISTERS: usize = 16;

    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX2 enabled.
        unsafe {
            let pairs = _mm256_maddubs_epi16(u, s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn dp16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX2 enabled.
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)) }
    }

    #[inline(always)]
    unsafe fn add_where(v: __m256i, bits: [u8; 4], b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX2 enabled.
        unsafe { _mm256_add_epi8(v, _mm256_and_si256(bits32(bits), b)) }
    }
}

impl IsaOps for AvxVnni {
    const BYTE_DP: bool = true;
    const REGISTERS: usize = 16;

    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX-VNNI enabled.
        unsafe { _mm256_dpbusd_avx_epi32(acc, u, s) }
    }

    #[inline(always)]
    unsafe fn dp16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX-VNNI enabled.
        unsafe { _mm256_dpwssd_avx_epi32(acc, a, b) }
    }

    #[inline(always)]
    unsafe fn add_where(v: __m256i, bits: [u8; 4], b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX2 enabled.
        unsafe { Avx2::add_where(v, bits, b) }
    }
}

impl IsaOps for Avx512 {
    const BYTE_DP: bool = true;
    const REGISTERS: usize = 32;

    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX-512 VL + VNNI enabled.
        unsafe { _mm256_dpbusd_epi32(acc, u, s) }
    }

    #[inline(always)]
    unsafe fn dp16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX-512 VL + VNNI enabled.
        unsafe { _mm256_dpwssd_epi32(acc, a, b) }
    }

    #[inline(always)]
    unsafe fn add_where(v: __m256i, bits: [u8; 4], b: __m256i) -> __m256i {
        // SAFETY: the caller runs with AVX-512 BW + VL enabled.
        unsafe { _mm256_mask_add_epi8(v, u32::from_le_bytes(bits), v, b) }
    }
}

/// Loads a 32-byte value (a quant array) into a vector.
#[inline(always)]
pub(crate) fn load32<T: bytemuck::Pod>(a: &T) -> __m256i {
    const { assert!(core::mem::size_of::<T>() == 32) };
    bytemuck::cast(*a)
}

/// Loads a 16-byte value into a vector.
#[inline(always)]
pub(crate) fn load16<T: bytemuck::Pod>(a: &T) -> __m128i {
    const { assert!(core::mem::size_of::<T>() == 16) };
    bytemuck::cast(*a)
}

/// Eight f16 bit patterns widened to f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn cvt_f16x8(bits: [u16; 8]) -> __m256 {
    _mm256_cvtph_ps(bytemuck::cast::<[u16; 8], __m128i>(bits))
}

/// The eight lane totals of eight i32 vectors: lane `j` of the result is the sum of
/// all lanes of `v[j]`. Exact (integer).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn reduce8x8(v: &[__m256i; 8]) -> __m256i {
    // Interleave-and-add rather than `vphaddd`, which issues at half the rate on Zen 4.
    // Per 128-bit half of sXY: [x0+x2, y0+y2, x1+x3, y1+y3].
    let s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    let s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    let s45 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[4], v[5]), _mm256_unpackhi_epi32(v[4], v[5]));
    let s67 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[6], v[7]), _mm256_unpackhi_epi32(v[6], v[7]));
    // Per 128-bit half: [v0, v1, v2, v3] partial sums (low half from lanes 0-3,
    // high half from lanes 4-7 of each vector).
    let s0123 = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
    let s4567 = _mm256_add_epi32(_mm256_unpacklo_epi64(s45, s67), _mm256_unpackhi_epi64(s45, s67));
    let lo = _mm256_permute2x128_si256(s0123, s4567, 0x20);
    let hi = _mm256_permute2x128_si256(s0123, s4567, 0x31);
    _mm256_add_epi32(lo, hi)
}

/// Sum of the eight i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01));
    _mm_cvtsi128_si32(s)
}

/// Folds eight f32 lanes exactly as [`crate::formats::reduce8`] does.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn reduce8_ps(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 0b01)))
}

/// Signed weight bytes `q` as the integer kernels dot them: `q + 128`, an unsigned byte,
/// where the ISA's dot product takes any ([`IsaOps::BYTE_DP`]; the sums then start from
/// `−128 · Σ y`, [`signed_offset`]), else `q` itself, which [`signed_dp`] dots through
/// the sign trick.
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
pub(crate) unsafe fn signed_bytes<I: IsaOps>(q: __m256i) -> __m256i {
    if I::BYTE_DP {
        // SAFETY: the caller guarantees the ISA (which has AVX2).
        unsafe { _mm256_xor_si256(q, _mm256_set1_epi8(i8::MIN)) }
    } else {
        q
    }
}

/// The bias of [`signed_bytes`] over the quants on ISA `I`.
#[inline(always)]
pub(crate) fn signed_offset<I: IsaOps>() -> u8 {
    if I::BYTE_DP {
        128
    } else {
        0
    }
}

/// `acc` plus i32 lanes whose total is `Σ p·y` for [`signed_bytes`] `p`: with VNNI the
/// dot product itself, else the sign trick, `Σ |q| · (y · sign(q))`, exact for
/// `|y| ≤ 127` (activations from our quantizers are; `q = −128` gives `|q| = 128` as an
/// unsigned byte).
///
/// # Safety
/// The CPU must support `I`.
#[inline(always)]
pub(crate) unsafe fn signed_dp<I: IsaOps>(acc: __m256i, p: __m256i, y: __m256i) -> __m256i {
    // SAFETY: the caller guarantees the ISA (which has AVX2).
    unsafe {
        if I::BYTE_DP {
            I::dp(acc, p, y)
        } else {
            I::dp(acc, _mm256_sign_epi8(p, p), _mm256_sign_epi8(y, p))
        }
    }
}

/// The eight nibbles of a little-endian u32, nibble `j` (bits `4j..4j + 4`) in i32 lane `j`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn nibbles8(word: [u8; 4]) -> __m256i {
    let shifted =
        _mm256_srlv_epi32(_mm256_set1_epi32(i32::from_le_bytes(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    _mm256_and_si256(shifted, _mm256_set1_epi32(0x0f))
}

/// Splits 16 packed bytes into 32 nibbles: low nibbles in bytes 0–15, high nibbles in
/// bytes 16–31 (the Q4_0/Q4_1/Q5_0/Q5_1 element order).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn nibbles32(qs: &[u8; 16]) -> __m256i {
    // The bytes in both halves (a load that broadcasts), the high half shifted down by
    // four: one shift instead of a shift and an insert.
    let both = _mm256_broadcastsi128_si256(load16(qs));
    _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f))
}

/// Byte `j` is `0xFF` if bit `j` of the little-endian u32 `qh` is set, else 0.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn bits32(qh: [u8; 4]) -> __m256i {
    let v = _mm256_set1_epi32(i32::from_le_bytes(qh));
    // Byte j takes byte j / 8 of the word (shuffles stay within 128-bit halves,
    // and every 32-bit lane holds the whole word).
    let pick = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bytes = _mm256_shuffle_epi8(v, pick);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit)
}

/// Defines, for a weight format `$W` of a family (`block32` or `superblock`, whose
/// `dot_rows` and `Tiled<$W>` give the row and tile kernels) with activations `$A`,
/// the modules `avx2`, `avxvnni` and `avx512`, each with the byte-level table entries `dot`,
/// `dot_rows` and `dot_tile` compiled for that ISA.
macro_rules! x86_entries {
    ($family:ident, $W:ty, $A:ty) => {
        // The feature lists are those `Isa::is_supported` checks.
        $crate::x86::x86_entries!(@isa avx2, $crate::x86::Avx2, "avx2,fma,f16c", $family, $W, $A);
        $crate::x86::x86_entries!(@isa avxvnni, $crate::x86::AvxVnni, "avx2,fma,f16c,avxvnni", $family, $W, $A);
        $crate::x86::x86_entries!(
            @isa avx512, $crate::x86::Avx512,
            "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", $family, $W, $A
        );
    };
    (@isa $module:ident, $I:ty, $features:literal, $family:ident, $W:ty, $A:ty) => {
        pub(crate) mod $module {
            use super::*;
            use $crate::formats::cast_blocks;

            /// Table entry: one row.
            ///
            /// # Safety
            /// The CPU must support the ISA; lengths as `dispatch::DotFn`.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn dot(w: &[u8], a: &[u8]) -> f32 {
                let mut out = [0f32];
                // SAFETY: this function's target features are the ISA's; one row of the
                // activations' length.
                unsafe { dot_rows(w, w.len(), a, &mut out) };
                out[0]
            }

            /// Table entry: every row against the activations, one after another.
            ///
            /// # Safety
            /// The CPU must support the ISA; lengths as `dispatch::DotRowsFn`.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn dot_rows(w: &[u8], stride: usize, a: &[u8], out: &mut [f32]) {
                // SAFETY: this function's target features are the ISA's; lengths as
                // `dispatch::DotRowsFn`.
                unsafe { $crate::x86::$family::dot_rows::<$I, $W>(w, stride, cast_blocks::<$A>(a), out) }
            }

            /// Table entry: every row with every activation row, a tile at a time.
            ///
            /// # Safety
            /// The CPU must support the ISA; lengths as `dispatch::DotTileFn`.
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn dot_tile(w: &[u8], a: &[u8], act_len: usize, out: &mut [f32], out_stride: usize) {
                use $crate::x86::$family::{Tiled, TILE};
                let nb = act_len / core::mem::size_of::<$A>();
                let (w, a) = (cast_blocks::<$W>(w), cast_blocks::<$A>(a));
                // SAFETY: this function's target features are the ISA's; lengths as
                // `dispatch::DotTileFn`.
                unsafe { $crate::x86::tile::drive::<$I, Tiled<$W>, { TILE.0 }, { TILE.1 }>(w, a, nb, out, out_stride) }
            }
        }
    };
}
pub(crate) use x86_entries;

/// Overrides the entries of `k` that have `isa`-specific code.
///
/// # Safety
/// The CPU must support `isa` (`isa.is_supported()`): the table then calls the entries.
pub(crate) unsafe fn register(k: &mut Kernels, isa: Isa) {
    macro_rules! set {
        ($isa:ident: $($w:ident => $module:ident),* $(,)?) => {
            $(
                let old = k.weight(WeightType::$w);
                k.set_weight(
                    WeightType::$w,
                    WeightKernels {
                        dot: $module::$isa::dot,
                        dot_rows: Some($module::$isa::dot_rows),
                        dequantize: old.dequantize,
                    },
                );
                k.set_tile(WeightType::$w, $module::$isa::dot_tile);
            )*
        };
    }
    match isa {
        Isa::Scalar => return,
        Isa::Avx2 => {
            set!(avx2: Q8_0 => q8_0, Q4_0 => q4_0, Q5_0 => q5_0, Q4_1 => q4_1, Q5_1 => q5_1,
                 Q2_K => q2_k, Q3_K => q3_k, Q4_K => q4_k, Q5_K => q5_k, Q6_K => q6_k,
                 IQ4_NL => iq4_nl, IQ4_XS => iq4_xs, IQ3_XXS => iq3_xxs, IQ3_S => iq3_s);
            float::register_avx2(k);
            k.set_attention(attention::AVX2);
            k.set_sketch(sketch::AVX2);
        }
        Isa::AvxVnni => {
            set!(avxvnni: Q8_0 => q8_0, Q4_0 => q4_0, Q5_0 => q5_0, Q4_1 => q4_1, Q5_1 => q5_1,
                 Q2_K => q2_k, Q3_K => q3_k, Q4_K => q4_k, Q5_K => q5_k, Q6_K => q6_k,
                 IQ4_NL => iq4_nl, IQ4_XS => iq4_xs, IQ3_XXS => iq3_xxs, IQ3_S => iq3_s);
            float::register_avx2(k);
            k.set_attention(attention::AVX2);
            k.set_sketch(sketch::AVXVNNI);
        }
        Isa::Avx512 => {
            set!(avx512: Q8_0 => q8_0, Q4_0 => q4_0, Q5_0 => q5_0, Q4_1 => q4_1, Q5_1 => q5_1,
                 Q2_K => q2_k, Q3_K => q3_k, Q4_K => q4_k, Q5_K => q5_k, Q6_K => q6_k,
                 IQ4_NL => iq4_nl, IQ4_XS => iq4_xs, IQ3_XXS => iq3_xxs, IQ3_S => iq3_s);
            float::register_avx512(k);
            k.set_attention(attention::AVX512);
            k.set_sketch(sketch::AVX512);
        }
    }
    // Every x86 table has AVX2 and uses its quantizers.
    k.set_quantize(ActivationType::Q8_0, quantize::q8_0_avx2);
    k.set_quantize(ActivationType::Q8_1, quantize::q8_1_avx2);
    k.set_quantize(ActivationType::Q8_K, quantize::q8_k_avx2);
}
