//! Rectification's effect on sparse decoding, on PG-19: how far certified
//! and ReSA attention drift from dense decoding over a long generation, with
//! and without a dense rectification every 32 tokens.
//!
//! ```sh
//! cargo bench --bench rectify -- --prefix 4096 --gen 1024 --teacher 4 --free 20 --out docs/rectify
//! ```
//!
//! Prefixes are spans of `--prefix` tokens (BOS first) of the books in
//! `--books` (default `../shared/data/pg19`), taken in turn from each book
//! at evenly spread offsets. Every run uses f32 activations against f32
//! weights (under 8-bit activation rounding any perturbation at all flips
//! about 5% of top-1 choices, which would hide the policies' own effect).
//! Each prefix is prefilled once, densely, and every policy decodes from a
//! copy of that cache ([`Session::fork`]). Policies: dense, certified
//! (ε = 0.1, δ = 0.001, value measure, fixed seed), certified with
//! rectification, resa, resa with rectification.
//!
//! * **Teacher-forced** (the first `--teacher` prefixes): dense decodes
//!   `--gen` greedy tokens; every sparse policy decodes the same tokens in
//!   lockstep, writing its own keys and values, and each step's
//!   `KL(dense ‖ policy)` and top-1 agreement are averaged per bin of 128
//!   positions.
//! * **Free-running** (the first `--free` prefixes): every policy's own
//!   `--free-gen` greedy tokens; the share of prefixes whose continuation
//!   equals dense's, and the mean position of the first difference among
//!   those that differ. A policy's greedy continuation is dense's up to the
//!   first step at which, fed dense's tokens, its top token is not dense's,
//!   so that step is found in lockstep with dense, and the policy stops
//!   there.
//!
//! Rectification's effect is shown per prefix too: each policy's mean KL
//! over the first and the second half of the teacher-forced tokens, with and
//! without rectification, and on how many prefixes rectification lowers the
//! second half's (a one-sided sign test over prefixes, which are independent
//! spans of text; the positions within one prefix are not independent).
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
//! JSON and plot to `--out`, as one run of all of them would have. Decode
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
use sift::attn::{AttentionKind, AttentionPolicy, Measure};
use sift::engine::{Session, DEFAULT_BATCH};
use sift::gguf::GgufFile;
use sift::kv::Storage;
use sift::matmul::{MatmulScratch, Matrix};
use sift::model::Model;
use sift::rectify::{Rectify, DEFAULT_EVERY};
use sift::tokenizer::Tokenizer;
use simd::WeightType;

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

/// What defines an experiment: runs with equal settings can be merged.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Settings {
    prefix: usize,
    gen: usize,
    teacher: usize,
    free: usize,
    free_gen: usize,
    rectify_every: usize,
}

impl Settings {
    /// Prefixes in the set: the teacher-forced ones are its first.
    fn runs(&self) -> usize {
        self.teacher.max(self.free)
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
                "--prefixes" => {
                    let (a, b) =
                        value.split_once("..").ok_or_else(|| anyhow::anyhow!("--prefixes {value}: not A..B"))?;
                    args.prefixes = Some(number(a)?..number(b)?);
                }
                _ => anyhow::bail!("unknown flag {flag}"),
            }
        }
        anyhow::ensure!(args.settings.free_gen >= 1, "--free-gen must be at least 1");
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

/// A policy and whether it rectifies.
#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    kind: AttentionKind,
    rectify: bool,
}

const VARIANTS: [Variant; 5] = [
    Variant { name: "dense", kind: AttentionKind::Dense, rectify: false },
    Variant { name: "certified", kind: AttentionKind::Certified, rectify: false },
    Variant { name: "certified+rectify", kind: AttentionKind::Certified, rectify: true },
    Variant { name: "resa", kind: AttentionKind::Resa, rectify: false },
    Variant { name: "resa+rectify", kind: AttentionKind::Resa, rectify: true },
];

/// The (without, with) rectification pairs of `VARIANTS`.
const PAIRS: [(usize, usize); 2] = [(1, 2), (3, 4)];

impl Variant {
    fn policy(&self) -> Box<dyn AttentionPolicy> {
        match self.kind {
            AttentionKind::Certified => {
                let params = Params { eps: 0.1, delta: 0.001, measure: Measure::Value, grid: Grid::default() };
                Box::new(CertifiedPolicy::new(params, PerturbationSeed { seed: 0, fixed: false }))
            }
            AttentionKind::Resa => Box::new(Resa::new(resa::Params::default())),
            _ => Box::new(Dense),
        }
    }

    fn fork<'m>(&self, base: &Session<'m>, every: usize) -> anyhow::Result<Session<'m>> {
        Ok(base.fork(self.policy(), Rectify::every(if self.rectify { every } else { 0 }))?)
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
    /// In `VARIANTS`' order.
    variants: Vec<VariantRun>,
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
    let s = args.settings;
    let range = args.prefixes.clone().unwrap_or(0..s.runs());
    let stem = match &args.prefixes {
        Some(r) => format!("rectify-{}-part-{}-{}", s.prefix, r.start, r.end),
        None => format!("rectify-{}", s.prefix),
    };
    let out = Output { dir: &args.out, stem, plot: args.prefixes.is_none() };
    let n_ctx = s.prefix + s.gen.max(s.free_gen) + 1;
    let storage = Storage { key_sketch: true, ..Storage::default() };
    let mut results = Results { settings: s, runs: Vec::new() };
    let mut head = Head::of(&model);
    let started = Instant::now();
    let stamp = || format!("[{:7.1} s]", started.elapsed().as_secs_f64());

    for index in range.clone() {
        let (book, offset, tokens) = prefix(&books, bos, &s, index)?;
        let mut base = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, storage, Box::new(Dense));
        let first = argmax(base.prefill(&tokens)?);
        eprintln!("{} prefix {index} ({book} at token {offset}) prefilled", stamp());
        let run = PrefixRun { index, book, offset, teacher_steps: 0, free_done: false, variants: Vec::new() };
        results.runs.push(run);
        lockstep(&base, &mut head, first, &s, &mut results, |results, steps| {
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

/// Every variant decodes dense's greedy tokens in lockstep, from `base`'s
/// cache, whose logits chose `first`, into the latest of `results`' runs.
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
    first: u32,
    settings: &Settings,
    results: &mut Results,
    mut checkpoint: impl FnMut(&Results, usize) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let last = results.runs.len() - 1;
    let teacher = results.runs[last].index < settings.teacher;
    let steps = if teacher { settings.gen } else { settings.free_gen - 1 };
    let mut sessions =
        VARIANTS.iter().map(|v| v.fork(base, settings.rectify_every)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut times = vec![Duration::ZERO; sessions.len()];
    let mut counts = vec![0; sessions.len()];
    let mut runs: Vec<VariantRun> =
        VARIANTS.iter().map(|v| VariantRun { policy: v.name.into(), ..VariantRun::default() }).collect();
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
        let free_step = step + 1 < settings.free_gen;
        let differs = |run: &VariantRun| run.first_difference.is_some();
        if !teacher && runs.iter().skip(1).all(differs) {
            break;
        }
        // Every variant still running steps; one product gives all their logits.
        hidden.clear();
        active.clear();
        for (j, session) in sessions.iter_mut().enumerate() {
            if !teacher && differs(&runs[j]) {
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
            if teacher {
                run.kl.push(kl(&dense, &log_softmax(logits)));
                run.agree.push(agree);
            }
        }
        token = dense_top;
        let current = &mut results.runs[last];
        current.teacher_steps = if teacher { step + 1 } else { 0 };
        current.free_done = step + 2 >= settings.free_gen;
        if teacher && (step + 1) % BIN == 0 {
            current.variants = record(&runs, &sessions, &times, &counts);
            checkpoint(results, step + 1)?;
        }
    }
    let current = &mut results.runs[last];
    current.free_done = true;
    current.variants = record(&runs, &sessions, &times, &counts);
    Ok(())
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
        if self.plot && report.teacher[1].positions() > 0 {
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
        let merged = by_prefix.entry(read.settings.prefix).or_insert(Results { settings: read.settings, runs: vec![] });
        anyhow::ensure!(
            merged.settings == read.settings,
            "{}: settings {:?} differ from an earlier file's {:?}",
            file.display(),
            read.settings,
            merged.settings
        );
        for run in read.runs {
            match merged.runs.iter_mut().find(|r| r.index == run.index) {
                // The same prefix twice (a run and its shard): the further one counts.
                Some(r) if (run.teacher_steps, run.free_done) > (r.teacher_steps, r.free_done) => *r = run,
                Some(_) => {}
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

/// One teacher-forced prefix's mean KL over the first and the second half
/// of its steps, without and with rectification.
struct Halves {
    index: usize,
    without: [f64; 2],
    with: [f64; 2],
}

/// The tables of a set of prefix runs.
struct Report<'a> {
    results: &'a Results,
    teacher: Vec<Tally>,
    free: Vec<Tally>,
}

impl<'a> Report<'a> {
    fn of(results: &'a Results) -> Self {
        let mut teacher = vec![Tally::default(); VARIANTS.len()];
        let mut free = vec![Tally::default(); VARIANTS.len()];
        for run in &results.runs {
            let steps = if run.teacher_steps > 0 { &mut teacher } else { &mut free };
            for (t, v) in steps.iter_mut().zip(&run.variants) {
                t.add_steps(v);
            }
            for (t, v) in free.iter_mut().zip(&run.variants).filter(|_| run.free_done) {
                t.add_free(v.first_difference);
            }
        }
        Self { results, teacher, free }
    }

    /// Per complete teacher-forced prefix and pair of `PAIRS`, the halves' mean KL.
    fn halves(&self, (without, with): (usize, usize)) -> Vec<Halves> {
        let gen = self.results.settings.gen;
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
        let split = |v: &VariantRun| [mean(&v.kl[..gen / 2]), mean(&v.kl[gen / 2..])];
        self.results
            .runs
            .iter()
            .filter(|r| r.teacher_steps == gen && gen >= 2)
            .map(|r| Halves { index: r.index, without: split(&r.variants[without]), with: split(&r.variants[with]) })
            .collect()
    }

    fn markdown(&self) -> String {
        use std::fmt::Write;
        let s_ = &self.results.settings;
        let mut s = String::new();
        let sparse = || VARIANTS.iter().zip(&self.teacher).skip(1);
        if self.teacher[1].positions() > 0 {
            let _ = writeln!(
                s,
                "Teacher-forced, prefixes of {} tokens, {} tokens decoded: mean KL(dense ‖ policy) / top-1 agreement per bin of {BIN} positions\n",
                s_.prefix, s_.gen
            );
            let names = sparse().map(|(v, _)| v.name).collect::<Vec<_>>().join(" | ");
            let _ = writeln!(s, "| positions | prefixes | {names} |");
            let _ = writeln!(s, "| --- | ---: |{}", " ---: |".repeat(VARIANTS.len() - 1));
            for bin in 0..self.teacher[1].kl.len() {
                let cells: Vec<String> =
                    sparse().map(|(_, t)| format!("{:.5} / {:.1}%", t.mean_kl(bin), 100.0 * t.top1(bin))).collect();
                let last = ((bin + 1) * BIN).min(s_.gen) - 1;
                let _ =
                    writeln!(s, "| {}–{last} | {} | {} |", bin * BIN, self.teacher[1].prefixes[bin], cells.join(" | "));
            }
            let all: Vec<String> = sparse()
                .map(|(_, t)| format!("**{:.5} / {:.1}%**", t.overall_kl(), 100.0 * t.overall_top1()))
                .collect();
            let _ = writeln!(s, "| all | | {} |\n", all.join(" | "));
            self.write_halves(&mut s);
        }
        let runs = self.free[0].free_runs();
        if runs > 0 {
            let _ = writeln!(
                s,
                "Free-running, {runs} prefixes of {} tokens, {} greedy tokens each\n",
                s_.prefix, s_.free_gen
            );
            let _ = writeln!(s, "| policy | identical to dense | mean first difference (of those that differ) |");
            let _ = writeln!(s, "| --- | ---: | ---: |");
            for (v, t) in VARIANTS.iter().zip(&self.free) {
                let diff = t.first_differences.len();
                let mean = t.mean_first_difference().map_or("—".into(), |m| format!("{m:.1} ({diff})"));
                let share = 100.0 * t.identical as f64 / runs as f64;
                let _ = writeln!(s, "| {} | {}/{runs} ({share:.0}%) | {mean} |", v.name, t.identical);
            }
            s.push('\n');
        }
        let _ = writeln!(s, "Decoding, all runs above together (loaded runs; compare within the column)\n");
        let _ = writeln!(s, "| policy | decode tok/s | rectifications | tokens rewritten | share of decode time |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for (v, (t, f)) in VARIANTS.iter().zip(self.teacher.iter().zip(&self.free)) {
            let time = t.decode_s + f.decode_s;
            let _ = writeln!(
                s,
                "| {} | {:.1} | {} | {} | {:.1}% |",
                v.name,
                (t.steps + f.steps) as f64 / time.max(1e-9),
                t.rectifications + f.rectifications,
                t.tokens_rewritten + f.tokens_rewritten,
                100.0 * (t.rectify_s + f.rectify_s) / time.max(1e-9)
            );
        }
        s
    }

    /// The per-prefix halves of every pair, and the sign test over prefixes.
    fn write_halves(&self, s: &mut String) {
        use std::fmt::Write;
        let gen = self.results.settings.gen;
        let complete = self.halves(PAIRS[0]).len();
        if complete == 0 {
            return;
        }
        let _ = writeln!(
            s,
            "Per prefix (the {complete} that decoded all {gen} tokens): mean KL over tokens 0–{} and {}–{}, without → with rectification\n",
            gen / 2 - 1,
            gen / 2,
            gen - 1
        );
        let _ = writeln!(s, "| policy | prefix | first half | second half | second half, with / without |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for pair in PAIRS {
            let halves = self.halves(pair);
            for h in &halves {
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.5} → {:.5} | {:.5} → {:.5} | {:.3} |",
                    VARIANTS[pair.0].name,
                    h.index,
                    h.without[0],
                    h.with[0],
                    h.without[1],
                    h.with[1],
                    h.with[1] / h.without[1].max(1e-300)
                );
            }
        }
        s.push('\n');
        for pair in PAIRS {
            let halves = self.halves(pair);
            let lower = halves.iter().filter(|h| h.with[1] < h.without[1]).count();
            let _ = writeln!(
                s,
                "{}: rectification lowers the second half's KL on {lower} of {} prefixes (one-sided sign test p = {:.3})",
                VARIANTS[pair.0].name,
                halves.len(),
                sign_test(lower, halves.len())
            );
        }
        s.push('\n');
    }

    fn json(&self) -> serde_json::Value {
        let variants: Vec<_> = VARIANTS
            .iter()
            .zip(self.teacher.iter().zip(&self.free))
            .map(|(v, (t, f))| {
                serde_json::json!({
                    "policy": v.name,
                    "bins": (0..t.kl.len()).map(|b| serde_json::json!({
                        "first": b * BIN, "mean_kl": t.mean_kl(b), "top1": t.top1(b),
                        "positions": t.count[b], "prefixes": t.prefixes[b],
                    })).collect::<Vec<_>>(),
                    "mean_kl": t.overall_kl(),
                    "top1": t.overall_top1(),
                    "free_prefixes": f.free_runs(),
                    "free_identical": f.identical,
                    "free_first_differences": f.first_differences,
                    "decode_s": t.decode_s + f.decode_s,
                    "decode_steps": t.steps + f.steps,
                    "rectifications": t.rectifications + f.rectifications,
                    "rectify_s": t.rectify_s + f.rectify_s,
                })
            })
            .collect();
        serde_json::json!({ "variants": variants })
    }

    /// Per-bin mean KL of the sparse variants, log scale.
    fn plot(&self, path: &Path) -> anyhow::Result<()> {
        let font = std::env::var("SIFT_PLOT_FONT")
            .unwrap_or_else(|_| "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf".into());
        let bytes: &'static [u8] = Box::leak(std::fs::read(&font)?.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| anyhow::anyhow!("{font}: not a font plotters can read"))?;
        let sparse: Vec<_> = VARIANTS.iter().zip(&self.teacher).skip(1).collect();
        let points = |t: &Tally| -> Vec<(f64, f64)> {
            (0..t.kl.len()).map(|b| ((b * BIN + BIN / 2) as f64, t.mean_kl(b).max(1e-7))).collect()
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
        let colors = [RED.mix(0.4), RED.mix(1.0), BLUE.mix(0.4), BLUE.mix(1.0)];
        for ((v, t), color) in sparse.iter().zip(colors) {
            let style = ShapeStyle { color, filled: true, stroke_width: if v.rectify { 3 } else { 1 } };
            chart
                .draw_series(LineSeries::new(points(t), style))?
                .label(v.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        root.present()?;
        Ok(())
    }
}

/// `P(X ≥ k)` for `X` binomial with `n` trials of probability ½: the chance
/// that `k` or more of `n` prefixes favour rectification if it made no
/// difference.
fn sign_test(k: usize, n: usize) -> f64 {
    let choose = |n: usize, i: usize| (0..i).fold(1.0f64, |c, j| c * (n - j) as f64 / (j + 1) as f64);
    (k..=n).map(|i| choose(n, i)).sum::<f64>() / 2f64.powi(n as i32)
}
