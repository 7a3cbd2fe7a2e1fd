//! `sift perplexity`: llama-perplexity's measurement on a text file.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sift::engine::Session;
use sift::model::Model;
use sift::perplexity::perplexity;
use sift::tokenizer::Tokenizer;

use super::{InputError, ModelArgs};

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score
    #[arg(short, long)]
    file: PathBuf,
    /// Tokens per chunk; the second half of each is scored
    #[arg(short = 'c', long = "ctx-size", default_value_t = 2048)]
    ctx: usize,
    /// Score at most this many chunks [default: all]
    #[arg(long)]
    chunks: Option<usize>,
    /// Print one JSON object {ppl, ppl_stderr, tokens_scored, chunks}
    #[arg(long)]
    json: bool,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    if args.ctx < 2 {
        return Err(anyhow::Error::new(super::Usage("-c must be at least 2 for perplexity".into())));
    }
    let bytes =
        std::fs::read(&args.file).map_err(|e| InputError(format!("{}: cannot read: {e}", args.file.display())))?;
    let text =
        String::from_utf8(bytes).map_err(|_| InputError(format!("{}: not valid UTF-8 text", args.file.display())))?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    let tokens = tokenizer.encode(&text, true, false).context("tokenizing the text")?;
    let bos = tokenizer.bos().filter(|_| tokenizer.adds_bos());
    let mut session = Session::new(&model, args.ctx);

    let available = tokens.len() / args.ctx;
    let total = args.chunks.map_or(available, |c| c.min(available));
    eprintln!("sift: {} tokens, {total} chunks of {}", tokens.len(), args.ctx);
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} chunks  {per_sec}  eta {eta}")
            .expect("static progress template"),
    );
    let started = std::time::Instant::now();
    let report = perplexity(&mut session, &tokens, bos, args.chunks, |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("PPL = {:.4} ± {:.5}", report.ppl, report.ppl_stderr);
    }
    eprintln!(
        "sift: {} chunks, {} tokens scored, {:.1} s ({:.0} tok/s evaluated)",
        report.chunks,
        report.tokens_scored,
        secs,
        (report.chunks * args.ctx) as f64 / secs
    );
    Ok(())
}
