//! Perplexity as llama-perplexity measures it: the text is cut into
//! non-overlapping chunks of `n_ctx` tokens, each chunk is evaluated from an
//! empty cache with BOS in place of its first token, and only the second half
//! of each chunk is scored (so every scored token has at least `n_ctx / 2`
//! tokens of context).

use crate::engine::{EngineError, Session};
use crate::matmul::MatmulScratch;

#[derive(Debug, Clone, serde::Serialize)]
pub struct PerplexityReport {
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
    /// Mean negative log-likelihood per scored token (nats).
    pub mean_nll: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("the text has {tokens} tokens; a context of {n_ctx} needs at least {n_ctx}")]
    TooShort { tokens: usize, n_ctx: usize },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Logits are computed for this many scored positions at a time: enough to
/// reuse each block of the output head, small enough to keep the buffer
/// modest (the vocabulary may have 262 144 entries).
const LOGIT_ROWS: usize = 32;

/// `progress(chunks_done, total_chunks)` is called after every chunk.
pub fn perplexity(
    session: &mut Session,
    tokens: &[u32],
    bos: Option<u32>,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(usize, usize),
) -> Result<PerplexityReport, PerplexityError> {
    let n_ctx = session.n_ctx();
    let available = tokens.len() / n_ctx;
    if available == 0 {
        return Err(PerplexityError::TooShort { tokens: tokens.len(), n_ctx });
    }
    let n_chunks = max_chunks.map_or(available, |m| m.clamp(1, available));
    let model = session.model();
    let n_vocab = model.hp.n_vocab;
    let n_embd = model.hp.n_embd;
    let first_scored = n_ctx / 2;
    let mut logits = vec![0.0f32; LOGIT_ROWS * n_vocab];
    let mut head = MatmulScratch::default();
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);

    for chunk in 0..n_chunks {
        let text = &tokens[chunk * n_ctx..(chunk + 1) * n_ctx];
        session.reset();
        let mut batch_tokens = Vec::with_capacity(session.batch());
        for start in (0..n_ctx).step_by(session.batch()) {
            let end = (start + session.batch()).min(n_ctx);
            batch_tokens.clear();
            batch_tokens.extend_from_slice(&text[start..end]);
            if start == 0 {
                if let Some(bos) = bos {
                    batch_tokens[0] = bos;
                }
            }
            let hidden = session.evaluate_all(&batch_tokens)?;
            // Position k predicts text[k + 1]; score k in [n_ctx/2, n_ctx - 1).
            let scored = start.max(first_scored)..end.min(n_ctx - 1);
            for group in scored.clone().step_by(LOGIT_ROWS) {
                let rows = group..(group + LOGIT_ROWS).min(scored.end);
                let n = rows.len();
                let h = &hidden[(rows.start - start) * n_embd..(rows.end - start) * n_embd];
                model.logits(h, &mut logits[..n * n_vocab], &mut head);
                for (k, row) in rows.zip(logits.chunks_exact(n_vocab)) {
                    let lp = f64::from(log_softmax_at(row, text[k + 1] as usize));
                    nll -= lp;
                    nll2 += lp * lp;
                    count += 1;
                }
            }
        }
        progress(chunk + 1, n_chunks);
    }
    let mean = nll / count as f64;
    let var = nll2 / count as f64 - mean * mean;
    let stderr = if var > 0.0 && count > 1 { (var / (count - 1) as f64).sqrt() } else { 0.0 };
    let ppl = mean.exp();
    Ok(PerplexityReport { ppl, ppl_stderr: ppl * stderr, tokens_scored: count, chunks: n_chunks, mean_nll: mean })
}

/// `log softmax(row)[target]`, stable.
pub fn log_softmax_at(row: &[f32], target: usize) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    row[target] - max - sum.ln() as f32
}
