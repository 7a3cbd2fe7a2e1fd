//! Attention alone on synthetic long-context caches of Llama-3.1-8B's shape
//! (32 query heads, 8 KV heads of 128, by default an f16 cache with key
//! sketches): dense,
//! certified (ε = 0.1, value measure, δ = 0.001) and top-k pages at about
//! certified's keys read, one after another on the same queries, in one run.
//!
//! `cargo bench --bench certified_attention [-- LEN... [--captured FILE]...
//! [--kv-cache f16,q8,q4,q2]]` (default 16384 32768 65536 131072, the f16
//! cache). `--kv-cache` takes a comma list, as `sift bench` does: each mode
//! gets its rows, every policy reading that mode's cache (dense its coded
//! rows, certified and top-k the coded keys as their sketch). The caches are drawn as
//! [`synthetic`](sift::attn::certified::synthetic) says: heavy hitters,
//! recency bias, heavy-tailed scores. `--captured FILE` adds a row per layer
//! of a capture (`sift run --capture FILE`, [`capture`](sift::attn::capture)):
//! the model's own keys and values, in the model's own shape, rebuilt into
//! the same f16 cache with sketches, and its last decoding steps' queries,
//! each at its own position. Prints per cache the median time of a call per
//! policy, the ratios to dense, keys read per head (fraction of the visible
//! positions) and bytes read per call. Timings are ratios within one run;
//! absolute numbers drift with the machine's load. A few untimed certified
//! calls come first.

use std::time::Instant;

use sift::attn::capture::Captured;
use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Params, PerturbationSeed};
use sift::attn::dense::Dense;
use sift::attn::topk::Topk;
use sift::attn::{AttentionBatch, AttentionPolicy, HeadRecord, LayerCall};
use sift::kv::{KvMode, PagedLayer, Storage, PAGE};

const STEPS: usize = 9;

/// Untimed certified calls before the timed ones: the first fills the
/// policy's buffers and its table of Chernoff intervals, which later calls
/// find ready, as the calls of a long generation do.
const WARM_UP: u64 = 3;

/// What one policy did over the steps.
#[derive(Default)]
struct Tally {
    times: Vec<f64>,
    keys: usize,
    visible: usize,
    bytes: f64,
    fallbacks: usize,
}

impl Tally {
    fn add(&mut self, seconds: f64, records: &[HeadRecord]) {
        self.times.push(seconds);
        self.keys += records.iter().map(|r| r.keys_read).sum::<usize>();
        self.visible += records.iter().map(|r| r.visible).sum::<usize>();
        self.bytes += records.iter().map(|r| r.bytes_read).sum::<f64>();
        self.fallbacks += records.iter().filter(|r| r.fallback).count();
    }

    fn median(&self) -> f64 {
        let mut t = self.times.clone();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let captured: Vec<&String> = args.windows(2).filter(|w| w[0] == "--captured").map(|w| &w[1]).collect();
    let modes: Vec<KvMode> = match args.windows(2).find(|w| w[0] == "--kv-cache") {
        Some(w) => w[1].split(',').map(|m| m.parse().unwrap_or_else(|e| panic!("--kv-cache: {e}"))).collect(),
        None => vec![KvMode::F16],
    };
    let lens: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let lens = if lens.is_empty() && captured.is_empty() { vec![16384, 32768, 65536, 131072] } else { lens };
    println!(
        "| cache | dense ms | certified ms | topk ms | certified vs dense | topk vs dense | keys read certified \
         | keys read topk | MB/call dense | MB/call certified | MB/call topk | fallbacks |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for mode in modes {
        // The f16 cache's key sketch; the quantized modes' coded keys are their own.
        let storage = Storage { mode, key_sketch: true, ..Storage::default() };
        for &len in &lens {
            let mut cache = SyntheticCache::new(SyntheticShape::llama_8b(len), storage, 1);
            let queries: Vec<Vec<f32>> = (0..=STEPS).map(|_| cache.queries()).collect();
            let batches: Vec<AttentionBatch> = queries.iter().map(|q| cache.decoding_batch(q)).collect();
            compare(&format!("synthetic {len}, {mode}"), &cache.layer, &batches);
        }
        for path in &captured {
            let capture = Captured::read(path.as_ref()).unwrap_or_else(|e| panic!("{e}"));
            for layer in &capture.layers {
                let cache = layer.cache(storage);
                let calls = &layer.calls[layer.calls.len().saturating_sub(STEPS + 1)..];
                assert!(calls.len() > 1, "{path}: layer {} has {} calls, at least 2 needed", layer.layer, calls.len());
                let rows: Vec<_> =
                    calls.iter().map(|c| (layer.row_keys(c.position), layer.row_values(c.position))).collect();
                let batches: Vec<AttentionBatch> =
                    calls.iter().zip(&rows).map(|(call, (keys, values))| layer.batch(call, keys, values)).collect();
                let last = calls[calls.len() - 1].position + 1;
                compare(&format!("captured layer {} at {last}, {mode}", layer.layer), &cache, &batches);
            }
        }
    }
}

/// One row: dense, certified and top-k over the calls of `batches` on
/// `cache`. The first call is untimed, made [`WARM_UP`] times by certified
/// (with other perturbations): top-k gets the pages certified's keys would
/// fill.
fn compare(label: &str, cache: &PagedLayer, batches: &[AttentionBatch]) {
    let mut certified = CertifiedPolicy::new(Params::default(), PerturbationSeed { seed: 42, fixed: false });
    let first = &batches[0];
    let mut out = vec![0.0; first.n_head * first.head_dim_v];
    let mut records = Vec::new();
    for warm_up in (0..WARM_UP).rev() {
        let step = if warm_up == 0 { 0 } else { batches.len() as u64 + warm_up };
        let call = LayerCall { layer: 0, step, batch: first, cache };
        records.clear();
        certified.attend(&call, &mut out, &mut records);
    }
    let keys = records.iter().map(|r| r.keys_read).sum::<usize>() / records.len();
    let mut topk = Topk::new(keys.div_ceil(PAGE));
    let mut dense = Dense;
    let mut tallies: [Tally; 3] = Default::default();
    for (step, batch) in batches.iter().enumerate().skip(1) {
        let call = LayerCall { layer: 0, step: step as u64, batch, cache };
        let policies: [&mut dyn AttentionPolicy; 3] = [&mut dense, &mut certified, &mut topk];
        for (tally, policy) in tallies.iter_mut().zip(policies) {
            records.clear();
            let start = Instant::now();
            policy.attend(&call, &mut out, &mut records);
            tally.add(start.elapsed().as_secs_f64(), &records);
        }
    }
    let steps = batches.len() - 1;
    let [d, c, t] = &tallies;
    let ms = |t: &Tally| 1e3 * t.median();
    let mb = |t: &Tally| t.bytes / steps as f64 / 1e6;
    let frac = |t: &Tally| t.keys as f64 / t.visible as f64;
    println!(
        "| {label} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.2}x | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | {} |",
        ms(d),
        ms(c),
        ms(t),
        d.median() / c.median(),
        d.median() / t.median(),
        frac(c),
        frac(t),
        mb(d),
        mb(c),
        mb(t),
        c.fallbacks
    );
}
