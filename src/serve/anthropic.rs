//! Anthropic's Messages API, `POST /v1/messages`, for clients written against it: the same
//! model, worker, chat template and sampling as `/v1/chat/completions`, in Anthropic's shapes.
//!
//! A request's `system` (a string or text blocks) becomes the conversation's system message, its
//! `messages` (`user` and `assistant`, each a string or text blocks) the turns; `max_tokens` is
//! required; `stop_sequences`, `temperature`, `top_p` and `top_k` set what they name, over the
//! server's defaults. Other content blocks (images, documents, tool use and results) and `tools`
//! are refused with a 400 that names them. A reply is one text block; streamed, it is Anthropic's
//! named events: `message_start`, `content_block_start`, a `content_block_delta` per piece of
//! text, `content_block_stop`, `message_delta` (the stop reason and the tokens generated) and
//! `message_stop`. Errors are `{"type": "error", "error": {"type", "message"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::api::Params;
use super::error::ApiError;
use super::worker::Finished;
use crate::chat::Message;
use crate::generate::StopReason;
use crate::sample::clock_seed;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub max_tokens: usize,
    #[serde(default)]
    pub system: Option<Content>,
    pub messages: Vec<InputMessage>,
    #[serde(default)]
    pub stop_sequences: Vec<String>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    #[serde(default)]
    pub tools: Vec<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub struct InputMessage {
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Content {
    /// The text of the content, its text blocks joined; `field` names it in errors.
    fn text(&self, field: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(text) => Ok(text.clone()),
            Content::Blocks(blocks) => blocks
                .iter()
                .enumerate()
                .map(|(i, block)| match (block.kind.as_str(), &block.text) {
                    ("text", Some(text)) => Ok(text.as_str()),
                    ("text", None) => Err(ApiError::invalid(format!("{field}[{i}]: a text block needs its text"))),
                    (kind, _) => Err(ApiError::invalid(format!(
                        "{field}[{i}]: content blocks of type {kind:?} are not supported (only \"text\")"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

impl MessagesRequest {
    /// The conversation the chat template renders.
    pub fn conversation(&self) -> Result<Vec<Message>, ApiError> {
        if !self.tools.is_empty() {
            return Err(ApiError::invalid("tools: sift calls tools on /v1/chat/completions, not on /v1/messages"));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages: at least one message is needed"));
        }
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            messages.push(Message::system(system.text("system")?));
        }
        for (i, message) in self.messages.iter().enumerate() {
            let text = message.content.text(&format!("messages[{i}].content"))?;
            messages.push(match message.role.as_str() {
                "user" => Message::user(text),
                "assistant" => Message::assistant(text),
                role => {
                    return Err(ApiError::invalid(format!(
                        "messages[{i}].role: {role:?} is not a role here (\"user\" or \"assistant\"; the system \
                         prompt goes in \"system\")"
                    )))
                }
            });
        }
        Ok(messages)
    }

    /// The request's settings over the server's `defaults`, with a fresh seed.
    pub fn params(&self, defaults: &Params, n_vocab: usize) -> Result<Params, ApiError> {
        if self.max_tokens == 0 {
            return Err(ApiError::invalid("max_tokens must be at least 1"));
        }
        if self.temperature.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
            return Err(ApiError::invalid("temperature must be between 0 and 1"));
        }
        let mut sampling = defaults.sampling.clone();
        sampling.temperature = self.temperature.unwrap_or(sampling.temperature);
        sampling.top_p = self.top_p.unwrap_or(sampling.top_p);
        sampling.top_k = self.top_k.unwrap_or(sampling.top_k);
        sampling.check(n_vocab).map_err(ApiError::invalid)?;
        sampling.seed = clock_seed();
        Ok(Params {
            sampling,
            max_tokens: self.max_tokens,
            stop: self.stop_sequences.clone(),
            top_logprobs: None,
            format: None,
            format_field: "response_format",
        })
    }
}

/// A whole reply, and the `message` of a stream's `message_start`.
#[derive(Debug, Serialize)]
pub struct MessageResponse {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<TextBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

#[derive(Debug, Serialize)]
pub struct TextBlock {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

impl TextBlock {
    pub fn new(text: String) -> Self {
        Self { kind: "text", text }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// The prompt's tokens the cache already held.
    pub cache_read_input_tokens: usize,
}

/// Why a reply ended, as Anthropic says it, and the stop sequence that ended it.
pub fn stop_reason(finished: &Finished, stops: &[String]) -> (&'static str, Option<String>) {
    match finished.stop {
        StopReason::EndOfGeneration | StopReason::Interrupted => ("end_turn", None),
        StopReason::StopString => ("stop_sequence", finished.stop_string.and_then(|i| stops.get(i).cloned())),
        StopReason::TokenLimit | StopReason::ContextFull => ("max_tokens", None),
    }
}

/// A stream's events, each with its name in `type` as well.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart { message: MessageResponse },
    ContentBlockStart { index: usize, content_block: TextBlock },
    ContentBlockDelta { index: usize, delta: TextDelta },
    ContentBlockStop { index: usize },
    MessageDelta { delta: StopDelta, usage: OutputUsage },
    MessageStop,
    Error { error: ErrorDetail },
}

impl StreamEvent {
    /// The event's name, as its `event:` line gives it.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Error { .. } => "error",
        }
    }

    pub fn text(text: String) -> Self {
        StreamEvent::ContentBlockDelta { index: 0, delta: TextDelta { kind: "text_delta", text } }
    }
}

#[derive(Debug, Serialize)]
pub struct TextDelta {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

#[derive(Debug, Serialize)]
pub struct StopDelta {
    pub stop_reason: &'static str,
    pub stop_sequence: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct OutputUsage {
    pub output_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub message: String,
}

impl ErrorDetail {
    /// `e` in Anthropic's kinds of error.
    pub fn of(e: &ApiError) -> Self {
        let kind = match e.status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        };
        Self { kind, message: e.message.clone() }
    }
}

/// `e` as Anthropic's API answers it, with `e`'s status (and `Retry-After`).
pub fn error_response(e: ApiError) -> Response {
    let mut response = (e.status, Json(StreamEvent::Error { error: ErrorDetail::of(&e) })).into_response();
    if let Some(seconds) = e.retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}
