//! Models written by the test itself, run by sift and by a plain f64
//! transformer written here from the architectures' definitions. They must
//! agree to 1e-3 (relative to the largest logit).
//!
//! The reference is deliberately naive: it recomputes every position from
//! scratch with full-precision arithmetic, shares no code with sift, and
//! states each architecture's quirks (RoPE pairing, Gemma's embedding scale,
//! sliding windows, QK-norm, post-norms, biases, tied heads) on its own.

use std::collections::HashMap;
use std::path::PathBuf;

use gguf_rs_lib::builder::GGUFBuilder;
use gguf_rs_lib::format::metadata::MetadataValue;
use gguf_rs_lib::tensor::TensorType;
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::model::Model;

#[derive(Clone, Copy)]
struct Spec {
    arch: &'static str,
    n_vocab: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_ff: usize,
    rope_base: f64,
    eps: f64,
    /// Gemma 3: window of the sliding layers (every 6th layer is global).
    window: Option<usize>,
    qkv_bias: bool,
    tied: bool,
    /// Llama 3 style per-frequency divisors in `rope_freqs.weight`.
    rope_freqs: bool,
    /// Store attention matrices as F16 (activations then meet f16 rounding).
    f16_attention: bool,
}

const LLAMA: Spec = Spec {
    arch: "llama",
    n_vocab: 61,
    n_embd: 64,
    n_layer: 2,
    n_head: 4,
    n_head_kv: 2,
    head_dim: 16,
    n_ff: 96,
    rope_base: 10_000.0,
    eps: 1e-5,
    window: None,
    qkv_bias: false,
    tied: false,
    rope_freqs: false,
    f16_attention: false,
};

/// Deterministic N(0, 1)-ish values (sum of uniforms), so the test needs no RNG crate.
struct Noise(u64);
impl Noise {
    fn next(&mut self) -> f64 {
        let mut acc = 0.0;
        for _ in 0..4 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            acc += (self.0 >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
        }
        acc * 3f64.sqrt()
    }
    fn vec(&mut self, n: usize, std: f64, mean: f64) -> Vec<f64> {
        (0..n).map(|_| mean + std * self.next()).collect()
    }
}

/// The weights as the file stores them (f16 rounding already applied where stored as F16).
type Weights = HashMap<String, Vec<f64>>;

fn write_model(spec: &Spec, seed: u64) -> (PathBuf, Weights) {
    let mut noise = Noise(seed);
    let mut w = Weights::new();
    let mut b = GGUFBuilder::new();
    let a = spec.arch;
    let meta_u32 = |b: GGUFBuilder, k: &str, v: usize| b.add_metadata(format!("{a}.{k}"), MetadataValue::U32(v as u32));
    b = b.add_metadata("general.architecture", MetadataValue::String(a.into()));
    b = meta_u32(b, "context_length", 256);
    b = meta_u32(b, "embedding_length", spec.n_embd);
    b = meta_u32(b, "block_count", spec.n_layer);
    b = meta_u32(b, "feed_forward_length", spec.n_ff);
    b = meta_u32(b, "attention.head_count", spec.n_head);
    b = meta_u32(b, "attention.head_count_kv", spec.n_head_kv);
    b = meta_u32(b, "attention.key_length", spec.head_dim);
    b = meta_u32(b, "attention.value_length", spec.head_dim);
    b = b.add_metadata(format!("{a}.attention.layer_norm_rms_epsilon"), MetadataValue::F32(spec.eps as f32));
    b = b.add_metadata(format!("{a}.rope.freq_base"), MetadataValue::F32(spec.rope_base as f32));
    if let Some(window) = spec.window {
        b = meta_u32(b, "attention.sliding_window", window);
    }

    let mut add = |b: GGUFBuilder, name: String, dims: Vec<usize>, std: f64, mean: f64, f16: bool| -> GGUFBuilder {
        let n: usize = dims.iter().product();
        let shape = dims.iter().map(|&d| d as u64).collect();
        let values = noise.vec(n, std, mean);
        let (b, stored) = if f16 {
            let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f64(v)).collect();
            let bytes = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
            (
                b.add_tensor(name.clone(), shape, TensorType::F16, bytes).unwrap(),
                halves.iter().map(|h| h.to_f64()).collect(),
            )
        } else {
            let floats: Vec<f32> = values.iter().map(|&v| v as f32).collect();
            let stored = floats.iter().map(|&f| f64::from(f)).collect();
            (b.add_f32_tensor(name.clone(), shape, floats).unwrap(), stored)
        };
        w.insert(name, stored);
        b
    };
    let (e, hd) = (spec.n_embd, spec.head_dim);
    let (q_dim, kv_dim) = (spec.n_head * hd, spec.n_head_kv * hd);
    let inv = |n: usize| 1.0 / (n as f64).sqrt();
    b = add(b, "token_embd.weight".into(), vec![e, spec.n_vocab], 1.0, 0.0, false);
    b = add(b, "output_norm.weight".into(), vec![e], 0.1, 1.0, false);
    if !spec.tied {
        b = add(b, "output.weight".into(), vec![e, spec.n_vocab], 0.5, 0.0, false);
    }
    if spec.rope_freqs {
        b = add(b, "rope_freqs.weight".into(), vec![hd / 2], 1.0, 4.0, false);
    }
    let gemma = spec.arch == "gemma3";
    for il in 0..spec.n_layer {
        let t = |n: &str| format!("blk.{il}.{n}");
        let f16 = spec.f16_attention;
        b = add(b, t("attn_norm.weight"), vec![e], 0.1, 1.0, false);
        b = add(b, t("attn_q.weight"), vec![e, q_dim], 1.5 * inv(e), 0.0, f16);
        b = add(b, t("attn_k.weight"), vec![e, kv_dim], 1.5 * inv(e), 0.0, f16);
        b = add(b, t("attn_v.weight"), vec![e, kv_dim], inv(e), 0.0, f16);
        if spec.qkv_bias {
            b = add(b, t("attn_q.bias"), vec![q_dim], 0.5, 0.0, false);
            b = add(b, t("attn_k.bias"), vec![kv_dim], 1.0, 0.0, false);
            b = add(b, t("attn_v.bias"), vec![kv_dim], 0.3, 0.0, false);
        }
        if gemma {
            b = add(b, t("attn_q_norm.weight"), vec![hd], 0.1, 1.0, false);
            b = add(b, t("attn_k_norm.weight"), vec![hd], 0.1, 1.0, false);
            b = add(b, t("post_attention_norm.weight"), vec![e], 0.1, 1.0, false);
            b = add(b, t("post_ffw_norm.weight"), vec![e], 0.1, 1.0, false);
        }
        b = add(b, t("attn_output.weight"), vec![q_dim, e], inv(q_dim), 0.0, f16);
        b = add(b, t("ffn_norm.weight"), vec![e], 0.1, 1.0, false);
        b = add(b, t("ffn_gate.weight"), vec![e, spec.n_ff], inv(e), 0.0, false);
        b = add(b, t("ffn_up.weight"), vec![e, spec.n_ff], inv(e), 0.0, false);
        b = add(b, t("ffn_down.weight"), vec![spec.n_ff, e], inv(spec.n_ff), 0.0, false);
    }
    let dir = std::env::temp_dir().join(format!("sift-reference-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}-{seed}.gguf", spec.arch));
    b.build_to_file(&path).unwrap();
    (path, w)
}

// ---- the f64 reference -------------------------------------------------

/// `y = W x` for a GGUF matrix stored as `dims = [cols, rows]`, row-major by output.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}

fn rope(head: &mut [f64], pos: usize, base: f64, neox: bool, freq_factors: Option<&[f64]>) {
    let d = head.len();
    for i in 0..d / 2 {
        let mut theta = pos as f64 * base.powf(-2.0 * i as f64 / d as f64);
        if let Some(f) = freq_factors {
            theta /= f[i];
        }
        let (a, b) = if neox { (i, i + d / 2) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * theta.cos() - x1 * theta.sin();
        head[b] = x0 * theta.sin() + x1 * theta.cos();
    }
}

/// Logits after every position of `tokens`.
fn reference_logits(spec: &Spec, w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let gemma = spec.arch == "gemma3";
    let neox = spec.arch != "llama";
    let (e, hd) = (spec.n_embd, spec.head_dim);
    let get = |n: String| w.get(&n).unwrap_or_else(|| panic!("{n}")).as_slice();
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let row = &w["token_embd.weight"][t as usize * e..(t as usize + 1) * e];
            let scale = if gemma { (e as f64).sqrt() } else { 1.0 };
            row.iter().map(|v| v * scale).collect()
        })
        .collect();
    let freq_factors = w.get("rope_freqs.weight").map(Vec::as_slice);
    for il in 0..spec.n_layer {
        let t = |n: &str| format!("blk.{il}.{n}");
        let sliding = gemma && spec.window.is_some() && (il + 1) % 6 != 0;
        let base = if sliding { 10_000.0 } else { spec.rope_base };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, get(t("attn_norm.weight")), spec.eps);
            let mut q = matvec(get(t("attn_q.weight")), &h);
            let mut k = matvec(get(t("attn_k.weight")), &h);
            let mut v = matvec(get(t("attn_v.weight")), &h);
            if spec.qkv_bias {
                for (y, bias) in [(&mut q, "attn_q.bias"), (&mut k, "attn_k.bias"), (&mut v, "attn_v.bias")] {
                    y.iter_mut().zip(get(t(bias))).for_each(|(a, b)| *a += b);
                }
            }
            for (y, norm) in [(&mut q, "attn_q_norm.weight"), (&mut k, "attn_k_norm.weight")] {
                for head in y.chunks_exact_mut(hd) {
                    if gemma {
                        let n = rms_norm(head, get(t(norm)), spec.eps);
                        head.copy_from_slice(&n);
                    }
                    rope(head, pos, base, neox, if gemma { None } else { freq_factors });
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let first = match (sliding, spec.window) {
                (true, Some(win)) => (pos + 1).saturating_sub(win),
                _ => 0,
            };
            let mut attn = vec![0.0; spec.n_head * hd];
            for h in 0..spec.n_head {
                let kvh = h / (spec.n_head / spec.n_head_kv);
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (first..=pos)
                    .map(|j| {
                        q.iter().zip(&ks[j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for (j, p) in (first..=pos).zip(&exps) {
                    for d in 0..hd {
                        attn[h * hd + d] += p / sum * vs[j][kvh * hd + d];
                    }
                }
            }
            let mut o = matvec(get(t("attn_output.weight")), &attn);
            if gemma {
                o = rms_norm(&o, get(t("post_attention_norm.weight")), spec.eps);
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms_norm(x, get(t("ffn_norm.weight")), spec.eps);
            let gate = matvec(get(t("ffn_gate.weight")), &h);
            let up = matvec(get(t("ffn_up.weight")), &h);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| {
                    let a = if gemma {
                        0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
                    } else {
                        g / (1.0 + (-g).exp())
                    };
                    a * u
                })
                .collect();
            let mut f = matvec(get(t("ffn_down.weight")), &act);
            if gemma {
                f = rms_norm(&f, get(t("post_ffw_norm.weight")), spec.eps);
            }
            x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
    }
    let head = if spec.tied { &w["token_embd.weight"] } else { &w["output.weight"] };
    xs.iter().map(|x| matvec(head, &rms_norm(x, &w["output_norm.weight"], spec.eps))).collect()
}

// ---- the comparison ----------------------------------------------------

/// Prefills `prompt`, then decodes the rest of `tokens` one by one, checking
/// the logits after every step against the reference.
fn check(spec: Spec, seed: u64) {
    let (path, w) = write_model(&spec, seed);
    let tokens: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % spec.n_vocab as u32).collect();
    let reference = reference_logits(&spec, &w, &tokens);
    let file = GgufFile::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    // Batches of 4 make the sliding layers' rings (window + batch slots) wrap.
    let mut session = Session::with_batch(&model, 64, 4);
    let prompt = 9;
    let mut worst = 0.0f64;
    let mut check_step = |pos: usize, logits: &[f32]| {
        let r = &reference[pos];
        let scale = r.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = r.iter().zip(logits).fold(0.0f64, |m, (a, &b)| m.max((a - f64::from(b)).abs())) / scale;
        worst = worst.max(err);
    };
    let logits = session.prefill(&tokens[..prompt]).unwrap().to_vec();
    check_step(prompt - 1, &logits);
    for (pos, &t) in tokens.iter().enumerate().skip(prompt) {
        let logits = session.decode(t).unwrap().to_vec();
        check_step(pos, &logits);
    }
    eprintln!("{} (seed {seed}): worst relative logit error {worst:.2e}", spec.arch);
    assert!(worst < 1e-3, "{}: sift differs from the f64 reference by {worst:.2e} (relative)", spec.arch);
}

#[test]
fn llama_matches_f64_reference() {
    check(LLAMA, 1);
}

#[test]
fn llama_with_f16_attention_and_llama3_rope_freqs_matches() {
    check(Spec { rope_freqs: true, f16_attention: true, tied: true, ..LLAMA }, 2);
}

#[test]
fn qwen2_with_biases_matches_f64_reference() {
    check(Spec { arch: "qwen2", qkv_bias: true, tied: true, rope_base: 1e6, eps: 1e-6, ..LLAMA }, 3);
}

#[test]
fn gemma3_with_sliding_window_matches_f64_reference() {
    // Seven layers: layer 5 is global, the others slide over a 4-token window,
    // which the 14-token sequence overruns several times.
    check(
        Spec {
            arch: "gemma3",
            n_layer: 7,
            n_head_kv: 1,
            head_dim: 32,
            window: Some(4),
            rope_base: 1e6,
            eps: 1e-6,
            tied: true,
            ..LLAMA
        },
        4,
    );
}
