//! Hyper-parameters, read from GGUF metadata once and then plain numbers.

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
    /// Dimensions rotated per head (the rest pass through).
    pub n_rot: usize,
    /// Base of global-attention layers.
    pub base: f32,
    /// Base of sliding-window layers (Gemma 3 uses its own).
    pub base_sliding: f32,
    /// Position multiplier of global layers (linear scaling: 1/factor).
    pub freq_scale: f32,
    /// Per-frequency divisors (Llama 3 scaling), `n_rot / 2` of them.
    pub freq_factors: Option<Vec<f32>>,
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
    /// Gemma multiplies token embeddings by sqrt(n_embd).
    pub embed_scale: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    pub ffn_activation: FfnActivation,
}

/// Gemma 3's files do not say which layers slide nor their RoPE base;
/// llama.cpp assumes every 6th layer global and base 10 000, and so do we.
const GEMMA3_GLOBAL_EVERY: usize = 6;
const GEMMA3_SLIDING_ROPE_BASE: f32 = 10_000.0;

impl HParams {
    pub fn from_gguf(file: &GgufFile, arch: Arch, n_vocab: usize) -> Result<Self> {
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
        let sliding_window = file.usize(&k(key::SLIDING_WINDOW))?.filter(|&w| w > 0);
        let sliding_layers = (0..n_layer)
            .map(|il| arch == Arch::Gemma3 && sliding_window.is_some() && (il + 1) % GEMMA3_GLOBAL_EVERY != 0)
            .collect();
        let base_sliding = file.f32(&k(key::ROPE_FREQ_BASE_SWA))?.unwrap_or(match arch {
            Arch::Gemma3 => GEMMA3_SLIDING_ROPE_BASE,
            _ => base,
        });

        Ok(Self {
            arch,
            name: file.str(key::NAME)?.unwrap_or("").to_string(),
            n_vocab: file.usize(&k(key::VOCAB_SIZE))?.unwrap_or(n_vocab),
            n_ctx_train: req_usize(key::CONTEXT_LENGTH)?,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff: req_usize(key::FEED_FORWARD_LENGTH)?,
            rms_eps: file.required(&k(key::RMS_EPS), GgufFile::f32)?,
            rope: Rope {
                style: match arch {
                    Arch::Llama => RopeStyle::Interleaved,
                    Arch::Qwen2 | Arch::Gemma3 => RopeStyle::Neox,
                },
                n_rot,
                base,
                base_sliding,
                freq_scale,
                freq_factors,
            },
            sliding_window,
            sliding_layers,
            attn_scale: 1.0 / (head_dim_k as f32).sqrt(),
            embed_scale: (arch == Arch::Gemma3).then(|| (n_embd as f32).sqrt()),
            final_logit_softcap: file.f32(&k(key::FINAL_LOGIT_SOFTCAPPING))?.filter(|&c| c > 0.0),
            ffn_activation: match arch {
                Arch::Gemma3 => FfnActivation::GeluTanh,
                Arch::Llama | Arch::Qwen2 => FfnActivation::Silu,
            },
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
