//! `sift gpu-bench`: the heavy GPU kernels' speed, in TFLOP/s.
//!
//! Each shape runs on each kernel path asked for (cooperative matrices and
//! the tiled fallback), once to warm up and then `--runs` times, timed by GPU
//! timestamps around the dispatches; the median is reported. Inputs are
//! pseudo-random (never zeros). After the runs a few output rows are checked
//! against an f64 computation on the CPU, so a fast wrong kernel shows. An
//! attention call whose output would not fit one storage binding is run in
//! chunks of queries (each attending to every key before it), as prefill
//! would run it.

use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use half::f16;
use sift::gpu::attention::{Attention, AttentionShape};
use sift::gpu::matmul::{Matmul, MatmulShape};
use sift::gpu::{AdapterPolicy, GpuContext, KernelPath};

use super::Usage;

#[derive(Args)]
pub struct GpuBenchArgs {
    /// Kernel paths to measure: best (the adapter's fastest), coop-matrix, tiled, or all
    #[arg(long, value_enum, default_value = "all")]
    path: PathChoice,
    /// Matmul shapes TOKENSxN_INxN_OUT, comma-separated [default, when neither --matmul nor
    /// --attention is given: Gemma 3 270M's prefill products at 32768 tokens]
    #[arg(long, value_delimiter = ',')]
    matmul: Vec<String>,
    /// Attention shapes N:HEADS:KV_HEADS:HEAD_DIM[:WINDOW] (N causal queries from position 0),
    /// comma-separated [default: Gemma 3's global layer 32768:4:1:256, Llama 3.1 8B's
    /// 32768:32:8:128 and 131072:32:8:128]
    #[arg(long, value_delimiter = ',')]
    attention: Vec<String>,
    /// Timed runs per shape and path, after one warm-up
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Attention shapes longer than this run on the coop-matrix path only (the tiled path is slow)
    #[arg(long, default_value_t = 32768)]
    tiled_max_n: u32,
    /// Also accept a software adapter (lavapipe): checks the command, measures nothing useful
    #[arg(long)]
    allow_software: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PathChoice {
    Best,
    CoopMatrix,
    Tiled,
    All,
}

/// Gemma 3 270M's products per layer at prefill (hidden 640, 4 query heads
/// and 1 KV head of 256, MLP 2048): Q, K (and V), O, gate (and up), down.
const DEFAULT_MATMULS: &[&str] =
    &["32768x640x1024", "32768x640x256", "32768x1024x640", "32768x640x2048", "32768x2048x640"];
const DEFAULT_ATTENTION: &[&str] = &["32768:4:1:256", "32768:32:8:128", "131072:32:8:128"];

pub fn run(args: GpuBenchArgs) -> anyhow::Result<()> {
    if args.runs == 0 {
        return Err(Usage("--runs must be at least 1".into()).into());
    }
    let (matmuls, attentions) = match args.matmul.is_empty() && args.attention.is_empty() {
        true => (strings(DEFAULT_MATMULS), strings(DEFAULT_ATTENTION)),
        false => (args.matmul.clone(), args.attention.clone()),
    };
    let matmuls = matmuls.iter().map(|s| parse_matmul(s)).collect::<Result<Vec<_>, _>>()?;
    let attentions = attentions.iter().map(|s| parse_attention(s)).collect::<Result<Vec<_>, _>>()?;
    let policy = match args.allow_software {
        true => AdapterPolicy::AllowSoftware,
        false => AdapterPolicy::Hardware,
    };
    let ctx = GpuContext::open(policy)?;
    let paths: Vec<KernelPath> = match args.path {
        PathChoice::Best => vec![KernelPath::best(&ctx)?],
        PathChoice::CoopMatrix => vec![KernelPath::CooperativeMatrix],
        PathChoice::Tiled => vec![KernelPath::Tiled],
        PathChoice::All => vec![KernelPath::CooperativeMatrix, KernelPath::Tiled],
    };
    let mut runnable = Vec::new();
    for path in paths {
        match path.available(&ctx) {
            Ok(()) => runnable.push(path),
            Err(e) if args.path == PathChoice::All => eprintln!("gpu-bench: skipping {}: {e}", path.name()),
            Err(e) => return Err(e.into()),
        }
    }
    println!(
        "adapter: {} ({:?}, driver {} {})",
        ctx.info.name, ctx.info.device_type, ctx.info.driver, ctx.info.driver_info
    );
    let coop: Vec<String> = ctx
        .cooperative_matrices
        .iter()
        .map(|p| format!("{}x{}x{} {:?}->{:?}", p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type))
        .collect();
    println!(
        "subgroups {}..{}, workgroup memory {} B, storage binding {} B, buffer {} B, cooperative matrices: [{}]",
        ctx.info.subgroup_min_size,
        ctx.info.subgroup_max_size,
        ctx.limits.max_compute_workgroup_storage_size,
        ctx.limits.max_storage_buffer_binding_size,
        ctx.limits.max_buffer_size,
        coop.join(", ")
    );
    let timing = match ctx.has(wgpu::Features::TIMESTAMP_QUERY) {
        true => "GPU timestamps",
        false => "wall clock (no timestamp queries)",
    };
    println!("median of {} runs after a warm-up, timed by {timing}", args.runs);
    let mut rows = Vec::new();
    for &shape in &matmuls {
        for &path in &runnable {
            rows.push(bench_matmul(&ctx, path, shape, args.runs)?);
        }
    }
    for spec in &attentions {
        for &path in &runnable {
            if path == KernelPath::Tiled && spec.n > args.tiled_max_n {
                eprintln!("gpu-bench: attention {} on tiled skipped (N over --tiled-max-n)", spec.label());
                continue;
            }
            rows.push(bench_attention(&ctx, path, spec, args.runs)?);
        }
    }
    println!();
    println!("| kernel | shape | path | median ms | TFLOP/s | checked rows: max rel. error |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.2} | {:.1e} |",
            r.kernel,
            r.shape,
            r.path.name(),
            r.ms,
            r.tflops,
            r.error
        );
    }
    for r in rows.iter().filter(|r| r.path == KernelPath::CooperativeMatrix) {
        if let Some(t) = rows.iter().find(|t| t.path == KernelPath::Tiled && t.kernel == r.kernel && t.shape == r.shape)
        {
            println!("{} {}: coop-matrix {:.1}x the tiled path", r.kernel, r.shape, t.ms / r.ms);
        }
    }
    Ok(())
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn parse_matmul(s: &str) -> Result<MatmulShape, Usage> {
    let v: Vec<u32> = s.split('x').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad_shape(s))?;
    match v[..] {
        [tokens, n_in, n_out] if tokens > 0 && n_in > 0 && n_out > 0 => Ok(MatmulShape { tokens, n_in, n_out }),
        _ => Err(bad_shape(s)),
    }
}

struct AttentionSpec {
    n: u32,
    n_head: u32,
    n_kv_head: u32,
    head_dim: u32,
    window: Option<u32>,
}

impl AttentionSpec {
    fn label(&self) -> String {
        let window = self.window.map_or(String::new(), |w| format!(" window {w}"));
        format!("N={} {}/{} heads d={}{window}", self.n, self.n_head, self.n_kv_head, self.head_dim)
    }
}

fn parse_attention(s: &str) -> Result<AttentionSpec, Usage> {
    let v: Vec<u32> = s.split(':').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad_shape(s))?;
    let spec = match v[..] {
        [n, n_head, n_kv_head, head_dim] => AttentionSpec { n, n_head, n_kv_head, head_dim, window: None },
        [n, n_head, n_kv_head, head_dim, w] => AttentionSpec { n, n_head, n_kv_head, head_dim, window: Some(w) },
        _ => return Err(bad_shape(s)),
    };
    let sane = spec.n > 0 && spec.n_kv_head > 0 && spec.n_head.is_multiple_of(spec.n_kv_head) && spec.n_head > 0;
    match sane && spec.window != Some(0) {
        true => Ok(spec),
        false => Err(bad_shape(s)),
    }
}

fn bad_shape(s: &str) -> Usage {
    Usage(format!("bad shape '{s}': matmul is TOKENSxN_INxN_OUT, attention N:HEADS:KV_HEADS:HEAD_DIM[:WINDOW]"))
}

struct Row {
    kernel: &'static str,
    shape: String,
    path: KernelPath,
    ms: f64,
    tflops: f64,
    /// Largest ‖got − want‖ / ‖want‖ over the rows checked.
    error: f64,
}

/// Inputs: a fixed block of noise repeated over each buffer, so that the CPU
/// check knows every element without keeping the buffers.
struct Pattern<T> {
    block: Vec<T>,
}

impl<T: bytemuck::Pod> Pattern<T> {
    const LEN: usize = 1 << 20;

    fn new(seed: u64, make: impl Fn(f32) -> T) -> Self {
        let mut state = seed;
        let block = (0..Self::LEN)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                make((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect();
        Self { block }
    }

    fn at(&self, i: usize) -> T {
        self.block[i % Self::LEN]
    }

    /// A storage buffer of `len` elements filled with the pattern.
    fn buffer(&self, ctx: &GpuContext, what: &str, len: usize) -> anyhow::Result<wgpu::Buffer> {
        let buffer = ctx.storage::<T>(what, len)?;
        for start in (0..len).step_by(Self::LEN) {
            let end = (start + Self::LEN).min(len);
            ctx.write(&buffer, (start * size_of::<T>()) as u64, &self.block[..end - start]);
        }
        Ok(buffer)
    }
}

/// Runs `record` once to warm up and `runs` times timed; the median in ms.
fn time(
    ctx: &GpuContext,
    runs: usize,
    record: &dyn Fn(&mut sift::gpu::Batch) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let mut samples = Vec::with_capacity(runs);
    for run in 0..=runs {
        let mut batch = ctx.batch();
        batch.mark();
        record(&mut batch)?;
        batch.mark();
        let start = Instant::now();
        let marks = batch.submit_timed()?;
        let ms = match marks {
            Some(between) => between[0],
            None => start.elapsed().as_secs_f64() * 1e3,
        };
        if run > 0 {
            samples.push(ms);
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    if got.iter().any(|g| !g.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm).sqrt()
}

fn bench_matmul(ctx: &GpuContext, path: KernelPath, shape: MatmulShape, runs: usize) -> anyhow::Result<Row> {
    let label = format!("{}x{}x{}", shape.tokens, shape.n_in, shape.n_out);
    eprintln!("gpu-bench: matmul {label} on {}", path.name());
    let (t, k, n) = (shape.tokens as usize, shape.n_in as usize, shape.n_out as usize);
    let xs = Pattern::new(1, |v| v);
    let ws = Pattern::new(2, f16::from_f32);
    let x = xs.buffer(ctx, "x", t * k)?;
    let w = ws.buffer(ctx, "w", n * k)?;
    let y = ctx.storage::<f32>("y", t * n)?;
    let matmul = Matmul::new(ctx, path);
    let bind = matmul.bind(&ctx.device, &x, &w, &y);
    let sizes = [x.size(), w.size(), y.size()];
    let ms = time(ctx, runs, &|batch| Ok(batch.record("matmul", |pass| matmul.dispatch(pass, &bind, shape, sizes))?))?;
    let mut error: f64 = 0.0;
    for row in [0, t / 2, t - 1] {
        let got: Vec<f32> = ctx.read(&y, (row * n * 4) as u64, n)?;
        let want: Vec<f64> =
            (0..n).map(|j| (0..k).map(|c| xs.at(row * k + c) as f64 * ws.at(j * k + c).to_f64()).sum()).collect();
        error = error.max(relative_error(&got, &want));
    }
    Ok(Row { kernel: "matmul", shape: label, path, ms, tflops: shape.flops() / ms / 1e9, error })
}

fn bench_attention(ctx: &GpuContext, path: KernelPath, spec: &AttentionSpec, runs: usize) -> anyhow::Result<Row> {
    eprintln!("gpu-bench: attention {} on {}", spec.label(), path.name());
    let attention = Attention::new(&ctx.device, path, spec.head_dim, spec.n_head / spec.n_kv_head)?;
    let d = spec.head_dim as usize;
    let (hq, hk) = (spec.n_head as usize, spec.n_kv_head as usize);
    // The most queries whose f32 output fits one binding, in whole 64s.
    let binding = ctx.limits.max_storage_buffer_binding_size.min(ctx.limits.max_buffer_size);
    let chunk = ((binding / (hq * d * 4) as u64) as u32 / 64 * 64).min(spec.n.next_multiple_of(64));
    if chunk == 0 {
        bail!("one query's output does not fit a storage binding");
    }
    let scale = 1.0 / (spec.head_dim as f32).sqrt();
    let shape_at = |pos0: u32| AttentionShape {
        n: chunk.min(spec.n - pos0),
        pos0,
        n_head: spec.n_head,
        n_kv_head: spec.n_kv_head,
        window: spec.window,
        scale,
    };
    let chunks: Vec<AttentionShape> = (0..spec.n).step_by(chunk as usize).map(shape_at).collect();
    let last = *chunks.last().context("no queries")?;
    let q_rows = attention.query_rows(&shape_at(0)) as usize;
    let k_rows = attention.key_rows(&last) as usize;
    let (qs, ks, vs) = (Pattern::new(3, f16::from_f32), Pattern::new(4, f16::from_f32), Pattern::new(5, f16::from_f32));
    // Every chunk reads the same queries (at its own positions): timing needs
    // no more.
    let q = qs.buffer(ctx, "q", q_rows * hq * d)?;
    let k = ks.buffer(ctx, "k", k_rows * hk * d)?;
    let v = vs.buffer(ctx, "v", k_rows * hk * d)?;
    let o = ctx.storage::<f32>("o", q_rows * hq * d)?;
    let bind = attention.bind(&ctx.device, &q, &k, &v, &o);
    let sizes = [q.size(), k.size(), v.size(), o.size()];
    let ms = time(ctx, runs, &|batch| {
        for shape in &chunks {
            batch.record("attention", |pass| attention.dispatch(pass, &bind, shape, sizes))?;
        }
        Ok(())
    })?;
    // Check rows of the last chunk (what O holds now) against f64.
    let mut error: f64 = 0.0;
    for i in [0, last.n as usize / 2, last.n as usize - 1] {
        for h in [0, hq - 1] {
            let got: Vec<f32> = ctx.read(&o, ((i * hq + h) * d * 4) as u64, d)?;
            let t = (last.pos0 as usize) + i;
            let first = spec.window.map_or(0, |w| (t + 1).saturating_sub(w as usize));
            let kvh = h / (hq / hk);
            let scores: Vec<f64> = (first..=t)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|c| qs.at((i * hq + h) * d + c).to_f64() * ks.at((j * hk + kvh) * d + c).to_f64())
                        .sum();
                    dot * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let want: Vec<f64> = (0..d)
                .map(|c| {
                    (first..=t).zip(&weights).map(|(j, w)| w * vs.at((j * hk + kvh) * d + c).to_f64()).sum::<f64>()
                        / sum
                })
                .collect();
            error = error.max(relative_error(&got, &want));
        }
    }
    let flops: f64 = chunks.iter().map(|s| s.flops(spec.head_dim)).sum();
    Ok(Row { kernel: "attention", shape: spec.label(), path, ms, tflops: flops / ms / 1e9, error })
}
