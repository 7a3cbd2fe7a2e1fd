//! Perplexity as llama-perplexity measures it: the text is cut into windows
//! of `n_ctx` tokens, each window is evaluated from an empty cache with BOS in
//! place of its first token, and only its last tokens are scored, so that
//! every scored token has plenty of context. By default the windows do not
//! overlap and their second halves are scored; with a stride `s`
//! (llama-perplexity's `--ppl-stride`) a window starts every `s` tokens and
//! its last `s` predictions are scored, each with at least `n_ctx - s - 1`
//! tokens of context.
//!
//! A run can also be compared with a base run (the f16 cache, say) token by
//! token. Keeping the base's full distributions is out of the question (44K
//! tokens of a 262K vocabulary are 23 GB in f16), so the base keeps, per
//! scored token, its [`TOP_K`] most likely tokens with their log-probabilities;
//! the KL divergence is taken over those tokens plus one bin holding the rest
//! of each distribution's mass. Merging outcomes never raises a divergence,
//! so this is a lower bound on the full KL, and a tight one where the base
//! puts little mass outside its top tokens.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use crate::engine::{EngineError, Session};
use crate::matmul::MatmulScratch;

/// Tokens a base run keeps per scored position.
pub const TOP_K: usize = 32;

/// How to cut a text into windows, and how to run them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Windows {
    /// Evaluate at most this many windows.
    pub max: Option<usize>,
    /// Start a window every `stride` tokens and score its last `stride`
    /// predictions; `None`: non-overlapping windows, second halves scored.
    pub stride: Option<usize>,
    pub scoring: Scoring,
}

/// How a window's scored positions are run through the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Scoring {
    /// In batches, like the unscored ones: llama-perplexity's way. Batches
    /// attend densely whatever the session's policy.
    #[default]
    Batched,
    /// The unscored positions in batches, then one decoding step per scored
    /// position, so that the scored tokens see the session's attention
    /// policy exactly as generation would.
    Decoded,
}

/// One scored position of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// The token that came next, and its log-probability.
    pub target: u32,
    pub log_prob: f32,
    /// The most likely tokens and their log-probabilities, most likely first
    /// (ties by lower id); empty unless asked for.
    pub top: Vec<(u32, f32)>,
    /// Against a base run: the KL divergence from the base's distribution,
    /// and whether the most likely tokens agree.
    pub kl: Option<(f64, bool)>,
}

/// A text's evaluation: every scored position, in order.
#[derive(Debug, Clone, Default)]
pub struct Evaluation {
    pub windows: usize,
    pub scored: Vec<Scored>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PerplexityReport {
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
    /// Mean negative log-likelihood per scored token (nats).
    pub mean_nll: f64,
}

/// How a run's distributions differ from its base's.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KlReport {
    pub kl_mean: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    /// Share of positions whose most likely token is the base's.
    pub top1_agreement: f64,
    /// The base run's perplexity over the same tokens.
    pub base_ppl: f64,
    /// `ln(PPL / base PPL)`: the mean over positions of how much more
    /// negative log-likelihood this run gives the target than the base did.
    pub log_ppl_ratio: f64,
    /// The standard error of [`Self::log_ppl_ratio`] from the spread of the
    /// per-position differences: a paired comparison, far tighter than the
    /// two perplexities' own errors, and what says whether a gap is more
    /// than the noise of the positions scored.
    pub log_ppl_ratio_stderr: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("the text has {tokens} token{}; a context of {n_ctx} needs at least {n_ctx}", if *tokens == 1 { "" } else { "s" })]
    TooShort { tokens: usize, n_ctx: usize },
    #[error("a stride of {stride} needs a context larger than it (-c {n_ctx})")]
    Stride { stride: usize, n_ctx: usize },
    #[error("the base run scored different tokens than this one (other text, context, stride or chunks?)")]
    BaseMismatch,
    #[error("{path}: {message}")]
    BaseFile { path: String, message: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Logits are computed for this many scored positions at a time: enough to
/// reuse each block of the output head, small enough to keep the buffer
/// modest (the vocabulary may have 262 144 entries).
const LOGIT_ROWS: usize = 32;

/// Evaluates `tokens`, keeping the `keep_top` most likely tokens of every
/// scored position, and comparing with `base` where given: a base run's
/// scored positions from this text's first on (more may follow, of other
/// texts). `progress` is called after every forward call (a batch, or a
/// decoding step), when the session's records are that call's.
pub fn evaluate(
    session: &mut Session,
    tokens: &[u32],
    bos: Option<u32>,
    windows: Windows,
    keep_top: usize,
    base: Option<&[Scored]>,
    mut progress: impl FnMut(&Progress),
) -> Result<Evaluation, PerplexityError> {
    let n_ctx = session.n_ctx();
    let (step, first_scored) = layout(n_ctx, windows.stride)?;
    let n_windows = window_count(tokens.len(), n_ctx, windows)?;
    let model = session.model();
    let (n_vocab, n_embd) = (model.hp.n_vocab, model.hp.n_embd);
    let mut scorer = Scorer {
        base,
        keep_top,
        logits: vec![0.0f32; LOGIT_ROWS * n_vocab],
        head: MatmulScratch::default(),
        order: Vec::new(),
        scored: Vec::new(),
    };
    let mut evaluated = 0;
    // Batches run up to `batched`; decoding steps from there on.
    let batched = match windows.scoring {
        Scoring::Batched => n_ctx,
        Scoring::Decoded => first_scored,
    };

    for window in 0..n_windows {
        let text = &tokens[window * step..][..n_ctx];
        session.reset();
        let mut batch_tokens = Vec::with_capacity(session.batch());
        for start in (0..batched).step_by(session.batch()) {
            let end = (start + session.batch()).min(batched);
            batch_tokens.clear();
            batch_tokens.extend_from_slice(&text[start..end]);
            if start == 0 {
                if let Some(bos) = bos {
                    batch_tokens[0] = bos;
                }
            }
            let hidden = session.evaluate_all(&batch_tokens)?;
            // Position k predicts text[k + 1].
            let rows = start.max(first_scored)..end.min(n_ctx - 1);
            for group in rows.clone().step_by(LOGIT_ROWS) {
                let group = group..(group + LOGIT_ROWS).min(rows.end);
                let n = group.len();
                let h = &hidden[(group.start - start) * n_embd..(group.end - start) * n_embd];
                model.logits(h, &mut scorer.logits[..n * n_vocab], &mut scorer.head);
                for (i, k) in group.enumerate() {
                    scorer.score(i, n_vocab, text[k + 1])?;
                }
            }
            evaluated += end - start;
            progress(&Progress { evaluated, window, session });
        }
        // The last token predicts nothing, and is not run.
        for k in batched..n_ctx - 1 {
            let logits = session.decode(text[k])?;
            scorer.logits[..n_vocab].copy_from_slice(logits);
            scorer.score(0, n_vocab, text[k + 1])?;
            evaluated += 1;
            progress(&Progress { evaluated, window, session });
        }
        if batched < n_ctx {
            // The last token, which predicts nothing, is counted but not run.
            evaluated += 1;
        }
    }
    Ok(Evaluation { windows: n_windows, scored: scorer.scored })
}

/// Where an evaluation stands, after a forward call.
pub struct Progress<'s, 'm> {
    /// Tokens evaluated so far, all windows together.
    pub evaluated: usize,
    /// The window being evaluated, from 0.
    pub window: usize,
    /// The session, whose records are the call's.
    pub session: &'s Session<'m>,
}

/// What scores the positions of a run, and the buffers it needs.
struct Scorer<'a> {
    base: Option<&'a [Scored]>,
    keep_top: usize,
    /// Rows of logits, [`LOGIT_ROWS`] at most.
    logits: Vec<f32>,
    head: MatmulScratch,
    order: Vec<u32>,
    scored: Vec<Scored>,
}

impl Scorer<'_> {
    /// Scores row `i` of the logits, whose next token is `target`.
    fn score(&mut self, i: usize, n_vocab: usize, target: u32) -> Result<(), PerplexityError> {
        let row = &self.logits[i * n_vocab..][..n_vocab];
        let lse = log_sum_exp(row);
        let kl = match self.base {
            Some(base) => {
                let b = base.get(self.scored.len()).filter(|b| b.target == target);
                Some(compare(b.ok_or(PerplexityError::BaseMismatch)?, row, lse))
            }
            None => None,
        };
        self.scored.push(Scored {
            target,
            log_prob: log_prob(row, target, lse),
            top: top_tokens(row, lse, self.keep_top, &mut self.order),
            kl,
        });
        Ok(())
    }
}

/// The tokens [`evaluate`] will run `tokens` through, all windows together.
pub fn tokens_to_evaluate(n_tokens: usize, n_ctx: usize, windows: Windows) -> Result<usize, PerplexityError> {
    Ok(window_count(n_tokens, n_ctx, windows)? * n_ctx)
}

/// The step between windows and the first scored position of a window.
fn layout(n_ctx: usize, stride: Option<usize>) -> Result<(usize, usize), PerplexityError> {
    match stride {
        None => Ok((n_ctx, n_ctx / 2)),
        Some(stride) if stride == 0 || stride + 1 >= n_ctx => Err(PerplexityError::Stride { stride, n_ctx }),
        Some(stride) => Ok((stride, n_ctx - 1 - stride)),
    }
}

fn window_count(n_tokens: usize, n_ctx: usize, windows: Windows) -> Result<usize, PerplexityError> {
    let (step, _) = layout(n_ctx, windows.stride)?;
    if n_tokens < n_ctx {
        return Err(PerplexityError::TooShort { tokens: n_tokens, n_ctx });
    }
    let available = (n_tokens - n_ctx) / step + 1;
    Ok(windows.max.map_or(available, |m| m.clamp(1, available)))
}

impl PerplexityReport {
    /// The perplexity of `scored` positions, evaluated in `chunks` windows.
    pub fn of(scored: &[Scored], chunks: usize) -> Self {
        let count = scored.len();
        let nll: f64 = scored.iter().map(|s| -f64::from(s.log_prob)).sum();
        let nll2: f64 = scored.iter().map(|s| f64::from(s.log_prob).powi(2)).sum();
        let mean = nll / count as f64;
        let var = nll2 / count as f64 - mean * mean;
        let stderr = if var > 0.0 && count > 1 { (var / (count - 1) as f64).sqrt() } else { 0.0 };
        let ppl = mean.exp();
        Self { ppl, ppl_stderr: ppl * stderr, tokens_scored: count, chunks, mean_nll: mean }
    }
}

impl KlReport {
    /// The comparison of `scored` positions (from a run given a base) with
    /// the `base` run's.
    pub fn of(scored: &[Scored], base: &[Scored]) -> Option<Self> {
        let mut kl: Vec<f64> = scored.iter().map(|s| s.kl.map(|(kl, _)| kl)).collect::<Option<_>>()?;
        if kl.is_empty() {
            return None;
        }
        let agree = scored.iter().filter(|s| s.kl.is_some_and(|(_, agree)| agree)).count();
        let gaps: Vec<f64> =
            scored.iter().zip(base).map(|(s, b)| f64::from(b.log_prob) - f64::from(s.log_prob)).collect();
        let (log_ppl_ratio, log_ppl_ratio_stderr) = mean_and_stderr(&gaps);
        let mean = kl.iter().sum::<f64>() / kl.len() as f64;
        kl.sort_by(f64::total_cmp);
        let p99 = kl[((kl.len() - 1) as f64 * 0.99).round() as usize];
        Some(Self {
            kl_mean: mean,
            kl_p99: p99,
            kl_max: kl[kl.len() - 1],
            top1_agreement: agree as f64 / scored.len() as f64,
            base_ppl: PerplexityReport::of(base, 0).ppl,
            log_ppl_ratio,
            log_ppl_ratio_stderr,
        })
    }
}

/// The mean of `x` and its standard error (the sample standard deviation
/// over `√n`); 0 for the error of fewer than two values.
fn mean_and_stderr(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    if x.len() < 2 {
        return (mean, 0.0);
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// `ln Σ exp(row)`, stable.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// The log-probability of `token` given the row's log-sum-exp `lse`.
fn log_prob(row: &[f32], token: u32, lse: f64) -> f32 {
    (f64::from(row[token as usize]) - lse) as f32
}

/// The `k` most likely tokens of `row`, most likely first, ties by lower id.
fn top_tokens(row: &[f32], lse: f64, k: usize, order: &mut Vec<u32>) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let k = k.min(row.len());
    let rank = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    order.clear();
    order.extend(0..row.len() as u32);
    order.select_nth_unstable_by(k - 1, rank);
    order[..k].sort_unstable_by(rank);
    order[..k].iter().map(|&id| (id, log_prob(row, id, lse))).collect()
}

/// KL(base ‖ row) over the base's top tokens and the rest of the mass, and
/// whether the row's most likely token is the base's.
fn compare(base: &Scored, row: &[f32], lse: f64) -> (f64, bool) {
    let (mut kl, mut p_top, mut q_top) = (0.0, 0.0, 0.0);
    for &(id, lp) in &base.top {
        let lq = log_prob(row, id, lse);
        let p = f64::from(lp).exp();
        kl += p * (f64::from(lp) - f64::from(lq));
        p_top += p;
        q_top += f64::from(lq).exp();
    }
    let (p_rest, q_rest) = ((1.0 - p_top).max(0.0), (1.0 - q_top).max(f64::MIN_POSITIVE));
    if p_rest > 0.0 {
        kl += p_rest * (p_rest.ln() - q_rest.ln());
    }
    let argmax = row.iter().enumerate().fold(0, |best, (i, &l)| if l > row[best] { i } else { best });
    let agree = base.top.first().is_some_and(|&(id, _)| id as usize == argmax);
    (kl.max(0.0), agree)
}

const MAGIC: &[u8; 8] = b"siftkld1";

/// Writes a base run's scored positions (with their top tokens) to `path`:
/// little-endian, `MAGIC`, the top count `k` and the position count (u32,
/// u64), then per position the target (u32), its log-probability (f32) and
/// `k` pairs of id (u32) and log-probability (f32).
pub fn save_base(path: &Path, scored: &[Scored]) -> Result<(), PerplexityError> {
    let io = |e: std::io::Error| base_file_error(path, e.to_string());
    let k = scored.first().map_or(0, |s| s.top.len());
    let mut w = BufWriter::new(std::fs::File::create(path).map_err(io)?);
    w.write_all(MAGIC).map_err(io)?;
    w.write_all(&(k as u32).to_le_bytes()).map_err(io)?;
    w.write_all(&(scored.len() as u64).to_le_bytes()).map_err(io)?;
    for s in scored {
        assert_eq!(s.top.len(), k, "every position keeps the same number of top tokens");
        w.write_all(&s.target.to_le_bytes()).map_err(io)?;
        w.write_all(&s.log_prob.to_le_bytes()).map_err(io)?;
        for &(id, lp) in &s.top {
            w.write_all(&id.to_le_bytes()).map_err(io)?;
            w.write_all(&lp.to_le_bytes()).map_err(io)?;
        }
    }
    w.flush().map_err(io)
}

/// Reads what [`save_base`] wrote.
pub fn load_base(path: &Path) -> Result<Vec<Scored>, PerplexityError> {
    let io = |e: std::io::Error| base_file_error(path, e.to_string());
    let mut r = BufReader::new(std::fs::File::open(path).map_err(io)?);
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(io)?;
    if &magic != MAGIC {
        return Err(base_file_error(path, "not a file written by --kl-divergence-base".into()));
    }
    let k = read_u32(&mut r).map_err(io)? as usize;
    let mut long = [0u8; 8];
    r.read_exact(&mut long).map_err(io)?;
    let n = u64::from_le_bytes(long) as usize;
    let expected = (n as u64).saturating_mul(8 + 8 * k as u64);
    let actual = std::fs::metadata(path).map_err(io)?.len().saturating_sub(20);
    if expected != actual {
        return Err(base_file_error(path, format!("{n} positions of {k} tokens need {expected} bytes, not {actual}")));
    }
    (0..n)
        .map(|_| {
            let target = read_u32(&mut r)?;
            let log_prob = f32::from_bits(read_u32(&mut r)?);
            let top = (0..k)
                .map(|_| Ok((read_u32(&mut r)?, f32::from_bits(read_u32(&mut r)?))))
                .collect::<std::io::Result<_>>()?;
            Ok(Scored { target, log_prob, top, kl: None })
        })
        .collect::<std::io::Result<_>>()
        .map_err(io)
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word).map(|()| u32::from_le_bytes(word))
}

fn base_file_error(path: &Path, message: String) -> PerplexityError {
    PerplexityError::BaseFile { path: path.display().to_string(), message }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(log_prob: f32) -> Scored {
        Scored { target: 7, log_prob, top: vec![(7, log_prob)], kl: Some((0.0, true)) }
    }

    #[test]
    fn the_paired_gap_is_the_log_of_the_perplexity_ratio() {
        let base: Vec<Scored> = [-1.0, -2.0, -0.5, -3.0].map(scored).to_vec();
        let run: Vec<Scored> = [-1.5, -2.0, -0.25, -3.5].map(scored).to_vec();
        let report = KlReport::of(&run, &base).unwrap();
        let ratio = PerplexityReport::of(&run, 1).ppl / PerplexityReport::of(&base, 1).ppl;
        assert!((report.log_ppl_ratio - ratio.ln()).abs() < 1e-12, "{}", report.log_ppl_ratio);
        // Gaps 0.5, 0, -0.25, 0.5: mean 0.1875, sample variance 0.140625.
        let stderr = (0.140625f64 / 4.0).sqrt();
        assert!((report.log_ppl_ratio_stderr - stderr).abs() < 1e-12, "{}", report.log_ppl_ratio_stderr);
    }
}
