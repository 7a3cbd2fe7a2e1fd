//! OpenAI's Responses API, `POST /v1/responses`, for the clients that have moved to it: the same
//! model, worker, chat template, tools and sampling as `/v1/chat/completions`, in its shapes.
//!
//! `input` is a string (one user message) or items: messages (`role` `user`, `system`,
//! `developer` or `assistant`; content a string or `input_text` / `output_text` parts), the
//! model's `function_call`s and their `function_call_output`s, written into the conversation as
//! the chat route writes tool calls and results. `instructions` is the system message;
//! `max_output_tokens`, `temperature`, `top_p`, `tools` (functions: `name`, `description`,
//! `parameters`), `tool_choice` (`auto`, `none`, `required`, `{"type": "function", "name"}`),
//! `parallel_tool_calls` and `text.format` (`text`, `json_object`, `json_schema` with its
//! `schema`) set what they name. The reply is an `output` of one `message` with one
//! `output_text`, or of `function_call`s; `status` is `completed`, or `incomplete` with
//! `incomplete_details.reason: "max_output_tokens"` where the token limit or the context ended
//! it. The server keeps its last responses in memory ([`Store`]; not those asked with
//! `"store": false`): `previous_response_id` goes on from one (its turns and its reply, not its
//! instructions, come before the request's input), `GET /v1/responses/{id}` gives one back and
//! `DELETE` forgets it. Images, files and hosted tools are refused with a 400 that names them.
//! Streamed, the reply is the API's named events, each with its `sequence_number`:
//! `response.created`, `response.in_progress`, then per output item
//! `response.output_item.added`, for a message `response.content_part.added`, a
//! `response.output_text.delta` per piece, `response.output_text.done` and
//! `response.content_part.done`, for a call one `response.function_call_arguments.delta` and
//! `.done`, then `response.output_item.done`; last `response.completed` (or
//! `response.incomplete`) with the whole response. A reply that may be calls is held until it
//! ends, as on the chat route. Errors are OpenAI's.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::{channel, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;

use super::api::{self, ChatMessage, JsonSchemaFormat, Options, ResponseFormat, TokenLogprob, WireCall, WireToolCall};
use super::error::ApiError;
use super::routes::{gather, json, offer_tools, parse, started, unix_now, Gathered, Relay, Relayed, Server};
use super::worker::{Event, Finished, Prompt};
use crate::generate::StopReason;
use crate::tools::{Reply, Tool, Toolbox};

/// `POST /v1/responses`.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: String,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub tools: Vec<ResponseTool>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<TextOptions>,
    #[serde(default)]
    pub stream: bool,
    pub previous_response_id: Option<String>,
    /// Whether the response is kept, for `previous_response_id` and `GET /v1/responses/{id}`
    /// (the default).
    pub store: Option<bool>,
    pub metadata: Option<Value>,
    /// What the output is to carry besides its text: [`LOGPROBS`] asks for each token's
    /// log-probability; the other values name hosted tools' output, which sift has none of.
    #[serde(default)]
    pub include: Vec<String>,
    /// With [`LOGPROBS`] included: how many alternatives each token lists, 0 to 20.
    pub top_logprobs: Option<usize>,
}

/// The `include` value that asks for the reply's log-probabilities.
const LOGPROBS: &str = "message.output_text.logprobs";

/// `input`: one user message's text, or items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// One of `input`'s items: a message (no `type`, or `message`), a `function_call` or a
/// `function_call_output`.
#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub role: Option<String>,
    pub content: Option<ItemContent>,
    pub call_id: Option<String>,
    pub name: Option<String>,
    pub arguments: Option<String>,
    pub output: Option<ItemContent>,
}

/// A message's content, or a call's output: a string, or parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ItemContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    pub refusal: Option<String>,
}

/// One of `tools`: `{"type": "function", "name", "description", "parameters", "strict"}`.
#[derive(Debug, Deserialize, Serialize)]
pub struct ResponseTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// `text`: the reply's `format`.
#[derive(Debug, Deserialize)]
pub struct TextOptions {
    pub format: Option<Value>,
}

/// A message of the chat route's form.
fn message(role: &str, text: Option<String>) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: text.map(api::Content::Text),
        tool_calls: None,
        tool_call_id: None,
        name: None,
    }
}

impl ItemContent {
    /// The text of the content's parts, joined; `field` names it in errors.
    fn text(&self, field: &str) -> Result<String, ApiError> {
        match self {
            ItemContent::Text(text) => Ok(text.clone()),
            ItemContent::Parts(parts) => (parts.iter().enumerate())
                .map(|(i, part)| match (part.kind.as_str(), &part.text, &part.refusal) {
                    ("input_text" | "output_text" | "text", Some(text), _) => Ok(text.clone()),
                    ("refusal", _, Some(refusal)) => Ok(refusal.clone()),
                    (kind, _, _) => Err(ApiError::invalid(format!(
                        "{field}[{i}]: content of type {kind:?} is not supported (sift runs text models)"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

impl ResponsesRequest {
    /// The request's turns in the chat route's form, after `previous` (the turns of the
    /// response it goes on from): its input items, written as that route writes its own.
    fn turns(&self, previous: Vec<ChatMessage>) -> Result<Vec<ChatMessage>, ApiError> {
        let mut wire = previous;
        let items = match &self.input {
            Input::Text(text) => {
                wire.push(message("user", Some(text.clone())));
                &[][..]
            }
            Input::Items(items) if items.is_empty() => {
                return Err(ApiError::invalid("input: at least one item is needed"));
            }
            Input::Items(items) => items,
        };
        for (i, item) in items.iter().enumerate() {
            let field = format!("input[{i}]");
            match item.kind.as_deref() {
                None | Some("message") => {
                    let role = item.role.as_deref().ok_or_else(|| ApiError::invalid(format!("{field}: no role")))?;
                    let text = match &item.content {
                        Some(content) => content.text(&format!("{field}.content"))?,
                        None => String::new(),
                    };
                    wire.push(message(role, Some(text)));
                }
                Some("function_call") => {
                    let (Some(name), Some(arguments)) = (&item.name, &item.arguments) else {
                        return Err(ApiError::invalid(format!(
                            "{field}: a function_call needs its name and arguments"
                        )));
                    };
                    let call = WireToolCall {
                        id: item.call_id.clone(),
                        kind: "function".into(),
                        function: WireCall { name: name.clone(), arguments: arguments.clone() },
                    };
                    // The calls of one turn join the turn's text, or the calls before them.
                    match wire.last_mut() {
                        Some(last) if last.role == "assistant" => {
                            last.tool_calls.get_or_insert_with(Vec::new).push(call)
                        }
                        _ => wire.push(ChatMessage { tool_calls: Some(vec![call]), ..message("assistant", None) }),
                    }
                }
                Some("function_call_output") => {
                    let output = match &item.output {
                        Some(output) => output.text(&format!("{field}.output"))?,
                        None => String::new(),
                    };
                    wire.push(ChatMessage { tool_call_id: item.call_id.clone(), ..message("tool", Some(output)) });
                }
                Some(kind) => {
                    return Err(ApiError::invalid(format!(
                        "{field}: items of type {kind:?} are not supported (messages, function_call and \
                         function_call_output)"
                    )))
                }
            }
        }
        Ok(wire)
    }

    /// The conversation as a chat template reads it: the instructions as the system message
    /// (a response's own, not carried over to the next), then `turns`.
    fn conversation(&self, turns: &[ChatMessage]) -> Result<Vec<crate::chat::Message>, ApiError> {
        let system = self.instructions.iter().map(|text| message("system", Some(text.clone())));
        api::conversation(&system.chain(turns.iter().cloned()).collect::<Vec<_>>())
    }

    /// The tools offered and what the model must do with them; none where no tools are given
    /// or `tool_choice` is `"none"`.
    pub fn toolbox(&self) -> Result<Option<Toolbox>, ApiError> {
        let Some(choice) = api::tool_choice(self.tool_choice.as_ref(), !self.tools.is_empty(), "/name")? else {
            return Ok(None);
        };
        let tools = (self.tools.iter().enumerate())
            .map(|(i, tool)| match (tool.kind.as_str(), &tool.name) {
                ("function", Some(name)) => Ok(Tool {
                    name: name.clone(),
                    description: tool.description.clone(),
                    parameters: tool.parameters.clone(),
                }),
                ("function", None) => Err(ApiError::invalid(format!("tools[{i}]: a function needs its name"))),
                (kind, _) => Err(ApiError::invalid(format!(
                    "tools[{i}]: tools of type {kind:?} are not supported (only \"function\")"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let parallel = self.parallel_tool_calls.unwrap_or(true);
        Toolbox::new(tools, choice, parallel).map(Some).map_err(|e| ApiError::invalid(format!("tools: {e}")))
    }

    /// How many alternatives each token lists, where [`LOGPROBS`] is included.
    fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        api::top_logprobs(self.include.iter().any(|item| item == LOGPROBS), self.top_logprobs)
    }

    /// `text.format` as the chat route's `response_format`.
    fn response_format(&self) -> Result<Option<ResponseFormat>, ApiError> {
        let Some(format) = self.text.as_ref().and_then(|text| text.format.as_ref()) else {
            return Ok(None);
        };
        match format["type"].as_str() {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(ResponseFormat::JsonObject { schema: None })),
            Some("json_schema") => Ok(Some(ResponseFormat::JsonSchema {
                json_schema: JsonSchemaFormat { schema: format.get("schema").cloned() },
            })),
            _ => Err(ApiError::invalid(format!("text.format {format} is not one sift knows"))),
        }
    }
}

/// A response: whole, or the snapshot a stream's lifecycle events carry.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject {
    id: String,
    object: &'static str,
    created_at: u64,
    status: &'static str,
    error: Option<Value>,
    incomplete_details: Option<IncompleteDetails>,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    model: String,
    output: Vec<OutputItem>,
    parallel_tool_calls: bool,
    previous_response_id: Option<String>,
    store: bool,
    temperature: f32,
    top_p: f32,
    text: Value,
    tool_choice: Value,
    tools: Vec<Value>,
    truncation: &'static str,
    usage: Option<ResponseUsage>,
    metadata: Value,
}

#[derive(Debug, Clone, Serialize)]
struct IncompleteDetails {
    reason: &'static str,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct ResponseUsage {
    input_tokens: usize,
    input_tokens_details: InputDetails,
    output_tokens: usize,
    output_tokens_details: OutputDetails,
    total_tokens: usize,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct InputDetails {
    cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct OutputDetails {
    reasoning_tokens: usize,
}

/// One item of a response's output.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutputItem {
    Message { id: String, status: &'static str, role: &'static str, content: Vec<OutputText> },
    FunctionCall { id: String, call_id: String, name: String, arguments: String, status: &'static str },
}

#[derive(Debug, Clone, Serialize)]
struct OutputText {
    #[serde(rename = "type")]
    kind: &'static str,
    text: String,
    annotations: Vec<Value>,
    logprobs: Vec<TokenLogprob>,
}

impl OutputText {
    fn new(text: String, logprobs: Vec<TokenLogprob>) -> Self {
        OutputText { kind: "output_text", text, annotations: Vec::new(), logprobs }
    }
}

impl OutputItem {
    /// The reply as output items: its calls, where the model called `toolbox`'s tools, else one
    /// message of its text and its tokens' `logprobs`. `id` makes the items' ids.
    fn reply(text: String, logprobs: Vec<TokenLogprob>, toolbox: Option<&Toolbox>, id: &str) -> Vec<OutputItem> {
        let suffix = id.trim_start_matches("resp_");
        match toolbox.map(|toolbox| toolbox.read(&text)) {
            Some(Reply::Calls(calls)) => (calls.into_iter().enumerate())
                .map(|(i, call)| OutputItem::FunctionCall {
                    id: format!("fc_{suffix}_{i}"),
                    call_id: format!("call_{suffix}_{i}"),
                    name: call.name,
                    arguments: call.arguments,
                    status: "completed",
                })
                .collect(),
            _ => vec![OutputItem::message(id, text, logprobs)],
        }
    }

    /// The reply's message of `text`, complete, with its tokens' `logprobs`.
    fn message(id: &str, text: String, logprobs: Vec<TokenLogprob>) -> OutputItem {
        let id = format!("msg_{}", id.trim_start_matches("resp_"));
        let content = vec![OutputText::new(text, logprobs)];
        OutputItem::Message { id, status: "completed", role: "assistant", content }
    }

    fn id(&self) -> &str {
        match self {
            OutputItem::Message { id, .. } | OutputItem::FunctionCall { id, .. } => id,
        }
    }

    /// The item as its `response.output_item.added` event shows it: in progress, empty.
    fn opened(&self) -> OutputItem {
        match self {
            OutputItem::Message { id, role, .. } => {
                OutputItem::Message { id: id.clone(), status: "in_progress", role, content: Vec::new() }
            }
            OutputItem::FunctionCall { id, call_id, name, .. } => OutputItem::FunctionCall {
                id: id.clone(),
                call_id: call_id.clone(),
                name: name.clone(),
                arguments: String::new(),
                status: "in_progress",
            },
        }
    }
}

impl ResponseObject {
    /// The response's reply as the chat route's turn: its text, or its calls with their ids.
    fn output_turn(&self) -> ChatMessage {
        let (mut text, mut calls) = (String::new(), Vec::new());
        for item in &self.output {
            match item {
                OutputItem::Message { content, .. } => content.iter().for_each(|part| text += &part.text),
                OutputItem::FunctionCall { call_id, name, arguments, .. } => calls.push(WireToolCall {
                    id: Some(call_id.clone()),
                    kind: "function".into(),
                    function: WireCall { name: name.clone(), arguments: arguments.clone() },
                }),
            }
        }
        let calls = (!calls.is_empty()).then_some(calls);
        ChatMessage { tool_calls: calls, ..message("assistant", Some(text)) }
    }

    /// The response as it starts: in progress, with no output yet.
    fn started(id: String, request: &ResponsesRequest, params: &api::Params, model: String) -> Self {
        let format = request.text.as_ref().and_then(|text| text.format.clone());
        ResponseObject {
            id,
            object: "response",
            created_at: unix_now(),
            status: "in_progress",
            error: None,
            incomplete_details: None,
            instructions: request.instructions.clone(),
            max_output_tokens: request.max_output_tokens,
            model,
            output: Vec::new(),
            parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
            previous_response_id: request.previous_response_id.clone(),
            store: request.store != Some(false),
            temperature: params.sampling.temperature,
            top_p: params.sampling.top_p,
            text: serde_json::json!({ "format": format.unwrap_or_else(|| serde_json::json!({ "type": "text" })) }),
            tool_choice: request.tool_choice.clone().unwrap_or_else(|| "auto".into()),
            tools: request.tools.iter().map(|tool| serde_json::to_value(tool).expect("plain data")).collect(),
            truncation: "disabled",
            usage: None,
            metadata: request.metadata.clone().unwrap_or_else(|| serde_json::json!({})),
        }
    }

    /// The response once the reply has ended with `output`.
    fn finished(&self, output: Vec<OutputItem>, finished: &Finished, prompt: (usize, usize)) -> Self {
        let (input_tokens, cached_tokens) = prompt;
        let incomplete = matches!(finished.stop, StopReason::TokenLimit | StopReason::ContextFull);
        ResponseObject {
            status: if incomplete { "incomplete" } else { "completed" },
            incomplete_details: incomplete.then_some(IncompleteDetails { reason: "max_output_tokens" }),
            output,
            usage: Some(ResponseUsage {
                input_tokens,
                input_tokens_details: InputDetails { cached_tokens },
                output_tokens: finished.completion_tokens,
                output_tokens_details: OutputDetails { reasoning_tokens: 0 },
                total_tokens: input_tokens + finished.completion_tokens,
            }),
            ..self.clone()
        }
    }
}

/// `POST /v1/responses`.
pub(super) async fn create(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: ResponsesRequest = parse(body)?;
        let previous = match &request.previous_response_id {
            Some(id) => server.responses.turns(id)?,
            None => Vec::new(),
        };
        let toolbox = request.toolbox()?;
        let turns = request.turns(previous)?;
        let mut messages = request.conversation(&turns)?;
        let response_format = request.response_format()?;
        if toolbox.is_some() && response_format.is_some() {
            return Err(ApiError::invalid("tools and text.format cannot both shape a reply: send one"));
        }
        let options = Options {
            temperature: request.temperature,
            top_p: request.top_p,
            max_tokens: request.max_output_tokens,
            response_format,
            ..Options::default()
        };
        let mut params = options.params(&server.config.defaults, request.top_logprobs()?, server.n_vocab)?;
        if let Some(toolbox) = &toolbox {
            messages = offer_tools(toolbox, messages, &mut params);
        }
        let model = match request.model.is_empty() {
            true => server.config.model_id.clone(),
            false => request.model.clone(),
        };
        let response = ResponseObject::started(server.new_id("resp").replace('-', "_"), &request, &params, model);
        let mut events = server.queue.submit(Prompt::Chat(messages), params)?;
        let usage = started(&mut events).await?;
        let prompt = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens);
        // Where the response is to be kept: the store, and the turns it goes on from.
        let keep = (request.store != Some(false)).then(|| (server.responses.clone(), turns));
        if request.stream {
            return Ok(stream(response, prompt, toolbox, events, keep));
        }
        let Gathered { text, tokens, finished } = gather(events).await?;
        let output = OutputItem::reply(text, tokens, toolbox.as_ref(), &response.id);
        let response = response.finished(output, &finished, prompt);
        if let Some((store, turns)) = keep {
            store.keep(&response, turns);
        }
        Ok(Json(response).into_response())
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `GET /v1/responses/{id}`: a response kept.
pub(super) async fn retrieve(State(server): State<Arc<Server>>, Path(id): Path<String>) -> Response {
    match server.responses.response(&id) {
        Ok(response) => Json(response).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a response kept.
pub(super) async fn delete(State(server): State<Arc<Server>>, Path(id): Path<String>) -> Response {
    match server.responses.forget(&id) {
        Ok(()) => Json(serde_json::json!({ "id": id, "object": "response.deleted", "deleted": true })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The responses kept in memory, the newest last, [`Store::KEPT`] at most: each with the turns
/// of its conversation, its reply's included, for a request that goes on from it
/// (`previous_response_id`). They are gone when the server stops.
#[derive(Debug, Default)]
pub struct Store {
    kept: Mutex<VecDeque<Kept>>,
}

#[derive(Debug)]
struct Kept {
    response: ResponseObject,
    /// The conversation's turns, up to the response's reply and with it (its instructions left
    /// out: they are a response's own).
    turns: Vec<ChatMessage>,
}

impl Store {
    /// The most responses kept; the oldest goes first.
    const KEPT: usize = 256;

    /// Keeps `response`, whose conversation's turns before its reply were `turns`.
    fn keep(&self, response: &ResponseObject, mut turns: Vec<ChatMessage>) {
        turns.push(response.output_turn());
        let mut kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if kept.len() == Self::KEPT {
            kept.pop_front();
        }
        kept.push_back(Kept { response: response.clone(), turns });
    }

    fn find<T>(&self, id: &str, what: impl FnOnce(&Kept) -> T) -> Result<T, ApiError> {
        let kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        kept.iter().find(|kept| kept.response.id == id).map(what).ok_or_else(|| not_kept(id))
    }

    /// The turns of the conversation `id` ended.
    fn turns(&self, id: &str) -> Result<Vec<ChatMessage>, ApiError> {
        self.find(id, |kept| kept.turns.clone()).map_err(|e| ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("previous_response_id: {}", e.message),
            ..e
        })
    }

    fn response(&self, id: &str) -> Result<ResponseObject, ApiError> {
        self.find(id, |kept| kept.response.clone())
    }

    fn forget(&self, id: &str) -> Result<(), ApiError> {
        let mut kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = kept.iter().position(|kept| kept.response.id == id).ok_or_else(|| not_kept(id))?;
        kept.remove(at);
        Ok(())
    }
}

/// 404: no response `id` is kept.
fn not_kept(id: &str) -> ApiError {
    ApiError {
        message: format!(
            "no response '{id}' is kept here (the server keeps the last {} it gave, while it runs, unless asked \
             not to with \"store\": false)",
            Store::KEPT
        ),
        ..ApiError::not_found("")
    }
}

/// A stream's events, named by `type`.
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
enum StreamEvent {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject },
    #[serde(rename = "response.in_progress")]
    InProgress { response: ResponseObject },
    #[serde(rename = "response.output_item.added")]
    ItemAdded { output_index: usize, item: OutputItem },
    #[serde(rename = "response.content_part.added")]
    PartAdded { item_id: String, output_index: usize, content_index: usize, part: OutputText },
    #[serde(rename = "response.output_text.delta")]
    TextDelta { item_id: String, output_index: usize, content_index: usize, delta: String, logprobs: Vec<TokenLogprob> },
    #[serde(rename = "response.output_text.done")]
    TextDone { item_id: String, output_index: usize, content_index: usize, text: String, logprobs: Vec<TokenLogprob> },
    #[serde(rename = "response.content_part.done")]
    PartDone { item_id: String, output_index: usize, content_index: usize, part: OutputText },
    #[serde(rename = "response.function_call_arguments.delta")]
    ArgumentsDelta { item_id: String, output_index: usize, delta: String },
    #[serde(rename = "response.function_call_arguments.done")]
    ArgumentsDone { item_id: String, output_index: usize, arguments: String },
    #[serde(rename = "response.output_item.done")]
    ItemDone { output_index: usize, item: OutputItem },
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject },
    #[serde(rename = "error")]
    Error { code: Option<&'static str>, message: String, param: Option<String> },
}

impl StreamEvent {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::ItemAdded { .. } => "response.output_item.added",
            StreamEvent::PartAdded { .. } => "response.content_part.added",
            StreamEvent::TextDelta { .. } => "response.output_text.delta",
            StreamEvent::TextDone { .. } => "response.output_text.done",
            StreamEvent::PartDone { .. } => "response.content_part.done",
            StreamEvent::ArgumentsDelta { .. } => "response.function_call_arguments.delta",
            StreamEvent::ArgumentsDone { .. } => "response.function_call_arguments.done",
            StreamEvent::ItemDone { .. } => "response.output_item.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Error { .. } => "error",
        }
    }

    /// The events that open `item`, at `index` of the output.
    fn opening(index: usize, item: &OutputItem) -> Vec<StreamEvent> {
        let mut events = vec![StreamEvent::ItemAdded { output_index: index, item: item.opened() }];
        if let OutputItem::Message { id, .. } = item {
            let part = OutputText::new(String::new(), Vec::new());
            events.push(StreamEvent::PartAdded { item_id: id.clone(), output_index: index, content_index: 0, part });
        }
        events
    }

    /// The events that close `item`, complete, at `index`.
    fn closing(index: usize, item: &OutputItem) -> Vec<StreamEvent> {
        let item_id = item.id().to_string();
        let mut events = Vec::new();
        match item {
            OutputItem::Message { content, .. } => {
                let part = content.first().cloned().unwrap_or_else(|| OutputText::new(String::new(), Vec::new()));
                events.push(StreamEvent::TextDone {
                    item_id: item_id.clone(),
                    output_index: index,
                    content_index: 0,
                    text: part.text.clone(),
                    logprobs: part.logprobs.clone(),
                });
                events.push(StreamEvent::PartDone { item_id, output_index: index, content_index: 0, part });
            }
            OutputItem::FunctionCall { arguments, .. } => {
                events.push(StreamEvent::ArgumentsDone { item_id, output_index: index, arguments: arguments.clone() });
            }
        }
        events.push(StreamEvent::ItemDone { output_index: index, item: item.clone() });
        events
    }

    /// The events of `item`, sent whole at `index`: opened, its content as one delta, closed.
    fn whole(index: usize, item: &OutputItem) -> Vec<StreamEvent> {
        let item_id = item.id().to_string();
        let delta = match item {
            OutputItem::Message { content, .. } => StreamEvent::TextDelta {
                item_id,
                output_index: index,
                content_index: 0,
                delta: content.first().map_or_else(String::new, |part| part.text.clone()),
                logprobs: content.first().map_or_else(Vec::new, |part| part.logprobs.clone()),
            },
            OutputItem::FunctionCall { arguments, .. } => {
                StreamEvent::ArgumentsDelta { item_id, output_index: index, delta: arguments.clone() }
            }
        };
        let mut events = Self::opening(index, item);
        events.push(delta);
        events.extend(Self::closing(index, item));
        events
    }
}

/// The event with its place in the stream.
#[derive(Debug, Serialize)]
struct Sequenced<'a> {
    #[serde(flatten)]
    event: &'a StreamEvent,
    sequence_number: usize,
}

/// A response as the API's named server-sent events, by a task that ends when the client goes
/// away: the lifecycle events, the message opened at its first text and a delta per piece (or,
/// for a reply held back because it may be calls, its items whole), the items closed, and the
/// response completed.
fn stream(
    response: ResponseObject,
    prompt: (usize, usize),
    toolbox: Option<Toolbox>,
    events: UnboundedReceiver<Event>,
    keep: Option<(Arc<Store>, Vec<ChatMessage>)>,
) -> Response {
    let (sse, body) = channel::<Result<SseEvent, Infallible>>(64);
    let mut relay = Relay::new(events, toolbox);
    tokio::spawn(async move {
        let mut sequence_number = 0;
        let mut send = |event: StreamEvent| {
            let data = json(&Sequenced { event: &event, sequence_number });
            sequence_number += 1;
            let sse = sse.clone();
            async move { sse.send(Ok(SseEvent::default().event(event.name()).data(data))).await.is_ok() }
        };
        let lifecycle = [
            StreamEvent::Created { response: response.clone() },
            StreamEvent::InProgress { response: response.clone() },
        ];
        for event in lifecycle {
            if !send(event).await {
                return;
            }
        }
        // The reply's text so far, once its message has been opened; the log-probabilities of
        // its tokens (where asked for), all of them and those of the text not yet sent.
        let mut streamed: Option<String> = None;
        let (mut logprobs, mut unsent) = (Vec::new(), Vec::new());
        let message_id = OutputItem::message(&response.id, String::new(), Vec::new()).id().to_string();
        while let Some(relayed) = relay.next(sse.closed()).await {
            let mut events = Vec::new();
            match relayed {
                Relayed::Token(token) => {
                    logprobs.push(token.clone());
                    unsent.push(token);
                }
                Relayed::Text(text) => {
                    let so_far = streamed.get_or_insert_with(|| {
                        let opened = OutputItem::message(&response.id, String::new(), Vec::new());
                        events = StreamEvent::opening(0, &opened);
                        String::new()
                    });
                    *so_far += &text;
                    events.push(StreamEvent::TextDelta {
                        item_id: message_id.clone(),
                        output_index: 0,
                        content_index: 0,
                        delta: text,
                        logprobs: std::mem::take(&mut unsent),
                    });
                }
                Relayed::Finished { held, finished } => {
                    let logprobs = std::mem::take(&mut logprobs);
                    let output = match (held, streamed.take()) {
                        (Some(text), _) => {
                            let output = OutputItem::reply(text, logprobs, relay.toolbox(), &response.id);
                            events.extend(output.iter().enumerate().flat_map(|(i, item)| StreamEvent::whole(i, item)));
                            output
                        }
                        (None, Some(text)) => {
                            let message = OutputItem::message(&response.id, text, logprobs);
                            events.extend(StreamEvent::closing(0, &message));
                            vec![message]
                        }
                        // An empty reply: one empty message.
                        (None, None) => {
                            let message = OutputItem::message(&response.id, String::new(), logprobs);
                            events.extend(StreamEvent::whole(0, &message));
                            vec![message]
                        }
                    };
                    let response = response.finished(output, &finished, prompt);
                    if let Some((store, turns)) = keep {
                        store.keep(&response, turns);
                    }
                    events.push(match response.status {
                        "incomplete" => StreamEvent::Incomplete { response },
                        _ => StreamEvent::Completed { response },
                    });
                    for event in events {
                        if !send(event).await {
                            break;
                        }
                    }
                    return;
                }
                Relayed::Failed(e) => {
                    send(StreamEvent::Error { code: e.code, message: e.message, param: None }).await;
                    return;
                }
            }
            for event in events {
                if !send(event).await {
                    return;
                }
            }
        }
    });
    Sse::new(ReceiverStream::new(body)).keep_alive(KeepAlive::default()).into_response()
}
