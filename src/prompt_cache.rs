//! Prompt caches (`sift run --prompt-cache FILE`): the KV cache after a prompt, kept in a
//! file, so that a later run whose prompt begins with the same tokens prefills only the rest.
//!
//! The file is the magic `SIFTKV1\n`, a header (its length as a little-endian `u64`, then
//! JSON: the model's [`fingerprint`](crate::gguf::GgufFile::fingerprint), the context, the
//! prefill batch, the cache's storage, and the tokens the cache holds), then every layer's
//! state as [`KvCache::write_to`](crate::kv::KvCache::write_to) writes it: the counters and
//! buffers of a cache built alike, so that reading needs no parsing beyond the header. A file
//! is read only by a session of the same model, context, batch and storage; one written for
//! other settings is refused with the setting that differs.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::audit::partial_path;
use crate::engine::Session;

const MAGIC: &[u8; 8] = b"SIFTKV1\n";

/// A header longer than this is not one (a context of millions of tokens stays below it).
const MAX_HEADER: u64 = 1 << 30;

#[derive(Serialize, Deserialize)]
struct Header {
    model: String,
    n_ctx: usize,
    batch: usize,
    storage: String,
    tokens: Vec<u32>,
}

impl Header {
    fn of(session: &Session, model: &str, tokens: &[u32]) -> Self {
        Self {
            model: model.to_string(),
            n_ctx: session.n_ctx(),
            batch: session.batch(),
            storage: format!("{:?}", session.storage()),
            tokens: tokens.to_vec(),
        }
    }

    /// The first setting in which `self`, from a file, differs from `now`.
    fn differs(&self, now: &Header) -> Option<(&'static str, String, String)> {
        let pairs = [
            ("model", self.model.clone(), now.model.clone()),
            ("context", self.n_ctx.to_string(), now.n_ctx.to_string()),
            ("batch", self.batch.to_string(), now.batch.to_string()),
            ("KV cache", self.storage.clone(), now.storage.clone()),
        ];
        pairs.into_iter().find(|(_, made, now)| made != now)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PromptCacheError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a sift prompt cache")]
    NotACache { path: PathBuf },
    #[error("{path}: made with another {setting} ({made}; this run: {now})")]
    Mismatch { path: PathBuf, setting: &'static str, made: String, now: String },
}

impl PromptCacheError {
    /// Whether the file is not there at all.
    pub fn is_missing(&self) -> bool {
        matches!(self, PromptCacheError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// Writes what `session`'s cache holds, the `tokens` at its positions, to `path`, for the
/// model of fingerprint `model`. The file appears only once complete (written beside it, then
/// renamed).
pub fn save(session: &Session, model: &str, tokens: &[u32], path: &Path) -> Result<(), PromptCacheError> {
    assert_eq!(tokens.len(), session.n_past(), "the tokens are the cache's");
    let io = |source| PromptCacheError::Io { path: path.to_path_buf(), source };
    let header = serde_json::to_vec(&Header::of(session, model, tokens)).map_err(|e| io(e.into()))?;
    let partial = partial_path(path).ok_or_else(|| io(io::ErrorKind::InvalidInput.into()))?;
    let written = (|| {
        let mut w = BufWriter::new(File::create(&partial)?);
        w.write_all(MAGIC)?;
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        session.cache().write_to(&mut w)?;
        w.into_inner().map_err(io::IntoInnerError::into_error)?.sync_all()?;
        std::fs::rename(&partial, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written.map_err(io)
}

/// Starts `session` over from the prompt cache at `path`, written for the model of
/// fingerprint `model`, and returns the tokens its cache then holds. After an error the
/// session holds nothing.
pub fn load(session: &mut Session, model: &str, path: &Path) -> Result<Vec<u32>, PromptCacheError> {
    let io = |source| PromptCacheError::Io { path: path.to_path_buf(), source };
    let not_a_cache = || PromptCacheError::NotACache { path: path.to_path_buf() };
    let mut r = BufReader::new(File::open(path).map_err(io)?);
    let mut magic = [0; 8];
    r.read_exact(&mut magic).map_err(|_| not_a_cache())?;
    let mut len = [0; 8];
    r.read_exact(&mut len).map_err(|_| not_a_cache())?;
    let len = u64::from_le_bytes(len);
    if magic != *MAGIC || len > MAX_HEADER {
        return Err(not_a_cache());
    }
    let mut header = vec![0; len as usize];
    r.read_exact(&mut header).map_err(|_| not_a_cache())?;
    let header: Header = serde_json::from_slice(&header).map_err(|_| not_a_cache())?;
    if let Some((setting, made, now)) = header.differs(&Header::of(session, model, &[])) {
        return Err(PromptCacheError::Mismatch { path: path.to_path_buf(), setting, made, now });
    }
    let n = header.tokens.len();
    if n > session.n_ctx() {
        return Err(not_a_cache());
    }
    let restored = session.restore(n, |cache| {
        cache.read_from(&mut r, n)?;
        // Nothing may follow the last layer.
        match r.read(&mut [0])? {
            0 => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, "bytes after the last layer")),
        }
    });
    if let Err(e) = restored {
        session.reset();
        return Err(io(e));
    }
    Ok(header.tokens)
}
