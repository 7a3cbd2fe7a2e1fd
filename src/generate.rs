//! The generation loop shared by `run` and `chat`: prefill the prompt, then
//! sample, stream and decode until an end-of-generation token, a stop string,
//! the token limit, a full context, or a request to stop.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::attn::HeadRecord;
use crate::engine::{EngineError, Session};
use crate::rectify::RectifyStats;
use crate::sample::Sampler;
use crate::structured::Grammar;
use crate::tokenizer::{TextStream, Tokenizer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndOfGeneration,
    StopString,
    TokenLimit,
    ContextFull,
    Interrupted,
}

/// When to stop besides an end-of-generation token or a full context.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    pub max_tokens: usize,
    /// Stop once the text contains one of these; the stop string and anything after it are cut.
    pub stop: &'a [String],
    /// Set elsewhere (by a Ctrl-C handler) to stop before the next token.
    pub interrupt: Option<&'a AtomicBool>,
    /// The grammar the reply must follow (structured output): each token is sampled among those
    /// it allows, and the reply ends where it is complete.
    pub grammar: Option<&'a Grammar>,
}

/// What a generation produced, and what it cost. It serializes as `sift run --json` prints it:
/// `prompt_tokens`, `tokens` (the count), `token_ids`, `text`, `stop`, `seed` and `timings`.
#[derive(Debug, Clone)]
pub struct Generated {
    /// Every token sampled, a stop string's included.
    pub tokens: Vec<u32>,
    /// The text streamed, a stop string's excluded.
    pub text: String,
    pub stop: StopReason,
    /// Which of the limits' stop strings ended the text, where one did.
    pub stop_string: Option<usize>,
    /// The sampler's seed.
    pub seed: u64,
    /// Tokens prefilled before the first one was sampled.
    pub prompt_tokens: usize,
    pub prefill_time: Duration,
    /// Time spent in decode steps, and how many there were.
    pub decode_time: Duration,
    pub decode_steps: usize,
    /// Dense rectification passes among the decode steps, and their share
    /// of `decode_time` ([`crate::rectify`]).
    pub rectifications: u64,
    pub rectify_time: Duration,
}

impl Generated {
    pub fn prefill_tok_s(&self) -> f64 {
        per_second(self.prompt_tokens, self.prefill_time)
    }

    pub fn decode_tok_s(&self) -> f64 {
        per_second(self.decode_steps, self.decode_time)
    }

    /// The share of the decode time that rectification took.
    pub fn rectify_share(&self) -> f64 {
        if self.decode_time.is_zero() {
            0.0
        } else {
            self.rectify_time.as_secs_f64() / self.decode_time.as_secs_f64()
        }
    }

    /// Counts the rectification passes of the decode steps.
    fn count_rectifications(&mut self, rectified: RectifyStats) {
        self.rectifications += rectified.passes;
        self.rectify_time += rectified.time;
    }

    /// Counts a rectification pass run after the decode steps (a chat's at
    /// the end of a reply) among them, its time in theirs.
    pub fn add_rectification(&mut self, rectified: RectifyStats) {
        self.decode_time += rectified.time;
        self.count_rectifications(rectified);
    }
}

fn per_second(n: usize, time: Duration) -> f64 {
    if time.is_zero() {
        0.0
    } else {
        n as f64 / time.as_secs_f64()
    }
}

impl serde::Serialize for Generated {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(serde::Serialize)]
        struct Timings {
            prefill_ms: f64,
            decode_ms: f64,
            prefill_tok_s: f64,
            decode_tok_s: f64,
            rectifications: u64,
            rectify_ms: f64,
            rectify_share: f64,
        }
        #[derive(serde::Serialize)]
        struct Shape<'a> {
            prompt_tokens: usize,
            tokens: usize,
            token_ids: &'a [u32],
            text: &'a str,
            stop: StopReason,
            seed: u64,
            timings: Timings,
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let shape = Shape {
            prompt_tokens: self.prompt_tokens,
            tokens: self.tokens.len(),
            token_ids: &self.tokens,
            text: &self.text,
            stop: self.stop,
            seed: self.seed,
            timings: Timings {
                prefill_ms: ms(self.prefill_time),
                decode_ms: ms(self.decode_time),
                prefill_tok_s: self.prefill_tok_s(),
                decode_tok_s: self.decode_tok_s(),
                rectifications: self.rectifications,
                rectify_ms: ms(self.rectify_time),
                rectify_share: self.rectify_share(),
            },
        };
        serde::Serialize::serialize(&shape, serializer)
    }
}

/// A token just sampled, and what it was sampled from, for an audit of the generation.
#[derive(Debug, Clone, Copy)]
pub struct Sampled<'a> {
    /// 0 for the first token after the prompt.
    pub step: usize,
    /// The token's position in the context.
    pub position: usize,
    pub token: u32,
    /// The text the token completes (before stop strings are cut); empty for an
    /// end-of-generation token.
    pub text: &'a str,
    /// The model's logits, before any sampling step changed them.
    pub logits: &'a [f32],
    /// What attention did in the forward call that computed the logits.
    pub attention: &'a [HeadRecord],
}

/// Appends `prompt` to the session and generates after it. `on_text` receives text as soon as it
/// forms valid UTF-8 and cannot be the start of a stop string. `on_token` sees every token sampled,
/// an end-of-generation token included, before its text is passed on; `Break` stops the
/// generation there (as `Interrupted`), that token's text unsent.
pub fn generate(
    session: &mut Session,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    limits: Limits,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(&Sampled) -> ControlFlow<()>,
) -> Result<Generated, EngineError> {
    let started = Instant::now();
    let mut logits = session.prefill(prompt)?.to_vec();
    let prefill_time = started.elapsed();
    let rectified = session.rectify_stats().clone();
    for &t in prompt {
        sampler.accept(t);
    }

    let mut stream = TextStream::new(tokenizer);
    let mut stops = StopStrings::new(limits.stop);
    let mut out = Generated {
        tokens: Vec::new(),
        text: String::new(),
        stop: StopReason::TokenLimit,
        stop_string: None,
        seed: sampler.params().seed,
        prompt_tokens: prompt.len(),
        prefill_time,
        decode_time: Duration::ZERO,
        decode_steps: 0,
        rectifications: 0,
        rectify_time: Duration::ZERO,
    };
    let mut emit = |out: &mut Generated, text: &str| {
        if !text.is_empty() {
            on_text(text);
            out.text.push_str(text);
        }
    };
    let mut grammar = limits.grammar.map(Grammar::start);
    let mut allowed = Vec::new();
    while out.tokens.len() < limits.max_tokens {
        if limits.interrupt.is_some_and(|flag| flag.load(Ordering::Relaxed)) {
            out.stop = StopReason::Interrupted;
            break;
        }
        let token = match &mut grammar {
            Some(grammar) => {
                allowed.clone_from(&logits);
                grammar.mask(&mut allowed)?;
                sampler.sample(&allowed)
            }
            None => sampler.sample(&logits),
        };
        let eog = tokenizer.is_eog(token);
        let text = if eog { String::new() } else { stream.push(token) };
        let sampled = Sampled {
            step: out.tokens.len(),
            position: session.n_past(),
            token,
            text: &text,
            logits: &logits,
            attention: session.last_records(),
        };
        if on_token(&sampled).is_break() {
            out.stop = StopReason::Interrupted;
            out.count_rectifications(session.rectify_stats().since(&rectified));
            return Ok(out);
        }
        if eog {
            out.stop = StopReason::EndOfGeneration;
            break;
        }
        sampler.accept(token);
        if let Some(grammar) = &mut grammar {
            grammar.accept(token)?;
        }
        out.tokens.push(token);
        match stops.push(&text) {
            Scan::Go(text) => emit(&mut out, &text),
            Scan::Stop(text, which) => {
                emit(&mut out, &text);
                (out.stop, out.stop_string) = (StopReason::StopString, Some(which));
                out.count_rectifications(session.rectify_stats().since(&rectified));
                return Ok(out);
            }
        }
        if out.tokens.len() == limits.max_tokens {
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
    match stops.push(&stream.finish()) {
        Scan::Go(text) => {
            emit(&mut out, &text);
            emit(&mut out, &stops.finish());
        }
        Scan::Stop(text, which) => {
            emit(&mut out, &text);
            (out.stop, out.stop_string) = (StopReason::StopString, Some(which));
        }
    }
    out.count_rectifications(session.rectify_stats().since(&rectified));
    Ok(out)
}

/// Watches the generated text for stop strings. Text that could be the start of one is held back
/// until the next tokens show whether it is, so no part of a stop string is ever streamed.
struct StopStrings<'a> {
    stops: &'a [String],
    held: String,
}

enum Scan {
    /// Text that is safe to stream.
    Go(String),
    /// A stop string was found: the text before it, still to stream, and which string it was
    /// (the one that starts first; of those, the first given).
    Stop(String, usize),
}

impl<'a> StopStrings<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self { stops, held: String::new() }
    }

    fn push(&mut self, text: &str) -> Scan {
        self.held.push_str(text);
        let found = (self.stops.iter().enumerate())
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| Some((self.held.find(s.as_str())?, i)))
            .min();
        if let Some((at, which)) = found {
            self.held.truncate(at);
            return Scan::Stop(std::mem::take(&mut self.held), which);
        }
        // The longest tail of the held text that some stop string starts with stays held.
        let keep_from = self.held.char_indices().map(|(i, _)| i).find(|&i| {
            let tail = &self.held[i..];
            self.stops.iter().any(|s| s.starts_with(tail))
        });
        let ready = keep_from.unwrap_or(self.held.len());
        let rest = self.held.split_off(ready);
        Scan::Go(std::mem::replace(&mut self.held, rest))
    }

    /// The text still held back: at the end, it was no stop string after all.
    fn finish(self) -> String {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `pieces` through the stop strings: what comes out, and whether it stopped.
    fn scan(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut matcher = StopStrings::new(&stops);
        let mut out = String::new();
        for piece in pieces {
            match matcher.push(piece) {
                Scan::Go(text) => out += &text,
                Scan::Stop(text, _) => return (out + &text, true),
            }
        }
        (out + &matcher.finish(), false)
    }

    #[test]
    fn stop_strings_are_cut_even_across_pieces() {
        assert_eq!(scan(&["\n\n"], &["Paris", ".\n", "\nThe"]), ("Paris.".into(), true));
        assert_eq!(scan(&["END"], &["a", "bE", "N", "Dc"]), ("ab".into(), true));
        assert_eq!(scan(&["END", "b"], &["aEN", "b"]), ("aEN".into(), true));
        assert_eq!(scan(&["END"], &["aEN", "d"]), ("aENd".into(), false));
        assert_eq!(scan(&["é!"], &["caf", "é", " ok"]), ("café ok".into(), false));
        assert_eq!(scan(&[], &["no", " stops"]), ("no stops".into(), false));
    }

    #[test]
    fn held_text_is_released_once_it_cannot_start_a_stop_string() {
        let stops = vec!["STOP".to_string()];
        let mut matcher = StopStrings::new(&stops);
        assert!(matches!(matcher.push("xST"), Scan::Go(text) if text == "x"));
        assert!(matches!(matcher.push("A"), Scan::Go(text) if text == "STA"));
    }
}
