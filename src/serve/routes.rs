//! The HTTP side: routes, the API key, bodies read as JSON, and responses whole or streamed.
//!
//! A streamed response is a task that turns the worker's [`Event`]s into server-sent events: a
//! first chunk with the assistant's role, one chunk per piece of text, a last chunk with the
//! finish reason (and sift's extension), the usage when asked for, and `data: [DONE]`. A reply
//! that may be [tool calls](crate::tools) is held back until it ends, and its calls go in one
//! chunk (or its text, if it turned out to be text). When the client goes away the task's sends
//! fail, it ends, and its end of the worker's channel closes.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Serialize;
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{channel, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;

use super::anthropic::{
    self, ContentBlock, ErrorDetail, MessageResponse, MessageUsage, MessagesRequest, OutputUsage, StopDelta,
    StreamEvent,
};
use super::api::{
    finish_reason, AssistantMessage, ChatChoice, ChatLogprobs, ChatRequest, ChunkChoice, Completion, CompletionRequest,
    Delta, DetokenizeRequest, Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage, EmbeddingVector,
    IndexedToolCall, ModelCard, ModelList, Options, Params, Props, ResponseFormat, SiftExtension, TextChoice,
    TextLogprobs, TokenLogprob, TokenizeRequest, Usage, WireCall, WireToolCall,
};
use super::error::ApiError;
use super::worker::{EmbedInput, Event, Finished, Prompt, Queue};
use super::{llamacpp, ollama, responses};
use super::{Config, ServeError};
use crate::chat::Message;
use crate::tokenizer::Tokenizer;
use crate::tools::{with_instructions, Reply, ToolChoice, Toolbox};

/// The chat page: one HTML file, its CSS and JS inline.
const PAGE: &str = include_str!("page.html");

pub(super) struct Server {
    pub(super) queue: Queue,
    /// The model's tokenizer, for `/tokenize` and `/detokenize` (a copy of the worker's: these
    /// routes do not wait for the model).
    tokenizer: Tokenizer,
    /// What `/props` answers, made once.
    pub(super) props: Props,
    pub(super) config: Config,
    pub(super) n_ctx: usize,
    /// For the token ids of `logit_bias`.
    pub(super) n_vocab: usize,
    /// The length of an embedding.
    pub(super) n_embd: usize,
    /// The responses of `/v1/responses` kept for the requests that go on from them.
    pub(super) responses: Arc<responses::Store>,
    started: u64,
    next_id: AtomicU64,
}

/// Serves HTTP on `listener` until Ctrl-C or SIGTERM.
pub fn run(
    listener: std::net::TcpListener,
    queue: Queue,
    config: Config,
    (tokenizer, props): (Tokenizer, Props),
    n_ctx: usize,
    (n_vocab, n_embd): (usize, usize),
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(ServeError::Runtime)?;
    let max_body = config.max_body;
    let cors = config.origins.layer();
    let server = Arc::new(Server {
        queue,
        tokenizer,
        props,
        config,
        n_ctx,
        n_vocab,
        n_embd,
        responses: Arc::default(),
        started: unix_now(),
        next_id: AtomicU64::new(1),
    });
    let app = Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/health", get(|| async { Json(serde_json::json!({ "status": "ok" })) }))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/props", get(properties))
        .route("/completion", post(llamacpp::complete))
        .route("/completions", post(llamacpp::complete))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed_texts))
        .route("/api/embeddings", post(ollama::embed_one))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::running))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .route("/api/pull", post(ollama::unmanaged))
        .route("/api/push", post(ollama::unmanaged))
        .route("/api/create", post(ollama::unmanaged))
        .route("/api/copy", post(ollama::unmanaged))
        .route("/api/delete", delete(ollama::unmanaged))
        .fallback(|uri: Uri| async move {
            match uri.path().starts_with("/api/") {
                true => ollama::error_response(ApiError::not_found(uri.path())),
                false => ApiError::not_found(uri.path()).into_response(),
            }
        })
        .layer(middleware::from_fn_with_state(server.clone(), authorize))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(cors)
        .with_state(server);
    runtime.block_on(async move {
        listener.set_nonblocking(true).map_err(ServeError::Runtime)?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(ServeError::Runtime)?;
        axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await.map_err(ServeError::Http)
    })
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(signal) => signal,
        Err(_) => {
            let _ = interrupt.await;
            return;
        }
    };
    tokio::select! {
        _ = interrupt => {}
        _ = terminate.recv() => {}
    }
}

/// With an API key set, every route but `/health` and the page needs it as a bearer token.
async fn authorize(State(server): State<Arc<Server>>, request: Request, next: Next) -> Response {
    let open = matches!(request.uri().path(), "/" | "/health");
    if let (Some(key), false) = (&server.config.api_key, open) {
        let headers = request.headers();
        let text = |name| headers.get(name).and_then(|value: &header::HeaderValue| value.to_str().ok());
        // OpenAI's clients send the key as a bearer token, Anthropic's as `x-api-key`.
        let given = text(header::AUTHORIZATION.as_str())
            .and_then(|value| value.strip_prefix("Bearer "))
            .or_else(|| text("x-api-key"))
            .unwrap_or("");
        // Constant time in the key's content (a length that differs fails at once).
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return match request.uri().path() {
                "/v1/messages" => anthropic::error_response(ApiError::unauthorized()),
                path if path.starts_with("/api/") => ollama::error_response(ApiError::unauthorized()),
                _ => ApiError::unauthorized().into_response(),
            };
        }
    }
    next.run(request).await
}

async fn models(State(server): State<Arc<Server>>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![server.card()] })
}

async fn model(State(server): State<Arc<Server>>, Path(asked): Path<String>) -> Result<Json<ModelCard>, ApiError> {
    match asked == server.config.model_id {
        true => Ok(Json(server.card())),
        false => Err(ApiError::model_not_found(&asked, &server.config.model_id)),
    }
}

impl Server {
    fn card(&self) -> ModelCard {
        ModelCard {
            id: self.config.model_id.clone(),
            object: "model",
            created: self.started,
            owned_by: "sift",
            x_sift_n_ctx: self.n_ctx,
        }
    }

    pub(super) fn new_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:x}-{}", self.started, self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

/// A JSON body, or the 400 (or 413) that says why it is not one.
pub(super) fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..ApiError::invalid(format!("the request body is larger than the limit: {}", rejection.body_text()))
        },
        _ => ApiError::invalid(rejection.body_text()),
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("the body is not a valid request: {e}")))
}

async fn chat_completions(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: ChatRequest = parse(body)?;
        if request.messages.is_empty() {
            return Err(ApiError::invalid("messages: at least one message is needed"));
        }
        let toolbox = request.toolbox()?;
        let mut messages = request.conversation()?;
        let top = request.top_logprobs()?;
        let mut params = request.options.params(&server.config.defaults, top, server.n_vocab)?;
        if let Some(toolbox) = &toolbox {
            if !matches!(request.options.response_format, None | Some(ResponseFormat::Text)) {
                return Err(ApiError::invalid("tools and response_format cannot both shape a reply: send one"));
            }
            messages = offer_tools(toolbox, messages, &mut params);
        }
        complete::<Chat>(&server, Prompt::Chat(messages), params, &request.options, toolbox).await
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `messages` with `toolbox`'s tools offered to the model, and `params` holding the reply to
/// text or calls of them.
pub(super) fn offer_tools(toolbox: &Toolbox, messages: Vec<Message>, params: &mut Params) -> Vec<Message> {
    params.format = Some(toolbox.format());
    params.format_field = "tools";
    with_instructions(messages, toolbox)
}

async fn completions(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: CompletionRequest = parse(body)?;
        let top = request.top_logprobs()?;
        let prompt = request.prompt.into_text()?;
        let params = request.options.params(&server.config.defaults, top, server.n_vocab)?;
        complete::<Text>(&server, Prompt::Text(prompt), params, &request.options, None).await
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

async fn embeddings(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: EmbeddingRequest = parse(body)?;
        let (inputs, base64) = request.inputs(server.n_embd)?;
        let (vectors, tokens) = embed(&server, inputs).await?;
        let data = (vectors.into_iter().enumerate())
            .map(|(index, vector)| Embedding {
                object: "embedding",
                index,
                embedding: EmbeddingVector::new(vector, base64),
            })
            .collect();
        let usage = EmbeddingUsage { prompt_tokens: tokens, total_tokens: tokens };
        let list = EmbeddingList { object: "list", data, model: server.config.model_id.clone(), usage };
        Ok(Json(list).into_response())
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// Queues the embedding of `inputs` and waits for their vectors, and their tokens' count.
pub(super) async fn embed(server: &Server, inputs: Vec<EmbedInput>) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let mut events = server.queue.submit(Prompt::Embed(inputs), server.config.defaults.clone())?;
    match events.recv().await {
        Some(Event::Embedded { vectors, tokens }) => Ok((vectors, tokens)),
        Some(Event::Failed(e)) => Err(e),
        Some(_) => Err(out_of_order()),
        None => Err(ApiError::shutting_down()),
    }
}

/// `POST /tokenize`: the content's tokens (llama.cpp's route), on a thread of the blocking
/// pool, so that a long text does not hold up the replies being streamed.
async fn tokenize(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: TokenizeRequest = parse(body)?;
        let tokens = tokio::task::spawn_blocking(move || request.tokenize(&server.tokenizer))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizing: {e}")))??;
        Ok(Json(tokens).into_response())
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `POST /v1/messages`: Anthropic's Messages API ([`anthropic`]), whole or streamed.
async fn messages(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: MessagesRequest = parse(body)?;
        let toolbox = request.toolbox()?;
        let mut conversation = request.conversation()?;
        let mut params = request.params(&server.config.defaults, server.n_vocab)?;
        if let Some(toolbox) = &toolbox {
            conversation = offer_tools(toolbox, conversation, &mut params);
        }
        let stops = params.stop.clone();
        let mut events = server.queue.submit(Prompt::Chat(conversation), params)?;
        let usage = started(&mut events).await?;
        let message = MessageResponse {
            id: server.new_id("msg"),
            kind: "message",
            role: "assistant",
            model: server.config.model_id.clone(),
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage {
                input_tokens: usage.prompt_tokens,
                output_tokens: 0,
                cache_read_input_tokens: usage.prompt_tokens_details.cached_tokens,
            },
        };
        if request.stream {
            return Ok(stream_message(message, stops, toolbox, events));
        }
        let Gathered { text, finished, .. } = gather(events).await?;
        let (content, called) = ContentBlock::reply(text, toolbox.as_ref(), &message.id);
        let (stop_reason, stop_sequence) = anthropic::stop_reason(&finished, &stops, called);
        let usage = MessageUsage { output_tokens: finished.completion_tokens, ..message.usage };
        Ok(Json(MessageResponse { content, stop_reason: Some(stop_reason), stop_sequence, usage, ..message })
            .into_response())
    };
    handle.await.unwrap_or_else(anthropic::error_response)
}

/// `GET /props`: the context size, the template, the default sampling (llama.cpp's route).
async fn properties(State(server): State<Arc<Server>>) -> Response {
    Json(&server.props).into_response()
}

/// `POST /detokenize`: the tokens' text (llama.cpp's route).
async fn detokenize(State(server): State<Arc<Server>>, body: Result<Bytes, BytesRejection>) -> Response {
    let handle = async {
        let request: DetokenizeRequest = parse(body)?;
        Ok(Json(request.detokenize(&server.tokenizer)?).into_response())
    };
    handle.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// Queues the job, waits for the model to take it, and answers whole or as a stream.
async fn complete<K: Kind>(
    server: &Server,
    prompt: Prompt,
    params: Params,
    options: &Options,
    toolbox: Option<Toolbox>,
) -> Result<Response, ApiError> {
    let logprobs = params.top_logprobs.is_some();
    let mut events = server.queue.submit(prompt, params)?;
    let usage = started(&mut events).await?;
    let answer = Answer {
        id: server.new_id(K::ID_PREFIX),
        created: unix_now(),
        model: server.config.model_id.clone(),
        usage,
        logprobs,
        include_usage: options.include_usage(),
        toolbox,
    };
    if options.stream {
        return Ok(stream::<K>(answer, events));
    }
    let gathered = gather(events).await?;
    let usage = completed(answer.usage, &gathered.finished);
    Ok(Json(answer.completion(K::OBJECT, vec![K::whole(&answer, gathered)], Some(usage))).into_response())
}

/// Waits for the worker to take the job: the usage so far (prompt and cached tokens), or why the
/// job cannot be served.
pub(super) async fn started(events: &mut UnboundedReceiver<Event>) -> Result<Usage, ApiError> {
    match events.recv().await {
        Some(Event::Started { prompt_tokens, cached_tokens }) => Ok(Usage::new(prompt_tokens, cached_tokens, 0)),
        Some(Event::Failed(e)) => Err(e),
        Some(_) => Err(out_of_order()),
        None => Err(ApiError::shutting_down()),
    }
}

/// The rest of a job, gathered: its text, its tokens' log-probabilities, how it finished.
pub(super) struct Gathered {
    pub(super) text: String,
    pub(super) tokens: Vec<TokenLogprob>,
    pub(super) finished: Finished,
}

pub(super) async fn gather(mut events: UnboundedReceiver<Event>) -> Result<Gathered, ApiError> {
    let (mut text, mut tokens) = (String::new(), Vec::new());
    while let Some(event) = events.recv().await {
        match event {
            Event::Text(piece) => text += &piece,
            Event::Token(token) => tokens.push(token),
            Event::Finished(finished) => return Ok(Gathered { text, tokens, finished }),
            Event::Failed(e) => return Err(e),
            Event::Embedded { .. } => return Err(out_of_order()),
            Event::Started { .. } => {}
        }
    }
    Err(ApiError::shutting_down())
}

fn extension(finished: &Finished) -> SiftExtension {
    SiftExtension {
        attention: finished.attention,
        prefill_tok_s: finished.prefill_tok_s,
        decode_tok_s: finished.decode_tok_s,
        rectifications: finished.rectifications,
        rectify_share: finished.rectify_share,
    }
}

fn completed(usage: Usage, finished: &Finished) -> Usage {
    Usage::new(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, finished.completion_tokens)
}

/// A request taken by the model: what its response says besides the text.
struct Answer {
    id: String,
    created: u64,
    model: String,
    /// The prompt's tokens, and those of them the cache held.
    usage: Usage,
    logprobs: bool,
    /// Whether a stream ends with a chunk of usage.
    include_usage: bool,
    /// The tools the reply may call.
    toolbox: Option<Toolbox>,
}

impl Answer {
    /// The reply's calls, if the model called tools, with their ids.
    fn calls(&self, text: &str) -> Option<Vec<WireToolCall>> {
        match self.toolbox.as_ref()?.read(text) {
            Reply::Text(_) => None,
            Reply::Calls(calls) => Some(
                calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, call)| WireToolCall {
                        id: Some(format!("call{}-{i}", self.id.trim_start_matches(Chat::ID_PREFIX))),
                        kind: "function".into(),
                        function: WireCall { name: call.name, arguments: call.arguments },
                    })
                    .collect(),
            ),
        }
    }

    fn completion<C>(&self, object: &'static str, choices: Vec<C>, usage: Option<Usage>) -> Completion<C> {
        Completion { id: self.id.clone(), object, created: self.created, model: self.model.clone(), choices, usage }
    }
}

/// The two kinds of completion, chat and text: how each writes its choice, whole or in chunks.
trait Kind {
    type Whole: Serialize;
    type Chunk: Serialize + Send;
    const ID_PREFIX: &'static str;
    /// The `object` of a whole response, and of a stream's chunks.
    const OBJECT: &'static str;
    const CHUNK_OBJECT: &'static str;
    fn whole(answer: &Answer, gathered: Gathered) -> Self::Whole;
    /// The chunk that opens a stream, if the kind has one.
    fn opening() -> Option<Self::Chunk>;
    /// A piece of text, with the log-probabilities of the tokens it completes.
    fn text(answer: &Answer, text: String, tokens: Vec<TokenLogprob>) -> Self::Chunk;
    /// A reply held back whole ([`Answer::holds`]): its calls, or else its text; and whether it
    /// called tools. Only chat replies can be calls.
    fn held(answer: &Answer, text: String, tokens: Vec<TokenLogprob>) -> (Self::Chunk, bool) {
        (Self::text(answer, text, tokens), false)
    }
    /// The chunk that closes a stream; `called`: the reply was calls.
    fn last(finished: &Finished, called: bool) -> Self::Chunk;
}

/// `/v1/chat/completions`.
struct Chat;

impl Kind for Chat {
    type Whole = ChatChoice;
    type Chunk = ChunkChoice;
    const ID_PREFIX: &'static str = "chatcmpl";
    const OBJECT: &'static str = "chat.completion";
    const CHUNK_OBJECT: &'static str = "chat.completion.chunk";

    fn whole(answer: &Answer, Gathered { text, tokens, finished }: Gathered) -> ChatChoice {
        let calls = answer.calls(&text);
        ChatChoice {
            index: 0,
            finish_reason: chat_finish(&finished, calls.is_some()),
            message: match calls {
                Some(calls) => AssistantMessage { role: "assistant", content: None, tool_calls: Some(calls) },
                None => AssistantMessage { role: "assistant", content: Some(text), tool_calls: None },
            },
            logprobs: answer.logprobs.then_some(ChatLogprobs { content: tokens }),
            x_sift: extension(&finished),
        }
    }

    fn opening() -> Option<ChunkChoice> {
        let delta = Delta { role: Some("assistant"), content: Some(String::new()), tool_calls: None };
        Some(ChunkChoice { index: 0, delta, logprobs: None, finish_reason: None, x_sift: None })
    }

    fn text(answer: &Answer, text: String, tokens: Vec<TokenLogprob>) -> ChunkChoice {
        ChunkChoice {
            index: 0,
            delta: Delta { role: None, content: Some(text), tool_calls: None },
            logprobs: answer.logprobs.then_some(ChatLogprobs { content: tokens }),
            finish_reason: None,
            x_sift: None,
        }
    }

    fn held(answer: &Answer, text: String, tokens: Vec<TokenLogprob>) -> (ChunkChoice, bool) {
        let Some(calls) = answer.calls(&text) else {
            return (Self::text(answer, text, tokens), false);
        };
        let calls = calls.into_iter().enumerate().map(|(index, call)| IndexedToolCall { index, call }).collect();
        let chunk = ChunkChoice {
            delta: Delta { role: None, content: None, tool_calls: Some(calls) },
            ..Self::text(answer, String::new(), tokens)
        };
        (chunk, true)
    }

    fn last(finished: &Finished, called: bool) -> ChunkChoice {
        ChunkChoice {
            index: 0,
            delta: Delta::default(),
            logprobs: None,
            finish_reason: Some(chat_finish(finished, called)),
            x_sift: Some(extension(finished)),
        }
    }
}

/// A chat reply's `finish_reason`: `tool_calls` where it called tools.
fn chat_finish(finished: &Finished, called: bool) -> &'static str {
    if called {
        "tool_calls"
    } else {
        finish_reason(finished.stop)
    }
}

/// `/v1/completions`: a whole response and its chunks have the same shape.
struct Text;

impl Kind for Text {
    type Whole = TextChoice;
    type Chunk = TextChoice;
    const ID_PREFIX: &'static str = "cmpl";
    const OBJECT: &'static str = "text_completion";
    const CHUNK_OBJECT: &'static str = "text_completion";

    fn whole(answer: &Answer, Gathered { text, tokens, finished }: Gathered) -> TextChoice {
        TextChoice {
            finish_reason: Some(finish_reason(finished.stop)),
            x_sift: Some(extension(&finished)),
            ..Self::text(answer, text, tokens)
        }
    }

    fn opening() -> Option<TextChoice> {
        None
    }

    fn text(answer: &Answer, text: String, tokens: Vec<TokenLogprob>) -> TextChoice {
        let logprobs = answer.logprobs.then(|| {
            let mut all = TextLogprobs::default();
            tokens.iter().for_each(|token| all.push(token));
            all
        });
        TextChoice { index: 0, text, logprobs, finish_reason: None, x_sift: None }
    }

    fn last(finished: &Finished, _called: bool) -> TextChoice {
        TextChoice {
            index: 0,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(finish_reason(finished.stop)),
            x_sift: Some(extension(finished)),
        }
    }
}

/// A reply's events as a stream sends them: its text as it comes, except a reply that may be
/// calls of the request's tools, which is held back whole until it ends; a stream's task reads
/// them until the client goes away.
pub(super) struct Relay {
    events: UnboundedReceiver<Event>,
    toolbox: Option<Toolbox>,
    /// The reply held back, from its first text on.
    held: Option<String>,
    /// Whether some text has been passed on (the reply is then text, whatever follows).
    passed: bool,
}

/// What a [`Relay`] passes on.
pub(super) enum Relayed {
    /// Text to send now.
    Text(String),
    /// A token's log-probabilities, when the request asked for them; they come before the text
    /// that holds the token.
    Token(TokenLogprob),
    /// The reply's end: the text held back (all of it), if it was, and how the reply finished.
    Finished {
        held: Option<String>,
        finished: Finished,
    },
    Failed(ApiError),
}

impl Relay {
    pub(super) fn new(events: UnboundedReceiver<Event>, toolbox: Option<Toolbox>) -> Self {
        Relay { events, toolbox, held: None, passed: false }
    }

    /// The tools the reply may call.
    pub(super) fn toolbox(&self) -> Option<&Toolbox> {
        self.toolbox.as_ref()
    }

    /// The next thing to send, or `None` once the reply is over or `closed` (the client's end
    /// going away) resolves.
    pub(super) async fn next(&mut self, closed: impl std::future::Future<Output = ()>) -> Option<Relayed> {
        tokio::pin!(closed);
        loop {
            let event = tokio::select! {
                event = self.events.recv() => event,
                () = &mut closed => None,
            }?;
            match event {
                Event::Started { .. } => {}
                Event::Token(token) => return Some(Relayed::Token(token)),
                // (An empty piece says nothing of the reply's first byte.)
                Event::Text(text) if text.is_empty() => {}
                Event::Text(text) => match &mut self.held {
                    Some(held) => *held += &text,
                    None if !self.passed && holds(self.toolbox.as_ref(), &text) => self.held = Some(text),
                    None => {
                        self.passed = true;
                        return Some(Relayed::Text(text));
                    }
                },
                Event::Finished(finished) => return Some(Relayed::Finished { held: self.held.take(), finished }),
                Event::Failed(e) => return Some(Relayed::Failed(e)),
                Event::Embedded { .. } => return Some(Relayed::Failed(out_of_order())),
            }
        }
    }
}

/// A reply as unnamed server-sent events (`data:` lines), by a task that ends when the client
/// goes away or the reply is over: the `opening` events, then those `data` makes of each relayed
/// event, saying whether that was the last.
pub(super) fn data_events(
    mut relay: Relay,
    opening: Vec<String>,
    mut data: impl FnMut(Relayed) -> (Vec<String>, bool) + Send + 'static,
) -> Response {
    let (sse, body) = channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let send = |data: String| {
            let sse = sse.clone();
            async move { sse.send(Ok(SseEvent::default().data(data))).await.is_ok() }
        };
        for event in opening {
            if !send(event).await {
                return;
            }
        }
        // A client that leaves closes the body: this task ends, and with it the worker's
        // channel, at once, even while no event comes (a long prompt's prefill).
        while let Some(relayed) = relay.next(sse.closed()).await {
            let (events, last) = data(relayed);
            for event in events {
                if !send(event).await {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(body)).keep_alive(KeepAlive::default()).into_response()
}

/// A completion's chunks as server-sent events, then `[DONE]`.
fn stream<K: Kind>(answer: Answer, events: UnboundedReceiver<Event>) -> Response {
    let relay = Relay::new(events, answer.toolbox.clone());
    let chunk =
        |answer: &Answer, choices: Vec<K::Chunk>, usage| json(&answer.completion(K::CHUNK_OBJECT, choices, usage));
    let opening = K::opening().map(|opening| chunk(&answer, vec![opening], None)).into_iter().collect();
    let mut tokens = Vec::new();
    data_events(relay, opening, move |relayed| match relayed {
        Relayed::Token(token) => {
            tokens.push(token);
            (Vec::new(), false)
        }
        Relayed::Text(text) => {
            (vec![chunk(&answer, vec![K::text(&answer, text, std::mem::take(&mut tokens))], None)], false)
        }
        Relayed::Finished { held, finished } => {
            let (reply, called) = match held {
                Some(text) => {
                    let (reply, called) = K::held(&answer, text, std::mem::take(&mut tokens));
                    (Some(chunk(&answer, vec![reply], None)), called)
                }
                None => (None, false),
            };
            let last = chunk(&answer, vec![K::last(&finished, called)], None);
            let usage = completed(answer.usage, &finished);
            let usage = answer.include_usage.then(|| chunk(&answer, Vec::new(), Some(usage)));
            ([reply, Some(last), usage, Some("[DONE]".to_string())].into_iter().flatten().collect(), true)
        }
        Relayed::Failed(e) => (vec![json(&e.body())], true),
    })
}

/// A Messages API reply as Anthropic's named server-sent events: the message (empty), its text
/// block opened at its first text, a delta per piece of text, the block closed, the stop reason
/// and tokens generated, the end. A reply that may be calls is held until it ends, then sent as
/// its blocks (a start, one delta and a stop each). As [`stream`], it ends when the client goes
/// away.
fn stream_message(
    message: MessageResponse,
    stops: Vec<String>,
    toolbox: Option<Toolbox>,
    events: UnboundedReceiver<Event>,
) -> Response {
    let (sse, body) = channel::<Result<SseEvent, Infallible>>(64);
    let mut relay = Relay::new(events, toolbox);
    tokio::spawn(async move {
        let send = |event: StreamEvent| {
            let sse = sse.clone();
            async move { sse.send(Ok(SseEvent::default().event(event.name()).data(json(&event)))).await.is_ok() }
        };
        let id = message.id.clone();
        if !send(StreamEvent::MessageStart { message }).await {
            return;
        }
        // Whether the text block has been opened.
        let mut open = false;
        while let Some(relayed) = relay.next(sse.closed()).await {
            let sent = match relayed {
                Relayed::Token(_) => true,
                Relayed::Text(text) => {
                    let mut sent = true;
                    if !open {
                        open = true;
                        let block = ContentBlock::Text { text: String::new() };
                        sent = send(StreamEvent::ContentBlockStart { index: 0, content_block: block }).await;
                    }
                    let delta = anthropic::Delta::TextDelta { text };
                    sent && send(StreamEvent::ContentBlockDelta { index: 0, delta }).await
                }
                Relayed::Finished { held, finished } => {
                    let (mut closing, mut called) = (Vec::new(), false);
                    match held {
                        Some(text) => {
                            let (blocks, calls) = ContentBlock::reply(text, relay.toolbox(), &id);
                            called = calls;
                            closing.extend(blocks.into_iter().enumerate().flat_map(|(i, b)| StreamEvent::block(i, b)));
                        }
                        None if open => closing.push(StreamEvent::ContentBlockStop { index: 0 }),
                        // An empty reply: one empty text block.
                        None => closing.extend(StreamEvent::block(0, ContentBlock::Text { text: String::new() })),
                    }
                    let (stop_reason, stop_sequence) = anthropic::stop_reason(&finished, &stops, called);
                    closing.push(StreamEvent::MessageDelta {
                        delta: StopDelta { stop_reason, stop_sequence },
                        usage: OutputUsage { output_tokens: finished.completion_tokens },
                    });
                    closing.push(StreamEvent::MessageStop);
                    for event in closing {
                        if !send(event).await {
                            break;
                        }
                    }
                    return;
                }
                Relayed::Failed(e) => {
                    send(StreamEvent::Error { error: ErrorDetail::of(&e) }).await;
                    return;
                }
            };
            if !sent {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(body)).keep_alive(KeepAlive::default()).into_response()
}

/// Whether a reply whose text opens with `first` waits for its end before it is sent: where it
/// may be calls of `toolbox`'s tools.
fn holds(toolbox: Option<&Toolbox>, first: &str) -> bool {
    match toolbox.map(Toolbox::choice) {
        None => false,
        Some(ToolChoice::Auto) => first.starts_with('{'),
        Some(_) => true,
    }
}

/// An event the request's kind does not expect.
pub(super) fn out_of_order() -> ApiError {
    ApiError::internal("the model's thread answered out of order")
}

pub(super) fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("responses are plain data")
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
