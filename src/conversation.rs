//! A conversation with a model: the engine that `sift run`, `sift chat` and `sift serve` share.
//!
//! A [`Conversation`] owns one session (one KV cache) and remembers which tokens that cache
//! holds. Each request comes as the token ids of the whole prompt (for a chat, the whole
//! conversation rendered by its template, see [`chat_prompt`]); only the ids the cache does not
//! hold yet are prefilled, so the next turn of a conversation costs only its new tokens. That
//! works while the history tokenizes as it did when it went into the cache. When it does not (a
//! template trims a reply, the system prompt changed, another conversation came in between), the
//! cache is emptied, the prompt prefilled anew, and [`Stats::re_prefills`] counts it.
//!
//! Generation itself is [`generate`]: limits and stop strings in [`Limits`], text streamed to a
//! callback, every token shown to another callback that can stop it at the next token. A session
//! that rectifies sparse decoding ([`crate::rectify`]) is rectified when a reply ends, so that the
//! next request starts from a clean cache.

use std::ops::ControlFlow;
use std::path::Path;

use crate::attn::AttentionPolicy;
use crate::chat::{self, ChatError, ChatTemplate, Message};
use crate::engine::{EngineError, Session, DEFAULT_BATCH};
use crate::generate::{generate, Generated, Limits, Sampled};
use crate::kv::Storage;
use crate::model::Model;
use crate::prompt_cache::{self, PromptCacheError};
use crate::rectify::Rectify;
use crate::sample::{Sampler, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    #[error(transparent)]
    Template(#[from] ChatError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// The ids of `messages` as the model reads them, rendered by `template`;
/// `add_generation_prompt` opens the assistant's turn.
pub fn chat_prompt(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ConversationError> {
    Ok(chat::encode(tokenizer, &template.render(messages, add_generation_prompt)?)?)
}

/// The prompt of a conversation that may have outgrown the context: its ids, and how many of
/// the turns after its system message (if any) the prompt leaves out.
///
/// The turns already left out, `forgotten`, stay out. When the prompt would leave fewer than
/// `room` tokens of `n_ctx` for the reply, the oldest turns go too, up to a user message, until
/// the prompt takes at most half the context (the next turns then find the cache they need,
/// rather than each dropping one turn and prefilling everything again), or until only the last
/// user message is left; a prompt that does not fit even so is the engine's `PromptTooLong`.
pub fn fitted_prompt(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[Message],
    forgotten: usize,
    n_ctx: usize,
    room: usize,
) -> Result<(Vec<u32>, usize), ConversationError> {
    let turns = &messages[system_messages(messages)..];
    let render = |skip: usize| chat_prompt(tokenizer, template, &kept_messages(messages, skip), true);
    let ids = render(forgotten)?;
    if ids.len() + room <= n_ctx {
        return Ok((ids, forgotten));
    }
    let mut fitted = None;
    for skip in (forgotten + 1..turns.len()).filter(|&k| turns[k].role == "user") {
        let ids = render(skip)?;
        let (fits, half) = (ids.len() + room <= n_ctx, ids.len() <= n_ctx / 2);
        if fits {
            fitted = Some((ids, skip));
        }
        if fits && half {
            break;
        }
    }
    fitted.ok_or_else(|| EngineError::PromptTooLong { prompt: ids.len(), n_ctx }.into())
}

/// 1 if the conversation starts with a system message, else 0.
fn system_messages(messages: &[Message]) -> usize {
    usize::from(messages.first().is_some_and(|m| m.role == "system"))
}

/// The conversation as its prompt has it: the system message (if any), then the turns after
/// the first `forgotten`.
pub fn kept_messages(messages: &[Message], forgotten: usize) -> Vec<Message> {
    let (head, turns) = messages.split_at(system_messages(messages));
    [head, &turns[forgotten.min(turns.len())..]].concat()
}

/// How many tokens `a` and `b` begin with alike.
pub fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many of `ids` a cache holding `cached` saves prefilling: all of `cached` when `ids` go on
/// from it (one token at least is left, for the logits after it), else none.
pub fn prefix_reuse(cached: &[u32], ids: &[u32]) -> usize {
    if ids.len() > cached.len() && ids.starts_with(cached) {
        cached.len()
    } else {
        0
    }
}

/// A conversation's cache set aside by [`Conversation::park`].
pub struct Parked {
    cached: Vec<u32>,
    pages: Vec<u8>,
}

impl Parked {
    /// The tokens the cache held.
    pub fn cached(&self) -> &[u32] {
        &self.cached
    }

    /// The memory it takes.
    pub fn bytes(&self) -> usize {
        self.pages.len() + 4 * self.cached.len()
    }
}

/// What the conversation has cost so far.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Prompt tokens prefilled for each request (a [`Conversation::prefill`] counts as one).
    pub prefilled: Vec<usize>,
    /// Requests whose prompt did not start with what the cache held, and so were prefilled anew.
    pub re_prefills: usize,
    pub last_reply: Option<Generated>,
}

/// One session and what its KV cache holds.
pub struct Conversation<'m> {
    session: Session<'m>,
    tokenizer: &'m Tokenizer,
    sampling: SamplingParams,
    sampler: Sampler,
    /// The tokens in the KV cache, in order.
    cached: Vec<u32>,
    stats: Stats,
}

impl<'m> Conversation<'m> {
    /// A conversation whose session keeps its cache as `storage` says and attends with `policy`.
    pub fn new(
        model: &'m Model<'m>,
        tokenizer: &'m Tokenizer,
        n_ctx: usize,
        storage: Storage,
        policy: Box<dyn AttentionPolicy>,
        sampling: SamplingParams,
    ) -> Self {
        Self {
            session: Session::with_policy(model, n_ctx, DEFAULT_BATCH, storage, policy),
            tokenizer,
            sampler: Sampler::new(sampling.clone()),
            sampling,
            cached: Vec::new(),
            stats: Stats::default(),
        }
    }

    /// Rectifies sparse decoding as `rectify` says; starts the conversation over.
    pub fn set_rectify(&mut self, rectify: Rectify) -> Result<(), EngineError> {
        self.session.set_rectify(rectify)?;
        self.reset();
        Ok(())
    }

    pub fn session(&self) -> &Session<'m> {
        &self.session
    }

    /// The session, to set its prefill backend (`--gpu`).
    pub fn session_mut(&mut self) -> &mut Session<'m> {
        &mut self.session
    }

    pub fn tokenizer(&self) -> &'m Tokenizer {
        self.tokenizer
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The tokens the KV cache holds.
    pub fn cached(&self) -> &[u32] {
        &self.cached
    }

    /// Samples the next requests with `sampling`: a sampler seeded afresh, which has seen the
    /// tokens the cache holds (for the repetition penalty), as if it had read them itself.
    pub fn set_sampling(&mut self, sampling: SamplingParams) {
        self.sampler = Sampler::new(sampling.clone());
        let recent = self.cached.len().saturating_sub(sampling.repeat_last_n);
        for &id in &self.cached[recent..] {
            self.sampler.accept(id);
        }
        self.sampling = sampling;
    }

    /// Whether a prompt of `ids` fits the context: the prompt is too long for a fresh
    /// conversation, and the context full for one under way.
    pub fn check_fits(&self, ids: &[u32]) -> Result<(), EngineError> {
        let n_ctx = self.session.n_ctx();
        if ids.len() <= n_ctx {
            Ok(())
        } else if self.cached.is_empty() {
            Err(EngineError::PromptTooLong { prompt: ids.len(), n_ctx })
        } else {
            Err(EngineError::ContextFull { n_ctx })
        }
    }

    /// How many of `ids` the cache will not prefill again: all it holds when `ids` go on from it;
    /// else the tokens they share, where the cache can forget what follows them (a reply
    /// regenerated, a last message edited). One token at least is left to prefill, for the
    /// logits after it.
    pub fn reusable(&self, ids: &[u32]) -> usize {
        match prefix_reuse(&self.cached, ids) {
            0 => {
                let shared = shared_prefix(&self.cached, ids).min(ids.len().saturating_sub(1));
                if shared > 0 && self.session.can_truncate(shared) {
                    shared
                } else {
                    0
                }
            }
            all => all,
        }
    }

    /// Sets what the cache holds aside, as the tokens and the bytes of the pages they fill, for
    /// [`Self::resume`]; the conversation goes on holding it.
    pub fn park(&self) -> Parked {
        let mut pages = Vec::new();
        self.session.cache().write_to(&mut pages).expect("writing to memory cannot fail");
        Parked { cached: self.cached.clone(), pages }
    }

    /// Takes up what [`Self::park`] set aside, in place of what the cache holds.
    pub fn resume(&mut self, parked: &Parked) {
        let n = parked.cached.len();
        self.session
            .restore(n, |cache| cache.read_from(&mut &parked.pages[..], n))
            .expect("a parked cache is read back into a cache built alike");
        self.cached = parked.cached.clone();
        self.reseed_sampler();
    }

    /// Generates after the prompt `ids`, prefilling only what the cache does not hold of it.
    /// `on_text` and `on_token` are [`generate`]'s callbacks: streamed text, and every token
    /// sampled (`Break` stops the generation there).
    pub fn generate(
        &mut self,
        ids: &[u32],
        limits: Limits,
        on_text: impl FnMut(&str),
        on_token: impl FnMut(&Sampled) -> ControlFlow<()>,
    ) -> Result<Generated, EngineError> {
        self.check_fits(ids)?;
        let start = self.reusable(ids);
        if start < self.cached.len() {
            self.go_back(start, ids)?;
        }
        let generated =
            generate(&mut self.session, self.tokenizer, &mut self.sampler, &ids[start..], limits, on_text, on_token);
        // The reply's last tokens are rectified now, so that the next turn starts from a clean cache.
        let before = self.session.rectify_stats().clone();
        let generated = generated.and_then(|mut generated| {
            self.session.rectify()?;
            generated.add_rectification(self.session.rectify_stats().since(&before));
            Ok(generated)
        });
        let generated = match generated {
            Ok(generated) => generated,
            Err(e) => {
                self.recover(ids, &e);
                return Err(e);
            }
        };
        self.cached = ids.to_vec();
        self.cached.extend(&generated.tokens);
        // The last token sampled is decoded only if generation goes on.
        self.cached.truncate(self.session.n_past());
        self.stats.prefilled.push(generated.prompt_tokens);
        Ok(self.stats.last_reply.insert(generated).clone())
    }

    /// Makes the cache hold `ids`, prefilling without generating anything: only what it lacks
    /// of them if it holds their beginning (forgetting what follows it, where the cache can),
    /// else all of them, from the start.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<(), EngineError> {
        let n_ctx = self.session.n_ctx();
        if ids.len() > n_ctx {
            return Err(EngineError::PromptTooLong { prompt: ids.len(), n_ctx });
        }
        let shared = shared_prefix(&self.cached, ids);
        if shared < self.cached.len() {
            match shared > 0 && self.session.can_truncate(shared) {
                true => self.go_back(shared, ids)?,
                false => self.reset(),
            }
        }
        let new = &ids[self.cached.len()..];
        if !new.is_empty() {
            if let Err(e) = self.session.prefill(new) {
                self.recover(ids, &e);
                return Err(e);
            }
        }
        for &id in new {
            self.sampler.accept(id);
        }
        self.stats.prefilled.push(new.len());
        self.cached = ids.to_vec();
        Ok(())
    }

    /// Starts over from the prompt cache at `path` ([`prompt_cache`]), written for the model of
    /// fingerprint `model`; returns how many tokens the cache then holds. After an error the
    /// cache holds nothing.
    pub fn load_prompt_cache(&mut self, path: &Path, model: &str) -> Result<usize, PromptCacheError> {
        self.reset();
        self.cached = prompt_cache::load(&mut self.session, model, path)?;
        self.reseed_sampler();
        Ok(self.cached.len())
    }

    /// Writes what the cache holds to the prompt cache at `path`, for the model of fingerprint
    /// `model`.
    pub fn save_prompt_cache(&self, path: &Path, model: &str) -> Result<(), PromptCacheError> {
        prompt_cache::save(&self.session, model, &self.cached, path)
    }

    /// Forgets everything: the cache, the statistics, and the sampler's state.
    pub fn reset(&mut self) {
        self.clear_cache();
        self.sampler = Sampler::new(self.sampling.clone());
        self.stats = Stats::default();
    }

    /// After `ids` failed with `e`: a prefill stopped by its progress callback
    /// leaves the prompt's first tokens in the cache, where the next prompt
    /// that begins with them goes on from; after any other failure what the
    /// cache holds is unknown, and it starts over.
    fn recover(&mut self, ids: &[u32], e: &EngineError) {
        match e {
            EngineError::Interrupted { .. } => {
                self.cached = ids[..self.session.n_past()].to_vec();
                self.reseed_sampler();
            }
            _ => self.clear_cache(),
        }
    }

    /// Makes the cache hold only the first `start` tokens, for a prompt `ids` that does not go
    /// on from what it holds: forgets what follows them, or starts over (a re-prefill).
    fn go_back(&mut self, start: usize, ids: &[u32]) -> Result<(), EngineError> {
        if start == 0 {
            self.stats.re_prefills += 1;
            self.clear_cache();
            return Ok(());
        }
        if let Err(e) = self.session.truncate(start) {
            self.recover(ids, &e);
            return Err(e);
        }
        self.cached.truncate(start);
        self.reseed_sampler();
        Ok(())
    }

    /// A sampler seeded afresh with the conversation's settings, which has seen what the cache
    /// now holds: after the cache changed under it.
    fn reseed_sampler(&mut self) {
        self.set_sampling(self.sampling.clone());
    }

    fn clear_cache(&mut self) {
        self.session.reset();
        self.cached.clear();
    }
}
