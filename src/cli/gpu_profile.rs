//! `sift gpu-profile`: the latency profile routed prefill needs, the mass
//! calibration δ, and a comparison of routed against dense attention.
//!
//! Without `--calibrate` or `--compare`, it measures the sparse attention
//! kernel for every pattern and budget of the library, and the probe, at each
//! length of `--tokens`, for the head shape of the model (or `--shape`), and
//! writes the profile to the file `--prefill-attn routed` reads (printed on
//! stdout). `--calibrate FILE...` prefills the first `--calibrate-tokens`
//! tokens of each text on the GPU and writes δ_q (see
//! `sift::gpu::route::calibration`). `--compare N,...` times attention over
//! synthetic queries, keys and values with recency and heavy hitters (a
//! local band of rotating directions, a few keys every query favours) at
//! each length: sift's dense kernel, then routed attention with its probe,
//! routing and index included, audited against the dense output; with
//! `--captured DIR` the inputs are instead a model's own queries, keys and
//! values, kept by `--capture DIR TEXT...` and tiled to the compared shape
//! (see `sift::gpu::route::captured`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use half::f16;
use sift::engine::Session;
use sift::gpu::attention::{Attention, AttentionShape, BLOCK};
use sift::gpu::prefill::GpuPrefill;
use sift::gpu::report::HeadReport;
use sift::gpu::route::calibration::CalibrationFile;
use sift::gpu::route::captured::{tile, CapturedLayer, CapturedPassage};
use sift::gpu::route::profile::{median, LatencyProfile, BUCKETS};
use sift::gpu::route::{Pattern, RecentRows, RouteSettings, RoutedAttention};
use sift::gpu::{AdapterPolicy, GpuContext, KernelPath};
use sift::model::Model;

use super::{ModelArgs, Usage};

#[derive(Args)]
pub struct GpuProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Head shape HEADS:KV_HEADS:HEAD_DIM to profile instead of the model's (no model is read)
    #[arg(long)]
    shape: Option<String>,
    /// Lengths to measure, comma-separated [default: 4096 up to 32768, or to 131072 with --shape]
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Timed runs per measurement, after one warm-up
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also accept a software adapter (lavapipe): checks the command, measures nothing useful
    #[arg(long)]
    allow_software: bool,
    /// Calibrate δ from dense runs on these texts (files, or directories of .txt files) instead
    /// of profiling; use texts other than those you evaluate on
    #[arg(long, value_name = "FILE", num_args = 1..)]
    calibrate: Vec<PathBuf>,
    /// Tokens of each calibration text prefilled
    #[arg(long, default_value_t = 8192)]
    calibrate_tokens: usize,
    /// The one-sided quantile δ is of the residuals m̂ − m
    #[arg(long, default_value_t = 0.95)]
    quantile: f64,
    /// Time routed against dense attention on synthetic inputs at these lengths (after
    /// profiling the shape if it has no profile yet)
    #[arg(long, value_delimiter = ',')]
    compare: Vec<u32>,
    /// --compare: the routed layer's budget, a fraction of dense time; several, comma-separated,
    /// are compared one after another on the same inputs and calibration
    #[arg(long, value_delimiter = ',', default_value = "0.25")]
    prefill_budget: Vec<f64>,
    /// --compare: dense fallback when a KV head's lower mass bound is under this; several as
    /// for --prefill-budget (every pair of the two lists is compared). The first is the τ
    /// --calibrate and --compare's calibration widen recent query blocks to with
    /// --prefill-recent-rows=keep
    #[arg(long, value_delimiter = ',', default_value = "0.95")]
    prefill_tau: Vec<f64>,
    /// --compare and --calibrate: what the probe's recent rows add to the lower mass bound
    /// (mean, bound or keep: see `sift run`'s flag)
    #[arg(long, value_name = "MODE", num_args = 0..=1, default_value = "mean", default_missing_value = "bound",
          require_equals = true, value_parser = super::recent_rows_parser())]
    prefill_recent_rows: RecentRows,
    /// Instead of profiling, prefill passages of these texts on the GPU and keep each passage's
    /// queries, keys and values at the global layers under --capture-dir
    #[arg(long, value_name = "FILE", num_args = 1.., requires = "capture_dir")]
    capture: Vec<PathBuf>,
    /// Where --capture writes (a directory per passage, named after the text and passage)
    #[arg(long, value_name = "DIR")]
    capture_dir: Option<PathBuf>,
    /// --capture: tokens of each passage (its first is BOS)
    #[arg(long, default_value_t = 32768)]
    capture_tokens: usize,
    /// --capture: disjoint passages taken from the start of each text, at most
    #[arg(long, default_value_t = 1)]
    capture_passages: usize,
    /// --compare on the captures under DIR, tiled to the shape, in place of synthetic inputs
    #[arg(long, value_name = "DIR", requires = "captured_calibration")]
    captured: Option<PathBuf>,
    /// --captured: the captures δ is calibrated on (other texts than --captured's)
    #[arg(long, value_name = "DIR")]
    captured_calibration: Option<PathBuf>,
}

pub fn run(args: GpuProfileArgs) -> anyhow::Result<()> {
    if args.runs == 0 {
        return Err(Usage("--runs must be at least 1".into()).into());
    }
    let policy = match args.allow_software {
        true => AdapterPolicy::AllowSoftware,
        false => AdapterPolicy::Hardware,
    };
    if !args.calibrate.is_empty() {
        return calibrate(&args, policy);
    }
    if let Some(dir) = &args.capture_dir {
        return capture(&args, dir, policy);
    }
    let (shape, default_top) = match &args.shape {
        Some(s) => (parse_shape(s)?, 131072),
        None => {
            let file = args.model.open()?;
            let model = Model::load(&file)?;
            let hp = &model.hp;
            ((hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim_k as u32), 32768)
        }
    };
    let ctx = GpuContext::open(policy)?;
    let path = KernelPath::best(&ctx)?;
    let file = LatencyProfile::file(&ctx, path, shape.2, shape.0, shape.1);
    let profile = match (args.compare.is_empty(), LatencyProfile::load(&file)) {
        (false, Ok(profile)) => profile,
        _ => {
            let buckets: Vec<u32> = match args.tokens.is_empty() {
                true => BUCKETS.iter().copied().filter(|&b| b <= default_top).collect(),
                false => args.tokens.clone(),
            };
            let profile = LatencyProfile::measure(&ctx, path, shape, &buckets, args.runs)?;
            profile.save(&file).with_context(|| format!("writing {}", file.display()))?;
            print_profile(&profile);
            println!("profile: {}", file.display());
            profile
        }
    };
    let inputs = match (&args.captured, &args.captured_calibration) {
        (Some(eval), Some(calibration)) => {
            let read = |dir: &PathBuf| CapturedPassage::read_all(dir).map_err(anyhow::Error::msg);
            Inputs::Captured { eval: read(eval)?, calibration: read(calibration)? }
        }
        _ => Inputs::Synthetic,
    };
    let settings: Vec<(f64, f64)> =
        args.prefill_tau.iter().flat_map(|&tau| args.prefill_budget.iter().map(move |&budget| (budget, tau))).collect();
    for &n in &args.compare {
        compare(&ctx, path, shape, n, &profile, &inputs, &settings, args.prefill_recent_rows, args.runs)?;
    }
    Ok(())
}

/// What `--compare` attends over.
enum Inputs {
    /// [`synthetic`], seed 0 measured and seed 1 calibrated on.
    Synthetic,
    /// Captures tiled to the shape.
    Captured { eval: Vec<CapturedPassage>, calibration: Vec<CapturedPassage> },
}

impl Inputs {
    /// Queries, keys and values of `n` positions for `(hq, hk, d)`, padded to
    /// `rows`, measured on or (with `calibration`) calibrated on.
    fn make(
        &self,
        (hq, hk, d): (u32, u32, u32),
        n: u32,
        rows: usize,
        calibration: bool,
    ) -> anyhow::Result<[Vec<f16>; 3]> {
        let shape = (hq as usize, hk as usize, d as usize);
        match self {
            Inputs::Synthetic => Ok(synthetic(n as usize, shape.0, shape.1, shape.2, rows, calibration as u64)),
            Inputs::Captured { eval, calibration: held_out } => {
                let passages = if calibration { held_out } else { eval };
                tile(passages, shape, n as usize, rows).map_err(anyhow::Error::msg)
            }
        }
    }

    fn describe(&self, calibration: bool) -> String {
        match self {
            Inputs::Synthetic => format!("synthetic, seed {}", calibration as u64),
            Inputs::Captured { eval, calibration: held_out } => {
                let passages = if calibration { held_out } else { eval };
                let names: Vec<&str> = passages.iter().map(|p| p.source.as_str()).collect();
                format!("captured from {}, tiled", names.join(", "))
            }
        }
    }
}

fn parse_shape(s: &str) -> Result<(u32, u32, u32), Usage> {
    let bad = || Usage(format!("bad --shape '{s}': HEADS:KV_HEADS:HEAD_DIM, heads a multiple of KV heads"));
    let v: Vec<u32> = s.split(':').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad())?;
    match v[..] {
        [h, kv, d] if kv > 0 && h > 0 && h.is_multiple_of(kv) && d > 0 && d.is_multiple_of(32) => Ok((h, kv, d)),
        _ => Err(bad()),
    }
}

fn print_profile(profile: &LatencyProfile) {
    println!("adapter: {} ({}), {} path", profile.adapter, profile.driver, profile.path);
    println!("| pattern | budget | tokens | µs per KV head | keys visited per KV head | µs per key / dense's |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    // The dense kernel's time per key at a length.
    let dense_per_key = |tokens: u32| {
        let e = profile.entries.iter().find(|e| e.pattern == Pattern::Dense && e.tokens == tokens)?;
        (e.keys > 0.0).then(|| e.us / e.keys)
    };
    let relative = |us: f64, keys: f64, tokens: u32| match dense_per_key(tokens) {
        Some(d) if keys > 0.0 => format!("{:.2}", us / keys / d),
        _ => "".into(),
    };
    for e in &profile.entries {
        println!(
            "| {} | {:?} | {} | {:.1} | {:.0} | {} |",
            e.pattern.name(),
            e.pattern.budget_units(e.budget),
            e.tokens,
            e.us,
            e.keys,
            relative(e.us, e.keys, e.tokens)
        );
    }
    for p in &profile.listed_dense {
        let keys = profile.entries.iter().find(|e| e.pattern == Pattern::Dense && e.tokens == p.tokens).map(|e| e.keys);
        let keys = keys.unwrap_or(0.0);
        println!(
            "| every block, sparse kernel | | {} | {:.1} | {keys:.0} | {} |",
            p.tokens,
            p.us,
            relative(p.us, keys, p.tokens)
        );
    }
    for p in &profile.probe {
        println!("| probe + index builders (layer) | | {} | {:.1} | | |", p.tokens, p.us);
    }
}

/// Synthetic attention inputs with recency (queries and keys share rotating
/// directions, so a query favours the keys near it) and heavy hitters (the
/// first 4 keys and every 997th get a component every query favours), more
/// or less sharp per KV head.
fn synthetic(n: usize, hq: usize, hk: usize, d: usize, rows: usize, seed: u64) -> [Vec<f16>; 3] {
    let mut state = 0x2545_f491_4f6c_dd1du64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let pairs = 8usize;
    let angle = |t: usize, f: usize| t as f32 * std::f32::consts::TAU / (128u32 << f) as f32;
    let sharpness = |kv_head: usize| 1.0 + (kv_head % 4) as f32;
    let mut q = vec![f16::ZERO; rows.max(n) * hq * d];
    let mut k = vec![f16::ZERO; rows.max(n) * hk * d];
    let mut v = vec![f16::ZERO; rows.max(n) * hk * d];
    let group = hq / hk;
    for t in 0..n {
        for h in 0..hq {
            let a = sharpness(h / group) * 1.6;
            let row = &mut q[(t * hq + h) * d..][..d];
            for (c, x) in row.iter_mut().enumerate() {
                *x = f16::from_f32(match c {
                    c if c < 2 * pairs => a * if c % 2 == 0 { angle(t, c / 2).cos() } else { angle(t, c / 2).sin() },
                    c if c == 2 * pairs => 3.0,
                    _ => 0.5 * noise(),
                });
            }
        }
        let heavy = t < 4 || t % 997 == 0;
        for h in 0..hk {
            let a = sharpness(h) * 1.6;
            let row = &mut k[(t * hk + h) * d..][..d];
            for (c, x) in row.iter_mut().enumerate() {
                *x = f16::from_f32(match c {
                    c if c < 2 * pairs => a * if c % 2 == 0 { angle(t, c / 2).cos() } else { angle(t, c / 2).sin() },
                    c if c == 2 * pairs => {
                        if heavy {
                            3.0
                        } else {
                            0.0
                        }
                    }
                    _ => 0.5 * noise(),
                });
            }
            for x in &mut v[(t * hk + h) * d..][..d] {
                *x = f16::from_f32(noise());
            }
        }
    }
    [q, k, v]
}

/// Dense against routed attention at `n` positions, δ calibrated first on
/// held-out inputs (synthetic of another seed, or other captures), at each
/// `(budget, τ)` of `settings` in turn on the same inputs.
///
/// The two are timed clock-fairly: the GPU's clock drops within seconds of
/// idling and takes some 0.1–0.5 s of work to climb back, so every input
/// sits on the GPU before the first timing, one untimed pass of each warms
/// the clock, the pipelines and the buffer pools, and then `runs`
/// repetitions alternate dense and routed, each routed pass right after a
/// dense one (as a prefill's projections precede its attention). Medians are
/// reported, with every sample. The routed passes are not audited (an
/// audit reads every output back); a separate audited pass, after them,
/// gives the report's true masses and certificate coverage.
#[allow(clippy::too_many_arguments)]
fn compare(
    ctx: &GpuContext,
    path: KernelPath,
    (hq, hk, d): (u32, u32, u32),
    n: u32,
    profile: &LatencyProfile,
    inputs: &Inputs,
    settings: &[(f64, f64)],
    recent_rows: RecentRows,
    runs: usize,
) -> anyhow::Result<()> {
    eprintln!("gpu-profile: comparing at {n} tokens on {}", inputs.describe(false));
    let dense = Attention::new(&ctx.device, path, d, hq / hk)?;
    // Chunks whose f32 output fits one binding, in whole blocks.
    let binding = ctx.limits.max_storage_buffer_binding_size.min(ctx.limits.max_buffer_size);
    let chunk = ((binding / (hq * d * 4) as u64) as u32 / BLOCK * BLOCK).min(n.next_multiple_of(BLOCK));
    let scale = 1.0 / (d as f32).sqrt();
    let shapes: Vec<AttentionShape> = (0..n)
        .step_by(chunk as usize)
        .map(|pos0| AttentionShape { n: chunk.min(n - pos0), pos0, n_head: hq, n_kv_head: hk, window: None, scale })
        .collect();
    let rows = n.next_multiple_of(BLOCK) as usize;
    // Calibrated with the masks routing makes (recent query blocks widened or not).
    let calibration = RouteSettings {
        pattern: Some(Pattern::AShape),
        calibrate: true,
        recent_rows,
        tau: settings[0].1,
        ..RouteSettings::default()
    };
    let calibrating = RoutedAttention::new(ctx, path, (d, hq / hk), calibration, None)?;
    let held_out = GpuInputs::upload(ctx, &inputs.make((hq, hk, d), n, rows, true)?, &shapes, d as usize)?;
    held_out.routed(ctx, &calibrating, &dense)?;
    held_out.recycle(ctx);
    let residuals = calibrating.residuals.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let calibrated = CalibrationFile::from_residuals(&residuals, 0.95, String::new(), vec![], n as usize);
    let delta = calibrated.as_ref().map_or(RouteSettings::default().delta, |c| c.delta_for(recent_rows));
    eprintln!("gpu-profile: δ = {delta:.4} from {} residuals on {}", residuals.len(), inputs.describe(true));
    if let Some(c) = &calibrated {
        println!("  {}", describe_calibration(c));
    }
    let pattern_deltas = calibrated.as_ref().map_or(vec![], |c| c.pattern_deltas(recent_rows));
    let measured = GpuInputs::upload(ctx, &inputs.make((hq, hk, d), n, rows, false)?, &shapes, d as usize)?;
    for &(budget, tau) in settings {
        let settings = RouteSettings {
            budget,
            tau,
            recent_rows,
            delta,
            pattern_deltas: pattern_deltas.clone(),
            ..RouteSettings::default()
        };
        let routed = RoutedAttention::new(ctx, path, (d, hq / hk), settings.clone(), Some(profile.clone()))?;
        measured.dense(ctx, &dense)?;
        measured.routed(ctx, &routed, &dense)?;
        let (mut dense_samples, mut routed_samples, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let mut unrouted = Vec::new();
        let mut reports = Vec::new();
        for _ in 0..runs {
            let dense_ms = measured.dense(ctx, &dense)?;
            *routed.report.lock().unwrap_or_else(|p| p.into_inner()) = Default::default();
            let unrouted_ms = measured.routed(ctx, &routed, &dense)?;
            let report = std::mem::take(&mut *routed.report.lock().unwrap_or_else(|p| p.into_inner()));
            let routed_ms = report.timing.routed_wall_ms + unrouted_ms;
            unrouted.push(unrouted_ms);
            dense_samples.push(dense_ms);
            routed_samples.push(routed_ms);
            ratios.push(dense_ms / routed_ms);
            reports.push(report);
        }
        // The repetition of the median ratio, for its time split.
        let mut order: Vec<usize> = (0..runs).collect();
        order.sort_by(|&a, &b| ratios[a].total_cmp(&ratios[b]));
        let timing = &reports[order[runs / 2]].timing;
        let audited = RoutedAttention::new(
            ctx,
            path,
            (d, hq / hk),
            RouteSettings { audit: true, ..settings },
            Some(profile.clone()),
        )?;
        measured.routed(ctx, &audited, &dense)?;
        let mut report = audited.report.lock().unwrap_or_else(|p| p.into_inner());
        report.summarize();
        println!(
            "compare N={n} {hq}/{hk} heads d={d} ({}), τ {tau}, budget {budget}, recent rows {}, δ {delta:.4}, \
             {runs} alternating runs after a warm-up of each: dense {:.2} ms (GPU timestamps), routed {:.2} ms \
             (wall clock, readbacks included), medians; dense/routed {:.2}x (median of the runs' ratios); \
             the median run's routed time: probe {:.2} + index {:.2} GPU, routing {:.2} + lists {:.2} CPU \
             (the GPU waiting for lists {:.2}), kernel {:.2} GPU = dense {:.2} + sparse {:.2}; chunks not routed \
             (wall clock) {:.2}",
            inputs.describe(false),
            recent_rows.name(),
            median(&dense_samples),
            median(&routed_samples),
            median(&ratios),
            timing.probe_ms,
            timing.index_ms,
            timing.routing_ms,
            timing.lists_ms,
            timing.lists_waited_ms,
            timing.kernel_ms,
            timing.dense_kernel_ms,
            timing.sparse_kernel_ms,
            unrouted[order[runs / 2]],
        );
        let list = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(", ");
        println!(
            "  runs: dense [{}] ms, routed [{}] ms, ratios [{}]",
            list(&dense_samples),
            list(&routed_samples),
            list(&ratios)
        );
        println!("  probe and index kernels (GPU ms, the median run): {:?}", timing.probe_kernels_ms);
        println!("  the audited pass (after the runs):");
        for layer in &report.layers {
            for h in &layer.heads {
                println!("  pos0 {} {h}", layer.pos0);
                println!("    highest m̲ per pattern: {}", highest_lower_bounds(h));
            }
        }
        println!(
            "  fallback rate {:.3}, coverage {:?}, layers within budget {}/{}",
            report.summary.fallback_rate,
            report.summary.coverage,
            report.summary.layers_within_budget,
            report.layers.len()
        );
    }
    measured.recycle(ctx);
    Ok(())
}

/// For each sparse pattern, the candidate the router weighed for `head` with
/// the highest m̲ (the cheapest of equals): how far the head was from a
/// sparse choice.
fn highest_lower_bounds(head: &HeadReport) -> String {
    let best = |pattern: Pattern| {
        let weighed = head.candidates.iter().filter(|c| c.pattern == pattern.name());
        let c = weighed.max_by(|a, b| a.mass_lower.total_cmp(&b.mass_lower).then(b.time_us.total_cmp(&a.time_us)))?;
        Some(format!(
            "{} {:?} m̂ {:.3} m̲ {:.3} ({:.0} µs)",
            c.pattern, c.budget, c.mass_estimate, c.mass_lower, c.time_us
        ))
    };
    Pattern::SPARSE.into_iter().filter_map(best).collect::<Vec<_>>().join(", ")
}

/// `--compare`'s inputs on the GPU: keys, values, each chunk's queries (so
/// that no upload idles the GPU between timings), and one output.
struct GpuInputs<'s> {
    shapes: &'s [AttentionShape],
    d: usize,
    queries: Vec<wgpu::Buffer>,
    keys: wgpu::Buffer,
    values: wgpu::Buffer,
    out: wgpu::Buffer,
}

impl<'s> GpuInputs<'s> {
    /// `[q, k, v]` for the chunks `shapes` (heads of `d` dimensions).
    fn upload(
        ctx: &GpuContext,
        [q, k, v]: &[Vec<f16>; 3],
        shapes: &'s [AttentionShape],
        d: usize,
    ) -> anyhow::Result<Self> {
        let q_row = shapes[0].n_head as usize * d;
        let widest = shapes.iter().map(|s| s.n.next_multiple_of(BLOCK) as usize).max().unwrap_or(0);
        let queries = shapes
            .iter()
            .map(|shape| {
                let rows = shape.n.next_multiple_of(BLOCK) as usize;
                let first = shape.pos0 as usize * q_row;
                let mut chunk_q = q[first..][..(rows * q_row).min(q.len() - first)].to_vec();
                chunk_q.resize(rows * q_row, f16::ZERO);
                ctx.upload("q", &chunk_q)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            shapes,
            d,
            queries,
            keys: ctx.upload("k", k)?,
            values: ctx.upload("v", v)?,
            out: ctx.storage::<f32>("o", widest * q_row)?,
        })
    }

    /// The dense kernel over every chunk; its GPU time (the wall clock
    /// without timestamp queries).
    fn dense(&self, ctx: &GpuContext, dense: &Attention) -> anyhow::Result<f64> {
        let mut ms = 0.0;
        for (shape, q) in self.shapes.iter().zip(&self.queries) {
            let started = Instant::now();
            let marks = self.dense_chunk(ctx, dense, shape, q)?;
            ms += marks.and_then(|m| m.first().copied()).unwrap_or_else(|| started.elapsed().as_secs_f64() * 1e3);
        }
        Ok(ms)
    }

    /// The dense kernel over one chunk; its GPU timestamps.
    fn dense_chunk(
        &self,
        ctx: &GpuContext,
        dense: &Attention,
        shape: &AttentionShape,
        q: &wgpu::Buffer,
    ) -> anyhow::Result<Option<Vec<f64>>> {
        let bind = dense.bind(&ctx.device, q, &self.keys, &self.values, &self.out);
        let sizes = [q.size(), self.keys.size(), self.values.size(), self.out.size()];
        let mut batch = ctx.batch();
        batch.mark();
        batch.record("attention", |pass| dense.dispatch(pass, &bind, shape, sizes))?;
        batch.mark();
        Ok(batch.submit_timed()?)
    }

    /// `routed` over every chunk, into its report, as a prefill calls it: a
    /// chunk that routing would not pay for (its dense attention costs less
    /// than the probe, as a prompt's last 64 queries at 128K) runs dense.
    /// Returns those chunks' wall clock, ms.
    fn routed(&self, ctx: &GpuContext, routed: &RoutedAttention, dense: &Attention) -> anyhow::Result<f64> {
        let mut dense_ms = 0.0;
        for (shape, q) in self.shapes.iter().zip(&self.queries) {
            if routed.takes(shape) {
                routed.attend(ctx, 0, shape, [q, &self.keys, &self.values, &self.out], dense, self.d)?;
            } else {
                let started = Instant::now();
                self.dense_chunk(ctx, dense, shape, q)?;
                dense_ms += started.elapsed().as_secs_f64() * 1e3;
            }
        }
        Ok(dense_ms)
    }

    fn recycle(self, ctx: &GpuContext) {
        for b in self.queries.into_iter().chain([self.keys, self.values, self.out]) {
            ctx.recycle(b);
        }
    }
}

/// `--capture`: each text's first `--capture-passages` passages of
/// `--capture-tokens` tokens (BOS and the text's next tokens) prefilled on
/// the GPU, their global layers' queries and keys after RoPE and their values
/// written to a directory per passage.
fn capture(args: &GpuProfileArgs, dir: &std::path::Path, policy: AdapterPolicy) -> anyhow::Result<()> {
    let file = args.model.open()?;
    let model = Model::load(&file)?;
    let hp = &model.hp;
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file)?;
    let bos = tokenizer.bos().context("the model has no BOS token")?;
    let ctx = GpuContext::open(policy)?;
    let prefill = GpuPrefill::new(&ctx, &model)?;
    let global: Vec<usize> = (0..hp.n_layer).filter(|&il| !hp.is_sliding(il)).collect();
    let rope = hp.rope.at_context(args.capture_tokens + 1);
    let frequencies: Vec<f64> = (0..rope.n_rot / 2)
        .map(|i| {
            let divisor = rope.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
            rope.freq_scale as f64 * (rope.base as f64).powf(-2.0 * i as f64 / rope.n_rot as f64) / divisor
        })
        .collect();
    let body_tokens =
        args.capture_tokens.checked_sub(1).filter(|&t| t > 0).context("--capture-tokens must be at least 2")?;
    for text in &args.capture {
        let body = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
        let tokens = tokenizer.encode(&body, false, false)?;
        let stem = text.file_stem().map_or("text".into(), |s| s.to_string_lossy().into_owned());
        for (i, passage) in tokens.chunks_exact(body_tokens).take(args.capture_passages).enumerate() {
            let prompt: Vec<u32> = std::iter::once(bos).chain(passage.iter().copied()).collect();
            let source = format!("{stem} tokens {}..{}", i * body_tokens, (i + 1) * body_tokens);
            eprintln!("gpu-profile: capturing {source}");
            let mut layers: Vec<CapturedLayer> =
                global.iter().map(|&layer| CapturedLayer { layer, ..CapturedLayer::default() }).collect();
            let mut keep = |stage: &str, il: usize, rows: &[f32]| {
                let Some(layer) = layers.iter_mut().find(|l| l.layer == il) else { return };
                let into = match stage {
                    "q_rope" => &mut layer.q,
                    "k_rope" => &mut layer.k,
                    "v" => &mut layer.v,
                    _ => return,
                };
                into.extend(rows.iter().map(|&x| f16::from_f32(x)));
            };
            let mut cache = sift::kv::KvCache::new(&model.cache_shape(), Default::default(), prompt.len() + 1, 1);
            prefill.run(&prompt, 0, &mut cache, sift::model::Outputs::CacheOnly, Some(&mut keep))?;
            let captured = CapturedPassage {
                source,
                tokens: prompt.len(),
                n_head: hp.n_head,
                n_kv_head: hp.n_head_kv,
                head_dim: hp.head_dim_k,
                attn_scale: hp.attn_scale,
                neox: rope.style == sift::model::hparams::RopeStyle::Neox,
                frequencies: frequencies.clone(),
                layers,
            };
            let out = dir.join(format!("{stem}-{i}"));
            captured.write(&out).with_context(|| format!("writing {}", out.display()))?;
            println!("captured {}: {} tokens, layers {global:?}: {}", captured.source, captured.tokens, out.display());
        }
    }
    Ok(())
}

/// `--calibrate`: δ from dense runs on the texts.
fn calibrate(args: &GpuProfileArgs, policy: AdapterPolicy) -> anyhow::Result<()> {
    let file = args.model.open()?;
    let model = Model::load(&file)?;
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file)?;
    let ctx: &'static GpuContext = Box::leak(Box::new(GpuContext::open(policy)?));
    // Calibrated with the masks routing makes (recent query blocks widened to τ or not).
    let settings = RouteSettings {
        pattern: Some(Pattern::BlockSparse),
        calibrate: true,
        recent_rows: args.prefill_recent_rows,
        tau: args.prefill_tau[0],
        ..RouteSettings::default()
    };
    let prefill = GpuPrefill::new(ctx, &model)?.with_routing(settings)?;
    let mut texts = Vec::new();
    for path in &args.calibrate {
        match path.is_dir() {
            true => {
                let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                    .with_context(|| format!("reading {}", path.display()))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                    .collect();
                files.sort();
                texts.extend(files);
            }
            false => texts.push(path.clone()),
        }
    }
    for text in &texts {
        eprintln!("gpu-profile: calibrating on {}", text.display());
        let body = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
        let mut tokens = tokenizer.encode(&body, true, false)?;
        tokens.truncate(args.calibrate_tokens);
        let mut session = Session::new(&model, tokens.len() + 1);
        session.set_prefill_backend(Box::new(&prefill));
        session.prefill(&tokens)?;
    }
    let residuals =
        prefill.routed().map(|r| r.residuals.lock().unwrap_or_else(|p| p.into_inner()).clone()).unwrap_or_default();
    let names = texts.iter().map(|t| t.display().to_string()).collect();
    let model_name = file.path().file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let calibration =
        CalibrationFile::from_residuals(&residuals, args.quantile, model_name, names, args.calibrate_tokens)
            .context("no global layer was routed: no residuals")?;
    let out = CalibrationFile::file(&model.hp);
    calibration.save(&out).with_context(|| format!("writing {}", out.display()))?;
    println!("{}: {}", describe_calibration(&calibration), out.display());
    Ok(())
}

/// δ of both bounds, overall and per pattern.
fn describe_calibration(c: &CalibrationFile) -> String {
    let patterns: Vec<String> = c
        .patterns
        .iter()
        .map(|p| format!("{} {:.4} / {:.4} of {}", p.pattern.name(), p.delta, p.delta_recent, p.residuals))
        .collect();
    format!(
        "delta {:.4} (the {} quantile of {} residuals m̂ − m; mean {:.4}, max {:.4}), with recent rows {} \
         (of min(m̂, ŵ) − m); per pattern (mean / recent rows): {}",
        c.delta,
        c.quantile,
        c.residuals,
        c.mean_residual,
        c.max_residual,
        c.delta_recent.map_or("none".into(), |d| format!("{d:.4}")),
        patterns.join(", ")
    )
}
