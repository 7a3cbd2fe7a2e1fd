//! Ollama's API, for the desktop apps and libraries written against it: the same model, worker,
//! chat template and sampling as the OpenAI routes, in Ollama's shapes.
//!
//! - `POST /api/chat`: `messages` (`system`, `user`, `assistant` with its `tool_calls`, and
//!   `tool` with its `tool_name`), `tools`, `format` (`"json"` or a JSON schema) and `options`
//!   (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `num_predict`, `stop`,
//!   `repeat_penalty`, `presence_penalty`, `frequency_penalty`; the others, such as `num_ctx`,
//!   are the server's to set and are ignored). A reply that calls tools is `message.tool_calls`,
//!   each call's arguments an object.
//! - `POST /api/generate`: a `prompt`, with an optional `system`, rendered with the chat template
//!   as one user turn, or tokenized as it is with `"raw": true`. `suffix`, `template`, `images`
//!   and `context` are refused with a 400 that says why: the server keeps the conversation's
//!   cache itself, so a client sends the whole prompt again rather than `context`.
//! - `POST /api/embed` (`input`: a text or texts; unit-length vectors, as `/v1/embeddings`) and
//!   the older `POST /api/embeddings` (`prompt`: one text).
//! - `GET /api/tags`, `GET /api/ps`, `POST /api/show` and `GET /api/version`: the one model the
//!   server serves, listed by its name (`--alias`, or its file's) tagged `latest` where it has no
//!   tag, with what its file says of it. The
//!   routes that manage models (`/api/pull`, `push`, `create`, `copy`, `delete`) are a 501 that
//!   says the server serves the file it was started with; other `/api/` paths are a 404.
//!
//! Both `/api/chat` and `/api/generate` stream by default, one JSON object a line
//! (`application/x-ndjson`): a line per piece of text with `"done": false`, then a last line with
//! `"done": true`, the `done_reason` (`stop` or `length`) and the counts and durations (in
//! nanoseconds). A request with no messages, or no prompt, loads the model (it is always loaded)
//! and answers at once with `"done_reason": "load"`. A request's `model` is echoed and not
//! checked (a server serves one model); `keep_alive` is ignored. `"think": true` is refused: the
//! models sift runs do not think aloud. Errors are `{"error": MESSAGE}` with the status.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::{channel, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;

use super::api::{
    self, finish_reason, ChatMessage, EmbeddingInput, EmbeddingRequest, Options, Params, ResponseFormat, Stop,
    TokenLogprob, WireCall, WireTool,
};
use super::error::ApiError;
use super::routes::{embed, gather, json, offer_tools, parse, started, unix_now, Gathered, Relay, Relayed, Server};
use super::worker::{Event, Finished, Prompt};
use crate::chat::{utc_timestamp, Message};
use crate::gguf::GgufFile;
use crate::model::Model;
use crate::tools::{Reply, ToolChoice, Toolbox};

/// `POST /api/chat`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub messages: Vec<WireMessage>,
    #[serde(default)]
    pub tools: Vec<WireTool>,
    pub format: Option<Value>,
    pub options: Option<ModelOptions>,
    #[serde(default = "yes")]
    pub stream: bool,
    pub think: Option<Value>,
    #[serde(flatten)]
    pub logprobs: Logprobs,
}

/// Whether each token's log-probability comes with the reply, and how many alternatives each
/// lists (0 to 20).
#[derive(Debug, Default, Deserialize)]
pub struct Logprobs {
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<usize>,
}

impl Logprobs {
    /// How many alternatives each token lists, where log-probabilities are asked for.
    fn top(&self) -> Result<Option<usize>, ApiError> {
        api::top_logprobs(self.logprobs, self.top_logprobs)
    }
}

fn yes() -> bool {
    true
}

/// One of a chat's messages.
#[derive(Debug, Deserialize)]
pub struct WireMessage {
    pub role: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub images: Vec<Value>,
    /// An assistant turn's calls.
    #[serde(default)]
    pub tool_calls: Vec<WireToolCall>,
    /// A `tool` message's tool.
    pub tool_name: Option<String>,
}

/// A call as Ollama writes it: `{"function": {"name", "arguments"}}`, the arguments an object.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireToolCall {
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: Value,
}

/// `options`: the sampling and the limits a request sets; the fields sift has no use for are
/// ignored, as the server's own settings (context size, threads) are not a request's to change.
#[derive(Debug, Default, Deserialize)]
pub struct ModelOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    /// A negative seed asks for a fresh one.
    pub seed: Option<i64>,
    /// The most tokens to generate; negative for no limit but the context.
    pub num_predict: Option<i64>,
    pub stop: Option<Vec<String>>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

/// A request's `format`: `"json"` (any JSON object) or a JSON schema; none where it is absent or
/// empty.
fn response_format(format: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(ResponseFormat::JsonObject { schema: None })),
        Some(schema @ Value::Object(_)) => Ok(Some(ResponseFormat::JsonObject { schema: Some(schema.clone()) })),
        Some(other) => Err(ApiError::invalid(format!("format: \"json\" or a JSON schema, not {other}"))),
    }
}

impl ModelOptions {
    /// The settings over the server's `defaults`, as the OpenAI routes take theirs, with the
    /// request's `format` and `logprobs`.
    fn params(
        &self,
        response_format: Option<ResponseFormat>,
        logprobs: &Logprobs,
        defaults: &Params,
        n_vocab: usize,
    ) -> Result<Params, ApiError> {
        let max_tokens = self.num_predict.map(|n| api::token_limit(n, "options.num_predict")).transpose()?;
        let options = Options {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            max_tokens,
            stop: self.stop.clone().map(Stop::Many),
            seed: self.seed.and_then(|seed| u64::try_from(seed).ok()),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_penalty: self.repeat_penalty,
            response_format,
            ..Options::default()
        };
        options.params(defaults, logprobs.top()?, n_vocab)
    }
}

/// `"think": true` (or a level) is refused; `false` or none is what sift does anyway.
fn refuse_thinking(think: Option<&Value>) -> Result<(), ApiError> {
    match think {
        None | Some(Value::Null | Value::Bool(false)) => Ok(()),
        Some(_) => Err(ApiError::invalid("think: the models sift runs do not think aloud; leave it out")),
    }
}

/// Images are refused, named by the field they came in.
fn refuse_images(images: &[Value], field: &str) -> Result<(), ApiError> {
    match images.is_empty() {
        true => Ok(()),
        false => Err(ApiError::invalid(format!("{field}: images are not supported (sift runs text models)"))),
    }
}

impl ChatRequest {
    /// The conversation as a chat template reads it: the messages in the OpenAI routes' form,
    /// written as those write theirs (calls as the model wrote them, results as one user turn).
    pub fn conversation(&self) -> Result<Vec<Message>, ApiError> {
        let wire = (self.messages.iter().enumerate())
            .map(|(i, message)| {
                refuse_images(&message.images, &format!("messages[{i}].images"))?;
                let calls = message.tool_calls.iter().map(|call| api::WireToolCall {
                    id: None,
                    kind: "function".into(),
                    function: WireCall {
                        name: call.function.name.clone(),
                        arguments: call.function.arguments.to_string(),
                    },
                });
                Ok(ChatMessage {
                    role: message.role.clone(),
                    content: Some(api::Content::Text(message.content.clone())),
                    tool_calls: (!message.tool_calls.is_empty()).then(|| calls.collect()),
                    tool_call_id: None,
                    name: message.tool_name.clone(),
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        api::conversation(&wire)
    }

    /// The tools offered, which the model may call or not (Ollama has no `tool_choice`).
    pub fn toolbox(&self) -> Result<Option<Toolbox>, ApiError> {
        if self.tools.is_empty() {
            return Ok(None);
        }
        let tools = self.tools.iter().map(WireTool::to_tool).collect::<Result<Vec<_>, _>>()?;
        Toolbox::new(tools, ToolChoice::Auto, true).map(Some).map_err(|e| ApiError::invalid(format!("tools: {e}")))
    }
}

/// `POST /api/generate`.
#[derive(Debug, Deserialize)]
pub struct GenerateRequest {
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub prompt: String,
    pub system: Option<String>,
    /// Whether the prompt goes to the model as it is, without the chat template.
    #[serde(default)]
    pub raw: bool,
    pub format: Option<Value>,
    pub options: Option<ModelOptions>,
    #[serde(default = "yes")]
    pub stream: bool,
    pub think: Option<Value>,
    pub suffix: Option<String>,
    pub template: Option<String>,
    #[serde(default)]
    pub images: Vec<Value>,
    pub context: Option<Vec<u32>>,
    #[serde(flatten)]
    pub logprobs: Logprobs,
}

impl GenerateRequest {
    /// What the model continues: the prompt as a user turn (after the system prompt), or as it
    /// is where `raw`; `None` for an empty prompt, which only loads the model.
    pub fn prompt(&self) -> Result<Option<Prompt>, ApiError> {
        refuse_thinking(self.think.as_ref())?;
        refuse_images(&self.images, "images")?;
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix: filling in the middle is not supported"));
        }
        if self.template.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(
                "template: the server renders the model's own chat template (or the one `sift serve --chat-template` \
                 names); send \"raw\": true with a prompt of your own instead",
            ));
        }
        if self.context.as_ref().is_some_and(|c| !c.is_empty()) {
            return Err(ApiError::invalid(
                "context: send the whole conversation as the prompt instead; the server keeps its cache, so what \
                 it has already read is not read again",
            ));
        }
        if self.prompt.is_empty() {
            return Ok(None);
        }
        if self.raw {
            return Ok(Some(Prompt::Text(self.prompt.clone())));
        }
        let system = self.system.iter().filter(|s| !s.is_empty()).map(|s| Message::system(s.clone()));
        Ok(Some(Prompt::Chat(system.chain([Message::user(self.prompt.clone())]).collect())))
    }
}

/// `POST /api/embeddings`, the older form: one text.
#[derive(Debug, Deserialize)]
pub struct LegacyEmbedRequest {
    pub prompt: String,
}

/// `POST /api/show`: `model` (or the older `name`).
#[derive(Debug, Deserialize)]
pub struct ShowRequest {
    pub model: Option<String>,
    pub name: Option<String>,
}

/// What the model's file says of it, for the listing routes: read once, when the server starts.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    /// The file's bytes.
    pub size: usize,
    /// When the file was last changed (Unix seconds).
    pub modified: i64,
    /// A name for the file's content ([`GgufFile::fingerprint`]).
    pub digest: String,
    pub details: Details,
    /// GGUF's keys for the architecture and shape, as Ollama's `model_info` gives them.
    pub info: serde_json::Map<String, Value>,
    /// The model file's path.
    pub path: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Details {
    pub parent_model: String,
    pub format: &'static str,
    pub family: String,
    pub families: Vec<String>,
    pub parameter_size: String,
    pub quantization_level: String,
}

impl ModelFacts {
    pub fn read(file: &GgufFile, model: &Model) -> Self {
        let hp = &model.hp;
        let arch = hp.arch.gguf_name();
        let parameters: usize = file.tensors().iter().map(|t| t.n_elements()).sum();
        let file_type = file.u64("general.file_type").ok().flatten();
        let modified = std::fs::metadata(file.path()).and_then(|m| m.modified()).ok();
        let modified = modified.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
        let mut info = serde_json::Map::new();
        let mut put = |key: String, value: Value| info.insert(key, value);
        put("general.architecture".into(), arch.into());
        put("general.parameter_count".into(), parameters.into());
        if let Some(file_type) = file_type {
            put("general.file_type".into(), file_type.into());
        }
        put(format!("{arch}.context_length"), hp.n_ctx_train.into());
        put(format!("{arch}.embedding_length"), hp.n_embd.into());
        put(format!("{arch}.block_count"), hp.n_layer.into());
        put(format!("{arch}.attention.head_count"), hp.n_head.into());
        put(format!("{arch}.attention.head_count_kv"), hp.n_head_kv.into());
        Self {
            size: file.file_size(),
            modified: i64::try_from(modified).unwrap_or(0),
            digest: file.fingerprint(),
            details: Details {
                parent_model: String::new(),
                format: "gguf",
                family: arch.to_string(),
                families: vec![arch.to_string()],
                parameter_size: parameter_size(parameters),
                quantization_level: file_type.map_or_else(|| "unknown".into(), quantization_level),
            },
            info,
            path: file.path().display().to_string(),
        }
    }
}

/// A parameter count as Ollama writes it: `268.10M`, `8.0B`.
fn parameter_size(n: usize) -> String {
    let n = n as f64;
    match n >= 1e9 {
        true => format!("{:.1}B", n / 1e9),
        false => format!("{:.2}M", n / 1e6),
    }
}

/// The name of a GGUF `general.file_type` (llama.cpp's numbering of its file types).
fn quantization_level(file_type: u64) -> String {
    let name = match file_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        30 => "IQ4_XS",
        32 => "BF16",
        other => return format!("file type {other}"),
    };
    name.to_string()
}

/// A line of a reply, or the whole reply: what the model is, when, the body (a chat's message or
/// a completion's text), and, on the last, how it ended.
#[derive(Debug, Serialize)]
struct Chunk<B> {
    model: String,
    created_at: String,
    #[serde(flatten)]
    body: B,
    /// The log-probabilities of the tokens of this line's text, where they were asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<TokenLogprob>>,
    done: bool,
    #[serde(flatten)]
    end: Option<Done>,
}

/// The last line's account of the reply (durations in nanoseconds).
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Done {
    done_reason: &'static str,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: usize,
    prompt_eval_duration: u64,
    eval_count: usize,
    eval_duration: u64,
}

/// The two kinds of reply: a chat's message and a completion's text.
trait ReplyBody: Serialize + Send + 'static {
    /// A piece of text.
    fn text(text: String) -> Self;
    /// A whole reply: its calls, where the model called `toolbox`'s tools, else its text.
    fn reply(text: String, toolbox: Option<&Toolbox>) -> Self;
}

#[derive(Debug, Serialize)]
struct ChatBody {
    message: ReplyMessage,
}

#[derive(Debug, Serialize)]
struct ReplyMessage {
    role: &'static str,
    content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<WireToolCall>,
}

impl ReplyBody for ChatBody {
    fn text(content: String) -> Self {
        ChatBody { message: ReplyMessage { role: "assistant", content, tool_calls: Vec::new() } }
    }

    fn reply(text: String, toolbox: Option<&Toolbox>) -> Self {
        match toolbox.map(|toolbox| toolbox.read(&text)) {
            Some(Reply::Calls(calls)) => {
                let tool_calls = (calls.into_iter())
                    .map(|call| WireToolCall {
                        function: FunctionCall {
                            // The grammar holds the arguments to a JSON object.
                            arguments: serde_json::from_str(&call.arguments).unwrap_or(Value::Null),
                            name: call.name,
                        },
                    })
                    .collect();
                ChatBody { message: ReplyMessage { role: "assistant", content: String::new(), tool_calls } }
            }
            _ => Self::text(text),
        }
    }
}

#[derive(Debug, Serialize)]
struct GenerateBody {
    response: String,
}

impl ReplyBody for GenerateBody {
    fn text(response: String) -> Self {
        GenerateBody { response }
    }

    fn reply(text: String, _toolbox: Option<&Toolbox>) -> Self {
        Self::text(text)
    }
}

/// What every line of one reply shares.
struct Head {
    model: String,
    begun: Instant,
    prompt_tokens: usize,
    /// Whether the lines carry their tokens' log-probabilities.
    logprobs: bool,
}

impl Head {
    fn new(server: &Server, asked: &str, logprobs: &Logprobs, begun: Instant) -> Self {
        let model = match asked.is_empty() {
            true => listed_name(server),
            false => asked.to_string(),
        };
        Head { model, begun, prompt_tokens: 0, logprobs: logprobs.logprobs }
    }

    /// A line of `body`, whose text the `tokens` make, ending the reply where `end` is given.
    fn chunk<B: ReplyBody>(&self, body: B, tokens: Vec<TokenLogprob>, end: Option<Done>) -> Chunk<B> {
        let created_at = utc_timestamp(i64::try_from(unix_now()).unwrap_or(0));
        let logprobs = self.logprobs.then_some(tokens);
        Chunk { model: self.model.clone(), created_at, body, logprobs, done: end.is_some(), end }
    }

    fn done(&self, finished: &Finished) -> Done {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Done {
            done_reason: finish_reason(finished.stop),
            total_duration: nanos(self.begun.elapsed()),
            load_duration: 0,
            prompt_eval_count: self.prompt_tokens,
            prompt_eval_duration: nanos(finished.prefill_time),
            eval_count: finished.completion_tokens,
            eval_duration: nanos(finished.decode_time),
        }
    }

    /// The answer to a request that only loads the model.
    fn loaded<B: ReplyBody>(&self) -> Response {
        let end = Done { done_reason: "load", ..Done::default() };
        Json(self.chunk(B::text(String::new()), Vec::new(), Some(end))).into_response()
    }
}

/// The model's name in the listings: the server's, tagged `latest` where it has no tag.
fn listed_name(server: &Server) -> String {
    let name = &server.config.model_id;
    match name.contains(':') {
        true => name.clone(),
        false => format!("{name}:latest"),
    }
}

/// `POST /api/chat`.
pub(super) async fn chat(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let begun = Instant::now();
    let handle = async {
        let request: ChatRequest = parse(body)?;
        refuse_thinking(request.think.as_ref())?;
        let head = Head::new(&server, &request.model, &request.logprobs, begun);
        if request.messages.is_empty() {
            return Ok(head.loaded::<ChatBody>());
        }
        let toolbox = request.toolbox()?;
        let mut messages = request.conversation()?;
        let format = response_format(request.format.as_ref())?;
        if toolbox.is_some() && format.is_some() {
            return Err(ApiError::invalid("tools and format cannot both shape a reply: send one"));
        }
        let options = request.options.unwrap_or_default();
        let mut params = options.params(format, &request.logprobs, &server.config.defaults, server.n_vocab)?;
        if let Some(toolbox) = &toolbox {
            messages = offer_tools(toolbox, messages, &mut params);
        }
        reply::<ChatBody>(&server, head, Prompt::Chat(messages), params, toolbox, request.stream).await
    };
    handle.await.unwrap_or_else(error_response)
}

/// `POST /api/generate`.
pub(super) async fn generate(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let begun = Instant::now();
    let handle = async {
        let request: GenerateRequest = parse(body)?;
        let head = Head::new(&server, &request.model, &request.logprobs, begun);
        let Some(prompt) = request.prompt()? else {
            return Ok(head.loaded::<GenerateBody>());
        };
        let format = response_format(request.format.as_ref())?;
        let options = request.options.unwrap_or_default();
        let params = options.params(format, &request.logprobs, &server.config.defaults, server.n_vocab)?;
        reply::<GenerateBody>(&server, head, prompt, params, None, request.stream).await
    };
    handle.await.unwrap_or_else(error_response)
}

/// Queues the job, waits for the model to take it, and answers whole or as lines.
async fn reply<B: ReplyBody>(
    server: &Server,
    mut head: Head,
    prompt: Prompt,
    params: Params,
    toolbox: Option<Toolbox>,
    stream: bool,
) -> Result<Response, ApiError> {
    let mut events = server.queue.submit(prompt, params)?;
    head.prompt_tokens = started(&mut events).await?.prompt_tokens;
    if stream {
        return Ok(lines::<B>(head, toolbox, events));
    }
    let Gathered { text, tokens, finished } = gather(events).await?;
    Ok(Json(head.chunk(B::reply(text, toolbox.as_ref()), tokens, Some(head.done(&finished)))).into_response())
}

/// A reply as one JSON object a line, by a task that ends when the client goes away: a line per
/// piece of text, then the last line. A reply that may be calls is held until it ends, then sent
/// as one line.
fn lines<B: ReplyBody>(head: Head, toolbox: Option<Toolbox>, events: UnboundedReceiver<Event>) -> Response {
    let (lines, body) = channel::<Result<Bytes, Infallible>>(64);
    let mut relay = Relay::new(events, toolbox);
    tokio::spawn(async move {
        let send = |line: String| {
            let lines = lines.clone();
            async move { lines.send(Ok(Bytes::from(line + "\n"))).await.is_ok() }
        };
        // The log-probabilities of the tokens whose text is not sent yet.
        let mut unsent = Vec::new();
        while let Some(relayed) = relay.next(lines.closed()).await {
            let sent = match relayed {
                Relayed::Token(token) => {
                    unsent.push(token);
                    true
                }
                Relayed::Text(text) => send(json(&head.chunk(B::text(text), std::mem::take(&mut unsent), None))).await,
                Relayed::Finished { held, finished } => {
                    let held = held.map(|text| {
                        json(&head.chunk(B::reply(text, relay.toolbox()), std::mem::take(&mut unsent), None))
                    });
                    let last = json(&head.chunk(B::text(String::new()), unsent, Some(head.done(&finished))));
                    for line in held.into_iter().chain([last]) {
                        if !send(line).await {
                            break;
                        }
                    }
                    return;
                }
                Relayed::Failed(e) => {
                    send(json(&ErrorBody::of(&e))).await;
                    return;
                }
            };
            if !sent {
                return;
            }
        }
    });
    let mut response = Body::from_stream(ReceiverStream::new(body)).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    response
}

/// The answer of `/api/embed` (its vectors written as f32, as `/v1/embeddings` writes them).
#[derive(Debug, Serialize)]
struct Embedded {
    model: String,
    embeddings: Vec<Vec<f32>>,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: usize,
}

/// The answer of `/api/embeddings`.
#[derive(Debug, Serialize)]
struct EmbeddedOne {
    embedding: Vec<f32>,
}

/// `POST /api/embed`: `input` (a text or texts), one unit-length vector each.
pub(super) async fn embed_texts(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let begun = Instant::now();
    let handle = async {
        let request: EmbeddingRequest = parse(body)?;
        let (inputs, _) = request.inputs(server.n_embd)?;
        let (embeddings, tokens) = embed(&server, inputs).await?;
        let total_duration = u64::try_from(begun.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let model = listed_name(&server);
        let embedded = Embedded { model, embeddings, total_duration, load_duration: 0, prompt_eval_count: tokens };
        Ok(Json(embedded).into_response())
    };
    handle.await.unwrap_or_else(error_response)
}

/// `POST /api/embeddings`: `prompt`, one text, its vector as `embedding`.
pub(super) async fn embed_one(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: LegacyEmbedRequest = parse(body)?;
        let request =
            EmbeddingRequest { input: EmbeddingInput::One(request.prompt), encoding_format: None, dimensions: None };
        let (inputs, _) = request.inputs(server.n_embd)?;
        let (mut embeddings, _) = embed(&server, inputs).await?;
        Ok(Json(EmbeddedOne { embedding: embeddings.pop().unwrap_or_default() }).into_response())
    };
    handle.await.unwrap_or_else(error_response)
}

/// The model as the listings show it.
#[derive(Debug, Serialize)]
struct Listed<'a> {
    name: String,
    model: String,
    modified_at: String,
    size: usize,
    digest: &'a str,
    details: &'a Details,
}

impl<'a> Listed<'a> {
    fn of(server: &'a Server) -> Self {
        let facts = &server.config.facts;
        Listed {
            name: listed_name(server),
            model: listed_name(server),
            modified_at: utc_timestamp(facts.modified),
            size: facts.size,
            digest: &facts.digest,
            details: &facts.details,
        }
    }
}

/// `GET /api/tags`: the model served.
pub(super) async fn tags(State(server): State<Arc<Server>>) -> Response {
    Json(serde_json::json!({ "models": [Listed::of(&server)] })).into_response()
}

/// `GET /api/ps`: the model served, which stays loaded as long as the server runs.
pub(super) async fn running(State(server): State<Arc<Server>>) -> Response {
    let mut listed = serde_json::to_value(Listed::of(&server)).expect("plain data");
    listed["expires_at"] = "9999-12-31T23:59:59Z".into();
    listed["size_vram"] = 0.into();
    listed["context_length"] = server.n_ctx.into();
    Json(serde_json::json!({ "models": [listed] })).into_response()
}

/// `GET /api/version`: sift's own version.
pub(super) async fn version() -> Response {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

/// `POST /api/show`: the model's details, its architecture's numbers, its chat template and the
/// server's default sampling; 404 for another model's name.
pub(super) async fn show(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: ShowRequest = parse(body)?;
        let asked = request.model.or(request.name).unwrap_or_default();
        let id = &server.config.model_id;
        if asked != *id && asked != listed_name(&server) {
            return Err(ApiError { message: format!("model '{asked}' not found"), ..ApiError::not_found("") });
        }
        let facts = &server.config.facts;
        let params = &server.props.default_generation_settings.params;
        let parameters = format!(
            "temperature {}\ntop_k {}\ntop_p {}\nmin_p {}\nrepeat_penalty {}\nnum_predict {}\nnum_ctx {}",
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            params.repeat_penalty,
            params.n_predict,
            server.n_ctx
        );
        let modelfile = format!(
            "FROM {}\n{}\n",
            facts.path,
            parameters.lines().map(|line| format!("PARAMETER {line}")).collect::<Vec<_>>().join("\n")
        );
        Ok(Json(serde_json::json!({
            "modelfile": modelfile,
            "parameters": parameters,
            "template": server.props.chat_template,
            "details": facts.details,
            "model_info": facts.info,
            "capabilities": ["completion", "tools"],
            "modified_at": utc_timestamp(facts.modified),
        }))
        .into_response())
    };
    handle.await.unwrap_or_else(error_response)
}

/// `/api/pull`, `/api/push`, `/api/create`, `/api/copy` and `/api/delete`: a server serves the
/// one model file it was started with, so these are a 501 that says so.
pub(super) async fn unmanaged(State(server): State<Arc<Server>>) -> Response {
    let message = format!(
        "sift serves the one model it was started with ({}) and manages no others; start `sift serve -m FILE` to \
         serve another GGUF file",
        listed_name(&server)
    );
    error_response(ApiError { status: axum::http::StatusCode::NOT_IMPLEMENTED, ..ApiError::invalid(message) })
}

/// An error as Ollama writes it.
#[derive(Debug, Serialize)]
struct ErrorBody {
    error: String,
}

impl ErrorBody {
    fn of(e: &ApiError) -> Self {
        ErrorBody { error: e.message.clone() }
    }
}

/// `e` as Ollama's API answers it, with `e`'s status (and `Retry-After`).
pub fn error_response(e: ApiError) -> Response {
    e.respond(ErrorBody::of(&e))
}
