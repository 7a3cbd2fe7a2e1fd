//! What the GGUF calls things: architecture names, metadata keys and tensor
//! names, in one table so that the rest of the model code speaks of meanings.

/// The model families sift runs. Llama-family files (Llama 2/3, Mistral,
/// SmolLM, TinyLlama) all say `llama`; Qwen2 adds QKV biases and NEOX RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }

    pub const SUPPORTED: &'static str = "llama, qwen2, gemma3";
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
    pub const ROPE_SCALING_ORIG_CTX: &str = "rope.scaling.original_context_length";
    pub const ROPE_SCALING_LOW_FREQ_FACTOR: &str = "rope.scaling.low_freq_factor";
    pub const ROPE_SCALING_HIGH_FREQ_FACTOR: &str = "rope.scaling.high_freq_factor";
    pub const FINAL_LOGIT_SOFTCAPPING: &str = "final_logit_softcapping";
}

/// Tensor names.
pub mod tensor {
    pub const TOKEN_EMBD: &str = "token_embd.weight";
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    pub const OUTPUT: &str = "output.weight";
    pub const ROPE_FREQS: &str = "rope_freqs.weight";

    /// `blk.{layer}.{name}`
    pub fn layer(il: usize, name: &str) -> String {
        format!("blk.{il}.{name}")
    }

    pub const ATTN_NORM: &str = "attn_norm.weight";
    pub const ATTN_Q: &str = "attn_q.weight";
    pub const ATTN_K: &str = "attn_k.weight";
    pub const ATTN_V: &str = "attn_v.weight";
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
