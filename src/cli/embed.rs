//! `sift embed`: texts as vectors, for scripts that search or cluster them.

use std::io::Write;

use clap::Args;
use sift::embed::{embed, Pooling};
use sift::model::Model;
use sift::tokenizer::Tokenizer;

use super::{read_prompt, InputError, ModelArgs, Usage};

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// One text; without it, each line of standard input is a text (empty lines skipped)
    #[arg(short, long)]
    prompt: Option<String>,
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
    let mut stdout = std::io::stdout().lock();
    for (i, text) in texts.iter().enumerate() {
        let ids = tokenizer.encode(text, true, false)?;
        if ids.len() > model.hp.n_ctx_train {
            let n = model.hp.n_ctx_train;
            return Err(InputError(format!(
                "text {} has {} tokens, more than the model's context of {n}",
                i + 1,
                ids.len()
            ))
            .into());
        }
        if ids.is_empty() {
            return Err(InputError(format!("text {} has no tokens", i + 1)).into());
        }
        writeln!(stdout, "{}", serde_json::to_string(&embed(&model, &ids, pooling)?)?)?;
    }
    Ok(())
}
