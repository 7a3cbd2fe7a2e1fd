//! Anthropic's Messages API, `POST /v1/messages`, for clients written against it: the same
//! model, worker, chat template and sampling as `/v1/chat/completions`, in Anthropic's shapes.
//!
//! A request's `system` (a string or text blocks) becomes the conversation's system message, its
//! `messages` (`user` and `assistant`, each a string or blocks) the turns; `max_tokens` is
//! required; `stop_sequences`, `temperature`, `top_p` and `top_k` set what they name, over the
//! server's defaults. `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`,
//! `any`, `tool`, `none`; `disable_parallel_tool_use`) go through sift's [tool calls](crate::tools)
//! as `/v1/chat/completions`' do: a reply that calls tools is `tool_use` blocks, with the stop
//! reason `tool_use`; an assistant turn's `tool_use` blocks and a user turn's `tool_result` blocks
//! are written into the conversation as the model wrote and reads them. Other blocks (images,
//! documents) and server tools are refused with a 400 that names them. Streamed, a reply is
//! Anthropic's named events: `message_start`, then per block `content_block_start`, its deltas
//! (`text_delta`, or one `input_json_delta` with a call's whole input) and `content_block_stop`,
//! then `message_delta` (the stop reason and the tokens generated) and `message_stop`. Errors are
//! `{"type": "error", "error": {"type", "message"}}`.

use std::collections::HashMap;

use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::api::{Options, Params, Stop};
use super::error::ApiError;
use super::worker::Finished;
use crate::chat::Message;
use crate::generate::StopReason;
use crate::tools::{calls_text, results_text, Reply, Tool, ToolCall, ToolChoice, ToolResult, Toolbox};

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
    pub tools: Vec<WireTool>,
    pub tool_choice: Option<WireToolChoice>,
}

/// A tool as Anthropic's API describes it.
#[derive(Debug, Deserialize)]
pub struct WireTool {
    /// Absent (or `custom`) for a client's own tools; Anthropic's server tools name their kind.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct WireToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    #[serde(default)]
    pub disable_parallel_tool_use: bool,
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

/// A content block: `text`, `tool_use` (`id`, `name`, `input`) or `tool_result` (`tool_use_id`,
/// `content`, `is_error`).
#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    pub id: Option<String>,
    pub name: Option<String>,
    pub input: Option<Value>,
    pub tool_use_id: Option<String>,
    pub content: Option<Content>,
    #[serde(default)]
    pub is_error: bool,
}

impl Content {
    /// The content's text, its text blocks joined; `field` names it in errors.
    fn text(&self, field: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(text) => Ok(text.clone()),
            Content::Blocks(blocks) => (blocks.iter().enumerate())
                .map(|(i, block)| block.text_of(&format!("{field}[{i}]")))
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

/// A user turn's text: its tools' results first (as the model reads them), then its text.
fn user_turn(blocks: &[Block], field: &str, names: &HashMap<String, String>) -> Result<String, ApiError> {
    let (mut results, mut texts) = (Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let field = format!("{field}.content[{j}]");
        match block.kind.as_str() {
            "tool_result" => {
                let content = match &block.content {
                    Some(content) => content.text(&format!("{field}.content"))?,
                    None => String::new(),
                };
                let name = block.tool_use_id.as_ref().and_then(|id| names.get(id)).cloned();
                let content = if block.is_error { format!("error: {content}") } else { content };
                results.push(ToolResult { name, content });
            }
            _ => texts.push(block.text_of(&field)?),
        }
    }
    let results = (!results.is_empty()).then(|| results_text(&results));
    Ok(results.into_iter().chain(texts.into_iter().filter(|t| !t.is_empty())).collect::<Vec<_>>().join("\n\n"))
}

/// An assistant turn's text: its text, then its calls as the model writes them; the calls' names
/// are kept by their ids for the results that answer them.
fn assistant_turn(blocks: &[Block], field: &str, names: &mut HashMap<String, String>) -> Result<String, ApiError> {
    let (mut text, mut calls) = (String::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let field = format!("{field}.content[{j}]");
        match (block.kind.as_str(), &block.name) {
            ("tool_use", Some(name)) => {
                if let Some(id) = &block.id {
                    names.insert(id.clone(), name.clone());
                }
                let arguments = block.input.clone().unwrap_or_else(|| serde_json::json!({})).to_string();
                calls.push(ToolCall { name: name.clone(), arguments });
            }
            ("tool_use", None) => return Err(ApiError::invalid(format!("{field}: a tool_use block needs its name"))),
            _ => text += &block.text_of(&field)?,
        }
    }
    if calls.is_empty() {
        return Ok(text);
    }
    let calls = calls_text(&calls).map_err(|e| ApiError::invalid(format!("{field}: {e}")))?;
    Ok(if text.is_empty() { calls } else { format!("{text}\n{calls}") })
}

impl Block {
    /// A text block's text; any other block is refused, named by `field`.
    fn text_of(&self, field: &str) -> Result<String, ApiError> {
        match (self.kind.as_str(), &self.text) {
            ("text", Some(text)) => Ok(text.clone()),
            ("text", None) => Err(ApiError::invalid(format!("{field}: a text block needs its text"))),
            (kind, _) => Err(ApiError::invalid(format!(
                "{field}: content blocks of type {kind:?} are not supported here (text, and tool_use and \
                 tool_result in their turns)"
            ))),
        }
    }
}

impl MessagesRequest {
    /// The conversation the chat template renders: the turns, tools' calls and results written
    /// as the model reads them (names looked up by the calls' ids).
    pub fn conversation(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages: at least one message is needed"));
        }
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            messages.push(Message::system(system.text("system")?));
        }
        let mut names = HashMap::new();
        for (i, message) in self.messages.iter().enumerate() {
            let field = format!("messages[{i}]");
            let (role, text) = match (message.role.as_str(), &message.content) {
                (role @ ("user" | "assistant"), Content::Text(text)) => (role, text.clone()),
                ("user", Content::Blocks(blocks)) => ("user", user_turn(blocks, &field, &names)?),
                ("assistant", Content::Blocks(blocks)) => ("assistant", assistant_turn(blocks, &field, &mut names)?),
                (role, _) => {
                    return Err(ApiError::invalid(format!(
                        "{field}.role: {role:?} is not a role here (\"user\" or \"assistant\"; the system prompt \
                         goes in \"system\")"
                    )))
                }
            };
            messages.push(Message { role: role.to_string(), content: text });
        }
        Ok(messages)
    }

    /// The request's tools and what the model must do with them; none where it has none, or
    /// where `tool_choice` is `none`.
    pub fn toolbox(&self) -> Result<Option<Toolbox>, ApiError> {
        let (choice, parallel) = match &self.tool_choice {
            None => (ToolChoice::Auto, true),
            Some(choice) => (
                match (choice.kind.as_str(), &choice.name) {
                    ("none", _) => return Ok(None),
                    ("auto", _) => ToolChoice::Auto,
                    ("any", _) => ToolChoice::Required,
                    ("tool", Some(name)) => ToolChoice::Function(name.clone()),
                    ("tool", None) => {
                        return Err(ApiError::invalid("tool_choice: type \"tool\" needs the tool's name"))
                    }
                    (kind, _) => {
                        return Err(ApiError::invalid(format!("tool_choice: type {kind:?} is not one sift knows")))
                    }
                },
                !choice.disable_parallel_tool_use,
            ),
        };
        if self.tools.is_empty() && choice == ToolChoice::Auto {
            return Ok(None);
        }
        let tools = (self.tools.iter().enumerate())
            .map(|(i, tool)| match tool.kind.as_deref() {
                None | Some("custom") => Ok(Tool {
                    name: tool.name.clone(),
                    description: tool.description.clone(),
                    parameters: tool.input_schema.clone(),
                }),
                Some(kind) => Err(ApiError::invalid(format!(
                    "tools[{i}]: server tools ({kind:?}) are not supported; only the client's own tools"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Toolbox::new(tools, choice, parallel).map(Some).map_err(|e| ApiError::invalid(format!("tools: {e}")))
    }

    /// The request's settings over the server's `defaults`, as the OpenAI routes take theirs.
    pub fn params(&self, defaults: &Params, n_vocab: usize) -> Result<Params, ApiError> {
        if self.max_tokens == 0 {
            return Err(ApiError::invalid("max_tokens must be at least 1"));
        }
        if self.temperature.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
            return Err(ApiError::invalid("temperature must be between 0 and 1"));
        }
        let options = Options {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: Some(self.max_tokens),
            stop: Some(Stop::Many(self.stop_sequences.clone())),
            ..Options::default()
        };
        options.params(defaults, None, n_vocab)
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
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

/// A block of a reply: text, or a call of a tool.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text { text: String },
    ToolUse { id: String, name: String, input: Value },
}

impl ContentBlock {
    /// The reply `text` as blocks: its calls where the model called tools, else its text; and
    /// whether it called. `id` makes the calls' ids.
    pub fn reply(text: String, toolbox: Option<&Toolbox>, id: &str) -> (Vec<ContentBlock>, bool) {
        match toolbox.map(|toolbox| toolbox.read(&text)) {
            Some(Reply::Calls(calls)) => {
                let blocks = (calls.into_iter().enumerate())
                    .map(|(i, call)| ContentBlock::ToolUse {
                        id: format!("toolu_{}_{i}", id.trim_start_matches("msg-")),
                        // The grammar holds the arguments to a JSON object.
                        input: serde_json::from_str(&call.arguments).unwrap_or(Value::Null),
                        name: call.name,
                    })
                    .collect();
                (blocks, true)
            }
            _ => (vec![ContentBlock::Text { text }], false),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// The prompt's tokens the cache already held.
    pub cache_read_input_tokens: usize,
}

/// Why a reply ended, as Anthropic says it, and the stop sequence that ended it; `called`: the
/// reply was calls.
pub fn stop_reason(finished: &Finished, stops: &[String], called: bool) -> (&'static str, Option<String>) {
    if called {
        return ("tool_use", None);
    }
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
    ContentBlockStart { index: usize, content_block: ContentBlock },
    ContentBlockDelta { index: usize, delta: Delta },
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

    /// The events of a block: its start, its content as one delta, its stop.
    pub fn block(index: usize, block: ContentBlock) -> [StreamEvent; 3] {
        let (opened, delta) = match block {
            ContentBlock::Text { text } => (ContentBlock::Text { text: String::new() }, Delta::TextDelta { text }),
            ContentBlock::ToolUse { id, name, input } => (
                ContentBlock::ToolUse { id, name, input: serde_json::json!({}) },
                Delta::InputJsonDelta { partial_json: input.to_string() },
            ),
        };
        [
            StreamEvent::ContentBlockStart { index, content_block: opened },
            StreamEvent::ContentBlockDelta { index, delta },
            StreamEvent::ContentBlockStop { index },
        ]
    }
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Delta {
    TextDelta { text: String },
    InputJsonDelta { partial_json: String },
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
    e.respond(StreamEvent::Error { error: ErrorDetail::of(&e) })
}
