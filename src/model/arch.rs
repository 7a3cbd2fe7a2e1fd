//! What the GGUF calls things, and what sets each model family apart: the
//! architecture table, metadata keys and tensor names, in one place so that
//! the rest of the model code speaks of meanings.
//!
//! Every family runs through the one forward pass of [`super::Model`]; a
//! family is a row of [`FAMILIES`] (how RoPE pairs dimensions, which
//! activation gates the MLP, which layers slide, how tensors are laid out,
//! which scores are soft-capped) plus the optional tensors its files carry
//! (biases, QK-norms, post-norms), which the weights loader finds by name.

use super::hparams::{FfnActivation, RopeStyle};

/// The model families sift runs. Llama-family files (Llama 2/3, Mistral,
/// SmolLM, TinyLlama) all say `llama`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
}

/// How a family's tensors are laid out and which steps its layers take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Family {
    pub arch: Arch,
    /// `general.architecture`, and the prefix of the family's metadata keys.
    pub gguf_name: &'static str,
    pub rope_style: RopeStyle,
    pub ffn_activation: FfnActivation,
    /// Token embeddings are multiplied by `sqrt(n_embd)` (Gemma).
    pub embed_scale: bool,
    /// When the file gives a sliding window: every `period`-th layer is
    /// global and the others slide (llama.cpp's default pattern for the
    /// family; its files carry no pattern). `None`: no layer slides, whatever
    /// the file says (llama.cpp ignores Phi-3's window).
    pub sliding_period: Option<usize>,
    /// RoPE base of sliding layers when the file gives none (`None`: the
    /// global base).
    pub sliding_rope_base: Option<f32>,
    /// `cap · tanh(x / cap)` on attention scores and on the final logits,
    /// with these caps where the file gives none (Gemma 2).
    pub softcaps: Option<Softcaps>,
    /// Q, K and V in one `attn_qkv` tensor, rows in that order (Phi-3).
    pub fused_qkv: bool,
    /// Gate and up projections in one `ffn_up` tensor, gate rows first (Phi-3).
    pub fused_gate_up: bool,
    /// The file may carry LongRoPE's `rope_factors_short` / `rope_factors_long`.
    pub long_rope: bool,
}

/// Soft-capping caps: `attention` on scores before the softmax, `output` on
/// the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Softcaps {
    pub attention: f32,
    pub output: f32,
}

const LLAMA: Family = Family {
    arch: Arch::Llama,
    gguf_name: "llama",
    rope_style: RopeStyle::Interleaved,
    ffn_activation: FfnActivation::Silu,
    embed_scale: false,
    sliding_period: None,
    sliding_rope_base: None,
    softcaps: None,
    fused_qkv: false,
    fused_gate_up: false,
    long_rope: false,
};

/// The architecture table. Qwen2 is Llama with NEOX RoPE (its QKV biases
/// are optional tensors); Qwen3 drops the biases and adds per-head QK-norms
/// (tensors again) and a head size of its own (`attention.key_length`).
pub const FAMILIES: [Family; 6] = [
    LLAMA,
    Family { arch: Arch::Qwen2, gguf_name: "qwen2", rope_style: RopeStyle::Neox, ..LLAMA },
    Family { arch: Arch::Qwen3, gguf_name: "qwen3", rope_style: RopeStyle::Neox, ..LLAMA },
    Family {
        arch: Arch::Gemma2,
        gguf_name: "gemma2",
        rope_style: RopeStyle::Neox,
        ffn_activation: FfnActivation::GeluTanh,
        embed_scale: true,
        sliding_period: Some(2),
        softcaps: Some(Softcaps { attention: 50.0, output: 30.0 }),
        ..LLAMA
    },
    Family {
        arch: Arch::Gemma3,
        gguf_name: "gemma3",
        rope_style: RopeStyle::Neox,
        ffn_activation: FfnActivation::GeluTanh,
        embed_scale: true,
        sliding_period: Some(6),
        sliding_rope_base: Some(10_000.0),
        ..LLAMA
    },
    Family {
        arch: Arch::Phi3,
        gguf_name: "phi3",
        rope_style: RopeStyle::Neox,
        fused_qkv: true,
        fused_gate_up: true,
        long_rope: true,
        ..LLAMA
    },
];

impl Arch {
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        FAMILIES.iter().find(|f| f.gguf_name == name).map(|f| f.arch)
    }

    pub fn family(self) -> &'static Family {
        FAMILIES.iter().find(|f| f.arch == self).expect("every architecture has a row in the table")
    }

    pub fn gguf_name(self) -> &'static str {
        self.family().gguf_name
    }

    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, gemma2, gemma3, phi3";
}

/// Metadata keys. Those under [`Arch`]'s prefix are written `"{arch}.{KEY}"`.
pub mod key {
    pub const ARCHITECTURE: &str = "general.architecture";
    pub const NAME: &str = "general.name";

    pub const CONTEXT_LENGTH: &str = "context_length";
    pub const EMBEDDING_LENGTH: &str = "embedding_length";
    pub const BLOCK_COUNT: &str = "block_count";
    pub const FEED_FORWARD_LENGTH: &str = "feed_forward_length";
    pub const VOCAB_SIZE: &str = "vocab_size";
    pub const HEAD_COUNT: &str = "attention.head_count";
    pub const HEAD_COUNT_KV: &str = "attention.head_count_kv";
    pub const KEY_LENGTH: &str = "attention.key_length";
    pub const VALUE_LENGTH: &str = "attention.value_length";
    pub const RMS_EPS: &str = "attention.layer_norm_rms_epsilon";
    pub const SLIDING_WINDOW: &str = "attention.sliding_window";
    pub const ROPE_DIMENSION_COUNT: &str = "rope.dimension_count";
    pub const ROPE_FREQ_BASE: &str = "rope.freq_base";
    pub const ROPE_FREQ_BASE_SWA: &str = "rope.freq_base_swa";
    pub const ROPE_SCALING_TYPE: &str = "rope.scaling.type";
    pub const ROPE_SCALING_FACTOR: &str = "rope.scaling.factor";
    pub const ROPE_SCALING_ATTN_FACTOR: &str = "rope.scaling.attn_factor";
    pub const ROPE_SCALING_ORIG_CTX: &str = "rope.scaling.original_context_length";
    pub const ROPE_SCALING_LOW_FREQ_FACTOR: &str = "rope.scaling.low_freq_factor";
    pub const ROPE_SCALING_HIGH_FREQ_FACTOR: &str = "rope.scaling.high_freq_factor";
    pub const ATTN_LOGIT_SOFTCAPPING: &str = "attn_logit_softcapping";
    pub const FINAL_LOGIT_SOFTCAPPING: &str = "final_logit_softcapping";
}

/// Tensor names.
pub mod tensor {
    pub const TOKEN_EMBD: &str = "token_embd.weight";
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    pub const OUTPUT: &str = "output.weight";
    pub const ROPE_FREQS: &str = "rope_freqs.weight";
    pub const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";
    pub const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";

    /// `blk.{layer}.{name}`
    pub fn layer(il: usize, name: &str) -> String {
        format!("blk.{il}.{name}")
    }

    pub const ATTN_NORM: &str = "attn_norm.weight";
    pub const ATTN_Q: &str = "attn_q.weight";
    pub const ATTN_K: &str = "attn_k.weight";
    pub const ATTN_V: &str = "attn_v.weight";
    pub const ATTN_QKV: &str = "attn_qkv.weight";
    pub const ATTN_Q_BIAS: &str = "attn_q.bias";
    pub const ATTN_K_BIAS: &str = "attn_k.bias";
    pub const ATTN_V_BIAS: &str = "attn_v.bias";
    pub const ATTN_Q_NORM: &str = "attn_q_norm.weight";
    pub const ATTN_K_NORM: &str = "attn_k_norm.weight";
    pub const ATTN_OUTPUT: &str = "attn_output.weight";
    pub const POST_ATTN_NORM: &str = "post_attention_norm.weight";
    pub const FFN_NORM: &str = "ffn_norm.weight";
    pub const FFN_GATE: &str = "ffn_gate.weight";
    pub const FFN_UP: &str = "ffn_up.weight";
    pub const FFN_DOWN: &str = "ffn_down.weight";
    pub const POST_FFN_NORM: &str = "post_ffw_norm.weight";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_found_by_its_name_and_listed_as_supported() {
        let names: Vec<&str> = FAMILIES.iter().map(|f| f.gguf_name).collect();
        assert_eq!(Arch::SUPPORTED, names.join(", "));
        for family in &FAMILIES {
            assert_eq!(Arch::from_gguf_name(family.gguf_name), Some(family.arch));
            assert_eq!(family.arch.family(), family);
        }
        assert_eq!(Arch::from_gguf_name("mamba"), None);
    }
}
