//! `sift run`: one prompt in, its continuation out.

use std::io::Write;

use clap::Args;
use sift::engine::{EngineError, Session};
use sift::generate::generate;
use sift::model::Model;
use sift::sample::{Sampler, SamplingParams};
use sift::tokenizer::Tokenizer;

use super::{context_size, read_prompt, ModelArgs};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text; `-` (or no -p with input piped in) reads standard input
    #[arg(short, long)]
    prompt: Option<String>,
    /// Tokens to generate at most
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    /// Context size in tokens [default: 4096, or the model's if smaller]
    #[arg(short = 'c', long = "ctx-size")]
    ctx: Option<usize>,
    /// Sampling temperature; 0 is greedy
    #[arg(long = "temp", default_value_t = 0.8)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: all)
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalise tokens seen in the last 64 (1.0: off)
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed [default: from the clock]
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object instead of streaming text
    #[arg(long)]
    json: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let prompt = read_prompt(args.prompt.as_deref())?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    let n_ctx = context_size(args.ctx, model.hp.n_ctx_train)?;
    let prompt_ids = tokenizer.encode(&prompt, true, false)?;
    if prompt_ids.len() > n_ctx {
        return Err(EngineError::PromptTooLong { prompt: prompt_ids.len(), n_ctx }.into());
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed,
        ..SamplingParams::default()
    });
    let mut session = Session::new(&model, n_ctx);
    eprintln!(
        "sift: {} ({}), {} prompt tokens, context {n_ctx}, {} threads",
        file.path().display(),
        model.hp.arch.gguf_name(),
        prompt_ids.len(),
        rayon::current_num_threads()
    );

    let mut stdout = std::io::stdout().lock();
    let generated = generate(&mut session, &tokenizer, &mut sampler, &prompt_ids, args.n_predict, |text| {
        if !args.json {
            // A closed pipe (`| head`) is not an error worth reporting.
            let _ = stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush());
        }
    })?;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let per_s = |n: usize, d: std::time::Duration| if d.is_zero() { 0.0 } else { n as f64 / d.as_secs_f64() };
    let prefill_tok_s = per_s(generated.prompt_tokens, generated.prefill_time);
    let decode_tok_s = per_s(generated.decode_steps, generated.decode_time);
    if args.json {
        let json = serde_json::json!({
            "prompt_tokens": generated.prompt_tokens,
            "tokens": generated.tokens.len(),
            "token_ids": generated.tokens,
            "text": generated.text,
            "stop": generated.stop,
            "seed": seed,
            "timings": {
                "prefill_ms": ms(generated.prefill_time),
                "decode_ms": ms(generated.decode_time),
                "prefill_tok_s": prefill_tok_s,
                "decode_tok_s": decode_tok_s,
            }
        });
        writeln!(stdout, "{json}")?;
    } else if std::io::IsTerminal::is_terminal(&stdout) {
        writeln!(stdout)?;
    }
    eprintln!(
        "sift: prefill {} tokens in {:.0} ms ({prefill_tok_s:.1} tok/s), decode {} tokens in {:.0} ms ({decode_tok_s:.1} tok/s)",
        generated.prompt_tokens,
        ms(generated.prefill_time),
        generated.decode_steps,
        ms(generated.decode_time),
    );
    Ok(())
}
