//! Every small GPU kernel against its CPU twin in `sift::model::blocks`, on
//! random inputs whose sizes are not multiples of the workgroups. Sizes stay
//! far below lavapipe's cap of 65,535 loop iterations per invocation.

mod common;

use rand::{rngs::StdRng, RngExt, SeedableRng};
use sift::gpu::layers::LayerKernels;
use sift::gpu::GpuContext;
use sift::model::blocks;
use sift::model::hparams::{FfnActivation, Rope, RopeStyle};

fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// Largest |a - b| relative to the largest |b| (at least 1).
fn max_relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale
}

fn setup(test: &str) -> Option<(&'static GpuContext, LayerKernels, StdRng)> {
    let gpu = common::gpu(test)?;
    Some((gpu, LayerKernels::new(gpu).unwrap(), StdRng::seed_from_u64(0x5eed)))
}

#[test]
fn rms_norm_matches_the_cpu() {
    let Some((gpu, k, mut rng)) = setup("rms_norm_matches_the_cpu") else { return };
    for (rows, width) in [(7, 640), (3, 1000), (33, 256), (2, 2048)] {
        let x = random(&mut rng, rows * width, 4.0);
        let w = random(&mut rng, width, 2.0);
        let mut want = vec![0.0; x.len()];
        blocks::rms_norm(&x, &w, 1e-6, &mut want);
        let (xb, wb) = (gpu.upload("x", &x).unwrap(), gpu.upload("w", &w).unwrap());
        let out = gpu.storage::<f32>("out", x.len()).unwrap();
        let mut b = gpu.batch();
        k.rms_norm(&mut b, &xb, &wb, &out, rows, 1e-6);
        k.rms_norm_in_place(&mut b, &xb, &wb, rows, 1e-6);
        b.submit();
        for (what, buffer) in [("beside", &out), ("in place", &xb)] {
            let got: Vec<f32> = gpu.read(buffer, 0, x.len()).unwrap();
            let err = max_relative_error(&got, &want);
            assert!(err < 1e-5, "{what} {rows}x{width}: {err}");
        }
    }
}

#[test]
fn rope_matches_the_cpu_in_both_styles_with_frequency_factors() {
    let Some((gpu, k, mut rng)) = setup("rope_matches_the_cpu_in_both_styles_with_frequency_factors") else { return };
    let (tokens, heads, head_dim) = (37, 3, 64);
    for (style, n_rot, factors) in [
        (RopeStyle::Neox, 64, None),
        (RopeStyle::Interleaved, 64, Some((0..32).map(|i| 1.0 + i as f32 * 0.25).collect::<Vec<f32>>())),
        (RopeStyle::Neox, 32, None),
    ] {
        let rope = Rope {
            style,
            n_rot,
            base: 10_000.0,
            base_sliding: 10_000.0,
            freq_scale: 0.5,
            freq_factors: factors,
            long_factors: None,
            original_context: 2048,
            attn_factor: 1.0,
        };
        let mut table = blocks::RopeTable::default();
        let pos0 = 3000;
        table.fill(&rope, rope.base, rope.freq_scale, pos0..pos0 + tokens);
        let x = random(&mut rng, tokens * heads * head_dim, 3.0);
        let mut want = x.clone();
        for t in 0..tokens {
            table.apply(&mut want[t * heads * head_dim..(t + 1) * heads * head_dim], head_dim, t, style);
        }
        let pairs: Vec<[f32; 2]> = table.cos_sin().iter().map(|&(c, s)| [c, s]).collect();
        let (xb, tb) = (gpu.upload("x", &x).unwrap(), gpu.upload("cos_sin", &pairs).unwrap());
        let mut b = gpu.batch();
        k.rope(&mut b, &xb, &tb, tokens, heads, head_dim, n_rot, style);
        b.submit();
        let got: Vec<f32> = gpu.read(&xb, 0, x.len()).unwrap();
        let err = max_relative_error(&got, &want);
        assert!(err < 1e-6, "{style:?} n_rot {n_rot}: {err}");
    }
}

#[test]
fn gated_activations_match_the_cpu() {
    let Some((gpu, k, mut rng)) = setup("gated_activations_match_the_cpu") else { return };
    let (rows, width) = (5, 1111);
    for (act, tolerance) in [(FfnActivation::Silu, 1e-5), (FfnActivation::GeluTanh, 2e-3)] {
        // Spread over ±14 so GELU's three regions are all visited.
        let gate = random(&mut rng, rows * width, 14.0);
        let up = random(&mut rng, rows * width, 2.0);
        let mut want = gate.clone();
        blocks::gated_activation(&mut want, &up, act, width);
        let (gb, ub) = (gpu.upload("gate", &gate).unwrap(), gpu.upload("up", &up).unwrap());
        let mut b = gpu.batch();
        k.gated_activation(&mut b, &gb, &ub, gate.len(), act);
        b.submit();
        let got: Vec<f32> = gpu.read(&gb, 0, gate.len()).unwrap();
        let err = max_relative_error(&got, &want);
        assert!(err < tolerance, "{act:?}: {err}");
    }
}

#[test]
fn residual_and_bias_adds_match_the_cpu() {
    let Some((gpu, k, mut rng)) = setup("residual_and_bias_adds_match_the_cpu") else { return };
    let (rows, width) = (9, 300);
    let x = random(&mut rng, rows * width, 1.0);
    let y = random(&mut rng, rows * width, 1.0);
    let bias = random(&mut rng, width, 1.0);
    let mut want = x.clone();
    blocks::add_assign(&mut want, &y);
    blocks::add_bias(&mut want, &bias);
    let (xb, yb, bb) = (gpu.upload("x", &x).unwrap(), gpu.upload("y", &y).unwrap(), gpu.upload("b", &bias).unwrap());
    let mut b = gpu.batch();
    k.add_assign(&mut b, &xb, &yb, x.len());
    k.add_bias(&mut b, &xb, &bb, x.len(), width);
    b.submit();
    let got: Vec<f32> = gpu.read(&xb, 0, x.len()).unwrap();
    assert_eq!(got, want);
}

#[test]
fn f16_conversion_lands_at_its_offset_rounded_as_the_cpu_rounds() {
    let Some((gpu, k, mut rng)) = setup("f16_conversion_lands_at_its_offset_rounded_as_the_cpu_rounds") else { return };
    let (len, offset, total) = (1002, 500, 1600);
    let src = random(&mut rng, len, 100.0);
    let sb = gpu.upload("src", &src).unwrap();
    let dst = gpu.upload("dst", &vec![half::f16::from_f32(-7.0); total]).unwrap();
    let mut b = gpu.batch();
    k.to_f16(&mut b, &sb, &dst, len, offset);
    b.submit();
    let got: Vec<half::f16> = gpu.read(&dst, 0, total).unwrap();
    for (i, g) in got.iter().enumerate() {
        let want = match i.checked_sub(offset).filter(|&j| j < len) {
            Some(j) => half::f16::from_f32(src[j]),
            None => half::f16::from_f32(-7.0),
        };
        assert_eq!(g.to_bits(), want.to_bits(), "element {i}");
    }
}
