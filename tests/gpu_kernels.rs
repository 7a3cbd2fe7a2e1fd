//! The heavy GPU kernels (matmul, attention) against f64 references on the
//! CPU, on every kernel path the adapter has: shapes with tails (sizes that
//! are not multiples of the tiles), grouped-query heads, causal masks, sliding
//! windows and chunks that start past position 0. Outputs are poisoned with
//! NaN before each run, so an element a kernel leaves unwritten fails.
//!
//! On lavapipe (CI) only the tiled path runs; Debian 12's lavapipe silently
//! stops shader loops after 65,535 iterations per invocation, so the shapes
//! stay well below that.

mod common;

use half::f16;
use sift::gpu::attention::{Attention, AttentionShape};
use sift::gpu::matmul::{Matmul, MatmulShape};
use sift::gpu::{GpuContext, KernelPath};

/// Uniform numbers in [-1, 1) from a fixed seed (xorshift64*).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn f32s(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.next() * scale).collect()
    }

    fn f16s(&mut self, len: usize, scale: f32) -> Vec<f16> {
        (0..len).map(|_| f16::from_f32(self.next() * scale)).collect()
    }
}

fn poisoned(ctx: &GpuContext, what: &str, len: usize) -> wgpu::Buffer {
    ctx.upload(what, &vec![f32::NAN; len]).unwrap()
}

// ---- matmul ----

fn matmul_reference(x: &[f32], w: &[f16], shape: MatmulShape) -> Vec<f64> {
    let (t, k, n) = (shape.tokens as usize, shape.n_in as usize, shape.n_out as usize);
    let mut y = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c].to_f64()).sum();
        }
    }
    y
}

fn check_matmul(ctx: &GpuContext, path: KernelPath, shape: MatmulShape, noise: &mut Noise) {
    let x = noise.f32s((shape.tokens * shape.n_in) as usize, 1.0);
    let w = noise.f16s((shape.n_out * shape.n_in) as usize, 1.0);
    let want = matmul_reference(&x, &w, shape);
    let (xb, wb) = (ctx.upload("x", &x).unwrap(), ctx.upload("w", &w).unwrap());
    let yb = poisoned(ctx, "y", want.len());
    let matmul = Matmul::new(ctx, path);
    let bind = matmul.bind(&ctx.device, &xb, &wb, &yb);
    let mut batch = ctx.batch();
    batch.record("matmul", |pass| matmul.dispatch(pass, &bind, shape, [xb.size(), wb.size(), yb.size()])).unwrap();
    batch.submit();
    let got: Vec<f32> = ctx.read(&yb, 0, want.len()).unwrap();
    let err = common::relative_error(&got, &want);
    // The cooperative path rounds X to f16: about 2^-11 per product term.
    let bound = match path {
        KernelPath::CooperativeMatrix => 2e-3,
        KernelPath::Tiled => 1e-5,
    };
    assert!(err < bound, "matmul {shape:?} on {}: relative error {err:.3e} (bound {bound:e})", path.name());
    eprintln!("matmul {shape:?} on {}: relative error {err:.3e}", path.name());
}

#[test]
fn matmul_matches_f64_reference_with_tails() {
    let Some(ctx) = common::gpu("matmul_matches_f64_reference_with_tails") else { return };
    let mut noise = Noise(0x5eed_0001);
    let shapes = [(1, 64, 64), (5, 36, 17), (70, 256, 130), (128, 128, 128), (130, 640, 257), (300, 64, 1)];
    for path in common::kernel_paths(ctx, "matmul_matches_f64_reference_with_tails") {
        for (tokens, n_in, n_out) in shapes {
            check_matmul(ctx, path, MatmulShape { tokens, n_in, n_out }, &mut noise);
        }
    }
}

#[test]
fn matmul_rejects_what_it_cannot_hold() {
    let Some(ctx) = common::gpu("matmul_rejects_what_it_cannot_hold") else { return };
    let Some(&path) = common::kernel_paths(ctx, "matmul_rejects_what_it_cannot_hold").last() else { return };
    let matmul = Matmul::new(ctx, path);
    let small = ctx.upload("small", &[0.0f32; 16]).unwrap();
    let bind = matmul.bind(&ctx.device, &small, &small, &small);
    let shape = MatmulShape { tokens: 8, n_in: 8, n_out: 8 };
    let mut batch = ctx.batch();
    let err = batch.record("matmul", |pass| matmul.dispatch(pass, &bind, shape, [64, 64, 64])).unwrap_err();
    assert!(err.to_string().contains("X holds 64 bytes, the shape needs 256"), "{err}");
}

// ---- attention ----

struct Case {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    head_dim: u32,
    window: Option<u32>,
}

/// Softmax attention in f64 over the f16 inputs, the layouts of
/// `sift::gpu::attention`: every earlier key, or those in the window.
fn attention_reference(q: &[f16], k: &[f16], v: &[f16], c: &Case, scale: f64) -> Vec<f64> {
    let case = common::AttentionCase {
        n: c.n as usize,
        pos0: c.pos0 as usize,
        n_head: c.n_head as usize,
        n_kv_head: c.n_kv_head as usize,
        d: c.head_dim as usize,
    };
    let window = c.window.map_or(usize::MAX, |w| w as usize);
    common::attention_reference(q, k, v, &case, scale, |_, t, j| t - j < window)
}

fn check_attention(ctx: &GpuContext, path: KernelPath, c: &Case, noise: &mut Noise) {
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let shape =
        AttentionShape { n: c.n, pos0: c.pos0, n_head: c.n_head, n_kv_head: c.n_kv_head, window: c.window, scale };
    let attention = Attention::new(&ctx.device, path, c.head_dim, c.n_head / c.n_kv_head).unwrap();
    let d = c.head_dim as usize;
    // What the kernel may read, padding included; the padding holds finite
    // noise, so only the masks keep it out.
    let q_rows = attention.query_rows(&shape) as usize;
    let k_rows = attention.key_rows(&shape) as usize;
    let q = noise.f16s(q_rows * c.n_head as usize * d, 2.0);
    let k = noise.f16s(k_rows * c.n_kv_head as usize * d, 2.0);
    let v = noise.f16s(k_rows * c.n_kv_head as usize * d, 1.0);
    let want = attention_reference(&q, &k, &v, c, scale as f64);
    let (qb, kb, vb) = (ctx.upload("q", &q).unwrap(), ctx.upload("k", &k).unwrap(), ctx.upload("v", &v).unwrap());
    let ob = poisoned(ctx, "o", q_rows * c.n_head as usize * d);
    let bind = attention.bind(&ctx.device, &qb, &kb, &vb, &ob);
    let mut batch = ctx.batch();
    let sizes = [qb.size(), kb.size(), vb.size(), ob.size()];
    batch.record("attention", |pass| attention.dispatch(pass, &bind, &shape, sizes)).unwrap();
    batch.submit();
    let got: Vec<f32> = ctx.read(&ob, 0, want.len()).unwrap();
    let err = common::relative_error(&got, &want);
    // The cooperative path rounds the probabilities to f16.
    let bound = match path {
        KernelPath::CooperativeMatrix => 3e-3,
        KernelPath::Tiled => 1e-5,
    };
    let what = format!(
        "attention n={} pos0={} heads {}/{} d={} window {:?} on {}",
        c.n,
        c.pos0,
        c.n_head,
        c.n_kv_head,
        c.head_dim,
        c.window,
        path.name()
    );
    assert!(err < bound, "{what}: relative error {err:.3e} (bound {bound:e})");
    eprintln!("{what}: relative error {err:.3e}");
}

#[test]
fn attention_matches_f64_reference() {
    let Some(ctx) = common::gpu("attention_matches_f64_reference") else { return };
    let mut noise = Noise(0x5eed_0002);
    let case = |n, pos0, n_head, n_kv_head, head_dim, window| Case { n, pos0, n_head, n_kv_head, head_dim, window };
    let cases = [
        // One query; Gemma 3's global shape; its sliding window; a tail of a
        // 16-query block; a chunk past position 0; Llama's grouping; a head
        // dimension of 64 with 3 query heads a KV head.
        case(1, 0, 1, 1, 128, None),
        case(37, 0, 4, 1, 256, None),
        case(100, 0, 4, 1, 256, Some(24)),
        case(70, 50, 2, 2, 128, None),
        case(33, 90, 8, 2, 128, Some(40)),
        case(20, 0, 3, 1, 64, None),
    ];
    for path in common::kernel_paths(ctx, "attention_matches_f64_reference") {
        for c in &cases {
            check_attention(ctx, path, c, &mut noise);
        }
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let Some(ctx) = common::gpu("attention_rejects_bad_shapes") else { return };
    let Some(&path) = common::kernel_paths(ctx, "attention_rejects_bad_shapes").last() else { return };
    assert!(Attention::new(&ctx.device, path, 100, 1).is_err());
    let attention = Attention::new(&ctx.device, path, 128, 4).unwrap();
    let b = ctx.upload("b", &[0.0f32; 1024]).unwrap();
    let bind = attention.bind(&ctx.device, &b, &b, &b, &b);
    let shape = AttentionShape { n: 4, pos0: 0, n_head: 6, n_kv_head: 2, window: None, scale: 1.0 };
    let mut batch = ctx.batch();
    let err = batch.record("attention", |pass| attention.dispatch(pass, &bind, &shape, [4096; 4])).unwrap_err();
    assert!(err.to_string().contains("6 query heads over 2 KV heads"), "{err}");
}

#[test]
fn gpu_bench_rejects_a_bad_shape_in_one_line() {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_sift")).args(["gpu-bench", "--matmul", "1x2"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("bad shape '1x2'"), "{err}");
}

#[test]
fn gpu_bench_without_the_asked_path_exits_2_naming_what_is_missing() {
    let Some(ctx) = common::gpu("gpu_bench_without_the_asked_path_exits_2_naming_what_is_missing") else { return };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(["gpu-bench", "--allow-software", "--path", "coop-matrix", "--matmul", "64x64x64", "--runs", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    match KernelPath::CooperativeMatrix.available(ctx) {
        Ok(()) => assert_eq!(out.status.code(), Some(0), "{err}"),
        Err(e) => {
            assert_eq!(out.status.code(), Some(2), "{err}");
            let last = err.lines().last().unwrap_or_default();
            assert_eq!(last, format!("sift: {e}"), "{err}");
        }
    }
}
