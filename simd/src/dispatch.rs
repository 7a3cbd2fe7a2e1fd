//! The kernel table: one set of function pointers per instruction-set level, chosen
//! once per process.
//!
//! Every entry is an `unsafe fn` pointer. Two things make calling one sound, and
//! [`Kernels`] guarantees both: it checks every length (and the formats' casts check
//! alignment) before calling, and a table holding ISA-specific entries can only be built
//! by [`Kernels::for_isa`] after the CPU was seen to support that ISA.

use std::sync::OnceLock;

use half::f16;

use crate::formats::{self, float32};
use crate::sketch::{Bounds, RefineQuery, RefinedRows, SketchCodes, SketchQuery};
use crate::{ActivationType, WeightType};

/// Dot of one weight row with one activation row. The row lengths have been checked
/// to describe the same number of elements.
pub(crate) type DotFn = unsafe fn(w_row: &[u8], act_row: &[u8]) -> f32;
/// `out[r] = dot(w_rows[r*stride ..][.. row_len], act_row)` where `row_len` is the
/// weight row length matching `act_row`; the caller has checked every row is in bounds.
pub(crate) type DotRowsFn = unsafe fn(w_rows: &[u8], stride: usize, act_row: &[u8], out: &mut [f32]);
/// `out[t*out_stride + r] = dot(row r of w_rows, row t of acts)` for the weight and
/// activation rows laid end to end in `w_rows` and `acts`, activation rows `act_len`
/// (> 0) bytes long; the caller has checked that both hold whole rows of matching
/// lengths, at least one each, and that `out` reaches every written element.
pub(crate) type DotTileFn = unsafe fn(w_rows: &[u8], acts: &[u8], act_len: usize, out: &mut [f32], out_stride: usize);
/// Weight rows per tile of the x86 tile kernels (see [`Kernels::tile_rows`]).
pub(crate) const TILE_ROWS: usize = 16;
/// Dequantize one row; `out` has the row's element count.
pub(crate) type DequantFn = unsafe fn(row: &[u8], out: &mut [f32]);
/// Quantize one activation row; `out` has the matching byte length.
pub(crate) type QuantFn = unsafe fn(x: &[f32], out: &mut [u8]);

/// `out[h · stride + j] = queries[h] · keys[j]` over rows of `dim` (> 0) elements.
pub(crate) type ScoresFn = unsafe fn(dim: usize, queries: &[f32], keys: &[f16], out: &mut [f32], stride: usize);
/// Each `x` becomes `exp(x − max)`; returns their sum.
pub(crate) type SoftmaxExpFn = unsafe fn(x: &mut [f32], max: f32) -> f32;
/// `out[h] += Σⱼ weights[h · stride + j] · values[j]` over rows of `dim` (> 0) elements.
pub(crate) type AddWeightedFn = unsafe fn(dim: usize, weights: &[f32], stride: usize, values: &[f16], out: &mut [f32]);

/// `sum[d] += w · v[d]` in f64 (see [`Kernels::add_scaled_f64`]); equal lengths.
pub(crate) type AddScaledF64Fn = unsafe fn(w: f64, v: &[f32], sum: &mut [f64]);
/// `‖v‖²` in f64 (see [`Kernels::squared_norm_f64`]).
pub(crate) type SquaredNormF64Fn = unsafe fn(v: &[f32]) -> f64;

/// f16 levels of rows of affine codes (see [`Kernels::levels_f16`]).
pub(crate) type LevelsF16Fn = unsafe fn(rows: &CodeRows, out: &mut [f16]);
/// [`ScoresFn`] over the levels of rows of affine codes.
pub(crate) type ScoresCodedFn = unsafe fn(queries: &[f32], keys: &CodeRows, out: &mut [f32], stride: usize);
/// [`AddWeightedFn`] over the levels of rows of affine codes.
pub(crate) type AddWeightedCodedFn = unsafe fn(weights: &[f32], stride: usize, values: &CodeRows, out: &mut [f32]);

/// Integer dots of a query group with rows of sketch codes (see [`Kernels::sketch_dots`]).
pub(crate) type SketchDotsFn = unsafe fn(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [i32]);
/// Integer dots of a query group with listed rows of sketch codes (see [`Kernels::sketch_dots_at`]).
pub(crate) type SketchDotsAtFn = unsafe fn(codes: &SketchCodes, queries: &[SketchQuery], rows: &[u32], out: &mut [i32]);
/// The set-up of a sketch query (see [`Kernels::sketch_prepare`]).
pub(crate) type SketchPrepareFn = unsafe fn(
    q: &[f32],
    min: &[f32],
    step: &[f32],
    weights: &mut [i8],
    residuals: &mut [i8],
) -> (crate::sketch::PrepareScales, crate::sketch::PrepareSums);
/// The first threshold each number reaches (see [`Kernels::first_levels`]).
pub(crate) type LevelsFn = unsafe fn(values: &[f32], thresholds: &[f32], out: &mut [u8]);
/// A page's refined bounds for a query group (see [`Kernels::sketch_refine_page`]).
pub(crate) type SketchRefinePageFn =
    unsafe fn(coarse: &SketchCodes, fine: &SketchCodes, queries: &[RefineQuery], out: &mut RefinedRows);
/// Score bounds of a query group over rows of sketch codes (see [`Kernels::sketch_scan`]).
pub(crate) type SketchScanFn = unsafe fn(codes: &SketchCodes, queries: &[SketchQuery], out: &mut [Bounds]);

/// Rows of affine codes, as the quantized KV cache keeps them: element `j`
/// of a row has the `j`-th code of `bits` bits in the row's `codes` (lowest
/// bits first) or, given `fine`, `16 · c_j + f_j` with `f_j` the `j`-th 4-bit
/// code of the row's `fine`. Its minimum and step are `min[j]` and `step[j]`
/// for every row when `group` is 1 (a page of keys, per channel); otherwise
/// each row has its own, one per `group` elements (a token's values).
#[derive(Clone, Copy, Debug)]
pub struct CodeRows<'a> {
    /// Elements per row.
    pub dim: usize,
    /// The codes, packed, each row in `(dim · bits).div_ceil(8)` bytes.
    pub codes: &'a [u8],
    /// Bits per code in `codes`: 2, 4 or 8 (4 with `fine`).
    pub bits: u32,
    /// The low 4 bits of 8-bit codes whose top 4 are in `codes`, each row
    /// in `dim.div_ceil(2)` bytes.
    pub fine: Option<&'a [u8]>,
    /// Elements sharing a minimum and a step: 1 (shared by every row) or a
    /// power of two from 16 (per row).
    pub group: usize,
    /// The minima: `dim` of them for `group` 1, else `dim.div_ceil(group)` per row.
    pub min: &'a [f32],
    /// The steps, as the minima.
    pub step: &'a [f32],
}

impl CodeRows<'_> {
    /// Bytes of one row's codes.
    pub(crate) fn row_bytes(&self) -> usize {
        (self.dim * self.bits as usize).div_ceil(8)
    }

    /// The number of rows, after checking that every part describes them.
    #[track_caller]
    fn check(&self) -> usize {
        let CodeRows { dim, codes, bits, fine, group, min, step } = *self;
        assert!(dim > 0, "code rows need at least one element");
        assert!(matches!((bits, fine.is_some()), (2 | 4 | 8, false) | (4, true)), "{bits}-bit codes");
        let rows = codes.len() / self.row_bytes();
        assert_eq!(codes.len(), rows * self.row_bytes(), "{} bytes are not whole rows of {dim} codes", codes.len());
        assert!(fine.is_none_or(|f| f.len() == rows * dim.div_ceil(2)), "{rows} rows need as many rows of fine codes");
        assert!(group == 1 || (group >= 16 && group.is_power_of_two()), "groups of {group}");
        let affine = if group == 1 { dim } else { rows * dim.div_ceil(group) };
        assert!(min.len() == affine && step.len() == affine, "{rows} rows need {affine} minima and steps");
        rows
    }
}

/// The attention kernels (see [`crate::attention`]).
#[derive(Clone, Copy)]
pub(crate) struct AttentionKernels {
    pub(crate) scores: ScoresFn,
    pub(crate) softmax_exp: SoftmaxExpFn,
    pub(crate) add_weighted: AddWeightedFn,
    pub(crate) levels_f16: LevelsF16Fn,
    pub(crate) scores_coded: ScoresCodedFn,
    pub(crate) add_weighted_coded: AddWeightedCodedFn,
    pub(crate) add_scaled_f64: AddScaledF64Fn,
    pub(crate) squared_norm_f64: SquaredNormF64Fn,
}

/// The key sketch's scan (see [`crate::sketch`]).
#[derive(Clone, Copy)]
pub(crate) struct SketchKernels {
    pub(crate) dots: SketchDotsFn,
    pub(crate) dots_at: SketchDotsAtFn,
    pub(crate) bounds: SketchScanFn,
    pub(crate) levels: LevelsFn,
    pub(crate) prepare: SketchPrepareFn,
    pub(crate) refine_page: SketchRefinePageFn,
}

/// The kernels of one weight format.
#[derive(Clone, Copy)]
pub(crate) struct WeightKernels {
    pub(crate) dot: DotFn,
    /// Several rows at a time, sharing work on the activations; `None` loops over `dot`.
    pub(crate) dot_rows: Option<DotRowsFn>,
    pub(crate) dequantize: DequantFn,
}

/// Instruction-set level of a kernel table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust, auto-vectorized for the compile target.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// AVX2 with AVX-VNNI: the integer dot products in the VEX form of
    /// `vpdpbusd` (Intel desktop CPUs from Alder Lake, AMD from Zen 5),
    /// everything else as AVX2.
    AvxVnni,
    /// x86-64 AVX-512 F/BW/VL with VNNI (plus AVX2, FMA, F16C).
    Avx512,
}

impl Isa {
    /// Every ISA, slowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512];

    /// The lowercase name used by `SIFT_ISA` and `--isa`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this CPU (and OS) can run this ISA's kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.is_supported() && std::arch::is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 => false,
        }
    }

    /// The ISAs this CPU supports, slowest first (always starts with `Scalar`).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The fastest supported ISA.
    pub fn best() -> Isa {
        *Isa::available().last().expect("scalar is always available")
    }
}

impl core::fmt::Display for Isa {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// An ISA name other than `scalar`, `avx2`, `avxvnni` or `avx512`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseIsaError(pub String);

impl core::fmt::Display for ParseIsaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "unknown ISA {:?} (expected scalar, avx2, avxvnni or avx512)", self.0)
    }
}

impl std::error::Error for ParseIsaError {}

impl core::str::FromStr for Isa {
    type Err = ParseIsaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| ParseIsaError(s.to_owned()))
    }
}

/// Why [`select_isa`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelectIsaError {
    /// This CPU cannot run the requested ISA.
    Unsupported(Isa),
    /// The table was already chosen, for another ISA.
    AlreadySelected {
        /// The ISA in use.
        current: Isa,
        /// The ISA asked for.
        requested: Isa,
    },
}

impl core::fmt::Display for SelectIsaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SelectIsaError::Unsupported(isa) => {
                write!(f, "this CPU does not support the {isa} kernels")
            }
            SelectIsaError::AlreadySelected { current, requested } => {
                write!(f, "cannot switch kernels to {requested}: {current} is already in use")
            }
        }
    }
}

impl std::error::Error for SelectIsaError {}

/// The kernel table for one ISA.
#[derive(Clone, Copy)]
pub struct Kernels {
    isa: Isa,
    weights: [WeightKernels; WeightType::ALL.len()],
    quantize: [QuantFn; ActivationType::ALL.len()],
    attention: AttentionKernels,
    pub(crate) sketch: SketchKernels,
    /// Per weight type, the tile kernel of [`Kernels::dot_tile`]; `None` loops over
    /// `dot_rows`.
    tiles: [Option<DotTileFn>; WeightType::ALL.len()],
}

static KERNELS: OnceLock<Kernels> = OnceLock::new();

/// The process-wide kernel table, chosen on first use: the ISA forced by
/// [`select_isa`], else the one named by the `SIFT_ISA` environment variable
/// (`scalar`, `avx2`, `avxvnni`, `avx512` or `auto`), else the best this CPU supports. An unknown
/// or unsupported `SIFT_ISA` value falls back to the best ISA with a warning on stderr.
pub fn kernels() -> &'static Kernels {
    KERNELS.get_or_init(|| {
        let isa = isa_from_env().unwrap_or_else(Isa::best);
        Kernels::for_isa(isa).expect("chosen ISA is supported")
    })
}

fn isa_from_env() -> Option<Isa> {
    let value = std::env::var("SIFT_ISA").ok()?;
    if value.trim().is_empty() || value.trim().eq_ignore_ascii_case("auto") {
        return None;
    }
    match value.parse::<Isa>() {
        Ok(isa) if isa.is_supported() => Some(isa),
        Ok(isa) => {
            eprintln!("sift: SIFT_ISA={isa} is not supported by this CPU; using {}", Isa::best());
            None
        }
        Err(e) => {
            eprintln!("sift: SIFT_ISA: {e}; using {}", Isa::best());
            None
        }
    }
}

/// Forces the process-wide table to `isa`. Must be called before the first
/// [`kernels()`] call (or with the ISA already in use).
pub fn select_isa(isa: Isa) -> Result<(), SelectIsaError> {
    let table = Kernels::for_isa(isa).ok_or(SelectIsaError::Unsupported(isa))?;
    let current = KERNELS.get_or_init(|| table).isa;
    if current == isa {
        Ok(())
    } else {
        Err(SelectIsaError::AlreadySelected { current, requested: isa })
    }
}

/// Plain dot/dequantize entries of one weight format's scalar code.
macro_rules! scalar_entry {
    ($module:ident) => {
        WeightKernels {
            dot: formats::$module::dot_bytes,
            dot_rows: None,
            dequantize: formats::$module::dequantize_bytes,
        }
    };
}

/// The portable table.
const SCALAR: Kernels = Kernels {
    isa: Isa::Scalar,
    // Order of WeightType::ALL.
    weights: [
        scalar_entry!(float32),
        scalar_entry!(float16),
        scalar_entry!(bfloat16),
        scalar_entry!(q4_0),
        scalar_entry!(q4_1),
        scalar_entry!(q5_0),
        scalar_entry!(q5_1),
        scalar_entry!(q8_0),
        scalar_entry!(q2_k),
        scalar_entry!(q3_k),
        scalar_entry!(q4_k),
        scalar_entry!(q5_k),
        scalar_entry!(q6_k),
        scalar_entry!(iq4_nl),
        scalar_entry!(iq4_xs),
        scalar_entry!(iq3_xxs),
        scalar_entry!(iq3_s),
    ],
    // Order of ActivationType::ALL.
    quantize: [
        float32::quantize_bytes,
        formats::q8_0::quantize_bytes,
        formats::q8_1::quantize_bytes,
        formats::q8_k::quantize_bytes,
    ],
    attention: AttentionKernels {
        scores: crate::attention::portable::scores,
        softmax_exp: crate::attention::portable::softmax_exp,
        add_weighted: crate::attention::portable::add_weighted,
        levels_f16: crate::attention::portable::levels_f16,
        scores_coded: crate::attention::portable::scores_coded,
        add_weighted_coded: crate::attention::portable::add_weighted_coded,
        add_scaled_f64: crate::attention::portable::add_scaled_f64,
        squared_norm_f64: crate::attention::portable::squared_norm_f64,
    },
    sketch: SketchKernels {
        dots: crate::sketch::portable::dots,
        dots_at: crate::sketch::portable::dots_at,
        bounds: crate::sketch::portable::bounds,
        levels: crate::sketch::portable::levels,
        prepare: crate::sketch::portable::prepare,
        refine_page: crate::sketch::portable::refine_page,
    },
    tiles: [None; WeightType::ALL.len()],
};

impl Kernels {
    /// The table for `isa`, or `None` if this CPU cannot run it.
    pub fn for_isa(isa: Isa) -> Option<Kernels> {
        if !isa.is_supported() {
            return None;
        }
        #[allow(unused_mut)]
        let mut k = SCALAR;
        k.isa = isa;
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `isa.is_supported()` was checked above, which is what the x86
            // entries require.
            unsafe { crate::x86::register(&mut k, isa) };
        }
        Some(k)
    }

    /// The ISA this table was built for.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn set_weight(&mut self, w: WeightType, entry: WeightKernels) {
        self.weights[w.index()] = entry;
    }

    pub(crate) fn weight(&self, w: WeightType) -> WeightKernels {
        self.weights[w.index()]
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn set_quantize(&mut self, a: ActivationType, f: QuantFn) {
        self.quantize[a.index()] = f;
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn set_tile(&mut self, w: WeightType, f: DotTileFn) {
        self.tiles[w.index()] = Some(f);
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn set_sketch(&mut self, entries: SketchKernels) {
        self.sketch = entries;
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn set_attention(&mut self, entries: AttentionKernels) {
        self.attention = entries;
    }

    /// Quantizes the f32 row `x` into `out` as activation type `ty` (for
    /// [`ActivationType::F32`], copies the bytes).
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of `ty.block_elems()`, if
    /// `out.len() != ty.row_bytes(x.len())`, or if `out` is misaligned for `ty`.
    pub fn quantize_activation(&self, ty: ActivationType, x: &[f32], out: &mut [u8]) {
        assert_eq!(
            out.len(),
            ty.row_bytes(x.len()),
            "{ty:?} row of {} elements needs {} bytes",
            x.len(),
            ty.row_bytes(x.len())
        );
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.quantize[ty.index()])(x, out) }
    }

    /// Dot product of one weight row (`n` elements of type `w`) with one activation row
    /// of type `w.activation()` quantized from `n` elements.
    ///
    /// # Panics
    /// If `n` is not a whole number of blocks of `w`, or a row length doesn't match `n`.
    pub fn dot(&self, w: WeightType, w_row: &[u8], act_row: &[u8], n: usize) -> f32 {
        check_rows(w, w_row.len(), act_row.len(), n);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.weight(w).dot)(w_row, act_row) }
    }

    /// `out[r]` = dot of weight row `r` with `act_row`, where row `r` starts at byte
    /// `r * row_bytes` of `w_rows` (`row_bytes` ≥ the row's length; a larger value is a
    /// stride) and has `n` elements.
    ///
    /// For the 32-element formats, the x86 tables prepare what depends on the activations
    /// alone (scales, sums) once for all rows; results equal [`Kernels::dot`]'s per row.
    ///
    /// # Panics
    /// As [`Kernels::dot`], and if `w_rows` is too short for `out.len()` rows.
    pub fn dot_rows(&self, w: WeightType, w_rows: &[u8], row_bytes: usize, act_row: &[u8], n: usize, out: &mut [f32]) {
        let len = w.row_bytes(n).unwrap_or(usize::MAX);
        check_rows(w, len, act_row.len(), n);
        assert!(row_bytes >= len, "row stride {row_bytes} is below the row length {len}");
        if let Some(last) = out.len().checked_sub(1) {
            let need = last.checked_mul(row_bytes).and_then(|b| b.checked_add(len)).expect("row span overflows usize");
            assert!(
                w_rows.len() >= need,
                "{} rows of stride {row_bytes} need {need} bytes, got {}",
                out.len(),
                w_rows.len()
            );
        }
        let entry = self.weight(w);
        match entry.dot_rows {
            // SAFETY: every row is in bounds (checked above) and the lengths match; the
            // table's ISA is supported (see module docs).
            Some(f) => unsafe { f(w_rows, row_bytes, act_row, out) },
            None => {
                for (r, o) in out.iter_mut().enumerate() {
                    let row = &w_rows[r * row_bytes..r * row_bytes + len];
                    // SAFETY: as above.
                    *o = unsafe { (entry.dot)(row, act_row) };
                }
            }
        }
    }

    /// Weight rows per tile of [`Kernels::dot_tile`]: row counts that are multiples of
    /// it waste no work at the tiles' edges.
    pub fn tile_rows(&self) -> usize {
        TILE_ROWS
    }

    /// Every weight row with every activation row: `out[t * out_stride + r]` = dot of
    /// weight row `r` with activation row `t`, where `w_rows` holds weight rows of `n`
    /// elements laid end to end and `acts` activation rows quantized from `n` elements
    /// each (as for [`Kernels::dot`]). Elements of `out` between the rows are left
    /// alone.
    ///
    /// For the quantized formats, the x86 tables work in tiles of 16 rows × 64 tokens:
    /// they rearrange each tile of tokens' activations once for all rows (in a buffer
    /// per thread, grown on first use) and unpack each weight block once per tile.
    /// Results equal [`Kernels::dot`]'s for every pair, bit for bit.
    ///
    /// # Panics
    /// If `n` is zero or not a whole number of blocks of `w`, if `w_rows` or `acts` is
    /// not a whole number of rows, if `out_stride` is below the number of weight rows,
    /// or if `out` is too short.
    pub fn dot_tile(&self, w: WeightType, w_rows: &[u8], acts: &[u8], n: usize, out: &mut [f32], out_stride: usize) {
        assert!(n > 0, "tiles need rows of at least one element");
        let len = w.row_bytes(n).unwrap_or(usize::MAX);
        let act_len = w.activation().row_bytes(n);
        check_rows(w, len, act_len, n);
        assert!(w_rows.len().is_multiple_of(len), "{} bytes are not whole {w} rows of {len} bytes", w_rows.len());
        assert!(acts.len().is_multiple_of(act_len), "{} bytes are not whole rows of {act_len} bytes", acts.len());
        let (n_rows, n_tokens) = (w_rows.len() / len, acts.len() / act_len);
        if n_rows == 0 || n_tokens == 0 {
            return;
        }
        assert!(out_stride >= n_rows, "output stride {out_stride} is below the {n_rows} weight rows");
        let need = (n_tokens - 1).checked_mul(out_stride).and_then(|o| o.checked_add(n_rows));
        assert!(
            need.is_some_and(|need| out.len() >= need),
            "{n_tokens} tokens of {n_rows} results at stride {out_stride} do not fit in {} elements",
            out.len()
        );
        match self.tiles[w.index()] {
            // SAFETY: whole rows of matching lengths, at least one each, and `out` is
            // long enough (all checked above); the table's ISA is supported (see module
            // docs).
            Some(f) => unsafe { f(w_rows, acts, act_len, out, out_stride) },
            None => {
                for (t, act_row) in acts.chunks_exact(act_len).enumerate() {
                    self.dot_rows(w, w_rows, len, act_row, n, &mut out[t * out_stride..][..n_rows]);
                }
            }
        }
    }

    /// Dequantizes one row of `out.len()` elements of type `w`. Bit-identical on every
    /// ISA, except that the x86 F16 path (F16C) may quiet signalling-NaN payloads.
    ///
    /// # Panics
    /// If `row.len() != w.row_bytes(out.len())`.
    pub fn dequantize_row(&self, w: WeightType, row: &[u8], out: &mut [f32]) {
        let n = out.len();
        assert_eq!(Some(row.len()), w.row_bytes(n), "{w} row of {n} elements has the wrong byte length");
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.weight(w).dequantize)(row, out) }
    }
}

/// Attention over an f16 key/value cache, for a group of queries at a time (the query
/// heads that share a KV head, which then read each key and value once): the scores
/// against a run of key rows, the softmax's exponentials, and the weighted sums of a run
/// of value rows. Sums are in f32; tables agree with each other to f32 rounding (they
/// sum in different orders), and a query's results do not depend on its group.
impl Kernels {
    /// `out[h · stride + j] = queries[h] · keys[j]`, where `queries` and `keys` hold rows
    /// of `dim` elements laid end to end: row `h` of the scores starts at `h · stride`.
    /// The products are exact (an f16 times an f32 fits an f32 when the queries hold f16
    /// values), so the only rounding is the summation's.
    ///
    /// # Panics
    /// If `dim` is 0, the lengths of `queries` or `keys` are not multiples of it, or
    /// `stride` and `out` leave no room for a row of scores per query.
    pub fn scores_f16(&self, dim: usize, queries: &[f32], keys: &[f16], out: &mut [f32], stride: usize) {
        check_attention_rows(dim, queries.len(), keys.len(), out.len(), stride);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.scores)(dim, queries, keys, out, stride) }
    }

    /// Replaces each `x` by `exp(x − max)` and returns the sum of the results: the
    /// softmax's numerators and denominator when `max` is the largest `x`.
    ///
    /// `exp` is a polynomial within 2·10⁻⁷ relative of the true value where that is at
    /// least `f32::MIN_POSITIVE`, and flushes smaller results to zero; arguments above 88
    /// are taken as 88.
    pub fn softmax_exp(&self, x: &mut [f32], max: f32) -> f32 {
        // SAFETY: the table's ISA is supported (see module docs).
        unsafe { (self.attention.softmax_exp)(x, max) }
    }

    /// `sum[d] += w · v[d]` in f64, for sums kept in f64 (a sparse attention's
    /// estimates): each product rounded, then each sum, never fused, so every table
    /// gives the same bits (and `w = ±1` adds or subtracts `v` exactly).
    ///
    /// # Panics
    /// If `v` and `sum` differ in length.
    pub fn add_scaled_f64(&self, w: f64, v: &[f32], sum: &mut [f64]) {
        assert_eq!(v.len(), sum.len(), "{} numbers added to {} sums", v.len(), sum.len());
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.add_scaled_f64)(w, v, sum) }
    }

    /// `‖v‖²` in f64: coordinate `d`'s square added to partial sum `d mod 8`, the eight
    /// sums then added in order, the same bits on every table.
    pub fn squared_norm_f64(&self, v: &[f32]) -> f64 {
        // SAFETY: the table's ISA is supported (see module docs).
        unsafe { (self.attention.squared_norm_f64)(v) }
    }

    /// `out[h] += Σⱼ weights[h · stride + j] · values[j]`, where `values` and `out` hold
    /// rows of `dim` elements laid end to end: output row `h` takes its weights from
    /// `h · stride` on. The products are exact when the weights hold f16 values
    /// (attention rounds its probabilities so); the sums are f32, row after row.
    ///
    /// # Panics
    /// If `dim` is 0, the lengths of `out` or `values` are not multiples of it, or
    /// `stride` and `weights` leave no room for a weight per value row and output row.
    pub fn add_weighted_f16(&self, dim: usize, weights: &[f32], stride: usize, values: &[f16], out: &mut [f32]) {
        check_attention_rows(dim, out.len(), values.len(), weights.len(), stride);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.add_weighted)(dim, weights, stride, values, out) }
    }
}

/// The quantized KV cache's codes, read back as attention reads them.
impl Kernels {
    /// `out[r · dim + j] = f16(min + step · (c · span + (span − 1)/2))`: the
    /// levels of [`CodeRows`], `c` the code of row `r`'s element `j` and `min`
    /// and `step` its minimum and step. `span` is `2^(8 − b)` for codes of `b`
    /// bits in all (8 with `fine`): a narrow code stands for the midpoint of the
    /// 8-bit codes it is the top bits of. The product is exact in f32 and the
    /// sum rounds once before the f16 rounding (to nearest, ties to even), so
    /// every table gives the same bits.
    ///
    /// # Panics
    /// If `bits` is not 2, 4 or 8 (4 with `fine`), `dim` is 0, `codes` is not
    /// whole rows, `fine`, `min` or `step` do not hold as many rows (see
    /// [`CodeRows`]), `group` is neither 1 nor a power of two from 16, or `out` does
    /// not hold every row.
    pub fn levels_f16(&self, rows: &CodeRows, out: &mut [f16]) {
        let n = rows.check();
        assert_eq!(out.len(), n * rows.dim, "{n} rows of {} levels", rows.dim);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.levels_f16)(rows, out) }
    }

    /// [`Kernels::scores_f16`] with the keys the levels of [`CodeRows`]
    /// (exactly as [`Kernels::levels_f16`] computes them, in f32: no f16
    /// rounding), without staging them anywhere.
    ///
    /// # Panics
    /// As [`Kernels::levels_f16`] for `keys`, and as [`Kernels::scores_f16`].
    pub fn scores_coded(&self, queries: &[f32], keys: &CodeRows, out: &mut [f32], stride: usize) {
        let n = keys.check();
        check_attention_rows(keys.dim, queries.len(), n * keys.dim, out.len(), stride);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.scores_coded)(queries, keys, out, stride) }
    }

    /// [`Kernels::add_weighted_f16`] with the values the levels of
    /// [`CodeRows`], as [`Kernels::scores_coded`] reads its keys.
    ///
    /// # Panics
    /// As [`Kernels::levels_f16`] for `values`, and as [`Kernels::add_weighted_f16`].
    pub fn add_weighted_coded(&self, weights: &[f32], stride: usize, values: &CodeRows, out: &mut [f32]) {
        let n = values.check();
        check_attention_rows(values.dim, out.len(), n * values.dim, weights.len(), stride);
        // SAFETY: lengths checked above; the table's ISA is supported (see module docs).
        unsafe { (self.attention.add_weighted_coded)(weights, stride, values, out) }
    }
}

/// Checks a group of `heads_len / dim` heads against `rows_len / dim` rows, with a
/// matrix of `matrix_len` numbers in rows of `stride` (one per head).
#[track_caller]
fn check_attention_rows(dim: usize, heads_len: usize, rows_len: usize, matrix_len: usize, stride: usize) {
    assert!(dim > 0, "attention rows need at least one element");
    assert!(heads_len.is_multiple_of(dim), "{heads_len} numbers are not whole heads of {dim}");
    assert!(rows_len.is_multiple_of(dim), "{rows_len} numbers are not whole rows of {dim}");
    let (heads, n) = (heads_len / dim, rows_len / dim);
    assert!(stride >= n, "a stride of {stride} cannot hold {n} rows");
    let need = if heads == 0 { 0 } else { (heads - 1) * stride + n };
    assert!(matrix_len >= need, "{heads} heads of {n} rows in a stride of {stride} need {need} numbers");
}

impl core::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Kernels").field("isa", &self.isa).finish_non_exhaustive()
    }
}

#[track_caller]
fn check_rows(w: WeightType, w_len: usize, act_len: usize, n: usize) {
    let expect = w.row_bytes(n);
    assert!(expect.is_some(), "{w} rows need a multiple of {} elements, got {n}", w.block_elems());
    assert_eq!(Some(w_len), expect, "{w} row of {n} elements has the wrong byte length");
    let a = w.activation();
    assert_eq!(act_len, a.row_bytes(n), "{a:?} row of {n} elements has the wrong byte length");
}
