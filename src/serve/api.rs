//! The wire format: OpenAI's request and response bodies, as far as sift serves them.
//!
//! Requests are read leniently, the way clients write them: a message's `content` is a string, an
//! array of text parts, or null; `stop` is a string or an array; fields sift does not use are
//! ignored. Values out of range are refused with a message naming the field. `model` is one of
//! the fields ignored: a server serves one model, whatever name a client gives it.

use serde::{Deserialize, Serialize};

use crate::attn::Certificate;
use crate::audit::AuditRecord;
use crate::chat::{special_texts, ChatTemplate, Message};
use crate::generate::StopReason;
use crate::sample::{clock_seed, SamplingParams};
use crate::structured::Format;
use crate::tokenizer::Tokenizer;
use crate::tools::{calls_text, results_text, Tool, ToolCall, ToolChoice, ToolResult, Toolbox};

use super::error::ApiError;
use super::worker::EmbedInput;

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
    /// Functions the model may call.
    #[serde(default)]
    pub tools: Vec<WireTool>,
    /// `"none"` (the tools are not offered), `"auto"` (the default with tools), `"required"` or
    /// `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<serde_json::Value>,
    /// Whether one reply may call more than one tool (the default).
    pub parallel_tool_calls: Option<bool>,
}

/// One of `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Deserialize)]
pub struct WireTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: WireFunction,
}

#[derive(Debug, Deserialize)]
pub struct WireFunction {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<serde_json::Value>,
}

impl ChatRequest {
    /// With `logprobs`, how many alternatives each position lists.
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        top_logprobs(self.logprobs, self.top_logprobs)
    }

    /// The tools offered and what the model must do with them; none where no tools are given
    /// or `tool_choice` is `"none"`.
    pub fn toolbox(&self) -> Result<Option<Toolbox>, ApiError> {
        let Some(choice) = tool_choice(self.tool_choice.as_ref(), !self.tools.is_empty(), "/function/name")? else {
            return Ok(None);
        };
        let tools = self.tools.iter().map(WireTool::to_tool).collect::<Result<Vec<_>, _>>()?;
        let parallel = self.parallel_tool_calls.unwrap_or(true);
        Toolbox::new(tools, choice, parallel).map(Some).map_err(|e| ApiError::invalid(format!("tools: {e}")))
    }

    /// The conversation as a chat template reads it ([`conversation`]).
    pub fn conversation(&self) -> Result<Vec<Message>, ApiError> {
        conversation(&self.messages)
    }
}

/// `tool_choice` as OpenAI's APIs take it: `"none"`, `"auto"` (the default where tools are
/// given), `"required"`, or an object naming a function, its name at the JSON pointer `name_at`
/// (`/function/name` in the chat API's `{"type": "function", "function": {"name"}}`, `/name` in
/// the Responses API's `{"type": "function", "name"}`). `None` where no tools are offered.
pub fn tool_choice(
    choice: Option<&serde_json::Value>,
    any_tools: bool,
    name_at: &str,
) -> Result<Option<ToolChoice>, ApiError> {
    use serde_json::Value;
    Ok(Some(match choice {
        None if !any_tools => return Ok(None),
        None => ToolChoice::Auto,
        Some(Value::String(choice)) => match choice.as_str() {
            "none" => return Ok(None),
            "auto" if !any_tools => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(ApiError::invalid(format!("tool_choice {other:?} is not one sift knows"))),
        },
        Some(choice) => match choice.pointer(name_at).and_then(Value::as_str) {
            Some(name) if choice["type"] == "function" => ToolChoice::Function(name.to_string()),
            _ => return Err(ApiError::invalid(format!("tool_choice {choice} is not one sift knows"))),
        },
    }))
}

impl WireTool {
    /// The tool as sift offers it; only functions are tools.
    pub fn to_tool(&self) -> Result<Tool, ApiError> {
        match self.kind.as_str() {
            "function" => Ok(Tool {
                name: self.function.name.clone(),
                description: self.function.description.clone(),
                parameters: self.function.parameters.clone(),
            }),
            kind => Err(ApiError::invalid(format!("tools: type {kind:?} is not supported (only \"function\")"))),
        }
    }
}

/// `wire` as a chat template reads it. An assistant turn that called tools is written as the
/// model wrote the calls; the results that follow it (`tool` messages) become one user turn,
/// joined to a user turn next to them (templates that want turns to alternate would refuse two).
pub fn conversation(wire: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    let mut messages: Vec<Message> = Vec::with_capacity(wire.len());
    // Whether the last message brings tools' results.
    let mut last_results = false;
    let mut push = |message: Message, results: bool| {
        match messages.last_mut() {
            Some(last) if last.role == "user" && message.role == "user" && (results || last_results) => {
                last.content += "\n\n";
                last.content += &message.content;
            }
            _ => messages.push(message),
        }
        last_results = results;
    };
    let mut names = std::collections::HashMap::new();
    let mut results = Vec::new();
    for (i, turn) in wire.iter().enumerate() {
        if turn.role == "tool" {
            let called = turn.tool_call_id.as_ref().and_then(|id| names.get(id).cloned());
            results.push(ToolResult { name: turn.name.clone().or(called), content: turn.to_text()? });
            if wire.get(i + 1).is_none_or(|next| next.role != "tool") {
                push(Message::user(results_text(&std::mem::take(&mut results))), true);
            }
            continue;
        }
        let mut message = turn.to_message()?;
        if let Some(wire_calls) = &turn.tool_calls {
            let mut calls = Vec::with_capacity(wire_calls.len());
            for call in wire_calls {
                let WireCall { name, arguments } = call.function.clone();
                if let Some(id) = &call.id {
                    names.insert(id.clone(), name.clone());
                }
                calls.push(ToolCall { name, arguments });
            }
            let text = calls_text(&calls).map_err(|e| ApiError::invalid(format!("messages: {e}")))?;
            message.content = match message.content.is_empty() {
                true => text,
                false => format!("{}\n{text}", message.content),
            };
        }
        push(message, false);
    }
    Ok(messages)
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

/// How many alternatives each token lists where log-probabilities are `asked` for: `top`
/// (none: 0), within 0 to 20, the range of OpenAI's `top_logprobs` (and of Ollama's).
pub fn top_logprobs(asked: bool, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    check(top.is_none_or(|n| n <= 20), "top_logprobs must be between 0 and 20")?;
    Ok(asked.then(|| top.unwrap_or(0)))
}

/// A token limit given as llama.cpp and Ollama give it, in `field`: a count, or a negative
/// number for no limit but the context; 0 is refused.
pub fn token_limit(n: i64, field: &str) -> Result<usize, ApiError> {
    if n == 0 {
        return Err(ApiError::invalid(format!("{field}: at least 1, or -1 for no limit")));
    }
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

impl CompletionRequest {
    /// How many alternatives each position lists, where logprobs are asked for: `logprobs`, 0
    /// to 5 (OpenAI's range for legacy completions).
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        check(self.logprobs.is_none_or(|n| n <= 5), "logprobs must be between 0 and 5")?;
        Ok(self.logprobs)
    }
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub input: EmbeddingInput,
    /// `"float"` (the default) or `"base64"` (the little-endian f32 bytes, as OpenAI's clients
    /// ask for them).
    pub encoding_format: Option<String>,
    /// The vector's length: the model's own, the only one served.
    pub dimensions: Option<usize>,
}

/// `POST /tokenize`, with llama.cpp's server's fields and defaults.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    /// BOS (and EOS) where the vocabulary asks for them.
    #[serde(default)]
    pub add_special: bool,
    /// The text of a control token (`<start_of_turn>`) as that token.
    #[serde(default = "yes")]
    pub parse_special: bool,
    /// Each token with the text it stands for.
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// What `/tokenize` answers: the ids, or each id with its piece.
#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub tokens: TokenList,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TokenList {
    Ids(Vec<u32>),
    Pieces(Vec<TokenPiece>),
}

#[derive(Debug, Serialize)]
pub struct TokenPiece {
    pub id: u32,
    pub piece: Piece,
}

/// A token's bytes: as text where they are UTF-8, else as numbers (a token may hold part of a
/// character).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

/// What `/detokenize` answers.
#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub content: String,
}

impl TokenizeRequest {
    /// The content's tokens, as `Tokenizer::encode` gives them.
    pub fn tokenize(&self, tokenizer: &Tokenizer) -> Result<TokenizeResponse, ApiError> {
        let ids = tokenizer
            .encode(&self.content, self.add_special, self.parse_special)
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let tokens = if self.with_pieces {
            let piece = |id| match String::from_utf8(tokenizer.token_bytes(id)) {
                Ok(text) => Piece::Text(text),
                Err(bytes) => Piece::Bytes(bytes.into_bytes()),
            };
            TokenList::Pieces(ids.into_iter().map(|id| TokenPiece { id, piece: piece(id) }).collect())
        } else {
            TokenList::Ids(ids)
        };
        Ok(TokenizeResponse { tokens })
    }
}

impl DetokenizeRequest {
    /// The tokens' text, as `Tokenizer::decode` gives it.
    pub fn detokenize(&self, tokenizer: &Tokenizer) -> Result<DetokenizeResponse, ApiError> {
        in_vocabulary("tokens", &self.tokens, tokenizer.vocab_size())?;
        Ok(DetokenizeResponse { content: tokenizer.decode(&self.tokens) })
    }
}

/// A 400 naming `field` if any of `ids` is past a vocabulary of `n_vocab`.
pub fn in_vocabulary(field: &str, ids: &[u32], n_vocab: usize) -> Result<(), ApiError> {
    match ids.iter().find(|&&id| id as usize >= n_vocab) {
        Some(id) => Err(ApiError::invalid(format!("{field}: token {id} is not in the vocabulary of {n_vocab}"))),
        None => Ok(()),
    }
}

/// `GET /props`: what llama.cpp's server says of itself, as far as sift has it, for clients that
/// read the context size, the template or the default sampling from there.
#[derive(Debug, Serialize)]
pub struct Props {
    pub default_generation_settings: GenerationSettings,
    /// Requests served at once.
    pub total_slots: usize,
    pub model_alias: String,
    pub chat_template: String,
    pub bos_token: String,
    pub eos_token: String,
    pub modalities: Modalities,
    pub build_info: String,
}

#[derive(Debug, Serialize)]
pub struct GenerationSettings {
    pub n_ctx: usize,
    pub params: DefaultParams,
}

/// The sampling a request gets for the fields it leaves out.
#[derive(Debug, Serialize)]
pub struct DefaultParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// The most tokens a reply may have.
    pub n_predict: usize,
}

#[derive(Debug, Serialize)]
pub struct Modalities {
    pub vision: bool,
    pub audio: bool,
}

impl Props {
    pub fn new(
        model_alias: &str,
        defaults: &Params,
        n_ctx: usize,
        template: &ChatTemplate,
        tokenizer: &Tokenizer,
    ) -> Self {
        let s = &defaults.sampling;
        let (bos, eos) = special_texts(tokenizer);
        Self {
            default_generation_settings: GenerationSettings {
                n_ctx,
                params: DefaultParams {
                    temperature: s.temperature,
                    top_k: s.top_k,
                    top_p: s.top_p,
                    min_p: s.min_p,
                    repeat_penalty: s.repeat_penalty,
                    repeat_last_n: s.repeat_last_n,
                    presence_penalty: s.presence_penalty,
                    frequency_penalty: s.frequency_penalty,
                    n_predict: defaults.max_tokens,
                },
            },
            total_slots: 1,
            model_alias: model_alias.to_string(),
            chat_template: template.source().to_string(),
            bos_token: bos.to_string(),
            eos_token: eos.to_string(),
            modalities: Modalities { vision: false, audio: false },
            build_info: format!("sift {}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// A text, texts, a text's tokens, or several texts' tokens.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    ManyTokens(Vec<Vec<u32>>),
}

impl EmbeddingRequest {
    /// The inputs, each to embed on its own; whether the vectors go as base64.
    pub fn inputs(self, n_embd: usize) -> Result<(Vec<EmbedInput>, bool), ApiError> {
        let base64 = match self.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid(format!("encoding_format {other:?}: \"float\" or \"base64\"")))
            }
        };
        if let Some(dimensions) = self.dimensions.filter(|&d| d != n_embd) {
            return Err(ApiError::invalid(format!("dimensions {dimensions}: this model's embeddings have {n_embd}")));
        }
        let inputs: Vec<EmbedInput> = match self.input {
            EmbeddingInput::One(text) => vec![EmbedInput::Text(text)],
            EmbeddingInput::Many(texts) => texts.into_iter().map(EmbedInput::Text).collect(),
            EmbeddingInput::Tokens(ids) => vec![EmbedInput::Tokens(ids)],
            EmbeddingInput::ManyTokens(lists) => lists.into_iter().map(EmbedInput::Tokens).collect(),
        };
        check(!inputs.is_empty(), "input: at least one text is needed")?;
        Ok((inputs, base64))
    }
}

/// The response of `/v1/embeddings`.
#[derive(Debug, Serialize)]
pub struct EmbeddingList {
    pub object: &'static str,
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Serialize)]
pub struct Embedding {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Floats(Vec<f32>),
    Base64(String),
}

impl EmbeddingVector {
    pub fn new(vector: Vec<f32>, base64: bool) -> Self {
        use base64::Engine;
        match base64 {
            false => EmbeddingVector::Floats(vector),
            true => {
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            }
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

/// What both kinds of request share: sampling, limits, streaming.
#[derive(Debug, Default, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// A `tool` message's call, and the tool's name (llama.cpp's clients send it).
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A call as the API writes it: `{"id", "type": "function", "function": {"name", "arguments"}}`,
/// the arguments a JSON object in a string.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireToolCall {
    pub id: Option<String>,
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    pub function: WireCall,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireCall {
    pub name: String,
    pub arguments: String,
}

fn function() -> String {
    "function".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a message's content; only text parts are read.
#[derive(Debug, Clone, Deserialize)]
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
        Ok(Message { role: role.to_string(), content: self.to_text()? })
    }

    /// The content's text.
    fn to_text(&self) -> Result<String, ApiError> {
        Ok(match &self.content {
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
        })
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
    /// The request field the format comes from, for its errors: `response_format` or `tools`.
    pub format_field: &'static str,
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
            format_field: "response_format",
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
    /// The audit's view of a token, in OpenAI's shape, with the record's alternatives.
    pub fn new(record: &AuditRecord, tokenizer: &Tokenizer) -> Self {
        let bytes = tokenizer.token_bytes(record.token);
        Self {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            logprob: record.logprob,
            bytes,
            top_logprobs: record
                .top
                .iter()
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
    /// Null where the reply is calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<WireToolCall>>,
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
    /// A stream's calls, each whole in one chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<IndexedToolCall>>,
}

/// A call in a stream's chunk, with its place in the reply's list.
#[derive(Debug, Serialize)]
pub struct IndexedToolCall {
    pub index: usize,
    #[serde(flatten)]
    pub call: WireToolCall,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: serde_json::Value) -> ChatRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn calls_and_results_become_turns_a_template_can_render() {
        let arguments = r#"{"city": "Oslo"}"#;
        let body = serde_json::json!({
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": "Weather in Oslo and Rome?" },
                { "role": "assistant", "content": null, "tool_calls": [
                    { "id": "a", "type": "function", "function": { "name": "weather", "arguments": arguments } },
                    { "id": "b", "type": "function", "function": { "name": "weather", "arguments": "{}" } },
                ] },
                { "role": "tool", "tool_call_id": "a", "content": "rain" },
                { "role": "tool", "tool_call_id": "b", "name": "forecast", "content": [{ "type": "text", "text": "sun" }] },
                { "role": "user", "content": "Thanks." },
                { "role": "assistant", "content": "You are welcome." },
            ],
        });
        let calls =
            r#"{"tool_calls":[{"name":"weather","arguments":{"city": "Oslo"}},{"name":"weather","arguments":{}}]}"#;
        let results = r#"{"tool_results":[{"name":"weather","content":"rain"},{"name":"forecast","content":"sun"}]}"#;
        assert_eq!(
            request(body).conversation().unwrap(),
            vec![
                Message::system("Be brief."),
                Message::user("Weather in Oslo and Rome?"),
                Message::assistant(calls),
                Message::user(format!("{results}\n\nThanks.")),
                Message::assistant("You are welcome."),
            ]
        );
    }

    #[test]
    fn tool_choice_decides_whether_and_how_tools_are_offered() {
        let tools = serde_json::json!([{ "type": "function", "function": { "name": "f" } }]);
        let with = |choice: serde_json::Value| {
            let mut body = serde_json::json!({ "messages": [], "tools": tools });
            if !choice.is_null() {
                body["tool_choice"] = choice;
            }
            request(body).toolbox().map(|t| t.map(|t| t.choice().clone()))
        };
        assert_eq!(with(serde_json::Value::Null), Ok(Some(ToolChoice::Auto)));
        assert_eq!(with("none".into()), Ok(None));
        assert_eq!(with("required".into()), Ok(Some(ToolChoice::Required)));
        let named = serde_json::json!({ "type": "function", "function": { "name": "f" } });
        assert_eq!(with(named), Ok(Some(ToolChoice::Function("f".into()))));
        assert!(with("always".into()).unwrap_err().message.contains("\"always\""));
        let other = serde_json::json!({ "type": "function", "function": { "name": "g" } });
        assert!(with(other).unwrap_err().message.contains("\"g\""));
        assert!(request(serde_json::json!({ "messages": [] })).toolbox().unwrap().is_none());
    }
}
