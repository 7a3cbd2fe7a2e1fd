//! `sift run`: one prompt in, its continuation out.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use clap::builder::NonEmptyStringValueParser;
use clap::Args;
use sift::attn::AttentionKind;
use sift::audit::{AuditError, AuditHeader, AuditLog, AuditRecord, AuditSummary};
use sift::chat::{self, ChatTemplate, Message};
use sift::engine::{EngineError, Session, DEFAULT_BATCH};
use sift::generate::{generate, Limits, Sampled};
use sift::model::Model;
use sift::sample::{Sampler, SamplingParams};
use sift::tokenizer::Tokenizer;

use super::chat::announce_template;
use super::{context_size, read_prompt, CacheArgs, GpuArgs, ModelArgs};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text; `-` (or no -p with input piped in) reads standard input
    #[arg(short, long)]
    prompt: Option<String>,
    /// Tokens to generate at most; 0 reads the prompt and generates nothing
    #[arg(short = 'n', long = "n-predict", visible_alias = "max-tokens", default_value_t = 128)]
    n_predict: usize,
    /// Stop when the text contains STR, which is left out of the output (repeatable)
    #[arg(long, value_name = "STR", value_parser = NonEmptyStringValueParser::new())]
    stop: Vec<String>,
    /// Wrap the prompt in the chat template, as the user's message
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat (implies --chat)
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Jinja chat template to use instead of the model's (implies --chat)
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Print one JSON object instead of streaming text
    #[arg(long)]
    json: bool,
    /// No information lines on stderr (warnings and errors still come)
    #[arg(short, long)]
    quiet: bool,
    #[command(flatten)]
    generation: GenerationArgs,
}

/// Context size, sampling and the audit, shared with `chat`.
#[derive(Args)]
pub struct GenerationArgs {
    /// Context size in tokens [default: 4096, or the model's if smaller]
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
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
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Write an audit of the generation to FILE, as JSON Lines: a header (model, cache,
    /// attention, context, sampling), per token its log-probability, the 5 most likely tokens and
    /// the attention's error bound, and a summary. A regular FILE appears only once complete
    #[arg(long, value_name = "FILE")]
    pub audit_out: Option<PathBuf>,
}

impl GenerationArgs {
    pub fn sampling(&self) -> SamplingParams {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed,
            ..SamplingParams::default()
        }
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // First, so that an audit that cannot be written costs no model load or generation.
    let mut audit = args.generation.audit_out.as_deref().map(AuditLog::create).transpose()?;
    let prompt = read_prompt(args.prompt.as_deref())?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    let n_ctx = context_size(args.generation.ctx, model.hp.n_ctx_train)?;
    let template = if args.chat || args.system.is_some() || args.chat_template.is_some() {
        Some(ChatTemplate::for_model(&tokenizer, model.hp.arch, args.chat_template.as_deref())?)
    } else {
        None
    };
    let prompt_ids = match &template {
        Some(template) => {
            let messages: Vec<Message> =
                args.system.into_iter().map(Message::system).chain([Message::user(prompt)]).collect();
            chat::encode(&tokenizer, &template.render(&messages, true)?)?
        }
        None => tokenizer.encode(&prompt, true, false)?,
    };
    if prompt_ids.len() > n_ctx {
        return Err(EngineError::PromptTooLong { prompt: prompt_ids.len(), n_ctx }.into());
    }
    let sampling = args.generation.sampling();
    let seed = sampling.seed;
    if let Some(audit) = &mut audit {
        let kv_cache = args.generation.cache.kv_cache;
        let arch = model.hp.arch.gguf_name();
        audit.header(&AuditHeader::new(
            file.path(),
            arch,
            kv_cache,
            AttentionKind::Dense,
            n_ctx,
            &sampling,
            Some(prompt_ids.len()),
        ))?;
    }
    let mut sampler = Sampler::new(sampling);
    let mut session = Session::with_cache(&model, n_ctx, DEFAULT_BATCH, args.generation.cache.storage());
    args.generation.gpu.attach(&model, &mut session)?;
    if !args.quiet {
        if let Some(template) = &template {
            announce_template(template);
        }
        eprintln!(
            "sift: {} ({}), {} prompt tokens, context {n_ctx}, {} threads",
            file.path().display(),
            model.hp.arch.gguf_name(),
            prompt_ids.len(),
            rayon::current_num_threads()
        );
    }

    let mut stdout = std::io::stdout().lock();
    let limits = Limits { max_tokens: args.n_predict, stop: &args.stop, interrupt: None };
    let mut audit_failure = None;
    let on_text = |text: &str| {
        if !args.json {
            // A closed pipe (`| head`) is not an error worth reporting.
            let _ = stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush());
        }
    };
    let on_token = |sampled: &Sampled| audit_token(audit.as_mut(), &mut audit_failure, sampled, &tokenizer, None);
    let generated = generate(&mut session, &tokenizer, &mut sampler, &prompt_ids, limits, on_text, on_token)?;
    if let Some(e) = audit_failure {
        return Err(e.into());
    }
    if let Some(audit) = audit {
        audit.finish(&AuditSummary { tokens: generated.tokens.len(), stop: Some(generated.stop), turns: None })?;
    }
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
    if !args.quiet {
        eprintln!(
            "sift: prefill {} tokens in {:.0} ms ({prefill_tok_s:.1} tok/s), decode {} tokens in {:.0} ms ({decode_tok_s:.1} tok/s)",
            generated.prompt_tokens,
            ms(generated.prefill_time),
            generated.decode_steps,
            ms(generated.decode_time),
        );
    }
    Ok(())
}

/// Writes a token's audit line, if an audit is being written. The first failure is kept in
/// `failure` and stops the generation: an audit with a gap is worth nothing.
pub fn audit_token(
    audit: Option<&mut AuditLog>,
    failure: &mut Option<AuditError>,
    sampled: &Sampled,
    tokenizer: &Tokenizer,
    turn: Option<usize>,
) -> ControlFlow<()> {
    let Some(audit) = audit else {
        return ControlFlow::Continue(());
    };
    match audit.token(&AuditRecord::new(sampled, tokenizer, turn)) {
        Ok(()) => ControlFlow::Continue(()),
        Err(e) => {
            *failure = Some(e);
            ControlFlow::Break(())
        }
    }
}
