//! RouteSparse's kernels against CPU references of the same masks: the sparse
//! attention kernel, for every pattern of the library and for KV heads with
//! different patterns in one dispatch, against softmax attention in f64 over
//! exactly the keys the index lists (causal within them).
//!
//! On lavapipe (CI) only the tiled path runs; sizes stay far below Debian 12
//! lavapipe's cap of 65,535 loop iterations per invocation.

mod common;

use half::f16;
use sift::gpu::attention::{Attention, AttentionShape};
use sift::gpu::route::{Mask, SparseIndex};
use sift::gpu::{GpuContext, KernelPath};

struct Noise(common::Rng);

impl Noise {
    fn f16s(&mut self, len: usize, scale: f32) -> Vec<f16> {
        (0..len).map(|_| f16::from_f32(((self.0.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale)).collect()
    }
}

fn paths(ctx: &GpuContext, test: &str) -> Vec<KernelPath> {
    [KernelPath::CooperativeMatrix, KernelPath::Tiled]
        .into_iter()
        .filter(|path| match path.available(ctx) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("SKIPPED {test} on the {} path: {e}", path.name());
                false
            }
        })
        .collect()
}

struct Case {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
}

/// Softmax attention in f64 over the keys `index` lets query t of each head see.
fn masked_reference(q: &[f16], k: &[f16], v: &[f16], c: &Case, index: &SparseIndex, scale: f64) -> Vec<f64> {
    let (hq, hk, d) = (c.n_head as usize, c.n_kv_head as usize, c.d as usize);
    let mut out = vec![0.0; c.n as usize * hq * d];
    for i in 0..c.n as usize {
        let t = c.pos0 as usize + i;
        for h in 0..hq {
            let kvh = h / (hq / hk);
            let keys: Vec<usize> = (0..=t).filter(|&j| index.sees(kvh as u32, t as u32, j as u32)).collect();
            let qrow = &q[(i * hq + h) * d..][..d];
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let krow = &k[(j * hk + kvh) * d..][..d];
                    scale * qrow.iter().zip(krow).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let o = &mut out[(i * hq + h) * d..][..d];
            for (&j, w) in keys.iter().zip(&weights) {
                for (o, x) in o.iter_mut().zip(&v[(j * hk + kvh) * d..][..d]) {
                    *o += w / sum * x.to_f64();
                }
            }
        }
    }
    out
}

fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    if got.iter().any(|g| !g.is_finite()) {
        return f64::NAN;
    }
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm).sqrt()
}

fn check(ctx: &GpuContext, path: KernelPath, c: &Case, masks: &[&Mask], noise: &mut Noise) {
    let scale = 1.0 / (c.d as f32).sqrt();
    let shape = AttentionShape { n: c.n, pos0: c.pos0, n_head: c.n_head, n_kv_head: c.n_kv_head, window: None, scale };
    let attention = Attention::sparse(&ctx.device, path, c.d, c.n_head / c.n_kv_head).unwrap();
    let index = SparseIndex::new(masks, shape.kv_len());
    let d = c.d as usize;
    let q_rows = attention.query_rows(&shape) as usize;
    let k_rows = attention.key_rows(&shape) as usize;
    // Larger scores than unit noise, so that which keys are left out matters.
    let q = noise.f16s(q_rows * c.n_head as usize * d, 3.0);
    let k = noise.f16s(k_rows * c.n_kv_head as usize * d, 3.0);
    let v = noise.f16s(k_rows * c.n_kv_head as usize * d, 1.0);
    let want = masked_reference(&q, &k, &v, c, &index, scale as f64);
    let dense = Attention::new(&ctx.device, path, c.d, c.n_head / c.n_kv_head).unwrap();
    let (qb, kb, vb) = (ctx.upload("q", &q).unwrap(), ctx.upload("k", &k).unwrap(), ctx.upload("v", &v).unwrap());
    let ob = ctx.upload("o", &vec![f32::NAN; q_rows * c.n_head as usize * d]).unwrap();
    let gpu_index = index.upload(ctx).unwrap();
    let bind = attention.bind_sparse(&ctx.device, [&qb, &kb, &vb, &ob], &gpu_index.buffers());
    let sizes = [qb.size(), kb.size(), vb.size(), ob.size()];
    let mut batch = ctx.batch();
    batch
        .record("sparse attention", |pass| attention.dispatch_sparse(pass, &bind, &shape, sizes, index.query_blocks))
        .unwrap();
    batch.submit();
    let got: Vec<f32> = ctx.read(&ob, 0, want.len()).unwrap();
    let err = relative_error(&got, &want);
    // And the dense kernel on the same inputs, to show the masks matter.
    let od = ctx.upload("o dense", &vec![f32::NAN; q_rows * c.n_head as usize * d]).unwrap();
    let bind = dense.bind(&ctx.device, &qb, &kb, &vb, &od);
    let mut batch = ctx.batch();
    batch.record("attention", |pass| dense.dispatch(pass, &bind, &shape, sizes)).unwrap();
    batch.submit();
    let dense_out: Vec<f32> = ctx.read(&od, 0, want.len()).unwrap();
    let dense_err = relative_error(&dense_out, &want);
    let bound = match path {
        KernelPath::CooperativeMatrix => 3e-3,
        KernelPath::Tiled => 1e-5,
    };
    let names: Vec<&str> = masks.iter().map(|m| m.name()).collect();
    let what =
        format!("{names:?} n={} pos0={} heads {}/{} d={} on {}", c.n, c.pos0, c.n_head, c.n_kv_head, c.d, path.name());
    eprintln!("{what}: relative error {err:.3e}, dense kernel's {dense_err:.3e}");
    assert!(err < bound, "{what}: relative error {err:.3e} (bound {bound:e})");
    let all_dense = masks.iter().all(|m| **m == Mask::Dense);
    assert!(all_dense || dense_err > 100.0 * bound, "{what}: the mask changes nothing ({dense_err:.3e})");
}

#[test]
fn each_pattern_kernel_equals_attention_over_its_mask() {
    let Some(ctx) = common::gpu("each_pattern_kernel_equals_attention_over_its_mask") else { return };
    let mut noise = Noise(common::Rng(0x5eed_0013));
    let ashape = Mask::AShape { sink_blocks: 1, local_blocks: 2 };
    let vslash = Mask::VerticalSlash { columns: vec![3, 70, 71, 150, 260, 333], diagonals: vec![0, 200] };
    let blocks = Mask::BlockSparse { blocks: vec![vec![], vec![], vec![1], vec![1], vec![2], vec![3, 1]] };
    let cases = [
        Case { n: 300, pos0: 0, n_head: 4, n_kv_head: 2, d: 64 },
        Case { n: 200, pos0: 0, n_head: 4, n_kv_head: 1, d: 256 },
        Case { n: 150, pos0: 192, n_head: 2, n_kv_head: 2, d: 128 },
    ];
    for path in paths(ctx, "each_pattern_kernel_equals_attention_over_its_mask") {
        for c in &cases {
            for mask in [&ashape, &vslash, &blocks] {
                let masks = vec![mask; c.n_kv_head as usize];
                check(ctx, path, c, &masks, &mut noise);
            }
        }
        // KV heads with different patterns share one dispatch.
        let c = Case { n: 300, pos0: 0, n_head: 8, n_kv_head: 4, d: 64 };
        check(ctx, path, &c, &[&vslash, &Mask::Dense, &ashape, &blocks], &mut noise);
    }
}
