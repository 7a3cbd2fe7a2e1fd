//! Hyper-parameters, read from GGUF metadata once and then plain numbers.
//! Where a file leaves a value out, the family's row of the architecture
//! table ([`super::arch::FAMILIES`]) and llama.cpp's defaults fill it in.

use std::borrow::Cow;

use crate::gguf::{GgufFile, Result};

use super::arch::{key, Arch};

/// How rotary position embedding pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): Llama.
    Interleaved,
    /// Halves (i, i + n_rot/2): GPT-NeoX, Qwen2, Gemma.
    Neox,
}

#[derive(Debug, Clone)]
pub struct Rope {
    pub style: RopeStyle,
    /// Dimensions rotated per head, the first of each head; the rest pass
    /// through (partial rotary: Phi-4-mini rotates 3/4 of every head).
    pub n_rot: usize,
    /// Base of global-attention layers.
    pub base: f32,
    /// Base of sliding-window layers (Gemma 3 uses its own).
    pub base_sliding: f32,
    /// Position multiplier of global layers (linear scaling: 1/factor).
    pub freq_scale: f32,
    /// Per-frequency divisors (Llama 3 scaling, or LongRoPE's short
    /// factors), `n_rot / 2` of them.
    pub freq_factors: Option<Vec<f32>>,
    /// LongRoPE (Phi-3 128K): the divisors that replace the short ones when
    /// the context is longer than `original_context`.
    pub long_factors: Option<Vec<f32>>,
    /// The context the model was first trained at
    /// (`rope.scaling.original_context_length`, else the trained context).
    pub original_context: usize,
    /// What every cos and sin is multiplied by: LongRoPE's attention factor
    /// (`rope.scaling.attn_factor`), 1 otherwise.
    pub attn_factor: f32,
}

impl Rope {
    /// The rotation a cache of `n_ctx` positions uses: LongRoPE's long
    /// factors beyond the original context (llama.cpp chooses by the
    /// context size too), else these.
    pub fn at_context(&self, n_ctx: usize) -> Cow<'_, Rope> {
        match &self.long_factors {
            Some(long) if n_ctx > self.original_context => {
                Cow::Owned(Rope { freq_factors: Some(long.clone()), long_factors: None, ..self.clone() })
            }
            _ => Cow::Borrowed(self),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnActivation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU.
    GeluTanh,
}

#[derive(Debug, Clone)]
pub struct HParams {
    pub arch: Arch,
    pub name: String,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope: Rope,
    /// Window of sliding-window layers, and which layers slide.
    pub sliding_window: Option<usize>,
    pub sliding_layers: Vec<bool>,
    pub attn_scale: f32,
    /// Attention scores become `cap · tanh(s / cap)` before the softmax.
    pub attn_softcap: Option<f32>,
    /// Gemma multiplies token embeddings by sqrt(n_embd).
    pub embed_scale: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    pub ffn_activation: FfnActivation,
}

/// Gemma 2 27B (46 layers) scales queries by `1/sqrt(n_embd / n_head)`
/// rather than by the head size (its `query_pre_attn_scalar`), and files
/// do not say so: llama.cpp knows the model by its layer count, as we do.
const GEMMA2_27B_LAYERS: usize = 46;

impl HParams {
    pub fn from_gguf(file: &GgufFile, arch: Arch, n_vocab: usize) -> Result<Self> {
        let family = arch.family();
        let a = arch.gguf_name();
        let k = |suffix: &str| format!("{a}.{suffix}");
        let req_usize = |suffix: &str| file.required(&k(suffix), GgufFile::usize);

        let n_embd = req_usize(key::EMBEDDING_LENGTH)?;
        let n_layer = req_usize(key::BLOCK_COUNT)?;
        let n_head = req_usize(key::HEAD_COUNT)?;
        let n_head_kv = file.usize(&k(key::HEAD_COUNT_KV))?.unwrap_or(n_head);
        let default_head_dim = n_embd.checked_div(n_head).unwrap_or(0);
        let head_dim_k = file.usize(&k(key::KEY_LENGTH))?.unwrap_or(default_head_dim);
        let head_dim_v = file.usize(&k(key::VALUE_LENGTH))?.unwrap_or(head_dim_k);
        let n_rot = file.usize(&k(key::ROPE_DIMENSION_COUNT))?.unwrap_or(head_dim_k);
        let base = file.f32(&k(key::ROPE_FREQ_BASE))?.unwrap_or(10_000.0);

        let (freq_scale, freq_factors) = rope_scaling(file, &k, n_rot, base)?;
        let (sliding_window, sliding_layers) = match family.sliding_period {
            Some(period) => {
                let window = file.usize(&k(key::SLIDING_WINDOW))?.filter(|&w| w > 0);
                (window, (0..n_layer).map(|il| window.is_some() && !(il + 1).is_multiple_of(period)).collect())
            }
            None => (None, vec![false; n_layer]),
        };
        let base_sliding = file.f32(&k(key::ROPE_FREQ_BASE_SWA))?.or(family.sliding_rope_base).unwrap_or(base);
        // A cap that is not positive caps nothing.
        let cap = |suffix: &str, default: f32| -> Result<Option<f32>> {
            Ok(Some(file.f32(&k(suffix))?.unwrap_or(default)).filter(|&c| c > 0.0))
        };
        let (attn_softcap, final_logit_softcap) = match family.softcaps {
            Some(caps) => {
                (cap(key::ATTN_LOGIT_SOFTCAPPING, caps.attention)?, cap(key::FINAL_LOGIT_SOFTCAPPING, caps.output)?)
            }
            None => (None, None),
        };
        let query_scale_dim = match arch {
            Arch::Gemma2 if n_layer == GEMMA2_27B_LAYERS => default_head_dim,
            _ => head_dim_k,
        };
        let n_ctx_train = req_usize(key::CONTEXT_LENGTH)?;
        let original_context = match family.long_rope {
            true => file.usize(&k(key::ROPE_SCALING_ORIG_CTX))?.unwrap_or(n_ctx_train),
            false => n_ctx_train,
        };

        Ok(Self {
            arch,
            name: file.str(key::NAME)?.unwrap_or("").to_string(),
            n_vocab: file.usize(&k(key::VOCAB_SIZE))?.unwrap_or(n_vocab),
            n_ctx_train,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff: req_usize(key::FEED_FORWARD_LENGTH)?,
            rms_eps: file.required(&k(key::RMS_EPS), GgufFile::f32)?,
            rope: Rope {
                style: family.rope_style,
                n_rot,
                base,
                base_sliding,
                freq_scale,
                freq_factors,
                long_factors: None,
                original_context,
                attn_factor: file.f32(&k(key::ROPE_SCALING_ATTN_FACTOR))?.unwrap_or(1.0),
            },
            sliding_window,
            sliding_layers,
            attn_scale: 1.0 / (query_scale_dim as f32).sqrt(),
            attn_softcap,
            embed_scale: family.embed_scale.then(|| (n_embd as f32).sqrt()),
            final_logit_softcap,
            ffn_activation: family.ffn_activation,
        })
    }

    pub fn is_sliding(&self, il: usize) -> bool {
        self.sliding_layers[il]
    }

    /// The window a layer attends within (None: the whole context).
    pub fn window(&self, il: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.is_sliding(il))
    }

    /// Query heads per key/value head.
    pub fn n_gqa(&self) -> usize {
        self.n_head / self.n_head_kv
    }
}

/// `rope.scaling.*`: linear scaling gives a position multiplier; Llama 3
/// scaling gives per-frequency divisors (converters usually store those as
/// the `rope_freqs.weight` tensor instead, which the weights loader reads).
fn rope_scaling(
    file: &GgufFile,
    k: &dyn Fn(&str) -> String,
    n_rot: usize,
    base: f32,
) -> Result<(f32, Option<Vec<f32>>)> {
    let factor = file.f32(&k(key::ROPE_SCALING_FACTOR))?.filter(|&f| f > 0.0);
    match (file.str(&k(key::ROPE_SCALING_TYPE))?, factor) {
        (Some("linear") | None, Some(f)) => Ok((1.0 / f, None)),
        (Some("llama3"), Some(factor)) => {
            let low = file.f32(&k(key::ROPE_SCALING_LOW_FREQ_FACTOR))?.unwrap_or(1.0);
            let high = file.f32(&k(key::ROPE_SCALING_HIGH_FREQ_FACTOR))?.unwrap_or(4.0);
            let orig = file.f32(&k(key::ROPE_SCALING_ORIG_CTX))?.unwrap_or(8192.0);
            Ok((1.0, Some(llama3_freq_factors(n_rot, base, factor, low, high, orig))))
        }
        _ => Ok((1.0, None)),
    }
}

/// Llama 3.1's frequency-dependent scaling: long wavelengths are divided by
/// `factor`, short ones kept, and the band between interpolated smoothly.
pub fn llama3_freq_factors(n_rot: usize, base: f32, factor: f32, low: f32, high: f32, orig_ctx: f32) -> Vec<f32> {
    let low_wavelen = orig_ctx / low;
    let high_wavelen = orig_ctx / high;
    (0..n_rot / 2)
        .map(|i| {
            let freq = base.powf(-((2 * i) as f32) / n_rot as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}
