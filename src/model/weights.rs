//! The model's tensors, looked up by name and checked against the shapes the
//! hyper-parameters promise. Matrices stay in the file's memory map; the small
//! vectors (norms, biases) are widened to f32 once. A fused tensor (Phi-3's
//! `attn_qkv`, its gate-and-up `ffn_up`) is split into views of its rows:
//! a matrix's rows lie end to end, so each part is a slice of the mapped
//! bytes and nothing is copied.

use simd::{kernels, WeightType};

use super::arch::tensor as name;
use super::hparams::HParams;
use super::ModelError;
use crate::gguf::GgufFile;
use crate::matmul::Matrix;

pub struct LayerWeights<'a> {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix<'a>,
    pub wk: Matrix<'a>,
    pub wv: Matrix<'a>,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Matrix<'a>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix<'a>,
    pub w_up: Matrix<'a>,
    pub w_down: Matrix<'a>,
    pub post_ffn_norm: Option<Vec<f32>>,
}

pub struct Weights<'a> {
    pub token_embd: Matrix<'a>,
    pub output_norm: Vec<f32>,
    /// The output head; the token embedding itself when the file ties them.
    pub output: Matrix<'a>,
    pub output_is_token_embd: bool,
    pub layers: Vec<LayerWeights<'a>>,
}

impl<'a> Weights<'a> {
    pub fn load(file: &'a GgufFile, hp: &HParams) -> Result<Self, ModelError> {
        let l = Loader { file };
        let family = hp.arch.family();
        let q_dim = hp.n_head * hp.head_dim_k;
        let k_dim = hp.n_head_kv * hp.head_dim_k;
        let v_dim = hp.n_head_kv * hp.head_dim_v;
        let o_dim = hp.n_head * hp.head_dim_v;
        let layers = (0..hp.n_layer)
            .map(|il| {
                let t = |n: &str| name::layer(il, n);
                let [wq, wk, wv] = match family.fused_qkv {
                    true => l.split(&t(name::ATTN_QKV), [q_dim, k_dim, v_dim], hp.n_embd)?,
                    false => [
                        l.matrix(&t(name::ATTN_Q), q_dim, hp.n_embd)?,
                        l.matrix(&t(name::ATTN_K), k_dim, hp.n_embd)?,
                        l.matrix(&t(name::ATTN_V), v_dim, hp.n_embd)?,
                    ],
                };
                let [w_gate, w_up] = match family.fused_gate_up {
                    true => l.split(&t(name::FFN_UP), [hp.n_ff, hp.n_ff], hp.n_embd)?,
                    false => [
                        l.matrix(&t(name::FFN_GATE), hp.n_ff, hp.n_embd)?,
                        l.matrix(&t(name::FFN_UP), hp.n_ff, hp.n_embd)?,
                    ],
                };
                Ok(LayerWeights {
                    attn_norm: l.vector(&t(name::ATTN_NORM), hp.n_embd)?,
                    wq,
                    wk,
                    wv,
                    bq: l.optional_vector(&t(name::ATTN_Q_BIAS), q_dim)?,
                    bk: l.optional_vector(&t(name::ATTN_K_BIAS), k_dim)?,
                    bv: l.optional_vector(&t(name::ATTN_V_BIAS), v_dim)?,
                    q_norm: l.optional_vector(&t(name::ATTN_Q_NORM), hp.head_dim_k)?,
                    k_norm: l.optional_vector(&t(name::ATTN_K_NORM), hp.head_dim_k)?,
                    wo: l.matrix(&t(name::ATTN_OUTPUT), hp.n_embd, o_dim)?,
                    post_attn_norm: l.optional_vector(&t(name::POST_ATTN_NORM), hp.n_embd)?,
                    ffn_norm: l.vector(&t(name::FFN_NORM), hp.n_embd)?,
                    w_gate,
                    w_up,
                    w_down: l.matrix(&t(name::FFN_DOWN), hp.n_embd, hp.n_ff)?,
                    post_ffn_norm: l.optional_vector(&t(name::POST_FFN_NORM), hp.n_embd)?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        let token_embd = l.matrix(name::TOKEN_EMBD, hp.n_vocab, hp.n_embd)?;
        let output_is_token_embd = !file.has_tensor(name::OUTPUT);
        let output = match output_is_token_embd {
            false => l.matrix(name::OUTPUT, hp.n_vocab, hp.n_embd)?,
            true => token_embd,
        };
        let output_norm = l.vector(name::OUTPUT_NORM, hp.n_embd)?;
        Ok(Self { token_embd, output_norm, output, output_is_token_embd, layers })
    }
}

/// Reads `rope_freqs.weight` (Llama 3 scaling as converters store it).
pub fn rope_freq_factors(file: &GgufFile, n_rot: usize) -> Result<Option<Vec<f32>>, ModelError> {
    Loader { file }.optional_vector(name::ROPE_FREQS, n_rot / 2)
}

/// Reads LongRoPE's `(short, long)` factors, each where the file has it.
pub fn long_rope_factors(file: &GgufFile, n_rot: usize) -> Result<[Option<Vec<f32>>; 2], ModelError> {
    let l = Loader { file };
    Ok([
        l.optional_vector(name::ROPE_FACTORS_SHORT, n_rot / 2)?,
        l.optional_vector(name::ROPE_FACTORS_LONG, n_rot / 2)?,
    ])
}

struct Loader<'a> {
    file: &'a GgufFile,
}

impl<'a> Loader<'a> {
    fn matrix(&self, tensor: &str, rows: usize, cols: usize) -> Result<Matrix<'a>, ModelError> {
        let view = self.file.tensor(tensor)?;
        let dims = &view.info.dims;
        if dims.len() != 2 || dims[0] != cols || dims[1] != rows {
            return Err(self.shape_error(tensor, dims, &[cols, rows]));
        }
        Matrix::new(view.info.ty, rows, cols, view.data).ok_or_else(|| self.shape_error(tensor, dims, &[cols, rows]))
    }

    /// The `N` consecutive row blocks of a fused matrix of `parts` rows each,
    /// as views into it.
    fn split<const N: usize>(
        &self,
        tensor: &str,
        parts: [usize; N],
        cols: usize,
    ) -> Result<[Matrix<'a>; N], ModelError> {
        let ty = self.matrix(tensor, parts.iter().sum(), cols)?.ty;
        let data = self.file.tensor(tensor)?.data;
        let row_bytes = ty.row_bytes(cols).expect("a matrix's rows have a size");
        let mut first = 0;
        Ok(parts.map(|rows| {
            let block = &data[first * row_bytes..(first + rows) * row_bytes];
            first += rows;
            Matrix::new(ty, rows, cols, block).expect("a block of whole rows is a matrix")
        }))
    }

    fn vector(&self, tensor: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let view = self.file.tensor(tensor)?;
        let dims = &view.info.dims;
        if dims.iter().product::<usize>() != len || dims[0] != len {
            return Err(self.shape_error(tensor, dims, &[len]));
        }
        if !matches!(view.info.ty, WeightType::F32 | WeightType::F16 | WeightType::BF16) {
            return Err(ModelError::Unsupported(format!(
                "{}: vector '{tensor}' is {}, expected a float type",
                self.file.path().display(),
                view.info.ty.name()
            )));
        }
        let mut out = vec![0.0; len];
        kernels().dequantize_row(view.info.ty, view.data, &mut out);
        Ok(out)
    }

    fn optional_vector(&self, tensor: &str, len: usize) -> Result<Option<Vec<f32>>, ModelError> {
        self.file.has_tensor(tensor).then(|| self.vector(tensor, len)).transpose()
    }

    fn shape_error(&self, tensor: &str, got: &[usize], want: &[usize]) -> ModelError {
        ModelError::Shape(format!(
            "{}: tensor '{tensor}' has shape {got:?}, expected {want:?}",
            self.file.path().display()
        ))
    }
}
