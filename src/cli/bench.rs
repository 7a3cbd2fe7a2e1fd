//! `sift bench`: llama-bench's measurements. `pp N` is the rate at which a
//! fresh N-token prompt is processed; `tg N` the rate of N single-token decode
//! steps, after a context of `depth` tokens has been prefilled (untimed).
//! Each test runs once to warm up, then `reps` timed times; tokens are drawn
//! at random from the vocabulary, after a BOS. Every test runs with each KV
//! cache mode and each attention policy asked for; the table says what each
//! mode stores per token, and, for generation, how many keys and bytes the
//! attention of a decoding step read (all layers and heads together). A
//! sparse policy's generation tests rectify every `--rectify-every` tokens
//! (each value given is a test of its own; by default 32 for a sparse
//! policy, off for dense), and say what share of the decode time the dense
//! rectification passes took.

use std::time::Instant;

use clap::Args;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sift::attn::AttentionKind;
use sift::engine::{Session, DEFAULT_BATCH};
use sift::kv::{KvMode, Storage};
use sift::model::Model;

use super::attn::{rectify_every, PolicyArgs};
use super::{GpuArgs, ModelArgs};
use sift::gpu::on_demand::{self, GpuMode};
use sift::rectify::Rectify;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to test (pp), comma-separated; 0 skips
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    prompts: Vec<usize>,
    /// Generation lengths to test (tg), comma-separated; 0 skips
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    gens: Vec<usize>,
    /// Context depths to run every test at, comma-separated
    #[arg(short = 'd', long = "depth", value_delimiter = ',', default_value = "0")]
    depths: Vec<usize>,
    /// Timed repetitions per test
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    reps: usize,
    /// KV cache modes to test, comma-separated (f16, q8, q4, q2)
    #[arg(long = "kv-cache", env = "SIFT_KV_CACHE", value_delimiter = ',', default_value = "f16")]
    kv_caches: Vec<KvMode>,
    /// Attention policies to test, comma-separated (dense, certified, topk); see `sift run --help`
    #[arg(long = "attn", value_delimiter = ',', default_value = "dense")]
    attns: Vec<AttentionKind>,
    #[command(flatten)]
    policy: PolicyArgs,
    /// Rectification intervals to test with each sparse policy, comma-separated (0: off); see
    /// `sift run --help`. Default 32 for a sparse policy, 0 for dense
    #[arg(long = "rectify-every", value_name = "F", value_delimiter = ',')]
    rectify_every: Vec<usize>,
    /// Dot f32 activations with weights dequantized to f32 instead of 8-bit activations
    #[arg(long)]
    f32_activations: bool,
    #[command(flatten)]
    gpu: GpuArgs,
    /// Print JSON rows {test, prefill, kv_cache, attn, rectify_every, kv_bytes_per_token,
    /// keys_per_step, bytes_per_step, rectify_share, tokens_per_s, stddev, median, samples,
    /// ttft_ms} instead of a table
    #[arg(long)]
    json: bool,
}

/// The seed of certified attention's perturbations in every test.
const PERTURBATION_SEED: u64 = 0;

#[derive(serde::Serialize)]
struct Row {
    test: String,
    /// Where the prompt was prefilled: "cpu" or "gpu" (decoding is the CPU's).
    prefill: &'static str,
    kv_cache: String,
    attn: AttentionKind,
    rectify_every: usize,
    kv_bytes_per_token: f64,
    /// Generation only: keys and cache bytes the attention of one decoding
    /// step read, all layers and heads together, over the last run's steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    keys_per_step: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_per_step: Option<f64>,
    /// Generation only: the share of the decode time the rectification
    /// passes took, over the last run.
    #[serde(skip_serializing_if = "Option::is_none")]
    rectify_share: Option<f64>,
    tokens_per_s: f64,
    stddev: f64,
    median: f64,
    samples: Vec<f64>,
    /// pp tests: time to first token, the median prefill time including the
    /// first token's logits.
    ttft_ms: Option<f64>,
}

/// Keys and bytes read by the decoding steps of a run, and the time it
/// spent rectifying.
#[derive(Default, Clone, Copy)]
struct Reads {
    steps: usize,
    keys: f64,
    bytes: f64,
    rectify_share: f64,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.reps == 0 {
        return Err(super::Usage("-r must be at least 1".into()).into());
    }
    args.policy.check()?;
    let file = args.model.open()?;
    let model = Model::load(&file)?;
    let longest = args.prompts.iter().chain(&args.gens).max().copied().unwrap_or(0) + 1;
    let deepest = args.depths.iter().max().copied().unwrap_or(0) + longest;
    if deepest > model.hp.n_ctx_train {
        eprintln!(
            "sift: warning: the deepest test reaches position {deepest}, past the model's training context of {}",
            model.hp.n_ctx_train
        );
    }
    sift::matmul::set_f32_activations(args.f32_activations);
    let bos = sift::tokenizer::Tokenizer::from_gguf(&file)?.bos();
    let mut rng = StdRng::seed_from_u64(1234);
    let n_vocab = model.hp.n_vocab as u32;
    let mut random_tokens = |n: usize| -> Vec<u32> {
        (0..n).map(|i| if i == 0 { bos.unwrap_or(0) } else { rng.random_range(0..n_vocab) }).collect()
    };

    // The GPU is opened and the weights uploaded once, before any timing.
    let gpu_prefill = match args.gpu.mode() {
        GpuMode::Off => None,
        mode => match on_demand::upload(&model, mode, &args.gpu.prefill_options(&model.hp)?) {
            Ok(prefill) => Some(prefill),
            Err(e) if mode == GpuMode::On => return Err(e.into()),
            Err(e) => {
                eprintln!("sift: {e}; prefill stays on the CPU");
                None
            }
        },
    };
    let on_gpu = |p: usize| gpu_prefill.as_ref().is_some_and(|g| g.takes_prompt(p));

    let mut rows = Vec::new();
    // Dense attention has nothing to rectify: one test, without.
    let intervals = |attn: AttentionKind| -> Result<Vec<usize>, super::Usage> {
        if attn == AttentionKind::Dense || args.rectify_every.is_empty() {
            return Ok(vec![rectify_every(None, attn)?]);
        }
        args.rectify_every.iter().map(|&every| rectify_every(Some(every), attn)).collect()
    };
    let mut tests = Vec::new();
    for (&mode, &attn) in args.kv_caches.iter().flat_map(|m| args.attns.iter().map(move |a| (m, a))) {
        tests.extend(intervals(attn)?.into_iter().map(|every| (mode, attn, every)));
    }
    for (mode, attn, every) in tests {
        let storage = Storage { mode, ..Storage::default() };
        let per_token = model.cache_shape().bytes_per_token(mode);
        let session = |n_ctx| -> anyhow::Result<Session> {
            let policy = args.policy.policy(attn, PERTURBATION_SEED, false)?;
            let mut session = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, storage, policy);
            session.set_rectify(Rectify::every(every))?;
            if let Some(prefill) = &gpu_prefill {
                session.set_prefill_backend(Box::new(prefill));
            }
            Ok(session)
        };
        let row = |test: String, samples, reads: Option<Reads>| Row {
            keys_per_step: reads.map(|r| r.keys / r.steps.max(1) as f64),
            bytes_per_step: reads.map(|r| r.bytes / r.steps.max(1) as f64),
            rectify_share: reads.map(|r| r.rectify_share),
            rectify_every: every,
            ..row(test, mode, attn, per_token, samples)
        };
        for &depth in &args.depths {
            let suffix = if depth > 0 { format!(" @ d{depth}") } else { String::new() };
            for &p in args.prompts.iter().filter(|&&p| p > 0) {
                let context = random_tokens(depth);
                let prompt = random_tokens(p);
                let samples = measure(args.reps, p, || {
                    let mut session = session(depth + p)?;
                    if depth > 0 {
                        session.set_prefill_progress(Some(super::prefill_progress(true, None)));
                        session.prefill(&context)?;
                        session.set_prefill_progress(None);
                    }
                    let t = Instant::now();
                    session.prefill(&prompt)?;
                    Ok(t.elapsed().as_secs_f64())
                })?;
                let mut r = row(format!("pp{p}{suffix}"), samples, None);
                r.ttft_ms = Some(p as f64 / r.median * 1e3);
                r.prefill = if depth == 0 && on_gpu(p) { "gpu" } else { "cpu" };
                rows.push(r);
            }
            for &n in args.gens.iter().filter(|&&n| n > 0) {
                let context = random_tokens(depth.max(1));
                let steps = random_tokens(n);
                let mut reads = Reads::default();
                let samples = measure(args.reps, n, || {
                    let mut session = session(depth + n + 1)?;
                    session.set_prefill_progress(Some(super::prefill_progress(true, None)));
                    session.prefill(&context)?;
                    session.set_prefill_progress(None);
                    reads = Reads::default();
                    let t = Instant::now();
                    for &token in &steps {
                        session.decode(token)?;
                        let records = session.last_records();
                        reads.steps += 1;
                        reads.keys += records.iter().map(|r| r.keys_read as f64).sum::<f64>();
                        reads.bytes += records.iter().map(|r| r.bytes_read).sum::<f64>();
                    }
                    let elapsed = t.elapsed().as_secs_f64();
                    reads.rectify_share = session.rectify_stats().time.as_secs_f64() / elapsed;
                    Ok(elapsed)
                })?;
                rows.push(row(format!("tg{n}{suffix}"), samples, Some(reads)));
            }
        }
    }

    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    let gib = file.tensors().iter().map(|t| t.n_bytes).sum::<usize>() as f64 / (1u64 << 30) as f64;
    println!(
        "| model | size | threads | isa | prefill | kv cache | attn | rectify | KV B/token | test | keys/step | MiB/step | rectify % | t/s | median | TTFT ms |"
    );
    println!(
        "| --- | ---: | ---: | --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    for r in &rows {
        println!(
            "| {} {} | {gib:.2} GiB | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {:.2} ± {:.2} | {:.2} | {} |",
            model.hp.arch.gguf_name(),
            model.hp.name,
            rayon::current_num_threads(),
            simd::kernels().isa(),
            r.prefill,
            r.kv_cache,
            r.attn,
            r.rectify_every,
            r.kv_bytes_per_token,
            r.test,
            or_dash(r.keys_per_step.map(|k| format!("{k:.0}"))),
            or_dash(r.bytes_per_step.map(|b| format!("{:.2}", b / (1u64 << 20) as f64))),
            or_dash(r.rectify_share.map(|s| format!("{:.1}", 100.0 * s))),
            r.tokens_per_s,
            r.stddev,
            r.median,
            r.ttft_ms.map_or(String::new(), |t| format!("{t:.1}"))
        );
    }
    Ok(())
}

/// One warm-up run, then `reps` timed runs; returns tokens per second of each.
fn measure(reps: usize, tokens: usize, mut run: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<Vec<f64>> {
    run()?;
    (0..reps).map(|_| run().map(|secs| tokens as f64 / secs)).collect()
}

fn row(test: String, mode: KvMode, attn: AttentionKind, kv_bytes_per_token: f64, samples: Vec<f64>) -> Row {
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - mean) * (s - mean)).sum::<f64>() / (n - 1.0).max(1.0);
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    eprintln!("sift: {test} ({mode}, {attn}): {mean:.2} t/s (median {median:.2})");
    Row {
        test,
        kv_cache: mode.to_string(),
        attn,
        kv_bytes_per_token,
        rectify_every: 0,
        keys_per_step: None,
        bytes_per_step: None,
        rectify_share: None,
        tokens_per_s: mean,
        stddev: var.sqrt(),
        median,
        samples,
        prefill: "cpu",
        ttft_ms: None,
    }
}
