//! `sift serve`: an OpenAI-compatible HTTP server, and a chat page for the browser.
//!
//! Routes: `POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent
//! events with `"stream": true`), the Responses API's `POST /v1/responses` ([`responses`]),
//! `POST /v1/embeddings`, `GET /v1/models`, `GET /health`,
//! llama.cpp's `POST /tokenize`, `POST /detokenize` and `GET /props`, Anthropic's `POST /v1/messages`
//! ([`anthropic`]), Ollama's `/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`
//! and the rest ([`ollama`]), and the chat page at `GET /`.
//! The HTTP side runs on tokio (axum), on a thread of its own; the model runs on the caller's
//! thread, one request at a time, behind a bounded queue ([`worker`]). The conversation API of
//! [`crate::conversation`] is shared with `sift chat`, so a request that extends the previous
//! conversation prefills only its new tokens (`usage.prompt_tokens_details.cached_tokens` says
//! how many it did not).
//!
//! With an API key, every route but `/health` and the page (which holds no data, and asks for
//! the key itself) needs `Authorization: Bearer KEY`, compared in constant time. Bodies are
//! limited in size (413). Ctrl-C or SIGTERM stops taking connections, lets the reply in flight
//! finish, and returns.

mod anthropic;
mod api;
mod cors;
mod error;
mod llamacpp;
mod ollama;
mod responses;
mod routes;
mod worker;

use std::net::TcpListener;

use crate::chat::ChatTemplate;
use crate::conversation::Conversation;
use crate::embed::Pooling;
use crate::structured::GrammarCompiler;

pub use api::Params;
pub use cors::Origins;
pub use ollama::ModelFacts;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The model's name in responses and in `/v1/models`.
    pub model_id: String,
    pub api_key: Option<String>,
    /// Requests that may wait while one is served; more are refused with 503.
    pub queue: usize,
    /// The largest request body accepted, in bytes.
    pub max_body: usize,
    /// Web origins whose pages may call the API from a browser.
    pub origins: Origins,
    /// Sampling and limits for what a request leaves out.
    pub defaults: Params,
    /// The most memory the caches set aside for later requests may take, in bytes.
    pub cache_ram: usize,
    /// How `/v1/embeddings` pools a text's hidden states.
    pub pooling: Pooling,
    /// What the model's file says of it, for Ollama's listings.
    pub facts: ModelFacts,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot start the HTTP server: {0}")]
    Runtime(std::io::Error),
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error("the HTTP server's thread panicked")]
    Panicked,
}

/// Serves `conversation` on `listener` until Ctrl-C or SIGTERM. Returns once the reply in
/// flight has been sent. `grammars` compiles the requests' structured formats; without one, it is
/// built when the first request asks for one.
pub fn serve(
    listener: TcpListener,
    conversation: Conversation<'_>,
    template: ChatTemplate,
    config: Config,
    grammars: Option<GrammarCompiler>,
) -> Result<(), ServeError> {
    let n_ctx = conversation.session().n_ctx();
    let hp = &conversation.session().model().hp;
    let sizes = (hp.n_vocab, hp.n_embd);
    let (cache_ram, pooling) = (config.cache_ram, config.pooling);
    let tokenizer = conversation.tokenizer().clone();
    let props = api::Props::new(&config.model_id, &config.defaults, n_ctx, &template, &tokenizer);
    let (queue, jobs) = worker::queue(config.queue);
    let http = std::thread::Builder::new()
        .name("sift-http".into())
        .spawn(move || routes::run(listener, queue, config, (tokenizer, props), n_ctx, sizes))
        .map_err(ServeError::Runtime)?;
    // Until the HTTP side lets go of the queue: after shutdown, or should it fail.
    worker::Worker::new(conversation, template, cache_ram, grammars, pooling).run(jobs);
    http.join().map_err(|_| ServeError::Panicked)?
}
