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

use crate::attn::dense::Dense;
use crate::attn::{AttentionPolicy, HeadRecord};
use crate::gpu::GpuError;
use crate::kv::{KvCache, Storage};
use crate::matmul::MatmulScratch;
use crate::model::{Attention, Model, Outputs, Scratch};
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

/// The CPU's prefill: [`Model::forward`] over batches of at most `batch`
/// tokens, attention by the session's policy.
pub struct CpuPrefill<'a, 'm> {
    pub model: &'m Model<'m>,
    pub scratch: &'a mut Scratch,
    pub attention: Attention<'a>,
    pub batch: usize,
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
            self.model.forward(chunk, pos, cache, self.scratch, outputs, &mut self.attention, None);
            if outputs == Outputs::All {
                hidden.extend_from_slice(&self.scratch.hidden);
            }
            pos += chunk.len();
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
        }
    }

    /// Hands the prompts `backend` takes to it (a GPU); the CPU keeps the rest
    /// and every decoding step.
    pub fn set_prefill_backend(&mut self, backend: Box<dyn PrefillBackend + 'm>) {
        self.prefill_backend = Some(backend);
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

    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Forgets everything; the cache memory is kept.
    pub fn reset(&mut self) {
        self.n_past = 0;
        self.steps = 0;
    }

    /// Appends `tokens` and returns the logits after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.check(tokens)?;
        self.records.clear();
        threads::on_pool(|| {
            self.forward(tokens, Outputs::Last)?;
            let n_vocab = self.model.hp.n_vocab;
            self.logits.resize(n_vocab, 0.0);
            self.model.logits(&self.hidden, &mut self.logits, &mut self.head_scratch);
            Ok(&self.logits[..])
        })
    }

    /// Appends one token and returns the logits after it: a decoding step.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.prefill(&[token])?;
        self.steps += 1;
        Ok(&self.logits)
    }

    /// Appends `tokens` (at most one batch) and hands the final-normed hidden
    /// state of every one of them to the caller, who computes logits for the
    /// rows it needs (perplexity scores half a chunk, in small groups).
    pub fn evaluate_all(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.check(tokens)?;
        assert!(tokens.len() <= self.batch, "evaluate_all takes at most one batch");
        self.records.clear();
        threads::on_pool(|| self.forward(tokens, Outputs::All))?;
        Ok(&self.hidden)
    }

    /// Runs `tokens` on the backend that takes them, appending to the cache
    /// and, on the CPU, to the records.
    fn forward(&mut self, tokens: &[u32], outputs: Outputs) -> Result<(), EngineError> {
        let (pos0, n) = (self.n_past, tokens.len());
        let backend = self.prefill_backend.as_deref_mut().and_then(|b| b.takes(pos0, n).then_some(b));
        match backend {
            Some(backend) => backend.prefill(tokens, pos0, &mut self.cache, outputs, &mut self.hidden)?,
            None => {
                let attention = Attention { policy: &mut *self.policy, step: self.steps, records: &mut self.records };
                let mut cpu =
                    CpuPrefill { model: self.model, scratch: &mut self.scratch, attention, batch: self.batch };
                cpu.prefill(tokens, pos0, &mut self.cache, outputs, &mut self.hidden)?;
            }
        }
        self.n_past += n;
        Ok(())
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
