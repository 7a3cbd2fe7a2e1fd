//! Products of quantized weight matrices with f32 activation rows.
//!
//! Activations are quantized once per product to the weight format's
//! activation type (Q8_0, Q8_1 or Q8_K, as ggml pairs them), then every weight
//! row is dotted against every activation row with the kernels of [`simd`]: one
//! row at a time when decoding, tiles of rows × tokens for a batch
//! ([`simd::Kernels::dot_tile`], bit-identical to the single dots). Work is split
//! across the pool by blocks of output rows, so each block of weights is read from
//! memory once for all tokens of a batch.
//!
//! [`set_f32_activations`] switches every product to f32 activations against
//! weights dequantized to f32: much slower, but free of the 8-bit activation
//! rounding, whose re-drawing by any perturbation upstream is the noise floor
//! of KL comparisons between cache modes. [`keep_dequantized_weights`]
//! makes products under that setting keep each matrix's f32
//! weights from its first product on (four bytes a weight, for the process's
//! life), so that a long decoding experiment reads them instead of
//! dequantizing every row again at every step; the dots are the same.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;
use simd::{kernels, WeightType};

static F32_ACTIVATIONS: AtomicBool = AtomicBool::new(false);

/// Whether products dot f32 activations with weights dequantized to f32
/// instead of quantizing the activations as ggml does; for the whole
/// process, as a measurement setting.
pub fn set_f32_activations(on: bool) {
    F32_ACTIVATIONS.store(on, Ordering::Relaxed);
}

static KEEP_DEQUANTIZED: AtomicBool = AtomicBool::new(false);

/// A matrix's weights kept in f32, by the address and length of the
/// quantized data they came from.
struct Kept {
    data: (usize, usize),
    weights: &'static [f32],
}

/// The f32 weights kept under [`keep_dequantized_weights`].
static DEQUANTIZED: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// Whether products with f32 activations keep every matrix's
/// dequantized weights after its first product (for the whole process; the
/// memory is never given back), instead of dequantizing each row at each
/// product. Results are the same either way. Kept weights are found by
/// where the quantized data lies, so this is for weights that stay where
/// they are while it is on (a loaded model's), not for matrices freed and
/// reallocated in between.
pub fn keep_dequantized_weights(on: bool) {
    KEEP_DEQUANTIZED.store(on, Ordering::Relaxed);
}

/// A weight matrix in GGUF order: `rows` output rows of `cols` inputs each,
/// stored row after row in its quantized format.
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

/// Reusable buffers, so a product allocates nothing once warmed up.
#[derive(Default)]
pub struct MatmulScratch {
    /// Quantized activations; `u64` words keep every activation type's blocks aligned.
    activations: Vec<u64>,
    by_row_block: Vec<f32>,
    /// The weights in f32, with f32 activations ([`set_f32_activations`]).
    dequantized: Vec<f32>,
}

impl<'a> Matrix<'a> {
    /// `None` when `data` does not hold exactly `rows` rows of `cols` elements.
    pub fn new(ty: WeightType, rows: usize, cols: usize, data: &'a [u8]) -> Option<Self> {
        let row_bytes = ty.row_bytes(cols)?;
        (row_bytes.checked_mul(rows)? == data.len()).then_some(Self { ty, rows, cols, row_bytes, data })
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        kernels().dequantize_row(self.ty, self.row(r), out);
    }

    /// `out[t * rows + r] = W[r] · x[t]` for the `x.len() / cols` rows of `x`.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], scratch: &mut MatmulScratch) {
        if self.ty != WeightType::F32 && F32_ACTIVATIONS.load(Ordering::Relaxed) {
            if x.len() == self.cols {
                return self.dequantized_matvec(x, out);
            }
            if KEEP_DEQUANTIZED.load(Ordering::Relaxed) {
                let bytes = bytemuck::cast_slice(self.kept_dequantized());
                return Matrix::new(WeightType::F32, self.rows, self.cols, bytes)
                    .expect("f32 rows")
                    .matmul(x, out, scratch);
            }
            let mut weights = std::mem::take(&mut scratch.dequantized);
            weights.resize(self.rows * self.cols, 0.0);
            weights.par_chunks_mut(self.cols).enumerate().for_each(|(r, out)| self.dequantize_row(r, out));
            let bytes = bytemuck::cast_slice(&weights);
            Matrix::new(WeightType::F32, self.rows, self.cols, bytes).expect("f32 rows").matmul(x, out, scratch);
            scratch.dequantized = weights;
            return;
        }
        let n_tokens = x.len() / self.cols;
        assert_eq!(x.len(), n_tokens * self.cols, "activation length is not a whole number of rows");
        assert_eq!(out.len(), n_tokens * self.rows, "output has the wrong length");
        let k = kernels();
        let act_ty = self.ty.activation();
        let act_bytes = act_ty.row_bytes(self.cols);
        scratch.activations.resize((n_tokens * act_bytes).div_ceil(8), 0);
        let acts = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut scratch.activations)[..n_tokens * act_bytes];
        let quantize = |(q, row): (&mut [u8], &[f32])| {
            k.quantize_activation(act_ty, row, q);
            round_to_weight_precision(self.ty, q);
        };
        // One row (decoding) is too little work to hand to the pool.
        if n_tokens == 1 {
            quantize((acts, x));
        } else {
            acts.par_chunks_mut(act_bytes).zip(x.par_chunks(self.cols)).for_each(quantize);
        }
        let acts = &*acts;

        let block = self.row_block(n_tokens);
        if n_tokens == 1 {
            out.par_chunks_mut(block).enumerate().for_each(|(b, out)| {
                let first = b * block;
                let w = &self.data[first * self.row_bytes..(first + out.len()) * self.row_bytes];
                k.dot_rows(self.ty, w, self.row_bytes, acts, self.cols, out);
            });
            return;
        }
        // Each task owns a block of rows and writes its results token-major into its
        // own stretch of the scratch (tiles of rows × tokens unpack each weight block
        // once per tile); a copy, parallel over tokens, then lays them out.
        scratch.by_row_block.resize(n_tokens * self.rows, 0.0);
        scratch.by_row_block.par_chunks_mut(block * n_tokens).enumerate().for_each(|(b, res)| {
            let first = b * block;
            let n_rows = res.len() / n_tokens;
            let w = &self.data[first * self.row_bytes..(first + n_rows) * self.row_bytes];
            k.dot_tile(self.ty, w, acts, self.cols, res, n_rows);
        });
        let by_row_block = &scratch.by_row_block;
        out.par_chunks_mut(self.rows).enumerate().for_each(|(t, out)| {
            for (b, res) in by_row_block.chunks(block * n_tokens).enumerate() {
                let n_rows = res.len() / n_tokens;
                out[b * block..][..n_rows].copy_from_slice(&res[t * n_rows..][..n_rows]);
            }
        });
    }

    /// One row of f32 activations against the weights dequantized to f32,
    /// a row at a time as each task reaches it: the products of the
    /// dequantized matrix (the same single-row dots), without writing it out
    /// and reading it back for every decoded token.
    fn dequantized_matvec(&self, x: &[f32], out: &mut [f32]) {
        let k = kernels();
        let (acts, row_bytes) = (bytemuck::cast_slice(x), self.cols * std::mem::size_of::<f32>());
        let block = self.row_block(1);
        if KEEP_DEQUANTIZED.load(Ordering::Relaxed) {
            let weights = self.kept_dequantized();
            out.par_chunks_mut(block).enumerate().for_each(|(b, out)| {
                let rows = &weights[b * block * self.cols..][..out.len() * self.cols];
                k.dot_rows(WeightType::F32, bytemuck::cast_slice(rows), row_bytes, acts, self.cols, out);
            });
            return;
        }
        out.par_chunks_mut(block).enumerate().for_each(|(b, out)| {
            let mut row = vec![0.0f32; self.cols];
            for (i, out) in out.iter_mut().enumerate() {
                self.dequantize_row(b * block + i, &mut row);
                k.dot_rows(
                    WeightType::F32,
                    bytemuck::cast_slice(&row),
                    row_bytes,
                    acts,
                    self.cols,
                    std::slice::from_mut(out),
                );
            }
        });
    }

    /// This matrix's weights in f32, dequantized on the first call and kept.
    fn kept_dequantized(&self) -> &'static [f32] {
        let key = (self.data.as_ptr() as usize, self.data.len());
        let mut kept = DEQUANTIZED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.iter().find(|k| k.data == key) {
            return k.weights;
        }
        let mut weights = vec![0.0f32; self.rows * self.cols];
        weights.par_chunks_mut(self.cols).enumerate().for_each(|(r, out)| self.dequantize_row(r, out));
        let weights: &'static [f32] = Box::leak(weights.into_boxed_slice());
        kept.push(Kept { data: key, weights });
        weights
    }

    /// Rows per task. Decoding: enough tasks to balance the pool. Tiles (several
    /// tokens): each task packs every token's activations once for all its rows, so
    /// fewer, larger tasks — two per thread, a whole number of tiles, weights within L2.
    fn row_block(&self, n_tokens: usize) -> usize {
        let threads = rayon::current_num_threads();
        let block = if n_tokens == 1 {
            self.rows.div_ceil(threads * 8)
        } else {
            let tile = kernels().tile_rows();
            let by_balance = self.rows.div_ceil(threads * 2);
            let by_cache = 256 * 1024 / self.row_bytes.max(1);
            (by_balance.min(by_cache) / tile).max(1) * tile
        };
        block.clamp(1, self.rows.max(1))
    }
}

/// ggml dots F16 and BF16 weights with activations converted to the weight's
/// own type; rounding the f32 activations the same way reproduces its results.
fn round_to_weight_precision(ty: WeightType, act: &mut [u8]) {
    let round: fn(f32) -> f32 = match ty {
        WeightType::F16 => |v| half::f16::from_f32(v).to_f32(),
        WeightType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        _ => return,
    };
    bytemuck::cast_slice_mut::<u8, f32>(act).iter_mut().for_each(|v| *v = round(*v));
}
