//! `sift run`: one prompt in, its continuation out.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use clap::builder::NonEmptyStringValueParser;
use clap::Args;
use sift::attn::capture::Capturing;
use sift::attn::AttentionPolicy;
use sift::audit::{audit_token, AuditHeader, AuditSummary};
use sift::chat::{ChatTemplate, Message};
use sift::conversation::{chat_prompt, shared_prefix, Conversation};
use sift::generate::{Limits, Sampled};
use sift::model::Model;
use sift::prompt_cache::PromptCacheError;
use sift::rectify::RectifyReport;
use sift::tokenizer::Tokenizer;

use super::{announce_template, context_size, read_prompt, AuditArgs, GenerationArgs, InputError, ModelArgs};

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
    #[command(flatten)]
    audit: AuditArgs,
    /// Dot f32 activations with weights dequantized to f32 instead of 8-bit activations, as
    /// `sift perplexity --f32-activations` does (several times slower)
    #[arg(long)]
    f32_activations: bool,
    /// Keep the queries of every decoding step on the layers a sparse policy reads sparsely (those
    /// that see 1024 positions or more: Gemma 3's global layers), with every key and value those
    /// layers hold, and write them to FILE at the end: real caches for `cargo bench --bench
    /// certified_attention -- --captured FILE`. Run it with dense attention
    #[arg(long, value_name = "FILE")]
    capture: Option<PathBuf>,
    /// Keep the KV cache after the prompt in FILE, and start from it when a later run's prompt
    /// begins with the same tokens (a long document, then each question): made when missing,
    /// remade with what two prompts share when the prompt differs, for this model, -c,
    /// --kv-cache and --attn's key sketch only
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<PathBuf>,
}

/// Starts `conversation` from the prompt cache at `path` where it holds the beginning of
/// `prompt`, and prefills the rest of the prompt but its last token. A missing file is made
/// with that; one that holds another prompt is made again with what the two share (a document
/// before different questions), so that the next prompt finds it; one made for other settings
/// is made again; one that holds a beginning of the prompt is left as it is. A file that is not
/// a prompt cache is an error, and is left alone; one that cannot be written, a warning.
fn prompt_cache(
    conversation: &mut Conversation,
    prompt: &[u32],
    path: &Path,
    model: &str,
    quiet: bool,
) -> anyhow::Result<()> {
    let info = |message: String| {
        if !quiet {
            eprintln!("sift: prompt cache: {message}");
        }
    };
    let cached = match conversation.load_prompt_cache(path, model) {
        Ok(_) => conversation.cached().to_vec(),
        Err(e) if e.is_missing() => Vec::new(),
        // Made for another model or settings: made again.
        Err(e @ PromptCacheError::Mismatch { .. }) => {
            eprintln!("sift: warning: {e}; it will be made again");
            Vec::new()
        }
        // Anything else is left alone: a file named by mistake is not overwritten.
        Err(e) => return Err(InputError(format!("{e}; not using or overwriting it")).into()),
    };
    // The last token is prefilled with the generation, for its logits.
    let Some(last) = prompt.len().checked_sub(1).filter(|&last| last > 0) else { return Ok(()) };
    if !cached.is_empty() && prompt[..last].starts_with(&cached) {
        info(format!("{} of the prompt's {} tokens from {}", cached.len(), prompt.len(), path.display()));
        return Ok(());
    }
    let shared = shared_prefix(&cached, prompt).min(last);
    let kept = if shared > 0 { shared } else { last };
    let start = std::time::Instant::now();
    conversation.prefill(&prompt[..kept])?;
    match conversation.save_prompt_cache(path, model) {
        Ok(()) => info(format!(
            "{kept} tokens prefilled and written to {} in {:.1} s",
            path.display(),
            start.elapsed().as_secs_f64()
        )),
        Err(e) => eprintln!("sift: warning: cannot write the prompt cache: {e}; going on without it"),
    }
    Ok(())
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // The sampling seed draws certified attention's perturbations too.
    let sampling = args.generation.sampling();
    let policy = args.generation.attention.policy(sampling.seed, args.audit.audit)?;
    let (policy, capture) = match &args.capture {
        Some(_) => {
            let (capturing, log) = Capturing::new(policy);
            (Box::new(capturing) as Box<dyn AttentionPolicy>, Some(log))
        }
        None => (policy, None),
    };
    let rectify = args.generation.attention.rectify(args.audit.audit)?;
    let mut audit = args.audit.create()?;
    let prompt = read_prompt(args.prompt.as_deref())?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    sampling.check(model.hp.n_vocab).map_err(super::Usage)?;
    let grammar = args.generation.grammar(&tokenizer)?;
    sift::matmul::set_f32_activations(args.f32_activations);
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
            chat_prompt(&tokenizer, template, &messages, true)?
        }
        None => tokenizer.encode(&prompt, true, false)?,
    };
    let storage = args.generation.cache.storage();
    let mut conversation = Conversation::new(&model, &tokenizer, n_ctx, storage, policy, sampling.clone());
    conversation.set_rectify(rectify)?;
    args.generation.gpu.attach(&model, conversation.session_mut())?;
    if !args.quiet {
        conversation.session_mut().set_prefill_progress(Some(super::prefill_progress(true, None)));
    }
    conversation.check_fits(&prompt_ids)?;
    if let Some(path) = &args.prompt_cache {
        prompt_cache(&mut conversation, &prompt_ids, path, &file.fingerprint(), args.quiet)?;
    }
    if let Some(audit) = &mut audit {
        let kv_cache = args.generation.cache.kv_cache;
        let arch = model.hp.arch.gguf_name();
        audit.header(&AuditHeader::new(
            file.path(),
            arch,
            kv_cache,
            args.generation.attention.kind,
            n_ctx,
            Some(&sampling),
            Some(prompt_ids.len()),
        ))?;
    }
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
    let limits = Limits { max_tokens: args.n_predict, stop: &args.stop, interrupt: None, grammar: grammar.as_ref() };
    let mut audit_failure = None;
    let on_text = |text: &str| {
        if !args.json {
            // A closed pipe (`| head`) is not an error worth reporting.
            let _ = stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush());
        }
    };
    let on_token = |sampled: &Sampled| audit_token(audit.as_mut(), &mut audit_failure, sampled, &tokenizer, None);
    let generated = conversation.generate(&prompt_ids, limits, on_text, on_token)?;
    if let Some(e) = audit_failure {
        return Err(e.into());
    }
    if let Some(audit) = audit {
        let session = conversation.session();
        let rectify = (rectify.every > 0).then(|| RectifyReport::of(rectify, session.rectify_stats()));
        let stop = Some(generated.stop);
        audit.finish(&AuditSummary { tokens: generated.tokens.len(), stop, turns: None, rectify })?;
    }
    if let (Some(path), Some(log)) = (&args.capture, capture) {
        log.captured().write(path)?;
    }
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string(&generated)?)?;
    } else if stdout.is_terminal() && !generated.text.ends_with('\n') {
        // The terminal's next line (the timing line, the shell's prompt) starts on a line of its own.
        writeln!(stdout)?;
    }
    if !args.quiet {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "sift: prefill {} tokens in {:.0} ms ({:.1} tok/s), decode {} tokens in {:.0} ms ({:.1} tok/s)",
            generated.prompt_tokens,
            ms(generated.prefill_time),
            generated.prefill_tok_s(),
            generated.decode_steps,
            ms(generated.decode_time),
            generated.decode_tok_s(),
        );
    }
    Ok(())
}
