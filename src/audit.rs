//! `--audit-out`: a JSON Lines record of a generation, one object a line, told apart by `type`:
//! a `header` (model, cache, attention, context, sampling), a `token` line for every token
//! sampled (its log-probability, the five most likely tokens, the attention's error
//! certificate), a `reply` line after each turn of a chat, and a closing `summary`. With
//! `--audit`, every decoding step also gets an `attention` line per layer and query head that
//! the audit checked against exact attention ([`AttentionRow`]); `sift perplexity` writes only
//! those, between its header and summary.
//!
//! A file that ends without its summary is never left under the asked-for name: the lines go to
//! a `.partial` file beside it, which is synced and renamed onto the name only after the summary,
//! and removed on any failure. Paths that cannot be renamed onto (a device such as `/dev/stdout`,
//! a FIFO, a symbolic link) are written in place.

use crate::rectify::RectifyReport;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::attn::{AttentionKind, Certificate, HeadRecord, Measure};
use crate::generate::{Sampled, StopReason};
use crate::kv::KvMode;
use crate::sample::SamplingParams;
use crate::tokenizer::Tokenizer;

/// How many of the most likely tokens each token line of an audit file lists.
pub const TOP: usize = 5;

#[derive(Debug, thiserror::Error)]
#[error("cannot write audit {}", path.display())]
pub struct AuditError {
    path: PathBuf,
    #[source]
    source: io::Error,
}

/// The first line: what produced the tokens that follow.
#[derive(Debug, Clone, Serialize)]
pub struct AuditHeader {
    /// The model file's path (lossily, should it not be UTF-8).
    pub model: String,
    pub architecture: &'static str,
    pub kv_cache: String,
    pub attention: AttentionKind,
    pub n_ctx: usize,
    /// The sampling settings, seed included, that reproduce the run (none for perplexity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingParams>,
    /// The prompt's length; a chat gives it per turn, in its `reply` lines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    pub sift_version: &'static str,
}

impl AuditHeader {
    pub fn new(
        model: &Path,
        architecture: &'static str,
        kv_cache: KvMode,
        attention: AttentionKind,
        n_ctx: usize,
        sampling: Option<&SamplingParams>,
        prompt_tokens: Option<usize>,
    ) -> Self {
        Self {
            model: model.display().to_string(),
            architecture,
            kv_cache: kv_cache.to_string(),
            attention,
            n_ctx,
            sampling: sampling.cloned(),
            prompt_tokens,
            sift_version: env!("CARGO_PKG_VERSION"),
        }
    }
}

/// One token sampled. Log-probabilities are the model's: log-softmax of the logits before the
/// repetition penalty, temperature or truncation.
#[derive(Debug, Clone, Serialize)]
pub struct AuditRecord {
    /// The chat turn (from 1); absent for `sift run`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    /// 0 for the first token after the prompt.
    pub step: usize,
    /// The token's position in the context.
    pub position: usize,
    pub token: u32,
    /// The text the token completes in the output: empty for an end-of-generation token and
    /// while a character spelled in several byte tokens is unfinished.
    pub text: String,
    pub logprob: f32,
    /// The most likely tokens ([`TOP`] in an audit file), most likely first (ties: lowest id
    /// first).
    pub top: Vec<Alternative>,
    /// What the attention of the forward call that computed the logits
    /// promises: the weakest of its heads' certificates.
    pub attention: Certificate,
}

#[derive(Debug, Clone, Serialize)]
pub struct Alternative {
    pub token: u32,
    /// The token's own bytes as text (a lone byte of a longer character shows as U+FFFD).
    pub text: String,
    pub logprob: f32,
}

impl AuditRecord {
    /// The record of a token, with its `top` most likely alternatives.
    pub fn new(sampled: &Sampled, tokenizer: &Tokenizer, turn: Option<usize>, top: usize) -> Self {
        let logits = sampled.logits;
        let log_z = log_sum_exp(logits);
        let logprob = |id: u32| (f64::from(logits[id as usize]) - log_z) as f32;
        let top = top_tokens(logits, top)
            .into_iter()
            .map(|id| Alternative {
                token: id,
                text: String::from_utf8_lossy(&tokenizer.token_bytes(id)).into_owned(),
                logprob: logprob(id),
            })
            .collect();
        Self {
            turn,
            step: sampled.step,
            position: sampled.position,
            token: sampled.token,
            text: sampled.text.to_string(),
            logprob: logprob(sampled.token),
            top,
            attention: Certificate::weakest(sampled.attention),
        }
    }
}

/// After each reply of a chat.
#[derive(Debug, Clone, Serialize)]
pub struct ReplySummary {
    pub turn: usize,
    /// Prompt tokens prefilled for this turn (those the cache did not hold yet).
    pub prompt_tokens: usize,
    pub tokens: usize,
    pub stop: StopReason,
}

/// The last line; a file without it is incomplete.
#[derive(Debug, Clone, Serialize)]
pub struct AuditSummary {
    /// Tokens generated, an end-of-generation token not counted (as in `--json`).
    pub tokens: usize,
    /// Why `sift run` stopped; a chat gives it per turn, in its `reply` lines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopReason>,
    /// The number of chat turns; absent for `sift run`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns: Option<usize>,
    /// What rectification did, with the per-layer drift of the keys and
    /// values it rewrote; absent when the session did not rectify.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rectify: Option<RectifyReport>,
}

/// One query head's attention in one decoding step, as the audit checked it.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionRow {
    /// The chat turn (from 1), for `sift chat`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    /// The chunk of the text (from 0), for `sift perplexity`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk: Option<usize>,
    /// The decoding step: of the generation, or of the chunk's scored half.
    pub step: usize,
    /// The position of the token the step ran.
    pub position: usize,
    pub layer: usize,
    pub head: usize,
    pub kind: AttentionKind,
    pub measure: Measure,
    /// The certificate's ε and δ (ε is `null` for a method without a bound).
    pub epsilon: f64,
    pub delta: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub level: Option<u32>,
    pub fallback: bool,
    pub visible: usize,
    pub keys_read: usize,
    pub bytes_read: f64,
    pub dense_bytes: f64,
    /// The error against exact attention, on `measure`'s scale.
    pub error: f64,
    /// The bound the certificate proved, where it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<f64>,
    pub violated: bool,
}

impl AttentionRow {
    /// The row of a record the audit checked; none for one it did not.
    pub fn new(
        record: &HeadRecord,
        turn: Option<usize>,
        chunk: Option<usize>,
        step: usize,
        position: usize,
    ) -> Option<Self> {
        let checked = record.audit?;
        Some(Self {
            turn,
            chunk,
            step,
            position,
            layer: record.layer,
            head: record.head,
            kind: record.certificate.kind,
            measure: checked.measure,
            epsilon: record.certificate.epsilon,
            delta: record.certificate.delta,
            level: record.level,
            fallback: record.fallback,
            visible: record.visible,
            keys_read: record.keys_read,
            bytes_read: record.bytes_read,
            dense_bytes: checked.dense_bytes,
            error: checked.error,
            bound: record.estimate.map(|e| e.bound).filter(|b| b.is_finite()),
            violated: checked.violated,
        })
    }
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Line<'a> {
    Header(&'a AuditHeader),
    Attention(&'a AttentionRow),
    Token(&'a AuditRecord),
    Reply(&'a ReplySummary),
    Summary {
        #[serde(flatten)]
        summary: &'a AuditSummary,
        /// Wall-clock time from the header to the summary.
        elapsed_ms: f64,
    },
}

/// The audit file being written.
pub struct AuditLog {
    path: PathBuf,
    /// Where the lines go until the summary is written, when `path` can be renamed onto.
    partial: Option<PathBuf>,
    file: File,
    started: Instant,
}

impl AuditLog {
    /// Opens the file (its `.partial` twin for a regular path), so that a missing or read-only
    /// directory shows before any work is done.
    pub fn create(path: &Path) -> Result<Self, AuditError> {
        let fail = |source| AuditError { path: path.to_path_buf(), source };
        // Only a regular file (or none yet) can be replaced by renaming; anything else is
        // written in place, as a shell's `>` would.
        let partial = match std::fs::symlink_metadata(path) {
            Ok(meta) if !meta.file_type().is_file() => None,
            Ok(_) => partial_path(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => partial_path(path),
            Err(e) => return Err(fail(e)),
        };
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(partial.as_deref().unwrap_or(path))
            .map_err(fail)?;
        Ok(Self { path: path.to_path_buf(), partial, file, started: Instant::now() })
    }

    pub fn header(&mut self, header: &AuditHeader) -> Result<(), AuditError> {
        self.started = Instant::now();
        self.write(&Line::Header(header))
    }

    pub fn token(&mut self, record: &AuditRecord) -> Result<(), AuditError> {
        self.write(&Line::Token(record))
    }

    pub fn attention(&mut self, row: &AttentionRow) -> Result<(), AuditError> {
        self.write(&Line::Attention(row))
    }

    pub fn reply(&mut self, reply: &ReplySummary) -> Result<(), AuditError> {
        self.write(&Line::Reply(reply))
    }

    /// Writes the summary, makes the file durable and only then gives it its name.
    pub fn finish(mut self, summary: &AuditSummary) -> Result<(), AuditError> {
        let elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
        self.write(&Line::Summary { summary, elapsed_ms })?;
        let Some(partial) = &self.partial else {
            return Ok(());
        };
        let fail = |source| AuditError { path: self.path.clone(), source };
        self.file.sync_all().map_err(fail)?;
        std::fs::rename(partial, &self.path).map_err(fail)?;
        self.partial = None;
        Ok(())
    }

    /// One line in one write, unbuffered: a reader can follow the file as it grows, and a full
    /// disk shows at the token it stops.
    fn write(&mut self, line: &Line) -> Result<(), AuditError> {
        let mut bytes = serde_json::to_vec(line).expect("audit lines are plain data");
        bytes.push(b'\n');
        self.file.write_all(&bytes).map_err(|source| AuditError { path: self.path.clone(), source })
    }
}

impl Drop for AuditLog {
    /// An audit that did not reach its summary leaves nothing behind.
    fn drop(&mut self) {
        if let Some(partial) = &self.partial {
            let _ = std::fs::remove_file(partial);
        }
    }
}

/// Writes a token's audit line, if an audit is being written. The first failure is kept in
/// `failure` and stops the generation: an audit with a gap is worth nothing.
pub fn audit_token(
    audit: Option<&mut AuditLog>,
    failure: &mut Option<AuditError>,
    sampled: &Sampled,
    tokenizer: &Tokenizer,
    turn: Option<usize>,
) -> ControlFlow<()> {
    let Some(audit) = audit else {
        return ControlFlow::Continue(());
    };
    // The attention lines of the step that computed the logits, which ran the token before.
    let position = sampled.position.saturating_sub(1);
    let rows = sampled.attention.iter().filter_map(|r| AttentionRow::new(r, turn, None, sampled.step, position));
    let written = audit
        .token(&AuditRecord::new(sampled, tokenizer, turn, TOP))
        .and_then(|()| rows.into_iter().try_for_each(|row| audit.attention(&row)));
    match written {
        Ok(()) => ControlFlow::Continue(()),
        Err(e) => {
            *failure = Some(e);
            ControlFlow::Break(())
        }
    }
}

/// `FILE.<pid>.partial` beside FILE: the same file system, so the rename is atomic, and the
/// process id keeps two runs aimed at one name apart. None for a path without a file name
/// (empty, `..`), which is then opened as it is and fails there.
pub(crate) fn partial_path(path: &Path) -> Option<PathBuf> {
    let mut name = path.file_name()?.to_os_string();
    name.push(format!(".{}.partial", std::process::id()));
    Some(path.with_file_name(name))
}

/// ln Σ exp(logits), in f64 so that a vocabulary of 262K terms loses nothing.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| (f64::from(l) - f64::from(max)).exp()).sum();
    f64::from(max) + sum.ln()
}

/// The ids of the `k` largest logits, largest first; of equal logits the lowest id comes
/// first, as greedy sampling picks it.
fn top_tokens(logits: &[f32], k: usize) -> Vec<u32> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (id, &logit) in logits.iter().enumerate() {
        if top.len() == k && top.last().is_none_or(|&(_, least)| logit <= least) {
            continue;
        }
        // After every equal logit already there: ids arrive in increasing order.
        let at = top.partition_point(|&(_, l)| l >= logit);
        top.insert(at, (id as u32, logit));
        top.truncate(k);
    }
    top.into_iter().map(|(id, _)| id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_tokens_are_sorted_and_ties_go_to_the_lowest_id() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0, 2.0, 0.5, 3.0];
        assert_eq!(top_tokens(&logits, 5), vec![1, 3, 7, 2, 5]);
        assert_eq!(top_tokens(&logits, 2), vec![1, 3]);
        assert_eq!(top_tokens(&logits, 0), Vec::<u32>::new());
        assert_eq!(top_tokens(&[0.0, 1.0], 5), vec![1, 0]);
    }

    #[test]
    fn log_sum_exp_is_stable_for_large_logits() {
        let lse = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9, "{lse}");
    }

    #[test]
    fn a_dropped_log_leaves_no_partial_file() {
        let dir = std::env::temp_dir().join(format!("sift-audit-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.jsonl");
        let partial = partial_path(&path).unwrap();
        let log = AuditLog::create(&path).unwrap();
        assert!(partial.exists());
        drop(log);
        assert!(!partial.exists() && !path.exists());
        std::fs::remove_dir(&dir).unwrap();
    }
}
