//! Models written by the test itself, run by sift and by a plain f64
//! transformer written here from the architectures' definitions. They must
//! agree to 1e-3 (relative to the largest logit).
//!
//! The reference is deliberately naive: it recomputes every position from
//! scratch with full-precision arithmetic, shares no code with sift, and
//! states each architecture's quirks on its own: RoPE pairing and partial
//! rotation, Gemma's embedding scale, GELU and post-norms, sliding windows
//! (Gemma 3: every 6th layer global; Gemma 2: odd layers global), QK-norm,
//! biases, tied heads, Gemma 2's soft-capped scores and logits, Phi-3's fused
//! tensors and LongRoPE's factors.

use std::collections::HashMap;
use std::path::PathBuf;

use gguf_rs_lib::builder::GGUFBuilder;
use gguf_rs_lib::format::metadata::MetadataValue;
use gguf_rs_lib::tensor::TensorType;
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::model::Model;
use simd::WeightType;

/// The context every check runs at.
const N_CTX: usize = 64;

#[derive(Clone, Copy)]
struct Spec {
    arch: &'static str,
    n_vocab: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    /// Written as `attention.key_length` / `value_length`.
    head_dim: usize,
    n_ff: usize,
    /// `rope.freq_base`; not written when `None` (the default 10 000 then).
    rope_base: Option<f64>,
    /// `rope.dimension_count` below the head size: partial rotary.
    n_rot: Option<usize>,
    eps: f64,
    /// The sliding layers' window.
    window: Option<usize>,
    qkv_bias: bool,
    /// Per-head RMS norms of queries and keys.
    qk_norm: bool,
    tied: bool,
    /// Llama 3 style per-frequency divisors in `rope_freqs.weight`.
    rope_freqs: bool,
    /// Store attention matrices as F16 (activations then meet f16 rounding).
    f16_attention: bool,
    /// Gemma 2's caps on attention scores and on logits, written as keys.
    softcaps: Option<(f64, f64)>,
    /// LongRoPE: short and long factors, the original context (long
    /// factors apply beyond it) and the attention factor.
    long_rope: Option<LongRope>,
    /// Store the FFN matrices as random blocks of this K-quant (their rows a multiple of
    /// 256 wide); the activations they meet are then rounded to 8 bits, unless
    /// `f32_activations`.
    ffn_type: Option<WeightType>,
    /// Run with `sift::matmul::set_f32_activations`, as `--f32-activations` does.
    f32_activations: bool,
    /// `pooling_type`, as embedding models carry it.
    pooling_type: Option<usize>,
}

#[derive(Clone, Copy)]
struct LongRope {
    original_context: usize,
    attn_factor: f64,
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
    rope_base: Some(10_000.0),
    n_rot: None,
    eps: 1e-5,
    window: None,
    qkv_bias: false,
    qk_norm: false,
    tied: false,
    rope_freqs: false,
    f16_attention: false,
    softcaps: None,
    long_rope: None,
    ffn_type: None,
    f32_activations: false,
    pooling_type: None,
};

impl Spec {
    /// How far sift's logits may be from the reference's, relative to the largest: f32 and
    /// f16 weights meet f32 activations; K-quant weights meet activations rounded to 8 bits
    /// (Q8_K) unless `f32_activations`, and the bound must then take in their error.
    fn tolerance(&self) -> f64 {
        match (self.ffn_type, self.f32_activations) {
            (Some(_), false) => 5e-2,
            _ => 1e-3,
        }
    }

    fn gemma(&self) -> bool {
        self.arch.starts_with("gemma")
    }

    fn phi3(&self) -> bool {
        self.arch == "phi3"
    }

    fn rotated(&self) -> usize {
        self.n_rot.unwrap_or(self.head_dim)
    }

    /// Whether layer `il` attends within the window.
    fn sliding(&self, il: usize) -> bool {
        self.window.is_some()
            && match self.arch {
                "gemma3" => !(il + 1).is_multiple_of(6),
                "gemma2" => il.is_multiple_of(2),
                _ => false,
            }
    }
}

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
    fn byte(&mut self) -> u8 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 56) as u8
    }
}

/// The weights as the file stores them (f16 rounding already applied where
/// stored as F16), a fused tensor's parts under their own names.
type Weights = HashMap<String, Vec<f64>>;

/// Draws tensors, keeps what the file will hold, and writes them.
struct Writer {
    builder: GGUFBuilder,
    noise: Noise,
    weights: Weights,
}

impl Writer {
    /// Values of `rows` x `cols` drawn and rounded as stored, recorded as `name`.
    fn draw(&mut self, name: String, rows: usize, cols: usize, std: f64, mean: f64, f16: bool) -> Vec<f64> {
        let values = self.noise.vec(rows * cols, std, mean);
        let stored: Vec<f64> = match f16 {
            true => values.iter().map(|&v| half::f16::from_f64(v).to_f64()).collect(),
            false => values.iter().map(|&v| f64::from(v as f32)).collect(),
        };
        self.weights.insert(name, stored.clone());
        stored
    }

    /// Writes `values` (`rows` of `cols`; a vector when `rows` is 1).
    fn put(&mut self, name: String, rows: usize, cols: usize, values: &[f64], f16: bool) {
        let shape = if rows == 1 { vec![cols as u64] } else { vec![cols as u64, rows as u64] };
        let builder = std::mem::take(&mut self.builder);
        self.builder = if f16 {
            let bytes = values.iter().flat_map(|&v| half::f16::from_f64(v).to_le_bytes()).collect();
            builder.add_tensor(name, shape, TensorType::F16, bytes).unwrap()
        } else {
            builder.add_f32_tensor(name, shape, values.iter().map(|&v| v as f32).collect()).unwrap()
        };
    }

    fn tensor(&mut self, name: String, rows: usize, cols: usize, std: f64, mean: f64, f16: bool) {
        let values = self.draw(name.clone(), rows, cols, std, mean, f16);
        self.put(name, rows, cols, &values, f16);
    }

    /// One tensor whose rows are the `parts` stacked in order, each drawn
    /// as `(name, rows, std)` and recorded under its own name.
    fn fused(&mut self, name: String, parts: &[(String, usize, f64)], cols: usize, f16: bool) {
        let mut rows = 0;
        let mut values = Vec::new();
        for (part, part_rows, std) in parts {
            values.extend(self.draw(part.clone(), *part_rows, cols, *std, 0.0, f16));
            rows += part_rows;
        }
        self.put(name, rows, cols, &values, f16);
    }

    /// `rows` x `cols` of random blocks of the quantized type `ty`, every block with the same
    /// scales, set so that the values' RMS is about `std`. Recorded as the blocks' values,
    /// which sift's dequantization gives: `simd/tests/reference_vectors.rs` checks it against
    /// llama.cpp's gguf-py bit for bit.
    fn quantized(&mut self, name: String, rows: usize, cols: usize, std: f64, ty: WeightType) {
        let row_bytes = ty.row_bytes(cols).expect("rows of whole super-blocks");
        // u16s, for the blocks' 2-byte alignment.
        let mut words = vec![0u16; rows * row_bytes / 2];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        bytes.iter_mut().for_each(|b| *b = self.noise.byte());
        // The f16 fields: the scale, and Q2_K's scale of the minimums (1.5 times it, which
        // centres the values near zero).
        let fields: &[(usize, f64)] = match ty {
            WeightType::Q2_K => &[(80, 1.0), (82, 1.5)],
            WeightType::Q3_K => &[(108, 1.0)],
            WeightType::IQ4_NL | WeightType::IQ4_XS | WeightType::IQ3_XXS | WeightType::IQ3_S => &[(0, 1.0)],
            _ => panic!("{ty:?}: no fields known"),
        };
        let set_scales = |bytes: &mut [u8], scale: f64| {
            for block in bytes.chunks_exact_mut(ty.block_bytes()) {
                for &(at, ratio) in fields {
                    block[at..at + 2].copy_from_slice(&half::f16::from_f64(scale * ratio).to_le_bytes());
                }
            }
        };
        let values = |bytes: &[u8]| {
            let mut out = vec![0f32; rows * cols];
            for (row, out) in bytes.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
                simd::kernels().dequantize_row(ty, row, out);
            }
            out
        };
        set_scales(bytes, 1.0);
        let unit = values(bytes);
        let rms = (unit.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / unit.len() as f64).sqrt();
        set_scales(bytes, std / rms);
        let stored: Vec<f64> = values(bytes).into_iter().map(f64::from).collect();
        self.weights.insert(name.clone(), stored);
        let tensor_type = match ty {
            WeightType::Q2_K => TensorType::Q2_K,
            WeightType::Q3_K => TensorType::Q3_K,
            WeightType::IQ4_NL => TensorType::IQ4_NL,
            WeightType::IQ4_XS => TensorType::IQ4_XS,
            WeightType::IQ3_XXS => TensorType::IQ3_XXS,
            _ => TensorType::IQ3_S,
        };
        let builder = std::mem::take(&mut self.builder);
        self.builder = builder.add_tensor(name, vec![cols as u64, rows as u64], tensor_type, bytes.to_vec()).unwrap();
    }

    fn meta(&mut self, key: String, value: MetadataValue) {
        self.builder = std::mem::take(&mut self.builder).add_metadata(key, value);
    }
}

fn write_model(spec: &Spec, seed: u64) -> (PathBuf, Weights) {
    let mut w = Writer { builder: GGUFBuilder::new(), noise: Noise(seed), weights: Weights::new() };
    let a = spec.arch;
    let u32_key = |w: &mut Writer, k: &str, v: usize| w.meta(format!("{a}.{k}"), MetadataValue::U32(v as u32));
    let f32_key = |w: &mut Writer, k: &str, v: f64| w.meta(format!("{a}.{k}"), MetadataValue::F32(v as f32));
    w.meta("general.architecture".into(), MetadataValue::String(a.into()));
    u32_key(&mut w, "context_length", 256);
    u32_key(&mut w, "embedding_length", spec.n_embd);
    u32_key(&mut w, "block_count", spec.n_layer);
    u32_key(&mut w, "feed_forward_length", spec.n_ff);
    u32_key(&mut w, "attention.head_count", spec.n_head);
    u32_key(&mut w, "attention.head_count_kv", spec.n_head_kv);
    u32_key(&mut w, "attention.key_length", spec.head_dim);
    u32_key(&mut w, "attention.value_length", spec.head_dim);
    f32_key(&mut w, "attention.layer_norm_rms_epsilon", spec.eps);
    if let Some(base) = spec.rope_base {
        f32_key(&mut w, "rope.freq_base", base);
    }
    if let Some(n_rot) = spec.n_rot {
        u32_key(&mut w, "rope.dimension_count", n_rot);
    }
    if let Some(window) = spec.window {
        u32_key(&mut w, "attention.sliding_window", window);
    }
    if let Some((attention, output)) = spec.softcaps {
        f32_key(&mut w, "attn_logit_softcapping", attention);
        f32_key(&mut w, "final_logit_softcapping", output);
    }
    if let Some(pooling) = spec.pooling_type {
        u32_key(&mut w, "pooling_type", pooling);
    }
    if let Some(long) = spec.long_rope {
        u32_key(&mut w, "rope.scaling.original_context_length", long.original_context);
        f32_key(&mut w, "rope.scaling.attn_factor", long.attn_factor);
    }

    let (e, hd) = (spec.n_embd, spec.head_dim);
    let (q_dim, kv_dim) = (spec.n_head * hd, spec.n_head_kv * hd);
    let inv = |n: usize| 1.0 / (n as f64).sqrt();
    let f16 = spec.f16_attention;
    w.tensor("token_embd.weight".into(), spec.n_vocab, e, 1.0, 0.0, false);
    w.tensor("output_norm.weight".into(), 1, e, 0.1, 1.0, false);
    if !spec.tied {
        w.tensor("output.weight".into(), spec.n_vocab, e, 0.5, 0.0, false);
    }
    if spec.rope_freqs {
        w.tensor("rope_freqs.weight".into(), 1, hd / 2, 1.0, 4.0, false);
    }
    if spec.long_rope.is_some() {
        w.tensor("rope_factors_short.weight".into(), 1, spec.rotated() / 2, 0.2, 1.3, false);
        w.tensor("rope_factors_long.weight".into(), 1, spec.rotated() / 2, 1.0, 5.0, false);
    }
    for il in 0..spec.n_layer {
        let t = |n: &str| format!("blk.{il}.{n}");
        w.tensor(t("attn_norm.weight"), 1, e, 0.1, 1.0, false);
        let (q, k, v) = (
            (t("attn_q.weight"), q_dim, 1.5 * inv(e)),
            (t("attn_k.weight"), kv_dim, 1.5 * inv(e)),
            (t("attn_v.weight"), kv_dim, inv(e)),
        );
        if spec.phi3() {
            w.fused(t("attn_qkv.weight"), &[q, k, v], e, f16);
        } else {
            for (name, rows, std) in [q, k, v] {
                w.tensor(name, rows, e, std, 0.0, f16);
            }
        }
        if spec.qkv_bias {
            w.tensor(t("attn_q.bias"), 1, q_dim, 0.5, 0.0, false);
            w.tensor(t("attn_k.bias"), 1, kv_dim, 1.0, 0.0, false);
            w.tensor(t("attn_v.bias"), 1, kv_dim, 0.3, 0.0, false);
        }
        if spec.qk_norm {
            w.tensor(t("attn_q_norm.weight"), 1, hd, 0.1, 1.0, false);
            w.tensor(t("attn_k_norm.weight"), 1, hd, 0.1, 1.0, false);
        }
        if spec.gemma() {
            w.tensor(t("post_attention_norm.weight"), 1, e, 0.1, 1.0, false);
            w.tensor(t("post_ffw_norm.weight"), 1, e, 0.1, 1.0, false);
        }
        w.tensor(t("attn_output.weight"), e, q_dim, inv(q_dim), 0.0, f16);
        w.tensor(t("ffn_norm.weight"), 1, e, 0.1, 1.0, false);
        let (gate, up) = ((t("ffn_gate.weight"), spec.n_ff, inv(e)), (t("ffn_up.weight"), spec.n_ff, inv(e)));
        let down = (t("ffn_down.weight"), e, inv(spec.n_ff));
        if let Some(ty) = spec.ffn_type {
            for (name, rows, std) in [gate, up] {
                w.quantized(name, rows, e, std, ty);
            }
            w.quantized(down.0, down.1, spec.n_ff, down.2, ty);
        } else if spec.phi3() {
            // Phi-3's `ffn_up` holds the gate's rows, then the up projection's.
            w.fused(t("ffn_up.weight"), &[gate, up], e, false);
            w.tensor(down.0, down.1, spec.n_ff, down.2, 0.0, false);
        } else {
            for (name, rows, std) in [gate, up] {
                w.tensor(name, rows, e, std, 0.0, false);
            }
            w.tensor(down.0, down.1, spec.n_ff, down.2, 0.0, false);
        }
    }
    let dir = std::env::temp_dir().join(format!("sift-reference-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}-{seed}.gguf", spec.arch));
    w.builder.build_to_file(&path).unwrap();
    (path, w.weights)
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

/// `cap · tanh(x / cap)`.
fn softcap(x: f64, cap: f64) -> f64 {
    cap * (x / cap).tanh()
}

/// How a head's first `n_rot` values are rotated.
struct Rotation<'a> {
    n_rot: usize,
    base: f64,
    neox: bool,
    /// Per-frequency divisors.
    factors: Option<&'a [f64]>,
    /// What cos and sin are multiplied by.
    attn_factor: f64,
}

fn rope(head: &mut [f64], pos: usize, r: &Rotation) {
    let d = r.n_rot;
    for i in 0..d / 2 {
        let mut theta = pos as f64 * r.base.powf(-2.0 * i as f64 / d as f64);
        if let Some(f) = r.factors {
            theta /= f[i];
        }
        let (a, b) = if r.neox { (i, i + d / 2) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (head[a], head[b]);
        let (cos, sin) = (theta.cos() * r.attn_factor, theta.sin() * r.attn_factor);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x0 * sin + x1 * cos;
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// Logits after every position of `tokens`, for a context of [`N_CTX`].
fn reference_logits(spec: &Spec, w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let head = if spec.tied { &w["token_embd.weight"] } else { &w["output.weight"] };
    reference_states(spec, w, tokens)
        .iter()
        .map(|x| {
            let logits = matvec(head, x);
            logits.into_iter().map(|z| spec.softcaps.map_or(z, |(_, cap)| softcap(z, cap))).collect()
        })
        .collect()
}

/// The final-normed hidden state after every position of `tokens`: what the output head reads.
fn reference_states(spec: &Spec, w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let gemma = spec.gemma();
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
    // LongRoPE: the long factors when the context exceeds the original one.
    let long_context = spec.long_rope.is_some_and(|l| N_CTX > l.original_context);
    let factors = match (spec.rope_freqs, spec.long_rope, long_context) {
        (true, ..) => Some("rope_freqs.weight"),
        (_, Some(_), false) => Some("rope_factors_short.weight"),
        (_, Some(_), true) => Some("rope_factors_long.weight"),
        _ => None,
    };
    let base = spec.rope_base.unwrap_or(10_000.0);
    for il in 0..spec.n_layer {
        let t = |n: &str| format!("blk.{il}.{n}");
        let sliding = spec.sliding(il);
        let rotation = Rotation {
            n_rot: spec.rotated(),
            base: if sliding && spec.arch == "gemma3" { 10_000.0 } else { base },
            neox: spec.arch != "llama",
            factors: factors.map(|f| w[f].as_slice()),
            attn_factor: spec.long_rope.map_or(1.0, |l| l.attn_factor),
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, get(t("attn_norm.weight")), spec.eps);
            let mut q = matvec(get(t("attn_q.weight")), &h);
            let mut k = matvec(get(t("attn_k.weight")), &h);
            let v = matvec(get(t("attn_v.weight")), &h);
            let mut v = v;
            if spec.qkv_bias {
                for (y, bias) in [(&mut q, "attn_q.bias"), (&mut k, "attn_k.bias"), (&mut v, "attn_v.bias")] {
                    y.iter_mut().zip(get(t(bias))).for_each(|(a, b)| *a += b);
                }
            }
            for (y, norm) in [(&mut q, "attn_q_norm.weight"), (&mut k, "attn_k_norm.weight")] {
                for head in y.chunks_exact_mut(hd) {
                    if spec.qk_norm {
                        let n = rms_norm(head, get(t(norm)), spec.eps);
                        head.copy_from_slice(&n);
                    }
                    rope(head, pos, &rotation);
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
                        let dot: f64 = q.iter().zip(&ks[j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum();
                        let s = dot / (hd as f64).sqrt();
                        spec.softcaps.map_or(s, |(cap, _)| softcap(s, cap))
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
                .map(|(&g, &u)| u * if gemma { gelu_tanh(g) } else { g / (1.0 + (-g).exp()) })
                .collect();
            let mut f = matvec(get(t("ffn_down.weight")), &act);
            if gemma {
                f = rms_norm(&f, get(t("post_ffw_norm.weight")), spec.eps);
            }
            x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
    }
    xs.iter().map(|x| rms_norm(x, &w["output_norm.weight"], spec.eps)).collect()
}

// ---- the comparison ----------------------------------------------------

/// Prefills `prompt`, then decodes the rest of `tokens` one by one, checking
/// the logits after every step against the reference.
fn check(spec: Spec, seed: u64) {
    let (path, w) = write_model(&spec, seed);
    // The switch is the process's: only the one test of models with K-quant weights turns
    // it, so that the other tests, running beside it, do not.
    if spec.ffn_type.is_some() {
        sift::matmul::set_f32_activations(spec.f32_activations);
    }
    let tokens: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % spec.n_vocab as u32).collect();
    let reference = reference_logits(&spec, &w, &tokens);
    let file = GgufFile::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    // Batches of 4 make the sliding layers' rings (window + batch slots) wrap.
    let mut session = Session::with_batch(&model, N_CTX, 4);
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
    let tolerance = spec.tolerance();
    assert!(worst < tolerance, "{}: sift differs from the f64 reference by {worst:.2e} (relative)", spec.arch);
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
    check(Spec { arch: "qwen2", qkv_bias: true, tied: true, rope_base: Some(1e6), eps: 1e-6, ..LLAMA }, 3);
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
            qk_norm: true,
            rope_base: Some(1e6),
            eps: 1e-6,
            tied: true,
            ..LLAMA
        },
        4,
    );
}

#[test]
fn qwen3_with_qk_norm_and_its_own_head_size_matches_f64_reference() {
    // Heads of 32 on a 64-wide model with 4 heads: queries are 128 wide.
    check(Spec { arch: "qwen3", head_dim: 32, qk_norm: true, tied: true, rope_base: Some(1e6), eps: 1e-6, ..LLAMA }, 5);
}

#[test]
fn gemma2_with_soft_caps_and_alternating_windows_matches_f64_reference() {
    // Four layers, 0 and 2 sliding over 4 positions: the 9-token prompt and
    // the steps after it reach past the window. Caps low enough to bend the
    // scores (about ±3 here) and the logits (about ±8).
    check(
        Spec {
            arch: "gemma2",
            n_layer: 4,
            head_dim: 24,
            window: Some(4),
            softcaps: Some((1.5, 4.0)),
            rope_base: None,
            eps: 1e-6,
            tied: true,
            ..LLAMA
        },
        6,
    );
}

#[test]
fn phi3_with_fused_tensors_and_partial_rotary_matches_f64_reference() {
    // 12 of each head's 16 values rotated; the short factors apply, the
    // context (64) being within the original one.
    let long_rope = LongRope { original_context: 256, attn_factor: 1.2 };
    check(Spec { arch: "phi3", n_rot: Some(12), long_rope: Some(long_rope), tied: true, ..LLAMA }, 7);
}

#[test]
fn phi3_beyond_its_original_context_takes_longrope_long_factors() {
    let long_rope = LongRope { original_context: 32, attn_factor: 1.1 };
    check(Spec { arch: "phi3", n_rot: Some(12), long_rope: Some(long_rope), ..LLAMA }, 8);
}

#[test]
fn llama_with_quantized_ffn_weights_matches_f64_reference() {
    // Rows of 256: one super-block across the model's width and the FFN's. With 8-bit
    // activations the logits are 1–2% off (the blocks have random scales: for Q2_K and
    // Q3_K per 16 values, Q2_K with minimums; for the IQ super-blocks per 32; and random
    // indices into the IQ grids): values far from Gaussian; with f32 activations they are
    // held to the 1e-3 of every other model here. (One test: the switch is the process's.)
    let types = [
        (WeightType::Q2_K, 9),
        (WeightType::Q3_K, 10),
        (WeightType::IQ4_NL, 15),
        (WeightType::IQ4_XS, 16),
        (WeightType::IQ3_XXS, 17),
        (WeightType::IQ3_S, 18),
    ];
    for (ty, seed) in types {
        for f32_activations in [false, true] {
            check(Spec { n_embd: 256, n_ff: 256, ffn_type: Some(ty), f32_activations, ..LLAMA }, seed);
        }
    }
}

/// Embeddings: the reference's final-normed states, averaged (no `pooling_type`, or 1) or the
/// last one's (3), scaled to unit length; a pooling sift does not do (2, the first token's) is
/// refused by name.
#[test]
fn embeddings_are_the_reference_states_pooled() {
    use sift::embed::{embed, Pooling};
    // Past one prefill batch of 512: the pooling goes on across batches.
    let tokens: Vec<u32> = (0..530).map(|i| (i * 5 + 2) % LLAMA.n_vocab as u32).collect();
    for (pooling_type, pooling, seed) in
        [(None, Pooling::Mean, 11), (Some(1), Pooling::Mean, 12), (Some(3), Pooling::Last, 13)]
    {
        let spec = Spec { pooling_type, ..LLAMA };
        let (path, w) = write_model(&spec, seed);
        let states = reference_states(&spec, &w, &tokens);
        let mut want = match pooling {
            Pooling::Mean => (0..spec.n_embd).map(|c| states.iter().map(|x| x[c]).sum::<f64>()).collect(),
            Pooling::Last => states[tokens.len() - 1].clone(),
        };
        let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
        want.iter_mut().for_each(|x| *x /= norm);
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(Pooling::for_model(&file, spec.arch), Ok(pooling));
        let got = embed(&Model::load(&file).unwrap(), &tokens, pooling).unwrap();
        let err = want.iter().zip(&got).fold(0.0f64, |m, (a, &b)| m.max((a - f64::from(b)).abs()));
        assert!(err < spec.tolerance(), "{pooling:?}: {err:.2e} from the reference");
        // The other pooling is another vector: the check can tell them apart.
        let other = if pooling == Pooling::Mean { Pooling::Last } else { Pooling::Mean };
        let other = embed(&Model::load(&file).unwrap(), &tokens, other).unwrap();
        assert!(want.iter().zip(&other).any(|(a, &b)| (a - f64::from(b)).abs() > 100.0 * spec.tolerance()));
    }
    let (path, _) = write_model(&Spec { pooling_type: Some(2), ..LLAMA }, 14);
    let e = Pooling::for_model(&GgufFile::open(&path).unwrap(), "llama").unwrap_err();
    assert!(e.to_string().contains("llama.pooling_type is 2"), "{e}");
}
