//! Embeddings: a text as one vector of unit length, for search and retrieval.
//!
//! A text's tokens run through the model on a cache of their own, and the final-normed hidden
//! states (the rows the output head would read, as llama.cpp takes them for its embeddings) are
//! pooled into one: their mean, or the last token's where the model file asks for it
//! (`{arch}.pooling_type`, as embedding models converted to GGUF carry it). The pooled vector
//! is scaled to unit length, so that a dot product of two is their cosine.
//!
//! A chat model's embeddings are what its hidden states make of a text; a model trained for
//! embeddings (of an architecture sift runs, such as Qwen3's) makes better ones.

use crate::engine::{EngineError, Session, DEFAULT_BATCH};
use crate::gguf::GgufFile;
use crate::model::Model;

/// How a text's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the tokens.
    Mean,
    /// The last token's.
    Last,
}

/// A pooling the model file asks for that sift does not do, or cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}: sift pools by the mean (1) or the last token (3)")]
pub struct PoolingError(String);

impl Pooling {
    /// The pooling the model file asks for: `{arch}.pooling_type` 1 (mean) or 3 (last token);
    /// the mean where the file says nothing (or 0, none: a model not made for embeddings).
    pub fn for_model(file: &GgufFile, arch: &str) -> Result<Self, PoolingError> {
        let key = format!("{arch}.pooling_type");
        match file.u64(&key) {
            Ok(None | Some(0 | 1)) => Ok(Pooling::Mean),
            Ok(Some(3)) => Ok(Pooling::Last),
            Ok(Some(other)) => Err(PoolingError(format!("{key} is {other}"))),
            Err(e) => Err(PoolingError(e.to_string())),
        }
    }
}

/// Embeds texts one after another on one cache, cleared between them: sized once for the
/// longest, rather than allocated anew for each.
pub struct Embedder<'m> {
    session: Session<'m>,
    pooling: Pooling,
}

impl<'m> Embedder<'m> {
    /// An embedder for texts of at most `n_ctx` tokens.
    pub fn new(model: &'m Model<'m>, n_ctx: usize, pooling: Pooling) -> Self {
        Self { session: Session::new(model, n_ctx), pooling }
    }

    /// The embedding of `tokens` (at least one, at most the embedder's `n_ctx`): their
    /// final-normed hidden states pooled, at unit length.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        assert!(!tokens.is_empty(), "an embedding needs a token");
        self.session.reset();
        let dim = self.session.model().hp.n_embd;
        let mut pooled = vec![0.0f64; dim];
        for chunk in tokens.chunks(DEFAULT_BATCH) {
            let hidden = self.session.evaluate_all(chunk)?;
            match self.pooling {
                Pooling::Mean => {
                    for row in hidden.chunks_exact(dim) {
                        pooled.iter_mut().zip(row).for_each(|(p, &x)| *p += f64::from(x));
                    }
                }
                Pooling::Last => {
                    let last = &hidden[hidden.len() - dim..];
                    pooled.iter_mut().zip(last).for_each(|(p, &x)| *p = f64::from(x));
                }
            }
        }
        let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
        // A zero vector (all states zero) stays zero.
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        Ok(pooled.iter().map(|&x| (x * scale) as f32).collect())
    }
}

/// The embedding of `tokens` alone (see [`Embedder::embed`]).
pub fn embed(model: &Model, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>, EngineError> {
    Embedder::new(model, tokens.len(), pooling).embed(tokens)
}
