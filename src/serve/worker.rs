//! The model's thread and the queue in front of it.
//!
//! Inference is CPU-bound and uses every core, so requests are served one at a time, on a thread
//! of their own, never on the async runtime's workers. Handlers put a [`Job`] in a bounded queue
//! (a full queue is refused at once, with 503) and read what the job produces from a channel of
//! [`Event`]s. A client that goes away drops its end of that channel; the worker sees it before
//! the next token (or the next batch of a prompt's prefill) and stops there, and skips a job
//! whose client left while it waited.
//!
//! The worker keeps one [`Conversation`], so a request that extends the previous one (the next
//! turn of a chat, whose messages repeat the earlier turns) prefills only its new tokens. When a
//! request starts something else (a chat app asking for a title between two turns), the cache it
//! replaces is parked in memory, the most recent first, as long as the parked caches fit
//! `--cache-ram`; a later request that goes on from a parked cache further than from the current
//! one takes it up again, and the current one is parked in its place.

use std::borrow::Cow;
use std::ops::ControlFlow;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::attn::Certificate;
use crate::audit::AuditRecord;
use crate::chat::{ChatTemplate, Message};
use std::collections::VecDeque;

use crate::conversation::{chat_prompt, prefix_reuse, Conversation, ConversationError, Parked};
use crate::embed::{Embedder, Pooling};
use crate::engine::EngineError;
use crate::generate::{Limits, Sampled, StopReason};
use crate::structured::{Format, Grammar, GrammarCompiler};

use super::api::{in_vocabulary, Params, TokenLogprob};
use super::error::ApiError;

/// What a request asks the model to continue.
#[derive(Debug)]
pub enum Prompt {
    /// A conversation, rendered with the chat template and the assistant's turn opened.
    Chat(Vec<Message>),
    /// Plain text, tokenized as `sift run` does.
    Text(String),
    /// Texts (or their tokens) to embed, each on its own.
    Embed(Vec<EmbedInput>),
}

/// One of the inputs of an embedding request.
#[derive(Debug)]
pub enum EmbedInput {
    /// Tokenized as `sift run` tokenizes a prompt (BOS, and EOS where the vocabulary asks).
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug)]
pub struct Job {
    pub prompt: Prompt,
    pub params: Params,
    events: UnboundedSender<Event>,
}

/// What the worker tells the request's handler, in this order: `Started` (or `Failed`), then
/// `Text` and `Token` as they come, then `Finished` (or `Failed`); for an embedding job,
/// `Embedded` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// Text ready to send; stop strings are never part of it.
    Text(String),
    /// A token's log-probabilities, when the request asked for them.
    Token(TokenLogprob),
    Finished(Finished),
    /// An embedding request's vectors, in the order of its inputs, and their tokens.
    Embedded {
        vectors: Vec<Vec<f32>>,
        tokens: usize,
    },
    Failed(ApiError),
}

#[derive(Debug, Clone, Copy)]
pub struct Finished {
    pub stop: StopReason,
    /// Which of the request's stop strings ended the reply, where one did.
    pub stop_string: Option<usize>,
    pub completion_tokens: usize,
    /// The weakest certificate of the steps that sampled the reply's tokens.
    pub attention: Certificate,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// The time the prompt's prefill took, and the reply's decoding.
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Dense rectification passes of the reply, and their share of its decode time.
    pub rectifications: u64,
    pub rectify_share: f64,
}

/// The handlers' end of the queue.
#[derive(Clone)]
pub struct Queue {
    jobs: SyncSender<Job>,
    depth: usize,
}

/// A bounded queue of `depth` waiting jobs (the one being served not counted).
pub fn queue(depth: usize) -> (Queue, Receiver<Job>) {
    let (jobs, waiting) = std::sync::mpsc::sync_channel(depth);
    (Queue { jobs, depth }, waiting)
}

impl Queue {
    /// Queues a job, or refuses it at once when the queue is full.
    pub fn submit(&self, prompt: Prompt, params: Params) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (events, receiver) = unbounded_channel();
        match self.jobs.try_send(Job { prompt, params, events }) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(ApiError::busy(self.depth)),
            Err(TrySendError::Disconnected(_)) => Err(ApiError::shutting_down()),
        }
    }
}

/// The model's side: serves jobs until every handle of the queue is gone.
pub struct Worker<'m> {
    conversation: Conversation<'m>,
    template: ChatTemplate,
    /// Caches set aside, the most recently used first.
    parked: VecDeque<Parked>,
    /// The most memory the parked caches may take, in bytes.
    cache_ram: usize,
    /// Given by the server (built for its default format), or built when the first request asks
    /// for structured output.
    grammars: Option<GrammarCompiler>,
    pooling: Pooling,
}

impl<'m> Worker<'m> {
    pub fn new(
        conversation: Conversation<'m>,
        template: ChatTemplate,
        cache_ram: usize,
        grammars: Option<GrammarCompiler>,
        pooling: Pooling,
    ) -> Self {
        Self { conversation, template, parked: VecDeque::new(), cache_ram, grammars, pooling }
    }

    /// `format` compiled for the model's vocabulary; one that cannot be is the fault of the
    /// request's `field`.
    fn grammar(&mut self, format: &Format, field: &str) -> Result<Grammar, ApiError> {
        let compiler = match &mut self.grammars {
            Some(compiler) => compiler,
            grammars => grammars.insert(
                GrammarCompiler::new(self.conversation.tokenizer()).map_err(|e| ApiError::internal(e.to_string()))?,
            ),
        };
        compiler.compile(format).map_err(|e| ApiError::invalid(format!("{field}: {e}")))
    }

    /// Makes the cache the one that saves `ids` the most prefilling: the current one, or a parked
    /// one, taken up in its place. A current cache that `ids` do not go on from is parked (whole,
    /// also when `ids` share its beginning and the conversation forgets the rest).
    fn choose_cache(&mut self, ids: &[u32]) {
        let here = self.conversation.reusable(ids);
        let best = self.parked.iter().enumerate().max_by_key(|(_, parked)| prefix_reuse(parked.cached(), ids));
        let taken = match best {
            Some((i, parked)) if prefix_reuse(parked.cached(), ids) > here => self.parked.remove(i),
            _ => None,
        };
        if here < self.conversation.cached().len() {
            self.parked.push_front(self.conversation.park());
        }
        if let Some(parked) = taken {
            self.conversation.resume(&parked);
        }
        let mut used = 0;
        self.parked.retain(|parked| {
            used += parked.bytes();
            used <= self.cache_ram
        });
    }

    pub fn run(&mut self, jobs: Receiver<Job>) {
        for job in jobs {
            if job.events.is_closed() {
                continue;
            }
            if let Err(e) = self.serve(&job) {
                // The handler may be gone already; nobody else is left to tell.
                let _ = job.events.send(Event::Failed(e));
            }
        }
    }

    /// Embeds each input on a cache of the embedder's, leaving the conversation's as it is.
    fn embed(&self, job: &Job, inputs: &[EmbedInput]) -> Result<(), ApiError> {
        let session = self.conversation.session();
        let (model, n_ctx) = (session.model(), session.n_ctx());
        let n_vocab = model.hp.n_vocab;
        let mut texts = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let ids = match input {
                EmbedInput::Text(text) => Cow::Owned(
                    self.conversation
                        .tokenizer()
                        .encode(text, true, false)
                        .map_err(|e| ApiError::invalid(e.to_string()))?,
                ),
                EmbedInput::Tokens(ids) => Cow::Borrowed(&ids[..]),
            };
            in_vocabulary(&format!("input[{i}]"), &ids, n_vocab)?;
            if ids.is_empty() {
                return Err(ApiError::invalid(format!("input[{i}] has no tokens")));
            }
            if ids.len() > n_ctx {
                return Err(ApiError::too_long(ids.len(), n_ctx));
            }
            texts.push(ids);
        }
        let longest = texts.iter().map(|ids| ids.len()).max().unwrap_or(1);
        let mut embedder = Embedder::new(model, longest, self.pooling);
        let mut vectors = Vec::with_capacity(texts.len());
        for ids in &texts {
            if job.events.is_closed() {
                return Ok(());
            }
            vectors.push(embedder.embed(ids).map_err(|e| ApiError::internal(e.to_string()))?);
        }
        let tokens = texts.iter().map(|ids| ids.len()).sum();
        let _ = job.events.send(Event::Embedded { vectors, tokens });
        Ok(())
    }

    fn serve(&mut self, job: &Job) -> Result<(), ApiError> {
        let tokenizer = self.conversation.tokenizer();
        let ids = match &job.prompt {
            Prompt::Chat(messages) => chat_prompt(tokenizer, &self.template, messages, true),
            Prompt::Text(text) => tokenizer.encode(text, true, false).map_err(ConversationError::from),
            Prompt::Embed(inputs) => return self.embed(job, inputs),
        }
        .map_err(|e| ApiError::invalid(e.to_string()))?;
        let n_ctx = self.conversation.session().n_ctx();
        if ids.len() > n_ctx {
            return Err(ApiError::too_long(ids.len(), n_ctx));
        }
        if ids.is_empty() {
            return Err(ApiError::invalid("the prompt is empty"));
        }
        let params = &job.params;
        let grammar = params.format.as_ref().map(|format| self.grammar(format, params.format_field)).transpose()?;
        self.choose_cache(&ids);
        self.conversation.set_sampling(params.sampling.clone());
        let cached_tokens = self.conversation.reusable(&ids);
        let send = |event| job.events.send(event).map_err(|_| ());
        if send(Event::Started { prompt_tokens: ids.len(), cached_tokens }).is_err() {
            return Ok(());
        }
        let limits =
            Limits { max_tokens: params.max_tokens, stop: &params.stop, interrupt: None, grammar: grammar.as_ref() };
        let on_text = |text: &str| {
            let _ = send(Event::Text(text.to_string()));
        };
        let mut attention = Certificate::DENSE;
        let on_token = |sampled: &Sampled| {
            if job.events.is_closed() {
                return ControlFlow::Break(());
            }
            attention = weaker(attention, Certificate::weakest(sampled.attention));
            if let (Some(top), false) = (params.top_logprobs, tokenizer.is_eog(sampled.token)) {
                let record = AuditRecord::new(sampled, tokenizer, None, top);
                let _ = send(Event::Token(TokenLogprob::new(&record, tokenizer)));
            }
            ControlFlow::Continue(())
        };
        // A client that leaves during a long prompt's prefill stops it at the next batch (the
        // batches done stay in the cache, for a retry of the same prompt).
        let events = job.events.clone();
        let progress =
            Box::new(move |_, _| if events.is_closed() { ControlFlow::Break(()) } else { ControlFlow::Continue(()) });
        self.conversation.session_mut().set_prefill_progress(Some(progress));
        let generated = self.conversation.generate(&ids, limits, on_text, on_token);
        self.conversation.session_mut().set_prefill_progress(None);
        let generated = generated.map_err(|e| match e {
            EngineError::PromptTooLong { prompt, n_ctx } => ApiError::too_long(prompt, n_ctx),
            e => ApiError::internal(e.to_string()),
        })?;
        let _ = send(Event::Finished(Finished {
            stop: generated.stop,
            stop_string: generated.stop_string,
            completion_tokens: generated.tokens.len(),
            attention,
            prefill_tok_s: generated.prefill_tok_s(),
            decode_tok_s: generated.decode_tok_s(),
            prefill_time: generated.prefill_time,
            decode_time: generated.decode_time,
            rectifications: generated.rectifications,
            rectify_share: generated.rectify_share(),
        }));
        Ok(())
    }
}

/// The weaker of two certificates: the larger ε, then the larger δ.
fn weaker(a: Certificate, b: Certificate) -> Certificate {
    if (b.epsilon, b.delta) > (a.epsilon, a.delta) {
        b
    } else {
        a
    }
}
