//! The generation loop shared by `run` and (later) `chat`: prefill the
//! prompt, then sample, stream and decode until an end-of-generation token,
//! the token limit, or a full context.

use std::time::{Duration, Instant};

use crate::engine::{EngineError, Session};
use crate::sample::Sampler;
use crate::tokenizer::{TextStream, Tokenizer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndOfGeneration,
    TokenLimit,
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    pub prefill_time: Duration,
    /// Time spent in decode steps, and how many there were.
    pub decode_time: Duration,
    pub decode_steps: usize,
}

/// `on_text` receives text as soon as it forms valid UTF-8.
pub fn generate(
    session: &mut Session,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    max_tokens: usize,
    mut on_text: impl FnMut(&str),
) -> Result<Generated, EngineError> {
    for &t in prompt {
        sampler.accept(t);
    }
    let started = Instant::now();
    let mut logits = session.prefill(prompt)?.to_vec();
    let prefill_time = started.elapsed();

    let mut stream = TextStream::new(tokenizer);
    let mut out = Generated {
        tokens: Vec::new(),
        text: String::new(),
        stop: StopReason::TokenLimit,
        prompt_tokens: prompt.len(),
        prefill_time,
        decode_time: Duration::ZERO,
        decode_steps: 0,
    };
    while out.tokens.len() < max_tokens {
        let token = sampler.sample(&logits);
        if tokenizer.is_eog(token) {
            out.stop = StopReason::EndOfGeneration;
            break;
        }
        sampler.accept(token);
        out.tokens.push(token);
        let piece = stream.push(token);
        if !piece.is_empty() {
            on_text(&piece);
            out.text.push_str(&piece);
        }
        if out.tokens.len() == max_tokens {
            break;
        }
        if session.n_past() >= session.n_ctx() {
            out.stop = StopReason::ContextFull;
            break;
        }
        let step = Instant::now();
        logits.copy_from_slice(session.decode(token)?);
        out.decode_time += step.elapsed();
        out.decode_steps += 1;
    }
    let rest = stream.finish();
    if !rest.is_empty() {
        on_text(&rest);
        out.text.push_str(&rest);
    }
    Ok(out)
}
