//! The wire format: OpenAI's request and response bodies, as far as sift serves them.
//!
//! Requests are read leniently, the way clients write them: a message's `content` is a string, an
//! array of text parts, or null; `stop` is a string or an array; fields sift does not use are
//! ignored. Values out of range are refused with a message naming the field. `model` is one of
//! the fields ignored: a server serves one model, whatever name a client gives it.

use serde::{Deserialize, Serialize};

use crate::attn::Certificate;
use crate::audit::{AuditRecord, TOP};
use crate::chat::Message;
use crate::generate::StopReason;
use crate::sample::{clock_seed, SamplingParams};
use crate::structured::Format;
use crate::tokenizer::Tokenizer;

use super::error::ApiError;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub options: Options,
    /// Whether each token's log-probability is returned.
    #[serde(default)]
    pub logprobs: bool,
    /// How many of the most likely tokens each position lists (with `logprobs`).
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    /// `"none"`, `"auto"`, `"required"` or a named function: sift calls no tools, so only the
    /// first two are served (a reply in text is what `"auto"` allows).
    pub tool_choice: Option<serde_json::Value>,
}

impl ChatRequest {
    /// Refuses a request that demands a tool call, which sift cannot make; `tools` themselves
    /// are not read (the model does not see them), so with `"auto"` the reply is text.
    pub fn check_tool_choice(&self) -> Result<(), ApiError> {
        match &self.tool_choice {
            None => Ok(()),
            Some(serde_json::Value::String(choice)) if choice == "none" || choice == "auto" => Ok(()),
            Some(choice) => Err(ApiError::invalid(format!(
                "tool_choice {choice}: sift does not call tools; use \"auto\" or \"none\", or response_format for JSON"
            ))),
        }
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptText,
    #[serde(flatten)]
    pub options: Options,
    /// How many of the most likely tokens each position lists; present, it asks for logprobs.
    #[serde(default)]
    pub logprobs: Option<usize>,
}

/// What both kinds of request share: sampling, limits, streaming.
#[derive(Debug, Deserialize)]
pub struct Options {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub max_tokens: Option<usize>,
    /// The newer name of `max_tokens` in the chat API.
    pub max_completion_tokens: Option<usize>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's server's name, as its clients send it.
    pub repeat_penalty: Option<f32>,
    /// Token ids (as strings: JSON's keys) to the bias added to their logits.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// How many choices to return: sift returns one.
    pub n: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Structured output: `{"type": "json_object"}` (with llama.cpp's `"schema"`, if any),
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` or `{"type": "text"}`.
    pub response_format: Option<ResponseFormat>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    /// Any JSON object; llama.cpp's server also reads a `schema` here, and so does sift.
    JsonObject {
        schema: Option<serde_json::Value>,
    },
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`: its `name` and `strict` are accepted and not needed (the schema
/// is always followed strictly).
#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub schema: Option<serde_json::Value>,
}

impl ResponseFormat {
    fn format(&self) -> Option<Format> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject { schema } => {
                Some(Format::JsonSchema(schema.clone().unwrap_or_else(|| serde_json::json!({ "type": "object" }))))
            }
            // Without a schema, any JSON value.
            ResponseFormat::JsonSchema { json_schema } => {
                Some(Format::JsonSchema(json_schema.schema.clone().unwrap_or_else(|| serde_json::json!({}))))
            }
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A completion's prompt: a string, or an array holding one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptText {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a message's content; only text parts are read.
#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatMessage {
    /// The message as a chat template reads it: `developer` is OpenAI's newer name for `system`.
    pub fn to_message(&self) -> Result<Message, ApiError> {
        let role = match self.role.as_str() {
            "developer" => "system",
            role @ ("system" | "user" | "assistant") => role,
            other => return Err(ApiError::invalid(format!("messages: role {other:?} is not supported"))),
        };
        let content = match &self.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(piece)) => text += piece,
                        (kind, _) => {
                            return Err(ApiError::invalid(format!(
                                "messages: content of type {kind:?} is not supported"
                            )))
                        }
                    }
                }
                text
            }
        };
        Ok(Message { role: role.to_string(), content })
    }
}

impl PromptText {
    pub fn into_text(self) -> Result<String, ApiError> {
        match self {
            PromptText::One(text) => Ok(text),
            PromptText::Many(mut texts) if texts.len() == 1 => Ok(texts.remove(0)),
            PromptText::Many(_) => Err(ApiError::invalid("prompt: only one prompt per request is supported")),
        }
    }
}

/// How one request generates, the server's defaults filled in.
#[derive(Debug, Clone)]
pub struct Params {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// With logprobs: how many alternatives each position lists.
    pub top_logprobs: Option<usize>,
    /// What the reply must be (structured output), compiled by the worker.
    pub format: Option<Format>,
}

impl Options {
    /// The request's settings over the server's `defaults`; a fresh seed where none is given.
    pub fn params(&self, defaults: &Params, top_logprobs: Option<usize>, n_vocab: usize) -> Result<Params, ApiError> {
        check(self.n.is_none_or(|n| n == 1), "n: only one choice per request is served")?;
        // OpenAI's range; the sampler takes hotter ones.
        check(self.temperature.is_none_or(|t| t <= 2.0), "temperature must be between 0 and 2")?;
        let mut sampling = defaults.sampling.clone();
        let set = |value: Option<f32>, field: &mut f32| *field = value.unwrap_or(*field);
        set(self.temperature, &mut sampling.temperature);
        set(self.top_p, &mut sampling.top_p);
        set(self.min_p, &mut sampling.min_p);
        set(self.repeat_penalty, &mut sampling.repeat_penalty);
        set(self.presence_penalty, &mut sampling.presence_penalty);
        set(self.frequency_penalty, &mut sampling.frequency_penalty);
        if let Some(k) = self.top_k {
            sampling.top_k = k;
        }
        if let Some(biases) = &self.logit_bias {
            sampling.logit_bias = biases
                .iter()
                .map(|(id, &bias)| match id.parse() {
                    Ok(id) => Ok((id, bias)),
                    Err(_) => Err(ApiError::invalid(format!("logit_bias: {id:?} is not a token id"))),
                })
                .collect::<Result<_, _>>()?;
        }
        sampling.check(n_vocab).map_err(ApiError::invalid)?;
        sampling.seed = self.seed.unwrap_or_else(clock_seed);
        if let Some(n) = top_logprobs {
            check(n <= TOP, &format!("top_logprobs must be at most {TOP}"))?;
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        check(stop.iter().all(|s| !s.is_empty()), "stop strings must not be empty")?;
        Ok(Params {
            sampling,
            max_tokens: self.max_completion_tokens.or(self.max_tokens).unwrap_or(defaults.max_tokens),
            stop,
            top_logprobs,
            format: self.response_format.as_ref().map_or_else(|| defaults.format.clone(), ResponseFormat::format),
        })
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

fn check(ok: bool, message: &str) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(message))
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::EndOfGeneration | StopReason::StopString | StopReason::Interrupted => "stop",
        StopReason::TokenLimit | StopReason::ContextFull => "length",
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens the KV cache already held from an earlier request, and so not prefilled.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// sift's extension on each choice.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SiftExtension {
    /// How far the attention that produced the reply may be from exact attention.
    pub attention: Certificate,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Dense rectification passes of the reply (sparse policies), and their share of its decode
    /// time.
    pub rectifications: u64,
    pub rectify_share: f64,
}

/// One position of a chat completion's `logprobs.content`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl TokenLogprob {
    /// The audit's view of a token, in OpenAI's shape, with the `top` most likely alternatives.
    pub fn new(record: &AuditRecord, tokenizer: &Tokenizer, top: usize) -> Self {
        let bytes = tokenizer.token_bytes(record.token);
        Self {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            logprob: record.logprob,
            bytes,
            top_logprobs: record
                .top
                .iter()
                .take(top)
                .map(|alt| TopLogprob {
                    token: alt.text.clone(),
                    logprob: alt.logprob,
                    bytes: tokenizer.token_bytes(alt.token),
                })
                .collect(),
        }
    }
}

/// A chat completion's `logprobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// A legacy completion's `logprobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
}

impl TextLogprobs {
    pub fn push(&mut self, token: &TokenLogprob) {
        self.tokens.push(token.token.clone());
        self.token_logprobs.push(token.logprob);
        self.top_logprobs.push(token.top_logprobs.iter().map(|t| (t.token.clone(), t.logprob)).collect());
    }
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    pub x_sift: SiftExtension,
}

#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub x_sift: Option<SiftExtension>,
}

/// A whole response (`object` says which kind) or one chunk of a stream.
#[derive(Debug, Serialize)]
pub struct Completion<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A chunk's change to the assistant's message.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub x_sift: Option<SiftExtension>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The context size the server runs the model with.
    pub x_sift_n_ctx: usize,
}
