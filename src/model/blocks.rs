//! The small pieces a transformer layer is made of.

use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;

use super::hparams::{FfnActivation, Rope, RopeStyle};

/// `1 / rms(x)`, the sum of squares in f64 as ggml does.
fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    let mean_sq = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    1.0 / (mean_sq as f32 + eps).sqrt()
}

/// `out = x / rms(x) * weight` for every `weight.len()`-long row of `x`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    for (row, out) in x.chunks_exact(weight.len()).zip(out.chunks_exact_mut(weight.len())) {
        let scale = inverse_rms(row, eps);
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] in place (per-head norms, post-norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(weight.len()) {
        let scale = inverse_rms(row, eps);
        for (v, &w) in row.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

/// cos/sin of every rotated frequency at each position of a batch.
#[derive(Default)]
pub struct RopeTable {
    half: usize,
    cos_sin: Vec<(f32, f32)>,
}

impl RopeTable {
    /// Angles are computed in f32 the way ggml does (a running product of
    /// `base^(-2/n_rot)`), so positions far into the context rotate exactly as
    /// llama.cpp rotates them; cos and sin are then multiplied by the
    /// rotation's attention factor, as ggml's `mscale`.
    pub fn fill(&mut self, rope: &Rope, base: f32, freq_scale: f32, positions: std::ops::Range<usize>) {
        self.half = rope.n_rot / 2;
        self.cos_sin.clear();
        let theta_scale = base.powf(-2.0 / rope.n_rot as f32);
        let m = rope.attn_factor;
        for pos in positions {
            let mut theta = pos as f32;
            for i in 0..self.half {
                let divisor = rope.freq_factors.as_ref().map_or(1.0, |f| f[i]);
                let angle = freq_scale * (theta / divisor);
                self.cos_sin.push((angle.cos() * m, angle.sin() * m));
                theta *= theta_scale;
            }
        }
    }

    /// The (cos, sin) pairs, `n_rot / 2` per position of the batch, position
    /// after position: the GPU's RoPE reads the same angles.
    pub fn cos_sin(&self) -> &[(f32, f32)] {
        &self.cos_sin
    }

    /// Rotates the first `n_rot` values of every head of `x` (one token's
    /// `n_heads * head_dim` row) for the `t`-th position of the batch.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, t: usize, style: RopeStyle) {
        let cos_sin = &self.cos_sin[t * self.half..(t + 1) * self.half];
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + self.half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// `gate = act(gate) * up`, the gated MLP's middle, for every `row`-long
/// token row, rows spread across the pool.
pub fn gated_activation(gate: &mut [f32], up: &[f32], act: FfnActivation, row: usize) {
    gate.par_chunks_mut(row).zip(up.par_chunks(row)).for_each(|(gate, up)| match act {
        FfnActivation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
        }
        FfnActivation::GeluTanh => {
            let table = gelu_table();
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = gelu_tanh_like_ggml(*g, table) * u;
            }
        }
    });
}

/// GELU (tanh form) as ggml evaluates it: zero below -10, the identity above
/// 10, and in between a table indexed by the f16 rounding of the input that
/// holds f16 results. Matching it keeps our logits within llama.cpp's rounding
/// (and a lookup is far cheaper than `tanh`).
fn gelu_tanh_like_ggml(x: f32, table: &[f16; 1 << 16]) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        table[usize::from(f16::from_f32(x).to_bits())].to_f32()
    }
}

/// `gelu(x)` rounded to f16 for every f16 bit pattern `x`, built once.
fn gelu_table() -> &'static [f16; 1 << 16] {
    static TABLE: OnceLock<Box<[f16; 1 << 16]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const COEF_A: f32 = 0.044_715;
        let mut table = Box::new([f16::ZERO; 1 << 16]);
        for (bits, y) in table.iter_mut().enumerate() {
            let x = f16::from_bits(bits as u16).to_f32();
            *y = f16::from_f32(0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh()));
        }
        table
    })
}

pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every `bias.len()`-long row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// `cap * tanh(x / cap)`: keeps logits within (-cap, cap).
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}
