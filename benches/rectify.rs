//! Rectification's effect on sparse decoding, on PG-19: how far certified
//! and ReSA attention drift from dense decoding over a long generation, with
//! and without a dense rectification every 32 tokens.
//!
//! ```sh
//! cargo bench --bench rectify -- --prefix 4096 --gen 1024 --teacher 4 --free 40 --out docs/rectify \
//!     --variants certified,certified+rectify,certified:0.5,certified:0.5+rectify,resa,resa+rectify \
//!     --free-variants certified:0.05+rectify
//! ```
//!
//! Prefixes are spans of `--prefix` tokens (BOS first) of the books in
//! `--books` (default `../shared/data/pg19`), taken in turn from each book
//! at evenly spread offsets. Every run uses f32 activations against f32
//! weights (under 8-bit activation rounding any perturbation at all flips
//! about 5% of top-1 choices, which would hide the policies' own effect).
//! Each prefix is prefilled once, densely, and every policy decodes from a
//! copy of that cache ([`Session::fork`]). Variants (`--variants`, each
//! `certified[:EPS][+rectify]` or `resa[+rectify]`; default
//! `certified,certified+rectify,resa,resa+rectify`) decode beside dense:
//! certified attention at ε (default 0.1; δ = 0.001, value measure, fixed
//! seed), resa, each with or without rectification every
//! `--rectify-every` (32) tokens. `--free-variants` adds variants whose
//! free-running result alone is wanted: on a teacher-forced prefix they
//! stop as a free-running one would. The weights are dequantized to f32
//! once and kept ([`sift::matmul::keep_dequantized_weights`]).
//!
//! * **Teacher-forced** (the first `--teacher` prefixes): dense decodes
//!   `--gen` greedy tokens; every sparse policy decodes the same tokens in
//!   lockstep, writing its own keys and values, and each step's
//!   `KL(dense ‖ policy)` and top-1 agreement are averaged per bin of 128
//!   positions. With `--teacher-sampled`, dense's tokens are drawn instead,
//!   as `sift run` draws them by default (temperature 0.8, top-k 40, top-p
//!   0.95, min-p 0.05, seeded with the prefix's number): a sampled
//!   continuation reads like text, where this model's greedy one soon
//!   settles into a loop. It measures no free-running result (`--free 0`).
//!   `--teacher-repeat-penalty R` (implies `--teacher-sampled`) divides the
//!   positive logits of the tokens among dense's last 64 by `R` (and
//!   multiplies the negative ones) before the draw, as `sift run
//!   --repeat-penalty` does, so that its text does not settle into a loop
//!   even where sampling alone would; the KL is of the unpenalised logits.
//! * **Free-running** (the first `--free` prefixes): every policy's own
//!   `--free-gen` greedy tokens; the share of prefixes whose continuation
//!   equals dense's, and the mean position of the first difference among
//!   those that differ. A policy's greedy continuation is dense's up to the
//!   first step at which, fed dense's tokens, its top token is not dense's,
//!   so that step is found in lockstep with dense, and the policy stops
//!   there.
//!
//! Rectification's effect is shown per prefix too: each pair's mean KL over
//! the first and the second half of the teacher-forced tokens, with and
//! without rectification; then, over the second half and each of its bins,
//! a paired one-sided test over prefixes (which are independent spans of
//! text; the positions within one prefix are not) of "rectification lowers
//! the mean KL": the sign test and Wilcoxon's signed-rank test (exact),
//! decided at α = 0.05 by the latter. Free-running rates come with their
//! Clopper–Pearson 95% interval. The opposite one-sided p (higher with
//! rectification) is given beside it.
//!
//! Where the KL lies: a teacher-forced prefix keeps dense's tokens, and the
//! second half's mean KL of each pair is split between positions whose
//! dense token continues a repeat of dense's own continuation (it and the
//! 8 tokens before it occurred earlier in it: a greedy loop) and the
//! others. At the end of a teacher-forced prefix, each variant's keys and
//! values at the decoded positions are compared with dense's, per layer and
//! bin (relative L2): how far its cache drifted, and whether that grows.
//!
//! Writes `rectify-<prefix>.md` (the tables), `rectify-<prefix>.json` (the
//! tables' numbers and every prefix's per-step record) and
//! `rectify-<prefix>.png` (per-bin mean KL, log scale) to `--out`, and the
//! tables to stdout. The JSON is rewritten after every prefix and every 128
//! teacher-forced steps, so a stopped run keeps what it measured.
//!
//! **Shards.** `--prefixes A..B` runs only the prefixes numbered `A` to
//! `B − 1` of the same set (so several processes, each with its own
//! `--threads`, share one experiment) and writes
//! `rectify-<prefix>-part-A-B.json` and `.md`, no plot. `--merge PATH...`
//! runs nothing: it reads the shards' (or whole runs') JSON, files or the
//! `rectify-*.json` in directories, and writes each prefix length's tables,
//! JSON and plot to `--out`, as one run of all of them would have. Shards of
//! the same prefix set may run different variants: each variant's rows are
//! over the prefixes that ran it. Decode
//! times are from loaded runs: compare them only with each other.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use plotters::prelude::*;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sift::attn::certified::{CertifiedPolicy, Grid, Params, PerturbationSeed};
use sift::attn::dense::Dense;
use sift::attn::resa::{self, Resa};
use sift::attn::{AttentionPolicy, Measure};
use sift::engine::{Session, DEFAULT_BATCH};
use sift::gguf::GgufFile;
use sift::kv::{PagedLayer, Storage};
use sift::matmul::{MatmulScratch, Matrix};
use sift::model::Model;
use sift::rectify::{Rectify, DEFAULT_EVERY};
use sift::sample::{Sampler, SamplingParams};
use sift::tokenizer::Tokenizer;
use simd::WeightType;

/// The plot's font, the first of these that exists (Debian's
/// fonts-liberation, fonts-dejavu-core), unless `SIFT_PLOT_FONT` names one.
const PLOT_FONTS: [&str; 2] = [
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
];

/// Positions per bin of the teacher-forced table.
const BIN: usize = 128;

struct Args {
    model: PathBuf,
    books: PathBuf,
    out: PathBuf,
    settings: Settings,
    threads: usize,
    /// The prefixes this process runs (all by default).
    prefixes: Option<Range<usize>>,
    /// Results to merge instead of running.
    merge: Vec<PathBuf>,
}

/// What defines an experiment. Runs whose prefix set is the same (equal
/// prefix length, generation lengths, interval and number of prefixes) can
/// be merged, whatever variants each ran: the report has a row per variant
/// name, over the prefixes that ran it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Settings {
    prefix: usize,
    gen: usize,
    teacher: usize,
    free: usize,
    free_gen: usize,
    rectify_every: usize,
    /// The variants decoded beside dense (results written before this field
    /// existed ran the default ones).
    #[serde(default = "Variant::defaults")]
    variants: Vec<Variant>,
    /// Teacher-forced on dense's sampled tokens rather than its greedy ones.
    #[serde(default)]
    teacher_sampled: bool,
    /// The repetition penalty of dense's draws (1: none).
    #[serde(default = "no_penalty")]
    teacher_repeat_penalty: f32,
}

fn no_penalty() -> f32 {
    1.0
}

impl Settings {
    /// Prefixes in the set: the teacher-forced ones are its first.
    fn runs(&self) -> usize {
        self.teacher.max(self.free)
    }

    /// Whether runs of `self` and `other` are of the same prefixes and steps.
    fn same_prefixes(&self, other: &Settings) -> bool {
        let key = |s: &Settings| {
            (s.prefix, s.gen, s.free_gen, s.rectify_every, s.runs(), s.teacher_sampled, s.teacher_repeat_penalty)
        };
        key(self) == key(other)
    }

    /// Dense first, then the sparse variants.
    fn all_variants(&self) -> Vec<Variant> {
        std::iter::once(Variant { policy: Policy::Dense, rectify: false, free_only: false })
            .chain(self.variants.iter().copied())
            .collect()
    }
}

impl Args {
    fn parse() -> anyhow::Result<Self> {
        let mut args = Self {
            model: std::env::var_os("SIFT_MODEL").map_or("models/gemma-3-270m-Q4_K_M.gguf".into(), PathBuf::from),
            books: "../shared/data/pg19".into(),
            out: "target/rectify".into(),
            settings: Settings {
                prefix: 4096,
                gen: 1024,
                teacher: 4,
                free: 20,
                free_gen: 128,
                rectify_every: DEFAULT_EVERY,
                variants: Variant::defaults(),
                teacher_sampled: false,
                teacher_repeat_penalty: 1.0,
            },
            threads: sift::threads::default_threads(),
            prefixes: None,
            merge: Vec::new(),
        };
        let mut it = std::env::args().skip(1).peekable();
        while let Some(flag) = it.next() {
            if flag == "--bench" {
                continue;
            }
            if flag == "--teacher-sampled" {
                args.settings.teacher_sampled = true;
                continue;
            }
            if flag == "--merge" {
                while let Some(path) = it.next_if(|a| !a.starts_with("--")) {
                    args.merge.push(path.into());
                }
                anyhow::ensure!(!args.merge.is_empty(), "--merge needs at least one file or directory");
                continue;
            }
            let value = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
            let number = |value: &str| value.parse::<usize>().map_err(|e| anyhow::anyhow!("{flag} {value}: {e}"));
            let s = &mut args.settings;
            match flag.as_str() {
                "--model" => args.model = value.into(),
                "--books" => args.books = value.into(),
                "--out" => args.out = value.into(),
                "--threads" => args.threads = number(&value)?,
                "--prefix" => s.prefix = number(&value)?,
                "--gen" => s.gen = number(&value)?,
                "--teacher" => s.teacher = number(&value)?,
                "--free" => s.free = number(&value)?,
                "--free-gen" => s.free_gen = number(&value)?,
                "--rectify-every" => s.rectify_every = number(&value)?,
                "--teacher-repeat-penalty" => {
                    s.teacher_repeat_penalty = value.parse().map_err(|e| anyhow::anyhow!("{flag} {value}: {e}"))?;
                    anyhow::ensure!(s.teacher_repeat_penalty >= 1.0, "{flag} {value}: below 1");
                    s.teacher_sampled = true;
                }
                "--variants" => {
                    let free_only: Vec<Variant> = s.variants.iter().filter(|v| v.free_only).copied().collect();
                    s.variants = value.split(',').map(Variant::parse).collect::<anyhow::Result<_>>()?;
                    s.variants.extend(free_only);
                }
                "--free-variants" => {
                    let free = value.split(',').map(|v| Ok(Variant { free_only: true, ..Variant::parse(v)? }));
                    s.variants.extend(free.collect::<anyhow::Result<Vec<_>>>()?);
                }
                "--prefixes" => {
                    let (a, b) =
                        value.split_once("..").ok_or_else(|| anyhow::anyhow!("--prefixes {value}: not A..B"))?;
                    args.prefixes = Some(number(a)?..number(b)?);
                }
                _ => anyhow::bail!("unknown flag {flag}"),
            }
        }
        anyhow::ensure!(args.settings.free_gen >= 1, "--free-gen must be at least 1");
        anyhow::ensure!(
            !args.settings.teacher_sampled || args.settings.free == 0,
            "--teacher-sampled measures no free-running result: pass --free 0"
        );
        if let Some(range) = &args.prefixes {
            anyhow::ensure!(
                range.start < range.end && range.end <= args.settings.runs(),
                "--prefixes {range:?}: the set has prefixes 0..{}",
                args.settings.runs()
            );
        }
        Ok(args)
    }
}

/// A sparse policy with its setting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
enum Policy {
    Dense,
    /// Certified attention at this ε (δ = 0.001, value measure, seed 0).
    Certified {
        eps: f64,
    },
    Resa,
}

/// The ε of certified attention's default setting, the one named plainly.
const DEFAULT_EPS: f64 = 0.1;

/// A policy and whether it rectifies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Variant {
    policy: Policy,
    rectify: bool,
    /// Only its free-running result is wanted: on a teacher-forced prefix it
    /// too stops at its first difference from dense, or after `--free-gen`.
    #[serde(default)]
    free_only: bool,
}

impl Variant {
    /// Certified and resa, each without and with rectification.
    fn defaults() -> Vec<Variant> {
        let certified = Policy::Certified { eps: DEFAULT_EPS };
        [(certified, false), (certified, true), (Policy::Resa, false), (Policy::Resa, true)]
            .map(|(policy, rectify)| Variant { policy, rectify, free_only: false })
            .to_vec()
    }

    /// `certified[:EPS][+rectify]` or `resa[+rectify]`.
    fn parse(spec: &str) -> anyhow::Result<Variant> {
        let (base, rectify) = match spec.strip_suffix("+rectify") {
            Some(base) => (base, true),
            None => (spec, false),
        };
        let policy = match base.split_once(':') {
            None if base == "certified" => Policy::Certified { eps: DEFAULT_EPS },
            None if base == "resa" => Policy::Resa,
            Some(("certified", eps)) => {
                let eps: f64 = eps.parse().map_err(|e| anyhow::anyhow!("--variants {spec}: ε {eps}: {e}"))?;
                anyhow::ensure!(eps > 0.0 && eps < 1.0, "--variants {spec}: ε must lie in (0, 1)");
                Policy::Certified { eps }
            }
            _ => anyhow::bail!("--variants {spec}: not certified[:EPS][+rectify] or resa[+rectify]"),
        };
        Ok(Variant { policy, rectify, free_only: false })
    }

    /// Its row's name: `certified`, `certified ε=0.4+rectify`, `resa+rectify`, ...
    fn name(&self) -> String {
        let base = match self.policy {
            Policy::Dense => "dense".to_string(),
            Policy::Certified { eps } if eps == DEFAULT_EPS => "certified".to_string(),
            Policy::Certified { eps } => format!("certified ε={eps}"),
            Policy::Resa => "resa".to_string(),
        };
        if self.rectify {
            base + "+rectify"
        } else {
            base
        }
    }

    fn attention(&self) -> Box<dyn AttentionPolicy> {
        match self.policy {
            Policy::Certified { eps } => {
                let params = Params { eps, delta: 0.001, measure: Measure::Value, grid: Grid::default() };
                Box::new(CertifiedPolicy::new(params, PerturbationSeed { seed: 0, fixed: false }))
            }
            Policy::Resa => Box::new(Resa::new(resa::Params::default())),
            Policy::Dense => Box::new(Dense),
        }
    }

    fn fork<'m>(&self, base: &Session<'m>, every: usize) -> anyhow::Result<Session<'m>> {
        Ok(base.fork(self.attention(), Rectify::every(if self.rectify { every } else { 0 }))?)
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// `KL(p ‖ q)` of log-probabilities.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(&p, &q)| p.exp() * (p - q)).sum::<f64>().max(0.0)
}

/// One prefix's runs: where it lies and what every variant did.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PrefixRun {
    /// Its number in the set.
    index: usize,
    book: String,
    /// Where its text starts in the book, in tokens.
    offset: usize,
    /// Teacher-forced steps decoded (0 for a free-running prefix).
    teacher_steps: usize,
    /// Whether the free-running comparison has reached its end.
    free_done: bool,
    /// Dense first, then the settings' variants, in order.
    variants: Vec<VariantRun>,
    /// Teacher-forced: the tokens dense decoded, the first after the prefix first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tokens: Vec<u32>,
}

impl PrefixRun {
    /// The same prefix from another file: of a variant in both, the run
    /// that went further counts; a variant in one only is kept. Dense's
    /// tokens and a variant's cache drift, where only the other run of as
    /// many steps has them, are taken from it.
    fn absorb(&mut self, other: PrefixRun) {
        let further = (other.teacher_steps, other.free_done) > (self.teacher_steps, self.free_done);
        let nearer = if further { std::mem::replace(self, other) } else { other };
        if self.tokens.is_empty() && nearer.teacher_steps == self.teacher_steps {
            self.tokens = nearer.tokens;
        }
        for v in nearer.variants {
            match self.variants.iter_mut().find(|f| f.policy == v.policy) {
                None => self.variants.push(v),
                Some(f) if f.cache_drift.is_empty() && f.kl.len() == v.kl.len() => f.cache_drift = v.cache_drift,
                Some(_) => {}
            }
        }
    }
}

/// What one variant did on one prefix.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct VariantRun {
    policy: String,
    /// Teacher-forced, per step: `KL(dense ‖ policy)` and whether the top tokens agree.
    kl: Vec<f64>,
    agree: Vec<bool>,
    /// Free-running: the first token of the continuation that differs from
    /// dense's (none: identical).
    first_difference: Option<usize>,
    decode_s: f64,
    steps: usize,
    rectifications: u64,
    tokens_rewritten: u64,
    rectify_s: f64,
    /// Teacher-forced, at the end: how far the keys and values in its cache
    /// at the decoded positions are from dense's, per layer and bin of
    /// [`BIN`] positions, `[keys, values]` relative L2 ([`cache_drift`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    cache_drift: Vec<Vec<Option<[f64; 2]>>>,
}

/// An experiment's prefix runs, as a run or a shard writes them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Results {
    settings: Settings,
    runs: Vec<PrefixRun>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse()?;
    if !args.merge.is_empty() {
        return merge(&args);
    }
    sift::threads::init(args.threads);
    sift::matmul::set_f32_activations(true);
    sift::matmul::keep_dequantized_weights(true);
    let file = GgufFile::open(&args.model)?;
    let model = Model::load(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let bos = tokenizer.bos().unwrap_or(0);
    let mut paths: Vec<_> = std::fs::read_dir(&args.books)?
        .map(|e| e.map(|e| e.path()))
        .filter(|p| p.as_ref().map_or(true, |p| p.extension().is_some_and(|e| e == "txt")))
        .collect::<Result<_, _>>()?;
    paths.sort();
    let books = paths
        .iter()
        .map(|p| {
            let name = p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
            Ok((name, tokenizer.encode(&std::fs::read_to_string(p)?, false, false)?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(!books.is_empty(), "{}: no .txt books", args.books.display());
    let s = args.settings.clone();
    let range = args.prefixes.clone().unwrap_or(0..s.runs());
    let stem = match &args.prefixes {
        Some(r) => format!("rectify-{}-part-{}-{}", s.prefix, r.start, r.end),
        None => format!("rectify-{}", s.prefix),
    };
    let out = Output { dir: &args.out, stem, plot: args.prefixes.is_none() };
    let n_ctx = s.prefix + s.gen.max(s.free_gen) + 1;
    let storage = Storage { key_sketch: true, ..Storage::default() };
    let mut results = Results { settings: s.clone(), runs: Vec::new() };
    let mut head = Head::of(&model);
    let started = Instant::now();
    let stamp = || format!("[{:7.1} s]", started.elapsed().as_secs_f64());

    for index in range.clone() {
        let (book, offset, tokens) = prefix(&books, bos, &s, index)?;
        let mut base = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, storage, Box::new(Dense));
        let mut next = NextToken::of(&s, index);
        let first = next.pick(base.prefill(&tokens)?);
        eprintln!("{} prefix {index} ({book} at token {offset}) prefilled", stamp());
        let run =
            PrefixRun { index, book, offset, teacher_steps: 0, free_done: false, variants: Vec::new(), tokens: vec![] };
        results.runs.push(run);
        lockstep(&base, &mut head, (first, next), &s, &mut results, |results, steps| {
            eprintln!("{} prefix {index}: {steps} teacher-forced steps", stamp());
            out.write(results, "in progress").map(drop)
        })?;
        let progress = format!("{} of {} prefixes done", results.runs.len(), range.len());
        eprintln!("{} {progress}", stamp());
        let table = out.write(&results, &progress)?;
        if results.runs.len() == range.len() {
            print!("{table}");
        }
    }
    Ok(())
}

/// Prefix `index` of the set: `settings.prefix` tokens, BOS first, from the
/// books in turn at evenly spread offsets; with its book's name and offset.
fn prefix(
    books: &[(String, Vec<u32>)],
    bos: u32,
    settings: &Settings,
    index: usize,
) -> anyhow::Result<(String, usize, Vec<u32>)> {
    let len = settings.prefix;
    let per_book = settings.runs().div_ceil(books.len());
    let ((name, book), j) = (&books[index % books.len()], index / books.len());
    anyhow::ensure!(book.len() >= len, "{name} has {} tokens, fewer than the prefix's {len}", book.len());
    let offset = (book.len() - len) * j / per_book;
    let mut prefix = vec![bos];
    prefix.extend_from_slice(&book[offset..offset + len - 1]);
    Ok((name.clone(), offset, prefix))
}

/// How dense's next token is chosen: greedy, or with `--teacher-sampled`
/// drawn as `sift run` draws by default, seeded with the prefix's number.
struct NextToken(Option<Sampler>);

impl NextToken {
    fn of(settings: &Settings, index: usize) -> Self {
        let params = SamplingParams {
            seed: index as u64,
            repeat_penalty: settings.teacher_repeat_penalty,
            ..SamplingParams::default()
        };
        Self(settings.teacher_sampled.then(|| Sampler::new(params)))
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        match &mut self.0 {
            None => argmax(logits),
            Some(sampler) => {
                let token = sampler.sample(logits);
                sampler.accept(token);
                token
            }
        }
    }
}

/// Every variant decodes dense's tokens in lockstep, from `base`'s cache,
/// whose logits chose the first of `next`'s tokens, into the latest of
/// `results`' runs.
/// Teacher-forced (a prefix numbered below `--teacher`), for `--gen` steps,
/// each step's KL and agreement recorded, and `checkpoint` called every
/// [`BIN`] steps. In any case the first `--free-gen` tokens also give the
/// free-running result: a policy's own greedy continuation is dense's up to
/// the first step where its top token differs from dense's (until then it
/// has decoded the very same tokens), so that step is where its
/// continuation first differs, and none means identical. Free-running
/// alone, a policy stops there.
fn lockstep(
    base: &Session,
    head: &mut Head,
    (first, mut next): (u32, NextToken),
    settings: &Settings,
    results: &mut Results,
    mut checkpoint: impl FnMut(&Results, usize) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let last = results.runs.len() - 1;
    let teacher = results.runs[last].index < settings.teacher;
    let steps = if teacher { settings.gen } else { settings.free_gen - 1 };
    let variants = settings.all_variants();
    let mut sessions =
        variants.iter().map(|v| v.fork(base, settings.rectify_every)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut times = vec![Duration::ZERO; sessions.len()];
    let mut counts = vec![0; sessions.len()];
    let mut runs: Vec<VariantRun> =
        variants.iter().map(|v| VariantRun { policy: v.name(), ..VariantRun::default() }).collect();
    let mut token = first;
    let record = |runs: &[VariantRun], sessions: &[Session], times: &[Duration], counts: &[usize]| {
        let mut runs = runs.to_vec();
        for (run, ((session, time), &steps)) in runs.iter_mut().zip(sessions.iter().zip(times).zip(counts)) {
            let r = session.rectify_stats();
            run.decode_s = time.as_secs_f64();
            run.steps = steps;
            run.rectifications = r.passes;
            run.tokens_rewritten = r.tokens;
            run.rectify_s = r.time.as_secs_f64();
        }
        runs
    };
    let (mut hidden, mut logits, mut active) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..steps {
        // Dense's sampled tokens are no policy's greedy continuation.
        let free_step = !settings.teacher_sampled && step + 1 < settings.free_gen;
        let differs = |run: &VariantRun| run.first_difference.is_some();
        if !teacher && runs.iter().skip(1).all(differs) {
            break;
        }
        // Every variant still running steps; one product gives all their logits.
        hidden.clear();
        active.clear();
        for (j, session) in sessions.iter_mut().enumerate() {
            let forced = teacher && !variants[j].free_only;
            if !forced && (differs(&runs[j]) || !free_step) {
                continue;
            }
            let started = Instant::now();
            hidden.extend_from_slice(session.decode_hidden(token)?);
            times[j] += started.elapsed();
            counts[j] += 1;
            active.push(j);
        }
        let started = Instant::now();
        head.logits(&hidden, &mut logits);
        let share = started.elapsed() / active.len() as u32;
        let n_vocab = head.rows;
        let dense_logits = &logits[..n_vocab];
        let (dense_top, dense) = (argmax(dense_logits), log_softmax(dense_logits));
        for (&j, logits) in active.iter().zip(logits.chunks_exact(n_vocab)) {
            times[j] += share;
            if j == 0 {
                continue;
            }
            let run = &mut runs[j];
            let agree = argmax(logits) == dense_top;
            if !agree && free_step && run.first_difference.is_none() {
                run.first_difference = Some(step + 1);
            }
            if teacher && !variants[j].free_only {
                run.kl.push(kl(&dense, &log_softmax(logits)));
                run.agree.push(agree);
            }
        }
        token = next.pick(dense_logits);
        let current = &mut results.runs[last];
        if teacher {
            current.tokens.push(token);
        }
        current.teacher_steps = if teacher { step + 1 } else { 0 };
        current.free_done = !settings.teacher_sampled && step + 2 >= settings.free_gen;
        if teacher && (step + 1) % BIN == 0 {
            current.variants = record(&runs, &sessions, &times, &counts);
            checkpoint(results, step + 1)?;
        }
    }
    let current = &mut results.runs[last];
    current.free_done = !settings.teacher_sampled;
    current.variants = record(&runs, &sessions, &times, &counts);
    if teacher {
        let decoded = base.n_past()..base.n_past() + steps;
        for (run, session) in current.variants.iter_mut().zip(&sessions).skip(1) {
            run.cache_drift = cache_drift(session, &sessions[0], decoded.clone());
        }
    }
    Ok(())
}

/// Per layer and bin of [`BIN`] of `positions`, the relative L2 distance of
/// `session`'s keys, and of its values, from `dense`'s:
/// `‖K − K_dense‖ / ‖K_dense‖` over the bin's rows of every KV head; none
/// for a bin a sliding layer no longer holds whole.
fn cache_drift(session: &Session, dense: &Session, positions: Range<usize>) -> Vec<Vec<Option<[f64; 2]>>> {
    let hp = &dense.model().hp;
    let (n_kv, dim_k, dim_v) = (hp.n_head_kv, hp.head_dim_k, hp.head_dim_v);
    let rows = |layer: &PagedLayer, span: Range<usize>| {
        let (mut keys, mut values) = (vec![0.0f32; span.len() * n_kv * dim_k], vec![0.0f32; span.len() * n_kv * dim_v]);
        let slots = span.flat_map(|pos| (0..n_kv).map(move |h| (h, pos)));
        for (i, (h, pos)) in slots.enumerate() {
            layer.key(h, pos, &mut keys[i * dim_k..][..dim_k]);
            layer.value(h, pos, &mut values[i * dim_v..][..dim_v]);
        }
        (keys, values)
    };
    (0..hp.n_layer)
        .map(|il| {
            let (layer, want) = (session.cache().layer(il), dense.cache().layer(il));
            let held = layer.held();
            (positions.start..positions.end)
                .step_by(BIN)
                .map(|a| {
                    let span = a..(a + BIN).min(positions.end);
                    (span.start >= held.start && span.end <= held.end).then(|| {
                        let ((k, v), (want_k, want_v)) = (rows(layer, span.clone()), rows(want, span));
                        [relative_l2(&k, &want_k), relative_l2(&v, &want_v)]
                    })
                })
                .collect()
        })
        .collect()
}

/// The tokens before a position that must have occurred earlier, with it,
/// for [`repeats`] to call it a repeat.
const REPEAT: usize = 8;

/// Whether each of `tokens` continues a repeat: it and the [`REPEAT`]
/// tokens before it occurred, in that order, earlier in `tokens`.
fn repeats(tokens: &[u32]) -> Vec<bool> {
    let stretch = |end: usize| &tokens[end - REPEAT..=end];
    (0..tokens.len()).map(|s| s >= REPEAT && (REPEAT..s).any(|j| stretch(j) == stretch(s))).collect()
}

/// `‖x − y‖ / ‖y‖`, in f64.
fn relative_l2(x: &[f32], y: &[f32]) -> f64 {
    let diff: f64 = x.iter().zip(y).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
    let norm: f64 = y.iter().map(|&b| f64::from(b).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The output head in f32, dequantized once, so that one product gives
/// every variant's logits of a step: a session's own decoding step would
/// dequantize the whole head (the 168M-element token embedding, on Gemma 3
/// 270M) for every variant and step. Its arithmetic is the f32 head's for
/// every variant, dense included.
struct Head {
    weights: Vec<f32>,
    rows: usize,
    cols: usize,
    softcap: Option<f32>,
    scratch: MatmulScratch,
}

impl Head {
    fn of(model: &Model) -> Self {
        let m = &model.weights().output;
        let mut weights = vec![0.0f32; m.rows * m.cols];
        sift::threads::on_pool(|| {
            weights.par_chunks_mut(m.cols).enumerate().for_each(|(r, row)| m.dequantize_row(r, row));
        });
        let softcap = model.hp.final_logit_softcap;
        Self { weights, rows: m.rows, cols: m.cols, softcap, scratch: MatmulScratch::default() }
    }

    /// The logits of every row of `hidden` (final-normed hidden states), row after row.
    fn logits(&mut self, hidden: &[f32], out: &mut Vec<f32>) {
        out.resize(hidden.len() / self.cols * self.rows, 0.0);
        let bytes = bytemuck::cast_slice(&self.weights);
        let head = Matrix::new(WeightType::F32, self.rows, self.cols, bytes).expect("whole f32 rows");
        sift::threads::on_pool(|| head.matmul(hidden, out, &mut self.scratch));
        if let Some(cap) = self.softcap {
            sift::model::blocks::softcap(out, cap);
        }
    }
}

/// Where a run writes, and whether it plots.
struct Output<'a> {
    dir: &'a Path,
    stem: String,
    plot: bool,
}

impl Output<'_> {
    /// Writes the tables, the JSON and (unless a shard) the plot; returns the tables.
    fn write(&self, results: &Results, progress: &str) -> anyhow::Result<String> {
        let report = Report::of(results);
        let table = format!("{progress}\n\n{}", report.markdown());
        std::fs::create_dir_all(self.dir)?;
        let stem = self.dir.join(&self.stem);
        write_whole(&stem.with_extension("md"), table.as_bytes())?;
        let json = serde_json::json!({
            "progress": progress,
            "settings": results.settings,
            "bin": BIN,
            "summary": report.json(),
            "runs": results.runs,
        });
        write_whole(&stem.with_extension("json"), serde_json::to_string_pretty(&json)?.as_bytes())?;
        if self.plot && report.teacher.iter().skip(1).any(|t| t.positions() > 0) {
            report.plot(&stem.with_extension("png"))?;
        }
        Ok(table)
    }
}

/// Writes `bytes` to `path` through a temporary file renamed into place, so
/// that a run stopped while writing leaves the previous file whole.
fn write_whole(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// Reads every shard or run in `--merge`'s paths, combines those of each
/// prefix length, and writes their report to `--out`.
fn merge(args: &Args) -> anyhow::Result<()> {
    let mut files = Vec::new();
    for path in &args.merge {
        if path.is_dir() {
            let mut found: Vec<_> = std::fs::read_dir(path)?
                .map(|e| e.map(|e| e.path()))
                .filter(|p| p.as_ref().map_or(true, |p| is_results_file(p)))
                .collect::<Result<_, _>>()?;
            found.sort();
            files.extend(found);
        } else {
            files.push(path.clone());
        }
    }
    let mut by_prefix: BTreeMap<usize, Results> = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file)?;
        let read: Results = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: not a rectify result: {e}", file.display()))?;
        let merged =
            by_prefix.entry(read.settings.prefix).or_insert(Results { settings: read.settings.clone(), runs: vec![] });
        let (m, r) = (&mut merged.settings, &read.settings);
        anyhow::ensure!(
            m.same_prefixes(r),
            "{}: settings {r:?} are not of the same prefixes as an earlier file's {m:?}",
            file.display(),
        );
        (m.teacher, m.free) = (m.teacher.max(r.teacher), m.free.max(r.free));
        // One variant per name: teacher-forced where any file forced it.
        for v in &r.variants {
            match m.variants.iter_mut().find(|w| w.name() == v.name()) {
                Some(w) => w.free_only &= v.free_only,
                None => m.variants.push(*v),
            }
        }
        for run in read.runs {
            match merged.runs.iter_mut().find(|r| r.index == run.index) {
                Some(r) => r.absorb(run),
                None => merged.runs.push(run),
            }
        }
    }
    anyhow::ensure!(!by_prefix.is_empty(), "--merge found no rectify-*.json");
    for (prefix, mut results) in by_prefix {
        results.runs.sort_by_key(|r| r.index);
        let progress = format!("merged from {} files: {} prefixes", files.len(), results.runs.len());
        let out = Output { dir: &args.out, stem: format!("rectify-{prefix}"), plot: true };
        print!("{}", out.write(&results, &progress)?);
    }
    Ok(())
}

/// A `rectify-*.json` of a run or shard.
fn is_results_file(path: &Path) -> bool {
    let name = path.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
    name.starts_with("rectify-") && name.ends_with(".json")
}

/// What one variant did, all prefixes together.
#[derive(Default, Clone)]
struct Tally {
    /// Per bin: sum of KL, top-1 agreements, positions, prefixes.
    kl: Vec<f64>,
    agree: Vec<usize>,
    count: Vec<usize>,
    prefixes: Vec<usize>,
    /// Free-running prefixes whose continuation is dense's; first differences of the others.
    identical: usize,
    first_differences: Vec<usize>,
    decode_s: f64,
    steps: usize,
    rectifications: u64,
    tokens_rewritten: u64,
    rectify_s: f64,
}

impl Tally {
    /// The steps of a run: its teacher-forced bins and its decode times.
    fn add_steps(&mut self, run: &VariantRun) {
        for (bin, (kl, agree)) in run.kl.chunks(BIN).zip(run.agree.chunks(BIN)).enumerate() {
            if self.kl.len() <= bin {
                self.kl.resize(bin + 1, 0.0);
                self.agree.resize(bin + 1, 0);
                self.count.resize(bin + 1, 0);
                self.prefixes.resize(bin + 1, 0);
            }
            self.kl[bin] += kl.iter().sum::<f64>();
            self.agree[bin] += agree.iter().filter(|&&a| a).count();
            self.count[bin] += kl.len();
            self.prefixes[bin] += 1;
        }
        self.decode_s += run.decode_s;
        self.steps += run.steps;
        self.rectifications += run.rectifications;
        self.tokens_rewritten += run.tokens_rewritten;
        self.rectify_s += run.rectify_s;
    }

    /// A free-running result: where the continuation first differs, if it does.
    fn add_free(&mut self, first_difference: Option<usize>) {
        match first_difference {
            None => self.identical += 1,
            Some(at) => self.first_differences.push(at),
        }
    }

    fn positions(&self) -> usize {
        self.count.iter().sum()
    }

    fn mean_kl(&self, bin: usize) -> f64 {
        self.kl[bin] / self.count[bin].max(1) as f64
    }

    fn top1(&self, bin: usize) -> f64 {
        self.agree[bin] as f64 / self.count[bin].max(1) as f64
    }

    fn overall_kl(&self) -> f64 {
        self.kl.iter().sum::<f64>() / self.positions().max(1) as f64
    }

    fn overall_top1(&self) -> f64 {
        self.agree.iter().sum::<usize>() as f64 / self.positions().max(1) as f64
    }

    fn free_runs(&self) -> usize {
        self.identical + self.first_differences.len()
    }

    fn mean_first_difference(&self) -> Option<f64> {
        let n = self.first_differences.len();
        (n > 0).then(|| self.first_differences.iter().sum::<usize>() as f64 / n as f64)
    }
}

/// One teacher-forced prefix's mean KL without and with rectification over
/// each span of [`Report::spans`] (none for a span it did not reach).
struct Paired {
    index: usize,
    without: Vec<Option<f64>>,
    with: Vec<Option<f64>>,
}

/// The paired tests' result on one span.
struct SpanTest {
    span: Range<usize>,
    /// Prefixes that decoded the whole span with and without rectification.
    prefixes: usize,
    /// Of those, on how many rectification lowered the mean KL.
    lower: usize,
    mean_without: f64,
    mean_with: f64,
    sign_p: f64,
    wilcoxon_p: f64,
    /// Wilcoxon's p of the opposite one-sided hypothesis: higher with rectification.
    wilcoxon_p_higher: f64,
}

/// The tables of a set of prefix runs.
struct Report<'a> {
    results: &'a Results,
    /// Dense first; the tallies are in this order.
    variants: Vec<Variant>,
    teacher: Vec<Tally>,
    free: Vec<Tally>,
}

/// The one-sided level at which the paired tests decide.
const ALPHA: f64 = 0.05;

impl<'a> Report<'a> {
    fn of(results: &'a Results) -> Self {
        let variants = results.settings.all_variants();
        let mut teacher = vec![Tally::default(); variants.len()];
        let mut free = vec![Tally::default(); variants.len()];
        for run in &results.runs {
            for v in &run.variants {
                let Some(i) = variants.iter().position(|w| w.name() == v.policy) else { continue };
                match run.teacher_steps > 0 {
                    true => teacher[i].add_steps(v),
                    false => free[i].add_steps(v),
                }
                if run.free_done {
                    free[i].add_free(v.first_difference);
                }
            }
        }
        Self { results, variants, teacher, free }
    }

    /// The (without, with) rectification pairs among the variants.
    fn pairs(&self) -> Vec<(usize, usize)> {
        let v = &self.variants;
        (0..v.len())
            .filter(|&i| !v[i].rectify && !v[i].free_only && v[i].policy != Policy::Dense)
            .filter_map(|i| v.iter().position(|w| w.rectify && !w.free_only && w.policy == v[i].policy).map(|j| (i, j)))
            .collect()
    }

    /// The spans rectification is judged on: the two halves of the
    /// teacher-forced steps, then each bin of the second half.
    fn spans(&self) -> Vec<Range<usize>> {
        let gen = self.results.settings.gen;
        let half = gen / 2;
        let late = (half..gen).step_by(BIN).map(|a| a..(a + BIN).min(gen));
        [0..half, half..gen].into_iter().chain(late.filter(|_| gen > BIN)).collect()
    }

    /// Per teacher-forced prefix of a pair, the spans' mean KL.
    fn paired(&self, (without, with): (usize, usize)) -> Vec<Paired> {
        let spans = self.spans();
        let find = |run: &'a PrefixRun, i: usize| {
            let name = self.variants[i].name();
            run.variants.iter().find(|v| v.policy == name && !v.kl.is_empty())
        };
        let means = |v: &VariantRun| -> Vec<Option<f64>> {
            let mean = |r: &Range<usize>| v.kl.get(r.clone()).map(|kl| kl.iter().sum::<f64>() / r.len() as f64);
            spans.iter().map(mean).collect()
        };
        self.results
            .runs
            .iter()
            .filter_map(|r| {
                let (a, b) = (find(r, without)?, find(r, with)?);
                Some(Paired { index: r.index, without: means(a), with: means(b) })
            })
            .collect()
    }

    /// A pair's tests on every span but the first half, each over the
    /// prefixes that decoded the whole span.
    fn tests(&self, pair: (usize, usize)) -> Vec<SpanTest> {
        let paired = self.paired(pair);
        let spans = self.spans();
        (1..spans.len())
            .map(|k| {
                let both: Vec<(f64, f64)> = paired.iter().filter_map(|p| Some((p.without[k]?, p.with[k]?))).collect();
                let differences: Vec<f64> = both.iter().map(|(a, b)| a - b).collect();
                let lower = differences.iter().filter(|&&d| d > 0.0).count();
                let n = both.len().max(1) as f64;
                SpanTest {
                    span: spans[k].clone(),
                    prefixes: both.len(),
                    lower,
                    mean_without: both.iter().map(|p| p.0).sum::<f64>() / n,
                    mean_with: both.iter().map(|p| p.1).sum::<f64>() / n,
                    sign_p: sign_test(lower, differences.iter().filter(|&&d| d != 0.0).count()),
                    wilcoxon_p: wilcoxon_signed_rank(&differences),
                    wilcoxon_p_higher: wilcoxon_signed_rank(&differences.iter().map(|d| -d).collect::<Vec<_>>()),
                }
            })
            .filter(|t| t.prefixes > 0)
            .collect()
    }

    fn markdown(&self) -> String {
        use std::fmt::Write;
        let s_ = &self.results.settings;
        let mut s = String::new();
        let sparse: Vec<usize> = (1..self.variants.len()).filter(|&i| self.teacher[i].positions() > 0).collect();
        if !sparse.is_empty() {
            let _ = writeln!(
                s,
                "Teacher-forced on dense's {} tokens, prefixes of {} tokens, {} tokens decoded: mean KL(dense ‖ policy) / top-1 agreement (prefixes) per bin of {BIN} positions\n",
                match (s_.teacher_sampled, s_.teacher_repeat_penalty) {
                    (false, _) => "greedy".to_string(),
                    (true, 1.0) => "sampled".to_string(),
                    (true, r) => format!("sampled (repetition penalty {r} over the last 64)"),
                },
                s_.prefix,
                s_.gen
            );
            let names = sparse.iter().map(|&i| self.variants[i].name()).collect::<Vec<_>>().join(" | ");
            let _ = writeln!(s, "| positions | {names} |");
            let _ = writeln!(s, "| --- |{}", " ---: |".repeat(sparse.len()));
            let bins = sparse.iter().map(|&i| self.teacher[i].kl.len()).max().unwrap_or(0);
            for bin in 0..bins {
                let cells: Vec<String> = sparse
                    .iter()
                    .map(|&i| {
                        let t = &self.teacher[i];
                        match bin < t.kl.len() {
                            true => {
                                format!("{:.5} / {:.1}% ({})", t.mean_kl(bin), 100.0 * t.top1(bin), t.prefixes[bin])
                            }
                            false => "—".into(),
                        }
                    })
                    .collect();
                let last = ((bin + 1) * BIN).min(s_.gen) - 1;
                let _ = writeln!(s, "| {}–{last} | {} |", bin * BIN, cells.join(" | "));
            }
            let all: Vec<String> = sparse
                .iter()
                .map(|&i| {
                    format!("**{:.5} / {:.1}%**", self.teacher[i].overall_kl(), 100.0 * self.teacher[i].overall_top1())
                })
                .collect();
            let _ = writeln!(s, "| all | {} |\n", all.join(" | "));
            self.write_paired(&mut s);
            self.write_repeats(&mut s);
            self.write_drift(&mut s);
        }
        let free: Vec<usize> = (0..self.variants.len()).filter(|&i| self.free[i].free_runs() > 0).collect();
        if !free.is_empty() {
            let _ = writeln!(
                s,
                "Free-running, prefixes of {} tokens, {} greedy tokens each (95% interval: Clopper–Pearson)\n",
                s_.prefix, s_.free_gen
            );
            let _ = writeln!(
                s,
                "| policy | identical to dense | 95% interval | mean first difference (of those that differ) |"
            );
            let _ = writeln!(s, "| --- | ---: | ---: | ---: |");
            for &i in &free {
                let t = &self.free[i];
                let (runs, diff) = (t.free_runs(), t.first_differences.len());
                let mean = t.mean_first_difference().map_or("—".into(), |m| format!("{m:.1} ({diff})"));
                let share = 100.0 * t.identical as f64 / runs as f64;
                let (lo, hi) = clopper_pearson(t.identical, runs);
                let _ = writeln!(
                    s,
                    "| {} | {}/{runs} ({share:.0}%) | {:.0}–{:.0}% | {mean} |",
                    self.variants[i].name(),
                    t.identical,
                    100.0 * lo,
                    100.0 * hi
                );
            }
            s.push('\n');
        }
        let _ = writeln!(s, "Decoding, all runs above together (loaded runs; compare within the column)\n");
        let _ = writeln!(s, "| policy | decode tok/s | rectifications | tokens rewritten | share of decode time |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for (v, (t, f)) in self.variants.iter().zip(self.teacher.iter().zip(&self.free)) {
            let time = t.decode_s + f.decode_s;
            let _ = writeln!(
                s,
                "| {} | {:.1} | {} | {} | {:.1}% |",
                v.name(),
                (t.steps + f.steps) as f64 / time.max(1e-9),
                t.rectifications + f.rectifications,
                t.tokens_rewritten + f.tokens_rewritten,
                100.0 * (t.rectify_s + f.rectify_s) / time.max(1e-9)
            );
        }
        s
    }

    /// The per-prefix halves of every pair, and the paired tests over
    /// prefixes (which are independent spans of text; positions within one
    /// prefix are not) of "rectification lowers the mean KL" on each span.
    fn write_paired(&self, s: &mut String) {
        use std::fmt::Write;
        let gen = self.results.settings.gen;
        let spans = self.spans();
        let name = |r: &Range<usize>| format!("{}–{}", r.start, r.end - 1);
        let pairs = self.pairs();
        let whole = |p: &Paired| p.without[1].is_some() && p.with[1].is_some();
        let complete: Vec<(usize, Vec<Paired>)> = pairs
            .iter()
            .map(|&(without, with)| (without, self.paired((without, with)).into_iter().filter(whole).collect()))
            .collect();
        if complete.iter().any(|(_, p)| !p.is_empty()) {
            let _ = writeln!(
                s,
                "Per prefix that decoded all {gen} tokens: mean KL over tokens {} and {}, without → with rectification\n",
                name(&spans[0]),
                name(&spans[1])
            );
            let _ = writeln!(s, "| policy | prefix | first half | second half | second half, with / without |");
            let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
            for (without, paired) in &complete {
                for p in paired {
                    let (a, b) = (p.without[1].unwrap_or(0.0), p.with[1].unwrap_or(0.0));
                    let _ = writeln!(
                        s,
                        "| {} | {} | {:.6} → {:.6} | {a:.6} → {b:.6} | {:.3} |",
                        self.variants[*without].name(),
                        p.index,
                        p.without[0].unwrap_or(0.0),
                        p.with[0].unwrap_or(0.0),
                        b / a.max(1e-300)
                    );
                }
            }
            s.push('\n');
        }
        let tests: Vec<_> =
            pairs.iter().map(|&pair| (pair.0, self.tests(pair))).filter(|(_, t)| !t.is_empty()).collect();
        if tests.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "Does rectification lower the mean KL? Paired over the prefixes that decoded the whole span, one-sided \
             (H₁: lower with rectification), sign test and Wilcoxon signed-rank (exact), decided at α = {ALPHA} by \
             Wilcoxon (with n prefixes no p is below 2⁻ⁿ: 5 are needed to decide at all)\n"
        );
        let _ = writeln!(
            s,
            "| policy | tokens | lower with rectification | mean KL without → with | sign test p | Wilcoxon p | at α = {ALPHA} | Wilcoxon p, H₁: higher |"
        );
        let _ = writeln!(s, "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |");
        for (without, tests) in &tests {
            for t in tests {
                let half = if t.span == spans[1] { " (second half)" } else { "" };
                let verdict = if t.wilcoxon_p < ALPHA { "**lower**" } else { "not shown" };
                let _ = writeln!(
                    s,
                    "| {} | {}{half} | {} of {} | {:.6} → {:.6} | {:.3} | {:.3} | {verdict} | {:.3} |",
                    self.variants[*without].name(),
                    name(&t.span),
                    t.lower,
                    t.prefixes,
                    t.mean_without,
                    t.mean_with,
                    t.sign_p,
                    t.wilcoxon_p,
                    t.wilcoxon_p_higher,
                );
            }
        }
        s.push('\n');
    }

    /// Per pair and prefix whose dense tokens the run kept, over the second
    /// half: the share of positions where dense's token continues a repeat of
    /// its own continuation ([`repeats`]), and the mean KL without → with
    /// rectification at those positions and at the others.
    fn write_repeats(&self, s: &mut String) {
        use std::fmt::Write;
        let gen = self.results.settings.gen;
        let second = gen / 2..gen;
        let mut rows = Vec::new();
        for (without, with) in self.pairs() {
            let names = (self.variants[without].name(), self.variants[with].name());
            for run in self.results.runs.iter().filter(|r| r.tokens.len() >= gen) {
                let find = |name: &str| run.variants.iter().find(|v| v.policy == name && v.kl.len() >= gen);
                let (Some(a), Some(b)) = (find(&names.0), find(&names.1)) else { continue };
                let repeat = repeats(&run.tokens[..gen]);
                let mean = |kl: &[f64], want: bool| {
                    let picked: Vec<f64> = second.clone().filter(|&i| repeat[i] == want).map(|i| kl[i]).collect();
                    (!picked.is_empty()).then(|| picked.iter().sum::<f64>() / picked.len() as f64)
                };
                let cell = |want: bool| match (mean(&a.kl, want), mean(&b.kl, want)) {
                    (Some(x), Some(y)) => format!("{x:.6} → {y:.6}"),
                    _ => "—".into(),
                };
                let share = second.clone().filter(|&i| repeat[i]).count() as f64 / second.len() as f64;
                rows.push(format!(
                    "| {} | {} | {:.0}% | {} | {} |",
                    names.0,
                    run.index,
                    100.0 * share,
                    cell(true),
                    cell(false)
                ));
            }
        }
        if rows.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "Where the second half's KL lies: positions whose dense token continues a repeat of dense's own \
             continuation (it and the {REPEAT} tokens before it occurred earlier in it), and the others; mean KL \
             without → with rectification\n"
        );
        let _ = writeln!(s, "| policy | prefix | repeats | KL at repeats | KL elsewhere |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for row in rows {
            let _ = writeln!(s, "{row}");
        }
        s.push('\n');
    }

    /// Per variant and layer, the mean over teacher-forced prefixes of the
    /// keys' drift from dense's at the end of the run ([`cache_drift`]), in
    /// the first and the last bin every layer still held.
    fn write_drift(&self, s: &mut String) {
        use std::fmt::Write;
        let mut columns = Vec::new();
        for v in self.variants.iter().skip(1) {
            let name = v.name();
            let drifts: Vec<&Vec<Vec<Option<[f64; 2]>>>> = (self.results.runs.iter())
                .filter_map(|r| r.variants.iter().find(|w| w.policy == name && !w.cache_drift.is_empty()))
                .map(|w| &w.cache_drift)
                .collect();
            if !drifts.is_empty() {
                columns.push((name, drifts));
            }
        }
        let Some((_, first)) = columns.first() else { return };
        let layers = first[0].len();
        let bins = first[0].iter().map(Vec::len).max().unwrap_or(0);
        // The first bin every layer held, and the last.
        let held = |b: usize| {
            columns.iter().all(|(_, d)| d.iter().all(|p| p.iter().all(|l| l.get(b).is_some_and(Option::is_some))))
        };
        let Some(early) = (0..bins).find(|&b| held(b)) else { return };
        let late = bins - 1;
        let _ = writeln!(
            s,
            "Keys' relative L2 distance from dense's at the end of the teacher-forced run, per layer: decoded positions \
             {}–{} → {}–{} (mean over prefixes)\n",
            early * BIN,
            (early + 1) * BIN - 1,
            late * BIN,
            self.results.settings.gen - 1
        );
        let names: Vec<String> = columns.iter().map(|(n, d)| format!("{n} ({})", d.len())).collect();
        let _ = writeln!(s, "| layer | {} |", names.join(" | "));
        let _ = writeln!(s, "| ---: |{}", " ---: |".repeat(columns.len()));
        for il in 0..layers {
            let cells: Vec<String> = columns
                .iter()
                .map(|(_, d)| {
                    let mean = |b: usize| {
                        d.iter().map(|p| p[il].get(b).copied().flatten().map_or(0.0, |x| x[0])).sum::<f64>()
                            / d.len() as f64
                    };
                    format!("{:.4} → {:.4}", mean(early), mean(late))
                })
                .collect();
            let _ = writeln!(s, "| {il} | {} |", cells.join(" | "));
        }
        s.push('\n');
    }

    fn json(&self) -> serde_json::Value {
        let variants: Vec<_> = self
            .variants
            .iter()
            .zip(self.teacher.iter().zip(&self.free))
            .map(|(v, (t, f))| {
                serde_json::json!({
                    "policy": v.name(),
                    "bins": (0..t.kl.len()).map(|b| serde_json::json!({
                        "first": b * BIN, "mean_kl": t.mean_kl(b), "top1": t.top1(b),
                        "positions": t.count[b], "prefixes": t.prefixes[b],
                    })).collect::<Vec<_>>(),
                    "mean_kl": t.overall_kl(),
                    "top1": t.overall_top1(),
                    "free_prefixes": f.free_runs(),
                    "free_identical": f.identical,
                    "free_identical_95": clopper_pearson(f.identical, f.free_runs()),
                    "free_first_differences": f.first_differences,
                    "decode_s": t.decode_s + f.decode_s,
                    "decode_steps": t.steps + f.steps,
                    "rectifications": t.rectifications + f.rectifications,
                    "rectify_s": t.rectify_s + f.rectify_s,
                })
            })
            .collect();
        let tests: Vec<_> = self
            .pairs()
            .into_iter()
            .map(|pair| {
                let per_span: Vec<_> = self
                    .tests(pair)
                    .iter()
                    .map(|t| {
                        serde_json::json!({
                            "tokens": [t.span.start, t.span.end],
                            "prefixes": t.prefixes,
                            "lower": t.lower,
                            "mean_kl_without": t.mean_without,
                            "mean_kl_with": t.mean_with,
                            "sign_p": t.sign_p,
                            "wilcoxon_p": t.wilcoxon_p,
                        })
                    })
                    .collect();
                serde_json::json!({ "policy": self.variants[pair.0].name(), "spans": per_span })
            })
            .collect();
        serde_json::json!({ "variants": variants, "rectification_tests": tests })
    }

    /// Per-bin mean KL of the sparse variants, log scale.
    fn plot(&self, path: &Path) -> anyhow::Result<()> {
        let font = match std::env::var("SIFT_PLOT_FONT") {
            Ok(font) => font,
            Err(_) => PLOT_FONTS.iter().find(|f| Path::new(f).exists()).map_or_else(
                || anyhow::bail!("no font for the plot: install fonts-liberation or fonts-dejavu-core, or set SIFT_PLOT_FONT to a .ttf file"),
                |f| Ok(f.to_string()),
            )?,
        };
        let bytes = std::fs::read(&font).map_err(|e| anyhow::anyhow!("SIFT_PLOT_FONT {font}: {e}"))?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| anyhow::anyhow!("{font}: not a font plotters can read"))?;
        let sparse: Vec<_> =
            self.variants.iter().zip(&self.teacher).skip(1).filter(|(_, t)| t.positions() > 0).collect();
        let points = |t: &Tally| -> Vec<(f64, f64)> {
            (0..t.kl.len()).map(|b| ((b * BIN + BIN / 2) as f64, t.mean_kl(b).max(1e-9))).collect()
        };
        let all: Vec<f64> = sparse.iter().flat_map(|(_, t)| points(t)).map(|p| p.1).collect();
        let (lo, hi) = all.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &y| (lo.min(y), hi.max(y)));
        let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let s = &self.results.settings;
        let caption = format!(
            "Gemma 3 270M, PG-19 prefixes of {} tokens, teacher-forced: KL against dense per {BIN} positions",
            s.prefix
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..s.gen as f64, (lo / 2.0..hi * 2.0).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("tokens decoded after the prefix")
            .y_desc("mean KL(dense || policy)")
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .draw()?;
        // One colour per policy setting: pale without rectification, full and thick with it.
        let palette = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
        let policies: Vec<Policy> = self.variants.iter().skip(1).map(|v| v.policy).fold(Vec::new(), |mut p, q| {
            if !p.contains(&q) {
                p.push(q);
            }
            p
        });
        for (v, t) in sparse {
            let hue = palette[policies.iter().position(|&p| p == v.policy).unwrap_or(0) % palette.len()];
            let color = hue.mix(if v.rectify { 1.0 } else { 0.4 });
            let style = ShapeStyle { color, filled: true, stroke_width: if v.rectify { 3 } else { 1 } };
            chart
                .draw_series(LineSeries::new(points(t), style))?
                .label(v.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(points(t).into_iter().map(|p| Circle::new(p, 3, style)))?;
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        root.present()?;
        Ok(())
    }
}

/// `P(X ≥ k)` for `X` binomial with `n` trials of probability ½: the chance
/// that `k` or more of `n` prefixes favour rectification if it made no
/// difference (prefixes where it made none at all are left out of `n`).
fn sign_test(k: usize, n: usize) -> f64 {
    binomial_tail(k, n, 0.5)
}

/// `P(X ≥ k)` for `X` binomial with `n` trials of probability `p`.
fn binomial_tail(k: usize, n: usize, p: f64) -> f64 {
    let choose = |n: usize, i: usize| (0..i).fold(1.0f64, |c, j| c * (n - j) as f64 / (j + 1) as f64);
    (k..=n).map(|i| choose(n, i) * p.powi(i as i32) * (1.0 - p).powi((n - i) as i32)).sum::<f64>().min(1.0)
}

/// The exact one-sided p-value of Wilcoxon's signed-rank test that the
/// differences lean positive: the chance, if each difference's sign were
/// a fair coin, that the sum of the positive ones' ranks (by absolute
/// value, ties given their mean rank) reaches the one observed. Zero
/// differences are left out; none left gives 1.
fn wilcoxon_signed_rank(differences: &[f64]) -> f64 {
    let mut d: Vec<f64> = differences.iter().copied().filter(|&d| d != 0.0).collect();
    d.sort_by(|a, b| a.abs().total_cmp(&b.abs()));
    // Ranks doubled, so that mean ranks of ties stay whole numbers.
    let mut ranks = vec![0usize; d.len()];
    let mut i = 0;
    while i < d.len() {
        let j = (i..d.len()).find(|&j| d[j].abs() != d[i].abs()).unwrap_or(d.len());
        ranks[i..j].fill(i + 1 + j);
        i = j;
    }
    let observed: usize = ranks.iter().zip(&d).filter(|(_, &d)| d > 0.0).map(|(r, _)| r).sum();
    // ways[w]: the sign patterns whose positive ranks sum to w.
    let mut ways = vec![0f64; ranks.iter().sum::<usize>() + 1];
    ways[0] = 1.0;
    for &r in &ranks {
        for w in (r..ways.len()).rev() {
            ways[w] += ways[w - r];
        }
    }
    ways[observed..].iter().sum::<f64>() / 2f64.powi(d.len() as i32)
}

/// The Clopper–Pearson 95% interval of a binomial rate, `k` of `n`: the
/// rates at which `k` or more (for the lower end), `k` or fewer (the upper)
/// would happen with probability 2.5%.
fn clopper_pearson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    // Bisection for where an increasing function of p reaches `target`.
    let solve = |f: &dyn Fn(f64) -> f64, target: f64| {
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if f(mid) < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let lower = if k == 0 { 0.0 } else { solve(&|p| binomial_tail(k, n, p), 0.025) };
    let upper = if k == n { 1.0 } else { solve(&|p| binomial_tail(k + 1, n, p), 0.975) };
    (lower, upper)
}
