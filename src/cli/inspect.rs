//! `sift inspect`: what a model file holds and what running it costs.

use std::collections::BTreeMap;

use clap::Args;
use sift::kv::{KvCache, KvMode, Storage};
use sift::model::arch::Family;
use sift::model::hparams::{FfnActivation, HParams};
use sift::model::Model;
use sift::tokenizer::Tokenizer;

use super::{context_size, ModelArgs};

#[derive(Args)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Context size to size the KV cache for [default: 4096, or the model's if smaller]
    #[arg(short = 'c', long = "ctx-size")]
    ctx: Option<usize>,
    /// Print JSON instead of text
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let file = args.model.open_for_metadata()?;
    let model = Model::load(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let hp = &model.hp;
    let family = hp.arch.family();
    let n_ctx = context_size(args.ctx, hp.n_ctx_train)?;

    let mut types: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for t in file.tensors() {
        let e = types.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.n_bytes;
    }
    let shape = model.cache_shape();
    // Per mode: the whole cache at -c, and what one more token costs.
    let kv: Vec<(KvMode, usize, f64)> = KvMode::ALL
        .into_iter()
        .map(|mode| {
            let storage = Storage { mode, ..Storage::default() };
            let bytes = KvCache::new(&shape, storage, n_ctx, sift::engine::DEFAULT_BATCH).bytes();
            (mode, bytes, shape.bytes_per_token(mode))
        })
        .collect();
    let steps = Steps::of(&model);
    let weight_bytes: usize = file.tensors().iter().map(|t| t.n_bytes).sum();
    let n_params: usize = file.tensors().iter().map(|t| t.n_elements()).sum();

    if args.json {
        let json = serde_json::json!({
            "file": file.path(),
            "file_bytes": file.file_size(),
            "gguf_version": file.version(),
            "architecture": hp.arch.gguf_name(),
            "name": hp.name,
            "parameters": n_params,
            "hparams": {
                "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd, "n_layer": hp.n_layer,
                "n_head": hp.n_head, "n_head_kv": hp.n_head_kv, "head_dim_k": hp.head_dim_k,
                "head_dim_v": hp.head_dim_v, "n_ff": hp.n_ff, "rms_eps": hp.rms_eps,
                "rope_base": hp.rope.base, "rope_base_sliding": hp.rope.base_sliding, "n_rot": hp.rope.n_rot,
                "sliding_window": hp.sliding_window, "sliding_layers": hp.sliding_layers.iter().filter(|&&s| s).count(),
                "global_layers": steps.global_layers, "rope_style": format!("{:?}", hp.rope.style),
                "rope_attn_factor": hp.rope.attn_factor, "rope_original_context": hp.rope.original_context,
                "rope_freq_factors": hp.rope.freq_factors.is_some(), "rope_long_factors": hp.rope.long_factors.is_some(),
                "attn_scale": hp.attn_scale, "attn_softcap": hp.attn_softcap, "final_logit_softcap": hp.final_logit_softcap,
                "embed_scale": hp.embed_scale, "ffn_activation": format!("{:?}", hp.ffn_activation),
                "qkv_bias": steps.qkv_bias, "qk_norm": steps.qk_norm, "post_norms": steps.post_norms,
                "fused_qkv": family.fused_qkv, "fused_gate_up": family.fused_gate_up, "tied_output": steps.tied_output,
            },
            "tensor_types": types.iter().map(|(ty, (n, el, b))| serde_json::json!({"type": ty, "tensors": n, "elements": el, "bytes": b})).collect::<Vec<_>>(),
            "memory": {
                "weights_bytes": weight_bytes,
                "n_ctx": n_ctx,
                "kv_bytes_per_token": kv[0].2.ceil() as u64,
                "kv_cache": kv.iter().map(|(mode, bytes, per_token)| serde_json::json!({"mode": mode.to_string(), "bytes": bytes, "bytes_per_token": per_token})).collect::<Vec<_>>(),
            },
            "tokenizer": { "vocab": tokenizer.vocab_size(), "bos": tokenizer.bos(), "eos": tokenizer.eos(), "chat_template": tokenizer.chat_template().is_some() },
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!("file          {} ({:.1} MiB, GGUF v{})", file.path().display(), mib(file.file_size()), file.version());
    println!("architecture  {} {}", hp.arch.gguf_name(), hp.name);
    println!("parameters    {:.1} M", n_params as f64 / 1e6);
    let id = |t: Option<u32>| t.map_or("none".to_string(), |t| t.to_string());
    println!(
        "vocabulary    {} tokens (BOS {}, EOS {})",
        tokenizer.vocab_size(),
        id(tokenizer.bos()),
        id(tokenizer.eos())
    );
    println!("layers        {} x (embd {}, ffn {})", hp.n_layer, hp.n_embd, hp.n_ff);
    let cap = |cap: Option<f32>| cap.map_or(String::new(), |c| format!(", soft-capped at {c}"));
    println!(
        "attention     {} heads, {} KV heads, head dim {}/{}, scores scaled by {:.4}{}",
        hp.n_head,
        hp.n_head_kv,
        hp.head_dim_k,
        hp.head_dim_v,
        hp.attn_scale,
        cap(hp.attn_softcap)
    );
    println!(
        "rope          {:?}, {} of {} dims, base {} (sliding layers {}){}",
        hp.rope.style,
        hp.rope.n_rot,
        hp.head_dim_k,
        hp.rope.base,
        hp.rope.base_sliding,
        if hp.rope.freq_factors.is_some() { ", per-frequency factors" } else { "" }
    );
    if hp.rope.long_factors.is_some() {
        println!(
            "longrope      long factors beyond {} positions, attention factor {}",
            hp.rope.original_context, hp.rope.attn_factor
        );
    }
    match hp.sliding_window {
        Some(w) => println!(
            "sliding       window {w} on {} of {} layers (global: {})",
            hp.sliding_layers.iter().filter(|&&s| s).count(),
            hp.n_layer,
            steps.global_layers.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        ),
        None => println!("sliding       none"),
    }
    println!("layers' steps {}", steps.describe(hp, family));
    println!(
        "output        {}{}",
        if steps.tied_output { "tied to token_embd" } else { "output.weight" },
        cap(hp.final_logit_softcap)
    );
    println!("context       {} trained", hp.n_ctx_train);
    println!("chat template {}", if tokenizer.chat_template().is_some() { "yes" } else { "none in file" });
    println!("tensor types");
    for (ty, (n, el, bytes)) in &types {
        println!("  {ty:<6} {n:>4} tensors {:>12} elements {:>9.1} MiB", el, mib(*bytes));
    }
    println!("memory");
    println!("  weights     {:.1} MiB (memory-mapped)", mib(weight_bytes));
    // Plain f16 keys and values, without the f16 mode's sketch.
    let plain =
        shape.windows.iter().filter(|w| w.is_none()).count() * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 2;
    for (mode, bytes, per_token) in &kv {
        println!(
            "  KV cache    {mode:<3} {:>7.1} MiB at -c {n_ctx}, {per_token:>6.0} bytes per token ({:.3}x plain f16 K/V)",
            mib(*bytes),
            per_token / plain as f64
        );
    }
    Ok(())
}

/// What a layer does beyond the common steps, as the file's tensors show.
struct Steps {
    qkv_bias: bool,
    qk_norm: bool,
    post_norms: bool,
    tied_output: bool,
    global_layers: Vec<usize>,
}

impl Steps {
    fn of(model: &Model) -> Self {
        let w = model.weights();
        let any = |has: fn(&sift::model::weights::LayerWeights) -> bool| w.layers.iter().any(has);
        Self {
            qkv_bias: any(|l| l.bq.is_some() || l.bk.is_some() || l.bv.is_some()),
            qk_norm: any(|l| l.q_norm.is_some() || l.k_norm.is_some()),
            post_norms: any(|l| l.post_attn_norm.is_some() || l.post_ffn_norm.is_some()),
            tied_output: model.output_is_token_embd(),
            global_layers: (0..model.hp.n_layer).filter(|&il| !model.hp.is_sliding(il)).collect(),
        }
    }

    /// e.g. `SiLU-gated MLP, QKV biases`.
    fn describe(&self, hp: &HParams, family: &Family) -> String {
        let mlp = match hp.ffn_activation {
            FfnActivation::Silu => "SiLU-gated MLP",
            FfnActivation::GeluTanh => "GELU(tanh)-gated MLP",
        };
        let steps = [
            (hp.embed_scale.is_some(), "embeddings x sqrt(n_embd)"),
            (self.qkv_bias, "QKV biases"),
            (self.qk_norm, "per-head QK-norm"),
            (self.post_norms, "post-norms"),
            (family.fused_qkv, "fused attn_qkv"),
            (family.fused_gate_up, "fused gate+up ffn_up"),
        ];
        let mut parts = vec![mlp];
        parts.extend(steps.iter().filter(|(on, _)| *on).map(|(_, what)| *what));
        parts.join(", ")
    }
}
