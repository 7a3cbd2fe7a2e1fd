//! `sift tokenize`: the ids a text becomes.

use clap::Args;
use sift::tokenizer::Tokenizer;

use super::{read_prompt, ModelArgs};

#[derive(Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text; `-` (or no -p with input piped in) reads standard input
    #[arg(short, long)]
    prompt: Option<String>,
    /// Do not add BOS/EOS even where the model asks for them
    #[arg(long)]
    no_special: bool,
    /// Also print each token's text, one per line
    #[arg(long)]
    pieces: bool,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let text = read_prompt(args.prompt.as_deref())?;
    let file = args.model.open_for_metadata()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let ids = tokenizer.encode(&text, !args.no_special, false)?;
    if args.pieces {
        for id in ids {
            println!("{id:>8} {:?}", String::from_utf8_lossy(&tokenizer.token_bytes(id)));
        }
    } else {
        println!("{}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
    }
    Ok(())
}
