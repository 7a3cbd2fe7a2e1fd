//! `sift embed`: texts as vectors, for scripts that search or cluster them.

use std::io::Write;

use clap::Args;
use sift::embed::{Embedder, Pooling};
use sift::engine::EngineError;
use sift::model::Model;
use sift::tokenizer::Tokenizer;

use super::{context_size, read_prompt, InputError, ModelArgs, Usage};

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// One text; without it, each line of standard input is a text (empty lines skipped)
    #[arg(short, long)]
    prompt: Option<String>,
    /// The most tokens a text may have [default: 4096, or the model's training context if smaller]
    #[arg(short = 'c', long = "ctx-size")]
    ctx: Option<usize>,
}

/// Prints one JSON array a text, in order: its final-normed hidden states pooled as the model
/// file asks (the mean, or the last token's) and scaled to unit length, as `sift serve`'s
/// `/v1/embeddings` gives them.
pub fn run(args: EmbedArgs) -> anyhow::Result<()> {
    let texts: Vec<String> = match args.prompt.as_deref() {
        Some(text) if text != "-" => vec![text.to_string()],
        prompt => read_prompt(prompt)?.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect(),
    };
    if texts.is_empty() {
        return Err(Usage("no text: give -p TEXT, or pipe texts on standard input, one a line".into()).into());
    }
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    let pooling = Pooling::for_model(&file, model.hp.arch.gguf_name())?;
    let n_ctx = context_size(args.ctx, model.hp.n_ctx_train)?;
    let mut embedder = Embedder::new(&model, n_ctx, pooling);
    let mut stdout = std::io::stdout().lock();
    for (i, text) in texts.iter().enumerate() {
        let ids = tokenizer.encode(text, true, false)?;
        if ids.len() > n_ctx {
            let too_long = EngineError::PromptTooLong { prompt: ids.len(), n_ctx };
            return Err(anyhow::Error::new(too_long).context(format!("text {}", i + 1)));
        }
        if ids.is_empty() {
            return Err(InputError(format!("text {} has no tokens", i + 1)).into());
        }
        writeln!(stdout, "{}", serde_json::to_string(&embedder.embed(&ids)?)?)?;
    }
    Ok(())
}
