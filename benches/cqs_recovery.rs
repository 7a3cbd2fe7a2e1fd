//! Stream-CQSA's recovery and its cost, at Gemma 3's global-layer attention
//! shape (4 query heads, 1 KV head, 256 dimensions, causal).
//!
//! For each length, the whole call runs on each kernel path the adapter has
//! (the dense kernels: Q, K, V uploaded, O read back) when its working memory
//! fits the budget and the device's limits, and the decomposed call runs from
//! the same host arrays under the budget. Each prints its wall time (host to
//! host), the GPU time of its kernels, the depth reached, the working memory
//! resident at most and the allocator's peak, and the relative error of a few
//! rows against f64 softmax attention.
//!
//! ```sh
//! cargo bench --bench cqs_recovery -- --budget 128M --lengths 8192,16384,32768,65536
//! ```
//!
//! `--budget` takes bytes (K, M, G suffixes); `--no-budget` runs the
//! decomposed call with none, so that only the device's limits split it;
//! `--allow-software` lets a software renderer run it (small lengths only).

use std::time::Instant;

use half::f16;
use rayon::prelude::*;
use sift::gpu::attention::{Attention, AttentionShape};
use sift::gpu::cqs::plan::Mask;
use sift::gpu::cqs::{working_bytes, AttentionCall, Cqs};
use sift::gpu::{AdapterPolicy, GpuContext, GpuError, KernelPath};

const N_HEAD: usize = 4;
const N_KV_HEAD: usize = 1;
const HEAD_DIM: usize = 256;
/// Query rows checked against f64.
const CHECKED_ROWS: usize = 4;

struct Options {
    budget: Option<u64>,
    lengths: Vec<usize>,
    policy: AdapterPolicy,
}

fn parse_bytes(s: &str) -> u64 {
    let (digits, shift) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 10),
        Some(b'M') => (&s[..s.len() - 1], 20),
        Some(b'G') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().unwrap_or_else(|_| panic!("--budget {s}: not a byte count")) << shift
}

fn options() -> Options {
    let mut o = Options { budget: Some(128 << 20), lengths: vec![8192, 16384, 32768], policy: AdapterPolicy::Hardware };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--budget" => o.budget = Some(parse_bytes(&args.next().expect("--budget BYTES"))),
            "--no-budget" => o.budget = None,
            "--lengths" => {
                let list = args.next().expect("--lengths N,N,...");
                o.lengths = list.split(',').map(|n| n.parse().expect("a length")).collect();
            }
            "--allow-software" => o.policy = AdapterPolicy::AllowSoftware,
            // cargo bench passes --bench.
            _ => {}
        }
    }
    o
}

/// Reproducible normal-ish f16s, filled in parallel.
fn noise(len: usize, seed: u64) -> Vec<f16> {
    let mut out = vec![f16::ZERO; len];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        let mut state = seed ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for x in chunk {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let sum: f64 = (0..4).map(|i| ((z >> (16 * i)) & 0xffff) as f64 / 65536.0).sum();
            *x = f16::from_f64((sum - 2.0) * 3f64.sqrt());
        }
    });
    out
}

/// The f64 softmax attention of query `t`, head `h` (causal).
fn reference(q: &[f16], k: &[f16], v: &[f16], t: usize, h: usize, scale: f64) -> Vec<f64> {
    let qrow = &q[(t * N_HEAD + h) * HEAD_DIM..][..HEAD_DIM];
    let kvh = h / (N_HEAD / N_KV_HEAD);
    let scores: Vec<f64> = (0..=t)
        .into_par_iter()
        .map(|j| {
            let krow = &k[(j * N_KV_HEAD + kvh) * HEAD_DIM..][..HEAD_DIM];
            scale * qrow.iter().zip(krow).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>()
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0.0; HEAD_DIM];
    let mut sum = 0.0;
    for (j, s) in scores.iter().enumerate() {
        let w = (s - max).exp();
        sum += w;
        for (o, x) in out.iter_mut().zip(&v[(j * N_KV_HEAD + kvh) * HEAD_DIM..][..HEAD_DIM]) {
            *o += w * x.to_f64();
        }
    }
    out.iter().map(|o| o / sum).collect()
}

/// The largest relative error (max-norm) of the checked rows.
fn check(out: &[f32], q: &[f16], k: &[f16], v: &[f16], n: usize, scale: f32) -> f64 {
    let rows = (0..CHECKED_ROWS).map(|i| if i == 0 { 0 } else { n * i / CHECKED_ROWS + i }.min(n - 1));
    let mut worst: f64 = 0.0;
    for t in rows.chain([n - 1]) {
        for h in 0..N_HEAD {
            let want = reference(q, k, v, t, h, scale as f64);
            let got = &out[(t * N_HEAD + h) * HEAD_DIM..][..HEAD_DIM];
            let diff = got.iter().zip(&want).map(|(&g, w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            worst = worst.max(diff / want.iter().map(|w| w.abs()).fold(0.0, f64::max));
        }
    }
    worst
}

/// The whole call on `path`: wall time, kernel time, allocator peak, output.
fn whole(
    ctx: &GpuContext,
    path: KernelPath,
    q: &[f16],
    k: &[f16],
    v: &[f16],
    n: usize,
    scale: f32,
) -> Result<(f64, Option<f64>, Option<u64>, Vec<f32>), GpuError> {
    let kernel_error =
        |e: sift::gpu::KernelError| GpuError::Kernel { kernel: "attention".into(), reason: e.to_string() };
    let attention =
        Attention::new(&ctx.device, path, HEAD_DIM as u32, (N_HEAD / N_KV_HEAD) as u32).map_err(kernel_error)?;
    let shape = AttentionShape {
        n: n as u32,
        pos0: 0,
        n_head: N_HEAD as u32,
        n_kv_head: N_KV_HEAD as u32,
        window: None,
        scale,
    };
    let (q_rows, k_rows) = (attention.query_rows(&shape) as usize, attention.key_rows(&shape) as usize);
    let started = Instant::now();
    let qb = ctx.storage::<f16>("q", q_rows * N_HEAD * HEAD_DIM)?;
    let kb = ctx.storage::<f16>("k", k_rows * N_KV_HEAD * HEAD_DIM)?;
    let vb = ctx.storage::<f16>("v", k_rows * N_KV_HEAD * HEAD_DIM)?;
    let ob = ctx.storage::<f32>("o", q_rows * N_HEAD * HEAD_DIM)?;
    let peak = ctx.device.generate_allocator_report().map(|r| r.total_allocated_bytes);
    let mut batch = ctx.batch();
    for b in [&qb, &kb, &vb] {
        batch.clear(b);
    }
    batch.submit();
    ctx.write(&qb, 0, q);
    ctx.write(&kb, 0, k);
    ctx.write(&vb, 0, v);
    let bind = attention.bind(&ctx.device, &qb, &kb, &vb, &ob);
    let mut batch = ctx.batch();
    batch.mark();
    let sizes = [qb.size(), kb.size(), vb.size(), ob.size()];
    batch.record("attention", |pass| attention.dispatch(pass, &bind, &shape, sizes)).map_err(kernel_error)?;
    batch.mark();
    let gpu = batch.submit_timed()?.map(|t| t.iter().sum());
    let out: Vec<f32> = ctx.read_once(&ob, 0, n * N_HEAD * HEAD_DIM)?;
    Ok((started.elapsed().as_secs_f64(), gpu, peak, out))
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn main() {
    let o = options();
    let ctx = GpuContext::open(o.policy).unwrap_or_else(|e| panic!("{e}"));
    let paths: Vec<KernelPath> =
        [KernelPath::CooperativeMatrix, KernelPath::Tiled].into_iter().filter(|p| p.available(&ctx).is_ok()).collect();
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let cqs = Cqs::new(&ctx, HEAD_DIM, N_HEAD / N_KV_HEAD, o.budget).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "adapter {}; budget {}; binding limit {} bytes",
        ctx.info.name,
        o.budget.map_or("none".into(), |b| format!("{b} bytes")),
        ctx.limits.max_storage_buffer_binding_size
    );
    println!("| N | method | depth | pieces | wall s | kernels s | resident GiB | allocator peak GiB | rel. error |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for &n in &o.lengths {
        let q = noise(n * N_HEAD * HEAD_DIM, 1);
        let k = noise(n * N_KV_HEAD * HEAD_DIM, 2);
        let v = noise(n * N_KV_HEAD * HEAD_DIM, 3);
        let call_bytes = working_bytes(n, n, N_HEAD, N_KV_HEAD, HEAD_DIM);
        for &path in &paths {
            let method = format!("whole ({})", path.name());
            if o.budget.is_some_and(|b| call_bytes > b) {
                println!("| {n} | {method} | – | – | refused: {call_bytes} bytes past the budget | | | | |");
                continue;
            }
            match whole(&ctx, path, &q, &k, &v, n, scale) {
                Ok((wall, gpu, peak, out)) => println!(
                    "| {n} | {method} | 0 | 1 | {wall:.3} | {} | {:.3} | {} | {:.1e} |",
                    gpu.map_or("–".into(), |g| format!("{:.3}", g / 1e3)),
                    gib(call_bytes),
                    peak.map_or("–".into(), |p| format!("{:.3}", gib(p))),
                    check(&out, &q, &k, &v, n, scale)
                ),
                Err(e) => println!("| {n} | {method} | – | – | failed: {e} | | | | |"),
            }
        }
        let call = AttentionCall {
            q: &q,
            k: &k,
            v: &v,
            queries: n,
            keys: n,
            n_head: N_HEAD,
            n_kv_head: N_KV_HEAD,
            head_dim: HEAD_DIM,
            mask: Mask { causal: true, window: None },
            scale,
        };
        let mut out = vec![0.0f32; n * N_HEAD * HEAD_DIM];
        let started = Instant::now();
        match cqs.attend(&ctx, &call, &mut out) {
            Ok(r) => {
                let wall = started.elapsed().as_secs_f64();
                println!(
                    "| {n} | decomposed | {} | {} | {wall:.3} | {:.3} | {:.3} | {} | {:.1e} |",
                    r.depth,
                    r.pieces,
                    r.compute_ms / 1e3,
                    gib(r.peak_bytes),
                    r.device_peak_bytes.map_or("–".into(), |p| format!("{:.3}", gib(p))),
                    check(&out, &q, &k, &v, n, scale)
                );
                eprintln!("N = {n}: {r}");
            }
            Err(e) => println!("| {n} | decomposed | – | – | failed: {e} | | | | |"),
        }
    }
}
