//! `sift perplexity`: llama-perplexity's measurement on text files, the KL
//! divergence of one run's predictions from another's (KV cache modes,
//! attention policies), and the audit of a sparse attention policy against
//! exact attention over the scored tokens.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use sift::attn::audit::{AuditTable, AuditTables, Audited, ShadowLog};
use sift::attn::{AttentionKind, AttentionPolicy, HeadRecord};
use sift::audit::{AttentionRow, AuditHeader, AuditLog, AuditSummary};
use sift::engine::{Session, DEFAULT_BATCH};
use sift::model::Model;
use sift::perplexity::{self, evaluate, Evaluation, KlReport, PerplexityReport, Progress, Scoring, Windows, TOP_K};
use sift::rectify::RectifyReport;
use sift::tokenizer::Tokenizer;

use super::attn::{AttentionArgs, ShadowSpec};
use super::{CacheArgs, GpuArgs, InputError, ModelArgs, Usage};

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    gpu: GpuArgs,
    /// Text file to score; repeat it, or name a directory to score its .txt files
    #[arg(short, long = "file", required = true)]
    files: Vec<PathBuf>,
    /// Tokens per chunk; the second half of each is scored (but see --stride)
    #[arg(short = 'c', long = "ctx-size", default_value_t = 2048)]
    ctx: usize,
    /// Score at most this many chunks per file [default: all]
    #[arg(long)]
    chunks: Option<usize>,
    /// Start a chunk every N tokens and score its last N predictions (llama-perplexity's --ppl-stride)
    #[arg(long)]
    stride: Option<usize>,
    /// The base run's log-probabilities: written by a run without --kl-divergence, read by one with it.
    /// Per scored token it keeps the 32 most likely tokens' log-probabilities (a 262K vocabulary's full
    /// distributions would take gigabytes); KL is taken over those 32 tokens plus one bin for the rest
    /// of the mass, a lower bound on the full KL
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    kl_base: Option<PathBuf>,
    /// Compare with the base run of --kl-divergence-base: KL mean, p99 and max, top-1 agreement, both PPLs
    #[arg(long = "kl-divergence", requires = "kl_base")]
    kl: bool,
    /// Print one JSON object {ppl, ppl_stderr, tokens_scored, chunks, kl?, files: [...]}
    #[arg(long)]
    json: bool,
    /// Dot f32 activations with weights dequantized to f32, instead of quantizing the activations
    /// to 8 bits as llama.cpp does: several times slower, but without the activation rounding that
    /// any change upstream re-draws, the noise floor of --kl-divergence between cache modes
    #[arg(long)]
    f32_activations: bool,
    #[command(flatten)]
    attention: AttentionArgs,
    /// Compute exact attention beside the policy at every scored token and end with a table:
    /// head calls checked, certified and fallback shares, keys read (mean, p90) as a share of the
    /// visible positions, bytes read against dense attention's, error p50/p90/max in units of
    /// --eps, violations. Scores through decoding steps even with --attn dense
    #[arg(long)]
    audit: bool,
    /// Write every head call the audit checked to FILE as JSON Lines (`attention` lines between a
    /// header and a summary, the format of `sift run --audit-out`); implies --audit
    #[arg(long, value_name = "FILE")]
    audit_out: Option<PathBuf>,
    /// Also run these policies beside --attn on every call the audit checks, each on the same
    /// queries and cache, its output discarded, and add a row per policy to the table:
    /// certified:EPS:MEASURE (with the run's --delta and perturbations) or topk:PAGES (its errors
    /// on --measure, in units of --eps). The cache and the tokens scored stay those of --attn's
    /// outputs. A comma list, or repeat the flag; implies --audit
    #[arg(long, value_name = "POLICY", value_delimiter = ',')]
    shadow: Vec<ShadowSpec>,
    /// Seed of certified attention's perturbations
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One file's results.
#[derive(serde::Serialize)]
struct Book {
    file: String,
    #[serde(flatten)]
    report: PerplexityReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    kl: Option<KlReport>,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    if args.ctx < 2 {
        return Err(anyhow::Error::new(Usage("-c must be at least 2 for perplexity".into())));
    }
    // First, so that bad settings or an audit that cannot be written cost no model load.
    let audited = args.audit || args.audit_out.is_some() || !args.shadow.is_empty();
    let (policy, shadows) = policies(&args, audited)?;
    let rectify = args.attention.rectify(audited)?;
    let mut audit_log = args.audit_out.as_deref().map(AuditLog::create).transpose()?;
    let paths = text_files(&args.files)?;
    let texts = paths.iter().map(|p| read_text(p)).collect::<anyhow::Result<Vec<_>>>()?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    sift::matmul::set_f32_activations(args.f32_activations);
    let bos = tokenizer.bos().filter(|_| tokenizer.adds_bos());
    // Scored tokens see a sparse policy, or the audit, only through decoding steps.
    let scoring =
        if args.attention.kind == AttentionKind::Dense && !audited { Scoring::Batched } else { Scoring::Decoded };
    let windows = Windows { max: args.chunks, stride: args.stride, scoring };
    let tokens = texts
        .iter()
        .map(|text| tokenizer.encode(text, true, false).context("tokenizing the text"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let to_evaluate = |(path, tokens): (&PathBuf, &Vec<u32>)| {
        perplexity::tokens_to_evaluate(tokens.len(), args.ctx, windows).with_context(|| path.display().to_string())
    };
    let total = paths.iter().zip(&tokens).map(to_evaluate).sum::<anyhow::Result<usize>>()?;
    let base = match (&args.kl_base, args.kl) {
        (Some(path), true) => Some(perplexity::load_base(path)?),
        _ => None,
    };
    let keep_top = if args.kl_base.is_some() && !args.kl { TOP_K } else { 0 };
    let mut session = Session::with_policy(&model, args.ctx, DEFAULT_BATCH, args.cache.storage(), policy);
    session.set_rectify(rectify)?;
    args.gpu.attach(&model, &mut session)?;
    eprintln!(
        "sift: {} file(s), {} tokens, context {}, KV cache {}, attention {}",
        paths.len(),
        tokens.iter().map(Vec::len).sum::<usize>(),
        args.ctx,
        args.cache.kv_cache,
        args.attention.kind
    );
    if let Some(log) = &mut audit_log {
        let arch = model.hp.arch.gguf_name();
        let kind = args.attention.kind;
        log.header(&AuditHeader::new(file.path(), arch, args.cache.kv_cache, kind, args.ctx, None, None))?;
    }

    let bar = super::token_bar(total);
    let started = std::time::Instant::now();
    let (mut books, mut all, mut base_used) = (Vec::new(), Evaluation::default(), 0);
    let mut checked: Vec<HeadRecord> = Vec::new();
    let (mut chunks_before, mut audit_failure) = (0, None);
    for (path, tokens) in paths.iter().zip(&tokens) {
        let done = bar.position();
        let base = base.as_deref().map(|b| b.get(base_used..).unwrap_or_default());
        let on_call = |p: &Progress| {
            bar.set_position(done + p.evaluated as u64);
            let records = p.session.last_records().iter().filter(|r| r.audit.is_some());
            let (step, position) = (p.session.steps().saturating_sub(1) as usize, p.session.n_past() - 1);
            for record in records {
                if let (Some(log), None) = (&mut audit_log, &audit_failure) {
                    let chunk = Some(chunks_before + p.window);
                    let row = AttentionRow::new(record, None, chunk, step, position).expect("a checked record");
                    audit_failure = log.attention(&row).err();
                }
                checked.push(record.clone());
            }
        };
        let eval = evaluate(&mut session, tokens, bos, windows, keep_top, base, on_call)?;
        if let Some(e) = audit_failure.take() {
            return Err(e.into());
        }
        chunks_before += eval.windows;
        let book_base = base.map(|b| &b[..eval.scored.len().min(b.len())]);
        base_used += eval.scored.len();
        books.push(Book {
            file: path.display().to_string(),
            report: PerplexityReport::of(&eval.scored, eval.windows),
            kl: book_base.and_then(|b| KlReport::of(&eval.scored, b)),
        });
        all.windows += eval.windows;
        all.scored.extend(eval.scored);
    }
    bar.finish_and_clear();
    if base.as_ref().is_some_and(|b| b.len() != base_used) {
        return Err(perplexity::PerplexityError::BaseMismatch.into());
    }
    if let (Some(path), false) = (&args.kl_base, args.kl) {
        perplexity::save_base(path, &all.scored)?;
    }
    let secs = started.elapsed().as_secs_f64();
    let overall = PerplexityReport::of(&all.scored, all.windows);
    if let Some(log) = audit_log {
        let rectify = (rectify.every > 0).then(|| RectifyReport::of(rectify, session.rectify_stats()));
        log.finish(&AuditSummary { tokens: overall.tokens_scored, stop: None, turns: None, rectify })?;
    }
    let kl = base.as_deref().and_then(|b| KlReport::of(&all.scored, b));
    let settings = &args.attention.settings;
    let audit = audited.then(|| AuditTable::of(&settings.describe(args.attention.kind), &checked, settings.epsilon));
    let shadows: Vec<AuditTable> = args
        .shadow
        .iter()
        .zip(shadows.map(|log| log.take()).unwrap_or_default())
        .map(|(spec, records)| {
            let (kind, own) = spec.settings(settings);
            AuditTable::of(&own.describe(kind), &records, own.epsilon)
        })
        .collect();
    let rectified = (rectify.every > 0).then(|| RectifyReport::of(rectify, session.rectify_stats()));
    if args.json {
        print_json(&overall, kl.as_ref(), audit.as_ref(), &shadows, rectified.as_ref(), &books)?;
    } else {
        print_text(&overall, kl.as_ref(), &books);
        if let Some(audit) = audit {
            println!("{}", AuditTables(&[&[audit][..], &shadows].concat()));
        }
        if let Some(rectified) = rectified.filter(|_| audited) {
            println!("{rectified}");
        }
    }
    eprintln!(
        "sift: {} chunks, {} tokens scored, {secs:.1} s ({:.0} tok/s evaluated)",
        overall.chunks,
        overall.tokens_scored,
        total as f64 / secs
    );
    Ok(())
}

/// The session's policy, audited if `audited`, and the log of the audit's
/// shadows when there are any.
fn policies(args: &PerplexityArgs, audited: bool) -> anyhow::Result<(Box<dyn AttentionPolicy>, Option<ShadowLog>)> {
    let settings = &args.attention.settings;
    if args.shadow.is_empty() {
        return Ok((args.attention.policy(args.seed, audited)?, None));
    }
    let shadows = args
        .shadow
        .iter()
        .map(|spec| {
            let (kind, own) = spec.settings(settings);
            own.unaudited(kind, args.seed)
        })
        .collect::<Result<_, _>>()?;
    let driver = settings.unaudited(args.attention.kind, args.seed)?;
    let (audited, log) = Audited::with_shadows(driver, settings.measure, shadows);
    Ok((Box::new(audited), Some(log)))
}

/// The files named, with each directory replaced by its .txt files in name
/// order.
fn text_files(names: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for name in names {
        if !name.is_dir() {
            files.push(name.clone());
            continue;
        }
        let entries =
            std::fs::read_dir(name).map_err(|e| InputError(format!("{}: cannot read: {e}", name.display())))?;
        let mut texts: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "txt"))
            .collect();
        if texts.is_empty() {
            return Err(InputError(format!("{}: no .txt files in the directory", name.display())).into());
        }
        texts.sort();
        files.extend(texts);
    }
    Ok(files)
}

fn read_text(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).map_err(|e| InputError(format!("{}: cannot read: {e}", path.display())))?;
    Ok(String::from_utf8(bytes).map_err(|_| InputError(format!("{}: not valid UTF-8 text", path.display())))?)
}

fn print_text(overall: &PerplexityReport, kl: Option<&KlReport>, books: &[Book]) {
    if books.len() > 1 {
        println!("| file | chunks | tokens | PPL | KL mean | top-1 |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: |");
        for b in books {
            let (kl_mean, top1) =
                b.kl.as_ref()
                    .map_or(("-".into(), "-".into()), |k| (format!("{:.6}", k.kl_mean), percent(k.top1_agreement)));
            println!(
                "| {} | {} | {} | {:.4} ± {:.5} | {kl_mean} | {top1} |",
                b.file, b.report.chunks, b.report.tokens_scored, b.report.ppl, b.report.ppl_stderr
            );
        }
    }
    println!("PPL = {:.4} ± {:.5}", overall.ppl, overall.ppl_stderr);
    if let Some(k) = kl {
        let (gap, stderr) = (k.log_ppl_ratio.exp_m1() * 100.0, k.log_ppl_ratio_stderr * 100.0);
        println!("base PPL = {:.4} ({gap:+.3}% ± {stderr:.3}%, paired)", k.base_ppl);
        println!("KL mean = {:.6}, p99 = {:.6}, max = {:.6}", k.kl_mean, k.kl_p99, k.kl_max);
        println!("top-1 agreement = {}", percent(k.top1_agreement));
    }
}

fn percent(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

fn print_json(
    overall: &PerplexityReport,
    kl: Option<&KlReport>,
    audit: Option<&AuditTable>,
    shadows: &[AuditTable],
    rectified: Option<&RectifyReport>,
    books: &[Book],
) -> anyhow::Result<()> {
    let mut json = serde_json::to_value(overall)?;
    json["kl"] = serde_json::to_value(kl)?;
    if let Some(audit) = audit {
        json["audit"] = serde_json::to_value(audit)?;
    }
    if !shadows.is_empty() {
        json["shadows"] = serde_json::to_value(shadows)?;
    }
    if let Some(rectified) = rectified {
        json["rectify"] = serde_json::to_value(rectified)?;
    }
    json["files"] = serde_json::to_value(books)?;
    println!("{}", serde_json::to_string(&json)?);
    Ok(())
}
