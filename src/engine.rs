//! A session: one model, one KV cache, and the position reached so far.
//! Prompts are prefilled in batches of up to [`Session::batch`] tokens,
//! then tokens are decoded one at a time against the same cache. Every
//! layer's attention is the session's [`AttentionPolicy`] (dense unless
//! asked otherwise), and every call leaves its heads' records behind
//! ([`Session::last_records`]).
//!
//! A prompt's forward pass is a [`PrefillBackend`]'s: [`CpuPrefill`] runs it
//! in batches through [`Model::forward`] under the session's policy; a GPU
//! backend ([`crate::gpu::prefill::GpuPrefill`]) takes the prompts it is
//! given ([`Session::set_prefill_backend`]) and says which it takes. Either
//! leaves every position's keys and values in the session's cache, in its
//! mode, and the final hidden states of the rows asked for. Decoding is the CPU's.
//!
//! Under a sparse policy, a session can rectify what its decoding steps
//! wrote ([`Session::set_rectify`], [`crate::rectify`]): every few steps,
//! and before the cache takes any other tokens, the tokens decoded since the
//! last pass are run again densely in one batch and their keys and values
//! overwritten.

use std::ops::ControlFlow;

use crate::attn::dense::Dense;
use crate::attn::{AttentionKind, AttentionPolicy, HeadRecord};
use crate::gpu::GpuError;
use crate::kv::{KvCache, Settled, Storage};
use crate::matmul::MatmulScratch;
use crate::model::{Attention, Model, Outputs, Scratch};
use crate::rectify::{self, Rectify, RectifyStats};
use crate::threads;

/// The batch size of prefill (llama.cpp's default micro-batch).
pub const DEFAULT_BATCH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt has {prompt} tokens but the context holds {n_ctx}; use a shorter prompt or a larger -c")]
    PromptTooLong { prompt: usize, n_ctx: usize },
    #[error("the context of {n_ctx} tokens is full")]
    ContextFull { n_ctx: usize },
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("nothing to evaluate: the prompt is empty")]
    EmptyInput,
    #[error("GPU prefill: {0}")]
    Gpu(#[from] GpuError),
    #[error("--rectify-every {every} is more than one batch of {batch} tokens")]
    RectifyWindow { every: usize, batch: usize },
    #[error("rectification: {0}")]
    Rectify(#[from] Settled),
    #[error("the session's cache has no key sketches, which this policy reads")]
    NoSketches,
    /// The prefill's progress callback asked it to stop; the cache holds the
    /// prompt's first `done` tokens, and the session counts them.
    #[error("the prompt's prefill was stopped after {done} tokens")]
    Interrupted { done: usize },
    /// The reply's grammar failed while it was being followed.
    #[error("structured output: {0}")]
    Grammar(#[from] crate::structured::GrammarError),
}

/// Runs a prompt's forward pass: stores the keys and values of `tokens` at
/// positions `pos0..` in `cache` and leaves the final-normed hidden states of
/// the `outputs` rows in `hidden`.
pub trait PrefillBackend: Send {
    /// Whether this backend takes `n` tokens appended after `pos0` positions.
    fn takes(&mut self, pos0: usize, n: usize) -> bool;

    fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError>;
}

/// Told how far a prompt's prefill has come (tokens done, of how many);
/// `Break` stops it at the next batch's start.
pub type PrefillProgress<'m> = Box<dyn FnMut(usize, usize) -> ControlFlow<()> + Send + 'm>;

/// The CPU's prefill: [`Model::forward`] over batches of at most `batch`
/// tokens, attention by the session's policy.
pub struct CpuPrefill<'a, 'm> {
    pub model: &'m Model<'m>,
    pub scratch: &'a mut Scratch,
    pub attention: Attention<'a>,
    pub batch: usize,
    /// Told the tokens done before each batch and once all are in; `Break`
    /// before a batch stops the prefill there, with
    /// [`EngineError::Interrupted`].
    pub progress: Option<&'a mut (dyn FnMut(usize, usize) -> ControlFlow<()> + Send)>,
}

impl PrefillBackend for CpuPrefill<'_, '_> {
    fn takes(&mut self, _pos0: usize, _n: usize) -> bool {
        true
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        hidden.clear();
        let mut pos = pos0;
        for chunk in tokens.chunks(self.batch) {
            let done = pos - pos0;
            if let Some(ControlFlow::Break(())) = self.progress.as_mut().map(|progress| progress(done, tokens.len())) {
                return Err(EngineError::Interrupted { done });
            }
            self.model.forward(chunk, pos, cache, self.scratch, outputs, &mut self.attention, None);
            if outputs == Outputs::All {
                hidden.extend_from_slice(&self.scratch.hidden);
            }
            pos += chunk.len();
        }
        if let Some(progress) = self.progress.as_mut() {
            // The prompt is in: nothing is left to stop.
            let _ = progress(tokens.len(), tokens.len());
        }
        if outputs == Outputs::Last {
            hidden.extend_from_slice(&self.scratch.hidden);
        }
        Ok(())
    }
}

pub struct Session<'m> {
    model: &'m Model<'m>,
    cache: KvCache,
    scratch: Scratch,
    head_scratch: MatmulScratch,
    logits: Vec<f32>,
    batch: usize,
    n_past: usize,
    policy: Box<dyn AttentionPolicy>,
    /// What the attention of the latest call did, every layer and head.
    records: Vec<HeadRecord>,
    /// Decoding steps since the last reset.
    steps: u64,
    /// Final-normed hidden states of the rows the latest call asked for.
    hidden: Vec<f32>,
    /// The backend that takes the prompts it wants; the CPU takes the rest.
    prefill_backend: Option<Box<dyn PrefillBackend + 'm>>,
    /// Told how far the CPU has come with each prompt.
    progress: Option<PrefillProgress<'m>>,
    /// How the cache stores its tokens.
    storage: Storage,
    rectify: Rectify,
    /// Tokens decoded since the last rectification, the newest in the cache.
    pending: Vec<u32>,
    /// Whether any attention call of a pending token read sparsely.
    pending_sparse: bool,
    rectified: RectifyStats,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Model<'m>, n_ctx: usize) -> Self {
        Self::with_batch(model, n_ctx, DEFAULT_BATCH)
    }

    /// A session whose prefill batches hold at most `batch` tokens (smaller
    /// batches shrink the sliding-window rings and the scratch buffers).
    pub fn with_batch(model: &'m Model<'m>, n_ctx: usize, batch: usize) -> Self {
        Self::with_cache(model, n_ctx, batch, Storage::default())
    }

    /// A session whose cache stores its tokens as `storage` says
    /// (`--kv-cache`).
    pub fn with_cache(model: &'m Model<'m>, n_ctx: usize, batch: usize, storage: Storage) -> Self {
        Self::with_policy(model, n_ctx, batch, storage, Box::new(Dense))
    }

    /// A session whose attention is `policy`'s (`--attn`). The f16 cache
    /// builds key sketches when the policy reads them, whatever `storage`
    /// says.
    pub fn with_policy(
        model: &'m Model<'m>,
        n_ctx: usize,
        batch: usize,
        storage: Storage,
        policy: Box<dyn AttentionPolicy>,
    ) -> Self {
        let batch = batch.clamp(1, n_ctx.max(1));
        let storage = Storage { key_sketch: storage.key_sketch || policy.reads_sketch(), ..storage };
        Self {
            model,
            cache: KvCache::new(&model.cache_shape(), storage, n_ctx, batch),
            storage,
            rectify: Rectify::default(),
            pending: Vec::new(),
            pending_sparse: false,
            rectified: RectifyStats::default(),
            scratch: Scratch::default(),
            head_scratch: MatmulScratch::default(),
            logits: Vec::new(),
            batch,
            n_past: 0,
            policy,
            records: Vec::new(),
            steps: 0,
            hidden: Vec::new(),
            prefill_backend: None,
            progress: None,
        }
    }

    /// Hands the prompts `backend` takes to it (a GPU); the CPU keeps the rest
    /// and every decoding step.
    pub fn set_prefill_backend(&mut self, backend: Box<dyn PrefillBackend + 'm>) {
        self.prefill_backend = Some(backend);
    }

    /// Tells `progress` how far the CPU has come with each prompt it
    /// prefills, batch by batch (a backend that takes a prompt runs it
    /// unreported); `None` stops the reports. When `progress` answers
    /// `Break`, the prefill stops before its next batch with
    /// [`EngineError::Interrupted`], the batches done kept: the session
    /// counts them, and a later prefill goes on from there.
    pub fn set_prefill_progress(&mut self, progress: Option<PrefillProgress<'m>>) {
        self.progress = progress;
    }

    /// Rectifies every `rectify.every` decoded tokens (0: never). Starts the
    /// session over, in a cache whose residual window keeps that many tokens
    /// exact ([`Rectify::storage`]).
    pub fn set_rectify(&mut self, rectify: Rectify) -> Result<(), EngineError> {
        if rectify.every > self.batch {
            return Err(EngineError::RectifyWindow { every: rectify.every, batch: self.batch });
        }
        let storage = rectify.storage(self.storage);
        if storage.residual != self.storage.residual {
            self.cache = KvCache::new(&self.model.cache_shape(), storage, self.n_ctx(), self.batch);
            self.storage = storage;
        }
        self.rectify = rectify;
        self.reset();
        Ok(())
    }

    pub fn rectify_settings(&self) -> Rectify {
        self.rectify
    }

    /// What rectification did over the session's life (a reset keeps it).
    pub fn rectify_stats(&self) -> &RectifyStats {
        &self.rectified
    }

    /// A session attending with `policy` and rectifying as `rectify` says,
    /// whose cache is a copy of this one's: one prefill for runs that then
    /// decode apart. The cache must hold what they need: sketches for a
    /// policy that reads them, and exact tokens enough for `rectify`.
    pub fn fork(&self, policy: Box<dyn AttentionPolicy>, rectify: Rectify) -> Result<Session<'m>, EngineError> {
        if policy.reads_sketch() && !self.storage.sketches() {
            return Err(EngineError::NoSketches);
        }
        if rectify.every > self.batch || rectify.storage(self.storage).residual > self.storage.residual {
            return Err(EngineError::RectifyWindow { every: rectify.every, batch: self.batch });
        }
        let mut fork = Session::with_policy(self.model, 1, 1, self.storage, policy);
        fork.cache = self.cache.clone();
        fork.batch = self.batch;
        fork.n_past = self.n_past;
        fork.steps = self.steps;
        fork.rectify = rectify;
        Ok(fork)
    }

    pub fn policy(&self) -> &dyn AttentionPolicy {
        &*self.policy
    }

    /// What attention did in the latest [`Self::prefill`], [`Self::decode`]
    /// or [`Self::evaluate_all`]: a record per layer and query head of each
    /// forward call it made, in order.
    pub fn last_records(&self) -> &[HeadRecord] {
        &self.records
    }

    pub fn model(&self) -> &'m Model<'m> {
        self.model
    }

    pub fn n_ctx(&self) -> usize {
        self.cache.n_ctx()
    }

    /// Tokens already in the cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Decoding steps since the last reset.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// How the cache stores its tokens.
    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// Starts over with the cache as `read` fills it (a prompt cache's), holding positions
    /// `0..len`. After an error the session holds nothing.
    pub fn restore<E>(&mut self, len: usize, read: impl FnOnce(&mut KvCache) -> Result<(), E>) -> Result<(), E> {
        self.reset();
        read(&mut self.cache)?;
        self.n_past = len;
        Ok(())
    }

    /// Whether [`Self::truncate`] to `len` would succeed.
    pub fn can_truncate(&self, len: usize) -> bool {
        len <= self.n_past && self.cache.check_truncate(len).is_ok()
    }

    /// Forgets positions from `len` on, so that a prompt that shares only the first `len`
    /// tokens with what the cache holds (a reply regenerated, a last message edited) goes on
    /// from there; first rectifies what sparse steps wrote. Nothing changes when a layer can no
    /// longer rewrite position `len` (a sliding window's ring or a quantized cache's exact
    /// pages have let it go): the caller prefills from the start then.
    pub fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        assert!(len <= self.n_past, "truncating to {len} of {} positions", self.n_past);
        self.rectify()?;
        self.cache.truncate(len)?;
        self.policy.forget_from(len);
        self.n_past = len;
        Ok(())
    }

    /// Forgets everything; the cache memory is kept.
    pub fn reset(&mut self) {
        self.n_past = 0;
        self.steps = 0;
        self.pending.clear();
        self.pending_sparse = false;
        self.policy.forget_from(0);
    }

    /// Appends `tokens` and returns the logits after the last one, first
    /// rectifying the tokens decoded since the last rectification.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.check(tokens)?;
        self.rectify()?;
        self.run_last(tokens)
    }

    /// Appends one token and returns the logits after it: a decoding step,
    /// followed by a rectification when it completes a window of
    /// [`Rectify::every`] tokens.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.decode_hidden(token)?;
        let n_vocab = self.model.hp.n_vocab;
        self.logits.resize(n_vocab, 0.0);
        threads::on_pool(|| self.model.logits(&self.hidden, &mut self.logits, &mut self.head_scratch));
        Ok(&self.logits)
    }

    /// [`Self::decode`] without the output head: returns the final-normed
    /// hidden state after `token`, for a caller that computes the logits
    /// itself (of several sessions' rows in one product, say). A
    /// rectification that follows the step leaves it as it was.
    pub fn decode_hidden(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.check(&[token])?;
        self.records.clear();
        threads::on_pool(|| self.forward_on_cpu(&[token], Outputs::Last, false))?;
        self.n_past += 1;
        self.steps += 1;
        if self.rectify.every > 0 {
            self.pending.push(token);
            self.pending_sparse |= self.records.iter().any(|r| r.certificate.kind != AttentionKind::Dense);
            if self.pending.len() >= self.rectify.every {
                self.rectify()?;
            }
        }
        Ok(&self.hidden)
    }

    /// Runs the tokens decoded since the last rectification again, densely
    /// and in one batch at their positions, and overwrites what they left in
    /// the cache; nothing to do when none of them was read sparsely. The
    /// logits and records of the latest call stay as they were.
    pub fn rectify(&mut self) -> Result<(), EngineError> {
        let tokens = std::mem::take(&mut self.pending);
        if !std::mem::take(&mut self.pending_sparse) || tokens.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let pos0 = self.n_past - tokens.len();
        let model = self.model;
        let hp = &model.hp;
        let dims = (hp.head_dim_k, hp.head_dim_v);
        let keys_len = tokens.len() * hp.n_head_kv * hp.head_dim_k;
        let read = |cache: &KvCache| rectify::read_rows(cache, hp.n_head_kv, dims, pos0..pos0 + tokens.len());
        let before = self.rectify.measure_drift.then(|| read(&self.cache));
        self.cache.truncate(pos0)?;
        self.policy.forget_from(pos0);
        let mut records = Vec::new();
        let mut hidden = Vec::new();
        threads::on_pool(|| {
            let attention = Attention { policy: &mut Dense, step: self.steps, records: &mut records };
            let (model, scratch, batch) = (self.model, &mut self.scratch, self.batch);
            let mut cpu = CpuPrefill { model, scratch, attention, batch, progress: None };
            cpu.prefill(&tokens, pos0, &mut self.cache, Outputs::CacheOnly, &mut hidden)
        })?;
        if let Some(before) = before {
            rectify::add_drift(&mut self.rectified.drift, &before, &read(&self.cache), keys_len);
        }
        self.rectified.passes += 1;
        self.rectified.tokens += tokens.len() as u64;
        self.rectified.time += started.elapsed();
        Ok(())
    }

    /// Appends checked `tokens` and returns the logits after the last one.
    fn run_last(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.records.clear();
        threads::on_pool(|| {
            self.forward(tokens, Outputs::Last)?;
            let n_vocab = self.model.hp.n_vocab;
            self.logits.resize(n_vocab, 0.0);
            self.model.logits(&self.hidden, &mut self.logits, &mut self.head_scratch);
            Ok(&self.logits[..])
        })
    }

    /// Appends `tokens` (at most one batch) and hands the final-normed hidden
    /// state of every one of them to the caller, who computes logits for the
    /// rows it needs (perplexity scores half a chunk, in small groups).
    pub fn evaluate_all(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.check(tokens)?;
        assert!(tokens.len() <= self.batch, "evaluate_all takes at most one batch");
        self.rectify()?;
        self.records.clear();
        threads::on_pool(|| self.forward(tokens, Outputs::All))?;
        Ok(&self.hidden)
    }

    /// Runs prompt `tokens` on the backend that takes them, appending to the
    /// cache and, on the CPU, to the records.
    fn forward(&mut self, tokens: &[u32], outputs: Outputs) -> Result<(), EngineError> {
        let (pos0, n) = (self.n_past, tokens.len());
        let done = match self.prefill_backend.as_deref_mut().and_then(|b| b.takes(pos0, n).then_some(b)) {
            Some(backend) => backend.prefill(tokens, pos0, &mut self.cache, outputs, &mut self.hidden),
            None => self.forward_on_cpu(tokens, outputs, true),
        };
        match done {
            Ok(()) => self.n_past += n,
            Err(EngineError::Interrupted { done }) => self.n_past += done,
            Err(_) => {}
        }
        done
    }

    /// The forward pass of `tokens` on the CPU under the session's policy
    /// (every decoding step's, whatever prefills the prompts), its progress
    /// reported if `prompt`; the caller advances the position.
    fn forward_on_cpu(&mut self, tokens: &[u32], outputs: Outputs, prompt: bool) -> Result<(), EngineError> {
        let attention = Attention { policy: &mut *self.policy, step: self.steps, records: &mut self.records };
        // (The reborrow shortens the callback's lifetime to the call's.)
        let progress = if prompt { self.progress.as_deref_mut().map(|p| p as _) } else { None };
        let (model, scratch, batch) = (self.model, &mut self.scratch, self.batch);
        let mut cpu = CpuPrefill { model, scratch, attention, batch, progress };
        cpu.prefill(tokens, self.n_past, &mut self.cache, outputs, &mut self.hidden)
    }

    fn check(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let n_ctx = self.n_ctx();
        if tokens.is_empty() {
            return Err(EngineError::EmptyInput);
        }
        if self.n_past + tokens.len() > n_ctx {
            return Err(if self.n_past == 0 {
                EngineError::PromptTooLong { prompt: tokens.len(), n_ctx }
            } else {
                EngineError::ContextFull { n_ctx }
            });
        }
        let n_vocab = self.model.hp.n_vocab;
        match tokens.iter().find(|&&id| id as usize >= n_vocab) {
            Some(&id) => Err(EngineError::TokenOutOfRange { id, n_vocab }),
            None => Ok(()),
        }
    }
}
