//! The Qwen3, Gemma 2 and Phi-3 files of `../shared/anchors/models` beyond
//! their logits (`tests/goldens.rs`): `sift inspect` gives the
//! hyper-parameters that `../shared/anchors/models/README.md` says llama.cpp
//! reads from each file, the chat fallback is the family's, the GPU prefill,
//! which has no soft-capped attention, stays out of Gemma 2's way, the sparse
//! policies read Gemma 2's global layers sparsely, and Phi-3's fused tensors
//! are views of the file.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn sift(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(args)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tiny(name: &str, test: &str) -> Option<PathBuf> {
    Some(common::shared_dir(test)?.join(format!("anchors/models/tiny-{name}.gguf")))
}

/// `sift inspect --json`'s hyper-parameters of a tiny model.
fn hparams(name: &str, test: &str) -> Option<Value> {
    let model = tiny(name, test)?;
    let o = sift(&["inspect", "-m", model.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let json: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(json["architecture"], name);
    Some(json["hparams"].clone())
}

#[test]
fn inspect_shows_qwen3s_head_size_and_qk_norms() {
    let Some(hp) = hparams("qwen3", "inspect_shows_qwen3s_head_size_and_qk_norms") else { return };
    assert_eq!((hp["n_embd"].as_u64(), hp["n_head"].as_u64(), hp["n_head_kv"].as_u64()), (Some(128), Some(4), Some(2)));
    assert_eq!(
        (hp["head_dim_k"].as_u64(), hp["head_dim_v"].as_u64(), hp["n_rot"].as_u64()),
        (Some(64), Some(64), Some(64))
    );
    assert_eq!(hp["attn_scale"].as_f64().unwrap() as f32, 0.125);
    assert_eq!((hp["qk_norm"].as_bool(), hp["qkv_bias"].as_bool()), (Some(true), Some(false)));
    assert_eq!((hp["rope_style"].as_str(), hp["rope_base"].as_f64()), (Some("Neox"), Some(1e6)));
    assert_eq!((hp["attn_softcap"].is_null(), hp["tied_output"].as_bool()), (true, Some(true)));
}

#[test]
fn inspect_shows_gemma2s_caps_and_alternating_windows() {
    let Some(hp) = hparams("gemma2", "inspect_shows_gemma2s_caps_and_alternating_windows") else { return };
    assert_eq!((hp["head_dim_k"].as_u64(), hp["n_rot"].as_u64()), (Some(48), Some(48)));
    assert_eq!((hp["attn_softcap"].as_f64(), hp["final_logit_softcap"].as_f64()), (Some(50.0), Some(30.0)));
    assert_eq!(hp["sliding_window"].as_u64(), Some(32));
    assert_eq!(hp["global_layers"], serde_json::json!([1, 3]), "even layers slide");
    assert_eq!(hp["attn_scale"].as_f64().unwrap() as f32, 1.0 / 48f32.sqrt());
    assert_eq!(hp["embed_scale"].as_f64().unwrap() as f32, 128f32.sqrt());
    assert_eq!((hp["rope_base"].as_f64(), hp["ffn_activation"].as_str()), (Some(10_000.0), Some("GeluTanh")));
    assert_eq!(hp["post_norms"].as_bool(), Some(true));
}

#[test]
fn inspect_shows_phi3s_fused_tensors_and_partial_rotary() {
    let Some(hp) = hparams("phi3", "inspect_shows_phi3s_fused_tensors_and_partial_rotary") else { return };
    assert_eq!((hp["head_dim_k"].as_u64(), hp["n_rot"].as_u64()), (Some(32), Some(24)));
    assert_eq!((hp["fused_qkv"].as_bool(), hp["fused_gate_up"].as_bool()), (Some(true), Some(true)));
    assert_eq!((hp["sliding_window"].is_null(), hp["rope_long_factors"].as_bool()), (true, Some(false)));
    assert_eq!((hp["rope_original_context"].as_u64(), hp["n_ff"].as_u64()), (Some(2048), Some(256)));
}

/// Each family chats in its own format when the file has no template.
#[test]
fn a_file_without_a_template_chats_in_its_familys_format() {
    for (name, format) in [("qwen3", "chatml"), ("gemma2", "gemma"), ("phi3", "phi3")] {
        let Some(model) = tiny(name, "a_file_without_a_template_chats_in_its_familys_format") else { return };
        let o = sift(&["run", "-m", model.to_str().unwrap(), "--chat", "-p", "Hi", "-n", "2", "--temp", "0"]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        assert!(stderr(&o).contains(&format!("built-in {format}")), "{name}: {}", stderr(&o));
    }
}

/// `--gpu on` names the step the GPU lacks, in one line, before any device
/// is opened; `--gpu auto` says so and prefills on the CPU.
#[test]
fn the_gpu_prefill_declines_soft_capped_attention() {
    let Some(model) = tiny("gemma2", "the_gpu_prefill_declines_soft_capped_attention") else { return };
    let model = model.to_str().unwrap();
    let o = sift(&["run", "-m", model, "-p", "Hi", "-n", "1", "--gpu", "on"]);
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("gemma2 soft-caps attention scores"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    // `auto` looks at prompts from 2048 tokens.
    let prompt = "The sea was calm. ".repeat(420);
    let o = sift(&["run", "-m", model, "-p", &prompt, "-c", "4096", "-n", "1", "--gpu", "auto", "--temp", "0"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("which the GPU does not; prefill stays on the CPU"), "{}", stderr(&o));
}

/// Sparse attention on Gemma 2: past 1024 positions, the decoding steps of
/// the two global layers (1 and 3) read sparsely through the cap, the
/// sliding ones (a 32-position window) stay dense.
#[test]
fn sparse_policies_read_gemma2s_global_layers_sparsely() {
    let Some(model) = tiny("gemma2", "sparse_policies_read_gemma2s_global_layers_sparsely") else { return };
    let prompt = "The sea was calm and the ship sailed north. ".repeat(110);
    for (kv_cache, attn) in [("q4", "certified"), ("f16", "topk")] {
        let path = std::env::temp_dir().join(format!("sift-families-{attn}-{}.jsonl", std::process::id()));
        let args = ["run", "-m", model.to_str().unwrap(), "-p", &prompt, "-n", "3", "--temp", "0", "--quiet"];
        let flags = ["--kv-cache", kv_cache, "--attn", attn, "--audit", "--audit-out", path.to_str().unwrap()];
        let o = sift(&[&args[..], &flags[..]].concat());
        assert_eq!(o.status.code(), Some(0), "{attn}: {}", stderr(&o));
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let rows: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|l| l["type"] == "attention")
            .collect();
        assert_eq!(rows.len(), 2 * 2 * 4, "{attn}: 2 steps x 2 global layers x 4 heads");
        for row in &rows {
            assert!(row["layer"] == 1 || row["layer"] == 3, "{attn}: {row}");
            assert_eq!(row["kind"], attn, "{row}");
            let (keys, visible) = (row["keys_read"].as_u64().unwrap(), row["visible"].as_u64().unwrap());
            assert!(visible > 1024 && keys < visible, "{attn}: {row}");
        }
    }
}

/// Phi-3's fused tensors are split into views of the file's bytes: each
/// part's first row lies where its block of rows begins, nothing copied.
#[test]
fn phi3s_fused_tensors_are_views_of_the_file() {
    let Some(path) = tiny("phi3", "phi3s_fused_tensors_are_views_of_the_file") else { return };
    let file = sift::gguf::GgufFile::open(&path).unwrap();
    let model = sift::model::Model::load(&file).unwrap();
    let (hp, layer) = (&model.hp, &model.weights().layers[3]);
    let start = |name: &str| file.tensor(&format!("blk.3.{name}")).unwrap().data.as_ptr();
    let at = |name: &str, rows: usize, m: &sift::matmul::Matrix| {
        let row_bytes = m.row(0).len();
        start(name).wrapping_add(rows * row_bytes)
    };
    let (q, kv) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
    assert_eq!(layer.wq.row(0).as_ptr(), at("attn_qkv.weight", 0, &layer.wq));
    assert_eq!(layer.wk.row(0).as_ptr(), at("attn_qkv.weight", q, &layer.wk));
    assert_eq!(layer.wv.row(0).as_ptr(), at("attn_qkv.weight", q + kv, &layer.wv));
    // Layer 3's `ffn_up` is Q8_0: the gate's rows, then the up projection's.
    assert_eq!(layer.w_gate.row(0).as_ptr(), at("ffn_up.weight", 0, &layer.w_gate));
    assert_eq!(layer.w_up.row(0).as_ptr(), at("ffn_up.weight", hp.n_ff, &layer.w_up));
    assert_eq!((layer.wq.rows, layer.wk.rows, layer.w_gate.rows, layer.w_up.rows), (q, kv, hp.n_ff, hp.n_ff));
}
