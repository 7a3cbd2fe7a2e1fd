//! The transformer, top-down.
//!
//! [`Model::forward`] runs a batch of tokens through every layer:
//! embed [× sqrt(n_embd)] → per layer (norm → Q/K/V [+ biases] → [per-head
//! QK-norm] → RoPE on the first `n_rot` values of each head → store K/V in
//! the cache → attention [soft-capped scores; a sliding window] → output
//! projection → [post-norm] → residual → norm → gated MLP (SiLU or GELU) →
//! [post-norm] → residual) → final norm. [`Model::logits`] applies the output
//! head to the rows the caller wants [and soft-caps the logits]. Every
//! family (Llama, Qwen2/3, Gemma 2/3, Phi-3) is this one pass: they differ
//! in the bracketed steps, the tensors' layout and a few constants, which
//! the architecture table ([`arch::FAMILIES`]) and [`HParams`] hold.

pub mod arch;
pub mod blocks;
pub mod hparams;
pub mod weights;

use simd::WeightType;

use crate::attn::{AttentionBatch, AttentionPolicy, HeadRecord, LayerCall, Scorer};
use crate::gguf::{GgufError, GgufFile};
use crate::kv::{CacheShape, KvCache};
use crate::matmul::MatmulScratch;
pub use arch::Arch;
use blocks::RopeTable;
pub use hparams::HParams;
pub use weights::Weights;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: architecture '{arch}' is not supported (sift runs: {supported})")]
    UnknownArch { path: String, arch: String, supported: &'static str },
    #[error("{0}")]
    Shape(String),
    #[error("{0}")]
    Unsupported(String),
}

/// Which rows of a batch the caller wants hidden states (and logits) for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outputs {
    /// Only the last token: generation.
    Last,
    /// Every token: perplexity.
    All,
    /// None: the pass only fills the cache (a rectification rewrites what its
    /// tokens left there), so the last layer stops once it has stored its
    /// keys and values.
    CacheOnly,
}

pub struct Model<'a> {
    pub hp: HParams,
    w: Weights<'a>,
}

/// The attention of a forward call: the policy, the session's decoding
/// steps so far, and where the policy's records go.
pub struct Attention<'a> {
    pub policy: &'a mut dyn AttentionPolicy,
    pub step: u64,
    pub records: &'a mut Vec<HeadRecord>,
}

/// Receives each stage's output during a forward pass: the stage's name (as
/// llama.cpp names its intermediates, e.g. `attn_norm`, `q_rope`, `ffn_out`,
/// `l_out`), the layer, and the stage's rows for the whole batch. Backends
/// report the same stages under the same names, so two runs can be compared
/// layer by layer and a divergence found at its stage.
pub type Trace<'t> = &'t mut dyn FnMut(&str, usize, &[f32]);

/// Work buffers for a forward pass, grown once to the largest batch seen.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    rope_global: RopeTable,
    rope_sliding: RopeTable,
    matmul: MatmulScratch,
    /// Final-normed hidden states of the requested rows.
    pub hidden: Vec<f32>,
}

impl<'a> Model<'a> {
    pub fn load(file: &'a GgufFile) -> Result<Self, ModelError> {
        let arch_name = file.str(arch::key::ARCHITECTURE)?.ok_or_else(|| file.missing(arch::key::ARCHITECTURE))?;
        let arch = Arch::from_gguf_name(arch_name).ok_or_else(|| ModelError::UnknownArch {
            path: file.path().display().to_string(),
            arch: arch_name.to_string(),
            supported: Arch::SUPPORTED,
        })?;
        let n_vocab = file.tensor(arch::tensor::TOKEN_EMBD)?.info.dims.get(1).copied().unwrap_or(0);
        let mut hp = HParams::from_gguf(file, arch, n_vocab)?;
        check_hparams(file, &hp)?;
        if arch.family().long_rope {
            let [short, long] = weights::long_rope_factors(file, hp.rope.n_rot)?;
            hp.rope.freq_factors = short.or(hp.rope.freq_factors);
            hp.rope.long_factors = long;
        }
        if let Some(factors) = weights::rope_freq_factors(file, hp.rope.n_rot)? {
            hp.rope.freq_factors = Some(factors);
        }
        let w = Weights::load(file, &hp)?;
        Ok(Self { hp, w })
    }

    pub fn cache_shape(&self) -> CacheShape {
        CacheShape {
            n_kv_head: self.hp.n_head_kv,
            head_dim_k: self.hp.head_dim_k,
            head_dim_v: self.hp.head_dim_v,
            windows: (0..self.hp.n_layer).map(|il| self.hp.window(il)).collect(),
        }
    }

    /// Bytes of weights a decoded token streams through (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let m = |m: &crate::matmul::Matrix| m.rows * m.ty.row_bytes(m.cols).unwrap_or(0);
        let layers: usize = self
            .w
            .layers
            .iter()
            .map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].map(m).iter().sum::<usize>())
            .sum();
        layers + m(&self.w.output)
    }

    /// The tensors, for a backend that runs the layers itself.
    pub fn weights(&self) -> &Weights<'a> {
        &self.w
    }

    pub fn output_type(&self) -> WeightType {
        self.w.output.ty
    }

    /// Whether the output head is the token embedding (a tied file).
    pub fn output_is_token_embd(&self) -> bool {
        self.w.output_is_token_embd
    }

    /// Runs `tokens` at positions `pos0..`, storing their keys and values in
    /// `cache`, and leaves the final-normed hidden states of the `outputs`
    /// rows in `s.hidden`. Every layer's attention is `attention`'s, which
    /// appends what it did to `records`. The caller keeps positions inside
    /// the cache and batches no larger than the cache was built for. With a
    /// `trace`, every stage's output is handed to it.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        s: &mut Scratch,
        outputs: Outputs,
        attention: &mut Attention,
        mut trace: Option<Trace>,
    ) {
        let mut stage = |name: &str, layer: usize, rows: &[f32]| {
            if let Some(trace) = trace.as_mut() {
                trace(name, layer, rows);
            }
        };
        let hp = &self.hp;
        let n = tokens.len();
        let (q_dim, kv_dim_k, kv_dim_v) =
            (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k, hp.n_head_kv * hp.head_dim_v);
        let grow = |v: &mut Vec<f32>, len: usize| v.resize(len, 0.0);
        grow(&mut s.x, n * hp.n_embd);
        grow(&mut s.normed, n * hp.n_embd);
        grow(&mut s.q, n * q_dim);
        grow(&mut s.k, n * kv_dim_k);
        grow(&mut s.v, n * kv_dim_v);
        grow(&mut s.attn, n * hp.n_head * hp.head_dim_v);
        grow(&mut s.proj, n * hp.n_embd);
        grow(&mut s.gate, n * hp.n_ff);
        grow(&mut s.up, n * hp.n_ff);
        let rope = hp.rope.at_context(cache.n_ctx());
        s.rope_global.fill(&rope, rope.base, rope.freq_scale, pos0..pos0 + n);
        s.rope_sliding.fill(&rope, rope.base_sliding, 1.0, pos0..pos0 + n);

        for (row, &token) in s.x.chunks_exact_mut(hp.n_embd).zip(tokens) {
            self.w.token_embd.dequantize_row(token as usize, row);
            if let Some(scale) = hp.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }

        for (il, l) in self.w.layers.iter().enumerate() {
            // Attention block.
            blocks::rms_norm(&s.x, &l.attn_norm, hp.rms_eps, &mut s.normed);
            stage("attn_norm", il, &s.normed);
            l.wq.matmul(&s.normed, &mut s.q, &mut s.matmul);
            l.wk.matmul(&s.normed, &mut s.k, &mut s.matmul);
            l.wv.matmul(&s.normed, &mut s.v, &mut s.matmul);
            for (dst, bias) in [(&mut s.q, &l.bq), (&mut s.k, &l.bk), (&mut s.v, &l.bv)] {
                if let Some(bias) = bias {
                    blocks::add_bias(dst, bias);
                }
            }
            stage("q", il, &s.q);
            stage("k", il, &s.k);
            stage("v", il, &s.v);
            if let Some(w) = &l.q_norm {
                blocks::rms_norm_in_place(&mut s.q, w, hp.rms_eps);
                stage("q_norm", il, &s.q);
            }
            if let Some(w) = &l.k_norm {
                blocks::rms_norm_in_place(&mut s.k, w, hp.rms_eps);
                stage("k_norm", il, &s.k);
            }
            let rope = if hp.is_sliding(il) { &s.rope_sliding } else { &s.rope_global };
            for t in 0..n {
                rope.apply(&mut s.q[t * q_dim..(t + 1) * q_dim], hp.head_dim_k, t, hp.rope.style);
                rope.apply(&mut s.k[t * kv_dim_k..(t + 1) * kv_dim_k], hp.head_dim_k, t, hp.rope.style);
            }
            stage("q_rope", il, &s.q);
            stage("k_rope", il, &s.k);
            let layer_cache = cache.layer_mut(il);
            for t in 0..n {
                layer_cache.store(
                    pos0 + t,
                    &s.k[t * kv_dim_k..(t + 1) * kv_dim_k],
                    &s.v[t * kv_dim_v..(t + 1) * kv_dim_v],
                );
            }
            if outputs == Outputs::CacheOnly && il + 1 == hp.n_layer {
                break;
            }
            let batch = AttentionBatch {
                queries: &s.q,
                keys: &s.k,
                values: &s.v,
                pos0,
                n_head: hp.n_head,
                head_dim_k: hp.head_dim_k,
                head_dim_v: hp.head_dim_v,
                n_gqa: hp.n_gqa(),
                scorer: Scorer { scale: hp.attn_scale, softcap: hp.attn_softcap },
            };
            let call = LayerCall { layer: il, step: attention.step, batch: &batch, cache: cache.layer(il) };
            attention.policy.attend(&call, &mut s.attn, attention.records);
            stage("attn_out", il, &s.attn);
            l.wo.matmul(&s.attn, &mut s.proj, &mut s.matmul);
            stage("attn_proj", il, &s.proj);
            if let Some(w) = &l.post_attn_norm {
                blocks::rms_norm_in_place(&mut s.proj, w, hp.rms_eps);
                stage("attn_post_norm", il, &s.proj);
            }
            blocks::add_assign(&mut s.x, &s.proj);
            stage("ffn_inp", il, &s.x);

            // Feed-forward block.
            blocks::rms_norm(&s.x, &l.ffn_norm, hp.rms_eps, &mut s.normed);
            stage("ffn_norm", il, &s.normed);
            l.w_gate.matmul(&s.normed, &mut s.gate, &mut s.matmul);
            l.w_up.matmul(&s.normed, &mut s.up, &mut s.matmul);
            blocks::gated_activation(&mut s.gate, &s.up, hp.ffn_activation, hp.n_ff);
            stage("ffn_act", il, &s.gate);
            l.w_down.matmul(&s.gate, &mut s.proj, &mut s.matmul);
            stage("ffn_out", il, &s.proj);
            if let Some(w) = &l.post_ffn_norm {
                blocks::rms_norm_in_place(&mut s.proj, w, hp.rms_eps);
                stage("ffn_post_norm", il, &s.proj);
            }
            blocks::add_assign(&mut s.x, &s.proj);
            stage("l_out", il, &s.x);
        }

        let rows = match outputs {
            Outputs::Last => &s.x[(n - 1) * hp.n_embd..],
            Outputs::All => &s.x[..],
            Outputs::CacheOnly => &[],
        };
        s.hidden.resize(rows.len(), 0.0);
        blocks::rms_norm(rows, &self.w.output_norm, hp.rms_eps, &mut s.hidden);
    }

    /// Logits for `hidden` rows (from [`Self::forward`]): `out` gets
    /// `rows * n_vocab` values.
    pub fn logits(&self, hidden: &[f32], out: &mut [f32], s: &mut MatmulScratch) {
        self.w.output.matmul(hidden, out, s);
        if let Some(cap) = self.hp.final_logit_softcap {
            blocks::softcap(out, cap);
        }
    }
}

/// Rejects hyper-parameters that would make the shapes meaningless before
/// any tensor is looked at, so that a hostile file cannot ask for absurd work.
fn check_hparams(file: &GgufFile, hp: &HParams) -> Result<(), ModelError> {
    let bad = |what: String| ModelError::Shape(format!("{}: {what}", file.path().display()));
    if hp.n_embd == 0 || hp.n_layer == 0 || hp.n_head == 0 || hp.n_head_kv == 0 || hp.n_ff == 0 || hp.n_vocab == 0 {
        return Err(bad("a model dimension is zero".into()));
    }
    if !hp.n_head.is_multiple_of(hp.n_head_kv) {
        return Err(bad(format!("{} query heads do not share {} KV heads evenly", hp.n_head, hp.n_head_kv)));
    }
    if hp.rope.n_rot > hp.head_dim_k || !hp.rope.n_rot.is_multiple_of(2) {
        return Err(bad(format!("RoPE dimension {} does not fit head size {}", hp.rope.n_rot, hp.head_dim_k)));
    }
    if hp.n_layer > 4096 || hp.head_dim_k > 4096 || hp.head_dim_v > 4096 {
        return Err(bad("layer count or head size is beyond any real model".into()));
    }
    Ok(())
}
