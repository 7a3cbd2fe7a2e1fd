//! llama.cpp's own completion route, `POST /completion` (and `/completions`), for the scripts and
//! editor plugins written against `llama-server`: the same model, worker and sampling as
//! `/v1/completions`, in llama.cpp's shapes.
//!
//! A request's `prompt` (a string) is continued as it is; `n_predict` (-1, the default: no limit
//! but the context), `temperature`, `top_k`, `top_p`, `min_p`, `seed` (-1: a fresh one), `stop`,
//! `repeat_penalty`, `presence_penalty`, `frequency_penalty`, `n_probs` (each token's log-
//! probability and that many alternatives, 0 to 20) and `json_schema` set what they name, over
//! the server's defaults. The reply is `content` with `stop`, `stop_type` (`eos`, `limit` or
//! `word`), `stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached` and
//! `timings`; streamed, it is `data:` events of `{"content", "stop": false}` per piece, then the
//! whole account with `"stop": true` and empty content. A prompt of token ids, and `grammar`
//! (GBNF, which sift does not read), are refused with a 400 that says so.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{self, Options, ResponseFormat, Stop, TokenLogprob};
use super::error::ApiError;
use super::routes::{data_events, gather, json, parse, started, Gathered, Relay, Relayed, Server};
use super::worker::{Event, Finished, Prompt};
use crate::generate::StopReason;

/// `POST /completion`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    #[serde(default = "no_limit")]
    pub n_predict: i64,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Vec<String>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n_probs: Option<usize>,
    pub json_schema: Option<Value>,
    pub grammar: Option<String>,
    #[serde(default)]
    pub stream: bool,
}

fn no_limit() -> i64 {
    -1
}

impl CompletionRequest {
    fn prompt(&self) -> Result<String, ApiError> {
        match &self.prompt {
            Value::String(text) => Ok(text.clone()),
            _ => Err(ApiError::invalid("prompt: a string (prompts of token ids are not supported)")),
        }
    }

    /// The settings over the server's `defaults`, as the OpenAI routes take theirs.
    fn params(&self, defaults: &api::Params, n_vocab: usize) -> Result<api::Params, ApiError> {
        if self.grammar.as_deref().is_some_and(|g| !g.is_empty()) {
            return Err(ApiError::invalid("grammar: GBNF grammars are not supported; send a json_schema"));
        }
        let max_tokens = api::token_limit(self.n_predict, "n_predict")?;
        let options = Options {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            max_tokens: Some(max_tokens),
            stop: Some(Stop::Many(self.stop.clone())),
            seed: self.seed.and_then(|seed| u64::try_from(seed).ok()),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_penalty: self.repeat_penalty,
            response_format: self.json_schema.clone().map(|schema| ResponseFormat::JsonObject { schema: Some(schema) }),
            ..Options::default()
        };
        options.params(defaults, api::top_logprobs(self.n_probs.is_some(), self.n_probs)?, n_vocab)
    }
}

/// The reply, whole or as a stream's last event.
#[derive(Debug, Serialize)]
struct Completion {
    content: String,
    stop: bool,
    model: String,
    /// `eos`, `limit` or `word` (a stop string, named in `stopping_word`).
    stop_type: &'static str,
    stopping_word: String,
    tokens_predicted: usize,
    /// The prompt's tokens.
    tokens_evaluated: usize,
    /// The tokens in the context once the reply is done: the prompt's and the reply's.
    tokens_cached: usize,
    truncated: bool,
    timings: Timings,
    /// Each token's log-probability and alternatives, where `n_probs` asked for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_probabilities: Option<Vec<TokenLogprob>>,
}

/// The prompt's and the reply's tokens and times, in milliseconds.
#[derive(Debug, Serialize)]
struct Timings {
    prompt_n: usize,
    prompt_ms: f64,
    prompt_per_token_ms: f64,
    prompt_per_second: f64,
    predicted_n: usize,
    predicted_ms: f64,
    predicted_per_token_ms: f64,
    predicted_per_second: f64,
}

impl Timings {
    fn new(prompt_n: usize, finished: &Finished) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let per = |ms: f64, n: usize| if n == 0 { 0.0 } else { ms / n as f64 };
        let (prompt_ms, predicted_ms) = (ms(finished.prefill_time), ms(finished.decode_time));
        let predicted_n = finished.completion_tokens;
        Timings {
            prompt_n,
            prompt_ms,
            prompt_per_token_ms: per(prompt_ms, prompt_n),
            prompt_per_second: finished.prefill_tok_s,
            predicted_n,
            predicted_ms,
            predicted_per_token_ms: per(predicted_ms, predicted_n),
            predicted_per_second: finished.decode_tok_s,
        }
    }
}

/// What every answer to one request shares.
struct Head {
    model: String,
    stop: Vec<String>,
    /// Prompt tokens, and those of them the cache already held.
    prompt: (usize, usize),
    logprobs: bool,
}

impl Head {
    /// The account of a finished reply of `content`.
    fn completion(&self, content: String, tokens: Vec<TokenLogprob>, finished: &Finished) -> Completion {
        let (stop_type, stopping_word) = match finished.stop {
            StopReason::StopString => ("word", finished.stop_string.map(|i| self.stop[i].clone())),
            StopReason::EndOfGeneration => ("eos", None),
            _ => ("limit", None),
        };
        let (prompt_tokens, cached) = self.prompt;
        Completion {
            content,
            stop: true,
            model: self.model.clone(),
            stop_type,
            stopping_word: stopping_word.unwrap_or_default(),
            tokens_predicted: finished.completion_tokens,
            tokens_evaluated: prompt_tokens,
            tokens_cached: prompt_tokens + finished.completion_tokens,
            truncated: false,
            timings: Timings::new(prompt_tokens - cached, finished),
            completion_probabilities: self.logprobs.then_some(tokens),
        }
    }
}

/// A piece of a streamed reply.
#[derive(Debug, Serialize)]
struct Piece {
    content: String,
    stop: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_probabilities: Option<Vec<TokenLogprob>>,
}

/// `POST /completion`: the prompt continued, whole or streamed.
pub(super) async fn complete(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: CompletionRequest = parse(body)?;
        let prompt = request.prompt()?;
        let params = request.params(&server.config.defaults, server.n_vocab)?;
        let logprobs = params.top_logprobs.is_some();
        let stop = params.stop.clone();
        let mut events = server.queue.submit(Prompt::Text(prompt), params)?;
        let usage = started(&mut events).await?;
        let prompt = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens);
        let head = Head { model: server.config.model_id.clone(), stop, prompt, logprobs };
        if request.stream {
            return Ok(stream(head, events));
        }
        let Gathered { text, tokens, finished } = gather(events).await?;
        Ok(Json(head.completion(text, tokens, &finished)).into_response())
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// A reply as `data:` events: a piece of text an event, then the whole account.
fn stream(head: Head, events: UnboundedReceiver<Event>) -> Response {
    // The log-probabilities of the tokens whose text is not sent yet.
    let mut unsent = Vec::new();
    data_events(Relay::new(events, None), Vec::new(), move |relayed| match relayed {
        Relayed::Token(token) => {
            unsent.push(token);
            (Vec::new(), false)
        }
        Relayed::Text(content) => {
            let completion_probabilities = head.logprobs.then(|| std::mem::take(&mut unsent));
            (vec![json(&Piece { content, stop: false, completion_probabilities })], false)
        }
        Relayed::Finished { finished, .. } => {
            (vec![json(&head.completion(String::new(), std::mem::take(&mut unsent), &finished))], true)
        }
        Relayed::Failed(e) => (vec![json(&e.body())], true),
    })
}
