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
//! Writes `rectify-<prefix>.md` (the tables), `rectify-<prefix>.json` and
//! `rectify-<prefix>.png` (per-bin mean KL, log scale) to `--out`, and the
//! tables to stdout. Decode times are from one loaded run: compare them
//! only with each other.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use plotters::prelude::*;
use sift::attn::certified::{CertifiedPolicy, Grid, Params, PerturbationSeed};
use sift::attn::dense::Dense;
use sift::attn::resa::{self, Resa};
use sift::attn::{AttentionKind, AttentionPolicy, Measure};
use sift::engine::{Session, DEFAULT_BATCH};
use sift::gguf::GgufFile;
use sift::kv::Storage;
use sift::model::Model;
use sift::rectify::{Rectify, RectifyStats, DEFAULT_EVERY};
use sift::tokenizer::Tokenizer;

/// Positions per bin of the teacher-forced table.
const BIN: usize = 128;

struct Args {
    model: PathBuf,
    books: PathBuf,
    out: PathBuf,
    prefix: usize,
    gen: usize,
    teacher: usize,
    free: usize,
    free_gen: usize,
    every: usize,
}

impl Args {
    fn parse() -> anyhow::Result<Self> {
        let mut args = Self {
            model: std::env::var_os("SIFT_MODEL").map_or("models/gemma-3-270m-Q4_K_M.gguf".into(), PathBuf::from),
            books: "../shared/data/pg19".into(),
            out: "target/rectify".into(),
            prefix: 4096,
            gen: 1024,
            teacher: 4,
            free: 20,
            free_gen: 128,
            every: DEFAULT_EVERY,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            if flag == "--bench" {
                continue;
            }
            let value = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
            let number = || value.parse::<usize>().map_err(|e| anyhow::anyhow!("{flag} {value}: {e}"));
            match flag.as_str() {
                "--model" => args.model = value.into(),
                "--books" => args.books = value.into(),
                "--out" => args.out = value.into(),
                "--prefix" => args.prefix = number()?,
                "--gen" => args.gen = number()?,
                "--teacher" => args.teacher = number()?,
                "--free" => args.free = number()?,
                "--free-gen" => args.free_gen = number()?,
                "--rectify-every" => args.every = number()?,
                _ => anyhow::bail!("unknown flag {flag}"),
            }
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

/// What one variant did, all prefixes together.
#[derive(Default, Clone)]
struct Tally {
    /// Per bin: sum of KL, top-1 agreements, positions.
    kl: Vec<f64>,
    agree: Vec<usize>,
    count: Vec<usize>,
    identical: usize,
    first_differences: Vec<usize>,
    decode: Duration,
    steps: usize,
    rectified: RectifyStats,
}

impl Tally {
    fn add_step(&mut self, position: usize, kl: f64, agree: bool) {
        let bin = position / BIN;
        if self.kl.len() <= bin {
            self.kl.resize(bin + 1, 0.0);
            self.agree.resize(bin + 1, 0);
            self.count.resize(bin + 1, 0);
        }
        self.kl[bin] += kl;
        self.agree[bin] += usize::from(agree);
        self.count[bin] += 1;
    }

    fn add_session(&mut self, session: &Session, decode: Duration, steps: usize) {
        self.decode += decode;
        self.steps += steps;
        let r = session.rectify_stats();
        self.rectified.passes += r.passes;
        self.rectified.tokens += r.tokens;
        self.rectified.time += r.time;
    }

    fn mean_kl(&self, bin: usize) -> f64 {
        self.kl[bin] / self.count[bin].max(1) as f64
    }

    fn overall_kl(&self) -> f64 {
        self.kl.iter().sum::<f64>() / self.count.iter().sum::<usize>().max(1) as f64
    }

    fn overall_agree(&self) -> f64 {
        self.agree.iter().sum::<usize>() as f64 / self.count.iter().sum::<usize>().max(1) as f64
    }
}

/// `n` prefixes of `len` tokens, BOS first, from the books in turn.
fn prefixes(books: &[Vec<u32>], bos: u32, len: usize, n: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let per_book = n.div_ceil(books.len());
    let mut out = Vec::new();
    for i in 0..n {
        let (book, j) = (&books[i % books.len()], i / books.len());
        anyhow::ensure!(book.len() >= len, "a book has {} tokens, fewer than the prefix's {len}", book.len());
        let offset = (book.len() - len) * j / per_book;
        let mut prefix = vec![bos];
        prefix.extend_from_slice(&book[offset..offset + len - 1]);
        out.push(prefix);
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse()?;
    sift::threads::init(sift::threads::default_threads());
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
        .map(|p| Ok(tokenizer.encode(&std::fs::read_to_string(p)?, false, false)?))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let runs = args.teacher.max(args.free);
    let prefixes = prefixes(&books, bos, args.prefix, runs)?;
    let n_ctx = args.prefix + args.gen.max(args.free_gen) + 1;
    let storage = Storage { key_sketch: true, ..Storage::default() };
    let mut tallies = vec![Tally::default(); VARIANTS.len()];
    let mut free_tallies = vec![Tally::default(); VARIANTS.len()];
    let started = Instant::now();

    for (i, prefix) in prefixes.iter().enumerate() {
        let mut base = Session::with_policy(&model, n_ctx, DEFAULT_BATCH, storage, Box::new(Dense));
        let first = argmax(base.prefill(prefix)?);
        let teacher = (i < args.teacher).then_some(&mut tallies[..]);
        lockstep(&base, first, &args, teacher, &mut free_tallies)?;
        let progress = format!("{} of {runs} prefixes done after {:.0} s", i + 1, started.elapsed().as_secs_f64());
        eprintln!("{progress}");
        let report = Report { args: &args, teacher: &tallies, free: &free_tallies, progress };
        let table = report.write()?;
        if i + 1 == runs {
            print!("{table}");
        }
    }
    Ok(())
}

/// Every variant decodes dense's greedy tokens in lockstep, from `base`'s
/// cache, whose logits chose `first`. Teacher-forced (`teacher` given), for
/// `--gen` steps, each step's KL and agreement added to `teacher`. In any
/// case the first `--free-gen` tokens also give the free-running result: a
/// policy's own greedy continuation is dense's up to the first step where
/// its top token differs from dense's (until then it has decoded the very
/// same tokens), so that step is where its continuation first differs, and
/// none means identical. Free-running alone, a policy stops there.
fn lockstep(
    base: &Session,
    first: u32,
    args: &Args,
    mut teacher: Option<&mut [Tally]>,
    free: &mut [Tally],
) -> anyhow::Result<()> {
    let steps = if teacher.is_some() { args.gen } else { args.free_gen - 1 };
    let mut sessions = VARIANTS.iter().map(|v| v.fork(base, args.every)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut times = vec![Duration::ZERO; sessions.len()];
    let mut counts = vec![0; sessions.len()];
    // Where each policy's free-running continuation first differs from dense's.
    let mut differs: Vec<Option<usize>> = vec![None; sessions.len()];
    let mut token = first;
    for step in 0..steps {
        let free_step = step + 1 < args.free_gen;
        if teacher.is_none() && differs.iter().skip(1).all(Option::is_some) {
            break;
        }
        let (mut dense, mut dense_top) = (Vec::new(), 0);
        for (j, session) in sessions.iter_mut().enumerate() {
            if teacher.is_none() && differs[j].is_some() {
                continue;
            }
            let started = Instant::now();
            let logits = session.decode(token)?;
            times[j] += started.elapsed();
            counts[j] += 1;
            if j == 0 {
                dense_top = argmax(logits);
                dense = log_softmax(logits);
                continue;
            }
            let agree = argmax(logits) == dense_top;
            if !agree && free_step && differs[j].is_none() {
                differs[j] = Some(step + 1);
            }
            if let Some(tallies) = teacher.as_deref_mut() {
                tallies[j].add_step(step, kl(&dense, &log_softmax(logits)), agree);
            }
        }
        token = dense_top;
        if let Some(tallies) = teacher.as_deref().filter(|_| (step + 1) % BIN == 0) {
            let progress = format!("in progress: {} of {} steps of the latest prefix", step + 1, args.gen);
            Report { args, teacher: tallies, free, progress }.write()?;
        }
    }
    for (j, session) in sessions.iter().enumerate() {
        let tally = match teacher.as_deref_mut() {
            Some(tallies) => &mut tallies[j],
            None => &mut free[j],
        };
        tally.add_session(session, times[j], counts[j]);
        match differs[j] {
            None => free[j].identical += 1,
            Some(at) => free[j].first_differences.push(at),
        }
    }
    Ok(())
}

struct Report<'a> {
    args: &'a Args,
    teacher: &'a [Tally],
    free: &'a [Tally],
    /// How far the runs have got.
    progress: String,
}

impl Report<'_> {
    /// Writes the tables, the JSON and the plot to `--out`; returns the tables.
    fn write(&self) -> anyhow::Result<String> {
        let table = self.markdown();
        std::fs::create_dir_all(&self.args.out)?;
        let stem = self.args.out.join(format!("rectify-{}", self.args.prefix));
        std::fs::write(stem.with_extension("md"), &table)?;
        std::fs::write(stem.with_extension("json"), serde_json::to_string_pretty(&self.json())?)?;
        if self.teacher[1].count.iter().sum::<usize>() > 0 {
            self.plot(&stem.with_extension("png"))?;
        }
        Ok(table)
    }

    fn markdown(&self) -> String {
        use std::fmt::Write;
        let a = self.args;
        let mut s = format!("{}\n\n", self.progress);
        let sparse = || VARIANTS.iter().zip(self.teacher).skip(1);
        if !self.teacher[1].kl.is_empty() {
            let _ = writeln!(
                s,
                "Teacher-forced, {} prefixes of {} tokens, {} tokens decoded: mean KL(dense ‖ policy) / top-1 agreement per bin of {BIN} positions\n",
                a.teacher, a.prefix, a.gen
            );
            let _ = writeln!(s, "| positions | {} |", sparse().map(|(v, _)| v.name).collect::<Vec<_>>().join(" | "));
            let _ = writeln!(s, "| --- |{}", " ---: |".repeat(VARIANTS.len() - 1));
            for bin in 0..self.teacher[1].kl.len() {
                let cells: Vec<String> = sparse()
                    .map(|(_, t)| {
                        format!(
                            "{:.5} / {:.1}%",
                            t.mean_kl(bin),
                            100.0 * t.agree[bin] as f64 / t.count[bin].max(1) as f64
                        )
                    })
                    .collect();
                let _ = writeln!(s, "| {}–{} | {} |", bin * BIN, ((bin + 1) * BIN).min(a.gen) - 1, cells.join(" | "));
            }
            let all: Vec<String> = sparse()
                .map(|(_, t)| format!("**{:.5} / {:.1}%**", t.overall_kl(), 100.0 * t.overall_agree()))
                .collect();
            let _ = writeln!(s, "| all | {} |\n", all.join(" | "));
        }
        let runs = self.free[0].identical + self.free[0].first_differences.len();
        if runs > 0 {
            let _ = writeln!(
                s,
                "Free-running, {runs} prefixes of {} tokens, {} greedy tokens each\n",
                a.prefix, a.free_gen
            );
            let _ = writeln!(s, "| policy | identical to dense | mean first difference (of those that differ) |");
            let _ = writeln!(s, "| --- | ---: | ---: |");
            for (v, t) in VARIANTS.iter().zip(self.free) {
                let diff = t.first_differences.len();
                let mean = t.first_differences.iter().sum::<usize>() as f64 / diff.max(1) as f64;
                let mean = if diff == 0 { "—".to_string() } else { format!("{mean:.1} ({diff})") };
                let share = 100.0 * t.identical as f64 / runs as f64;
                let _ = writeln!(s, "| {} | {}/{runs} ({share:.0}%) | {} |", v.name, t.identical, mean);
            }
            s.push('\n');
        }
        let _ = writeln!(s, "Decoding, all runs above together (one loaded run; compare within the column)\n");
        let _ = writeln!(s, "| policy | decode tok/s | rectifications | tokens rewritten | share of decode time |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for (v, (t, f)) in VARIANTS.iter().zip(self.teacher.iter().zip(self.free)) {
            let time = t.decode + f.decode;
            let rectify = t.rectified.time + f.rectified.time;
            let _ = writeln!(
                s,
                "| {} | {:.1} | {} | {} | {:.1}% |",
                v.name,
                (t.steps + f.steps) as f64 / time.as_secs_f64().max(1e-9),
                t.rectified.passes + f.rectified.passes,
                t.rectified.tokens + f.rectified.tokens,
                100.0 * rectify.as_secs_f64() / time.as_secs_f64().max(1e-9)
            );
        }
        s
    }

    fn json(&self) -> serde_json::Value {
        let a = self.args;
        let variants: Vec<_> = VARIANTS
            .iter()
            .zip(self.teacher.iter().zip(self.free))
            .map(|(v, (t, f))| {
                serde_json::json!({
                    "policy": v.name,
                    "bins": (0..t.kl.len()).map(|b| serde_json::json!({
                        "first": b * BIN, "mean_kl": t.mean_kl(b),
                        "top1": t.agree[b] as f64 / t.count[b].max(1) as f64, "positions": t.count[b],
                    })).collect::<Vec<_>>(),
                    "mean_kl": t.overall_kl(),
                    "top1": t.overall_agree(),
                    "free_identical": f.identical,
                    "free_first_differences": f.first_differences,
                    "decode_s": (t.decode + f.decode).as_secs_f64(),
                    "decode_steps": t.steps + f.steps,
                    "rectifications": t.rectified.passes + f.rectified.passes,
                    "rectify_s": (t.rectified.time + f.rectified.time).as_secs_f64(),
                })
            })
            .collect();
        serde_json::json!({
            "progress": self.progress,
            "prefix": a.prefix, "gen": a.gen, "teacher_prefixes": a.teacher, "free_prefixes": a.free,
            "free_gen": a.free_gen, "rectify_every": a.every, "bin": BIN, "variants": variants,
        })
    }

    /// Per-bin mean KL of the sparse variants, log scale.
    fn plot(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let font = std::env::var("SIFT_PLOT_FONT")
            .unwrap_or_else(|_| "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf".into());
        let bytes: &'static [u8] = Box::leak(std::fs::read(&font)?.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| anyhow::anyhow!("{font}: not a font plotters can read"))?;
        let sparse: Vec<_> = VARIANTS.iter().zip(self.teacher).skip(1).collect();
        let points = |t: &Tally| -> Vec<(f64, f64)> {
            (0..t.kl.len()).map(|b| ((b * BIN + BIN / 2) as f64, t.mean_kl(b).max(1e-7))).collect()
        };
        let all: Vec<f64> = sparse.iter().flat_map(|(_, t)| points(t)).map(|p| p.1).collect();
        let (lo, hi) = all.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &y| (lo.min(y), hi.max(y)));
        let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let caption = format!(
            "Gemma 3 270M, PG-19 prefixes of {} tokens, teacher-forced: KL against dense per {BIN} positions",
            self.args.prefix
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..self.args.gen as f64, (lo / 2.0..hi * 2.0).log_scale())?;
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
