//! Attention calls captured from a model (`sift run --capture FILE`), for
//! benchmarks that need real caches beside synthetic ones.
//!
//! [`Capturing`] wraps a session's policy and, on every call a sparse policy
//! would read sparsely ([`worth_sparse`]: decoding steps on layers that see
//! at least [`SPARSE_MIN_VISIBLE`](super::SPARSE_MIN_VISIBLE) positions, on
//! Gemma 3 its global layers), keeps the call's queries (after RoPE, before
//! any rounding) and its position, and every key and value the layer holds
//! up to it, as the cache reads them back (f16 in the f16 cache, so exactly;
//! dequantized in the quantized modes). A layer's positions are copied once,
//! as they first become visible, so that later calls add one row each; a
//! policy that rewrites positions it already showed (rectification) would
//! make the copy stale, and a capture should run without one.
//!
//! The file ([`Captured::write`], [`Captured::read`]) is little-endian:
//! `siftcap1`, the layer count (u32), then per layer its index, KV heads,
//! query heads, key and value sizes, positions and calls (u32 each), the
//! score's scale and soft cap (f32, 0 for none), the keys and the values
//! (f16 bits, `[position][kv head][size]`), and per call its position (u32)
//! and queries (f32, `[head][key size]`). [`CapturedLayer::cache`] rebuilds
//! a cache of any storage from it and [`CapturedLayer::batch`] a call's
//! batch, so that the benchmark runs every policy on the model's own keys,
//! values and queries.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use half::f16;

use super::{worth_sparse, AttentionBatch, AttentionKind, AttentionPolicy, HeadRecord, LayerCall, Scorer};
use crate::kv::{CacheShape, PagedLayer, Storage};

const MAGIC: &[u8; 8] = b"siftcap1";

/// A policy whose sparse-worthy calls are captured as they run.
pub struct Capturing {
    inner: Box<dyn AttentionPolicy>,
    log: CaptureLog,
}

/// What a [`Capturing`] policy captured so far, shared with whoever writes it.
#[derive(Clone, Default)]
pub struct CaptureLog(Arc<Mutex<Captured>>);

impl CaptureLog {
    /// A copy of the capture so far.
    pub fn captured(&self) -> Captured {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl Capturing {
    pub fn new(inner: Box<dyn AttentionPolicy>) -> (Self, CaptureLog) {
        let log = CaptureLog::default();
        (Self { inner, log: log.clone() }, log)
    }
}

impl AttentionPolicy for Capturing {
    fn kind(&self) -> AttentionKind {
        self.inner.kind()
    }

    fn reads_sketch(&self) -> bool {
        self.inner.reads_sketch()
    }

    fn forget_from(&mut self, pos: usize) {
        self.inner.forget_from(pos);
    }

    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>) {
        self.inner.attend(call, out, records);
        if worth_sparse(call) {
            self.log.0.lock().unwrap_or_else(PoisonError::into_inner).add(call);
        }
    }
}

/// Captured calls, per layer in the order the layers were first seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Captured {
    pub layers: Vec<CapturedLayer>,
}

/// One layer's keys and values, and the calls captured on it.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedLayer {
    pub layer: usize,
    pub n_kv_head: usize,
    pub n_head: usize,
    pub dim_k: usize,
    pub dim_v: usize,
    pub scorer: Scorer,
    /// `[position][kv head][dim_k]`, as the cache read them back.
    pub keys: Vec<f16>,
    /// `[position][kv head][dim_v]`.
    pub values: Vec<f16>,
    pub calls: Vec<CapturedCall>,
}

/// One decoding step's call on a layer.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedCall {
    /// The position of the step's token: the call sees `0..=position`.
    pub position: usize,
    /// `[head][dim_k]`, after RoPE.
    pub queries: Vec<f32>,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a capture written by sift run --capture")]
    NotACapture { path: String },
}

impl Captured {
    fn add(&mut self, call: &LayerCall) {
        let batch = call.batch;
        let at = match self.layers.iter().position(|l| l.layer == call.layer) {
            Some(at) => at,
            None => {
                self.layers.push(CapturedLayer {
                    layer: call.layer,
                    n_kv_head: batch.n_kv_head(),
                    n_head: batch.n_head,
                    dim_k: batch.head_dim_k,
                    dim_v: batch.head_dim_v,
                    scorer: batch.scorer,
                    keys: Vec::new(),
                    values: Vec::new(),
                    calls: Vec::new(),
                });
                self.layers.len() - 1
            }
        };
        let layer = &mut self.layers[at];
        let (mut key, mut value) = (vec![0.0f32; layer.dim_k], vec![0.0f32; layer.dim_v]);
        for pos in layer.len()..call.visible(0).end {
            for head in 0..layer.n_kv_head {
                call.cache.key(head, pos, &mut key);
                call.cache.value(head, pos, &mut value);
                layer.keys.extend(key.iter().map(|&x| f16::from_f32(x)));
                layer.values.extend(value.iter().map(|&x| f16::from_f32(x)));
            }
        }
        layer.calls.push(CapturedCall { position: batch.pos0, queries: batch.queries.to_vec() });
    }

    /// Writes the capture to `path`, in the format of the module's doc.
    pub fn write(&self, path: &Path) -> Result<(), CaptureError> {
        let io = |source| CaptureError::Io { path: path.display().to_string(), source };
        let mut w = BufWriter::new(std::fs::File::create(path).map_err(io)?);
        let mut put = |bytes: &[u8]| w.write_all(bytes).map_err(io);
        put(MAGIC)?;
        put(&(self.layers.len() as u32).to_le_bytes())?;
        for l in &self.layers {
            for n in [l.layer, l.n_kv_head, l.n_head, l.dim_k, l.dim_v, l.len(), l.calls.len()] {
                put(&(n as u32).to_le_bytes())?;
            }
            put(&l.scorer.scale.to_le_bytes())?;
            put(&l.scorer.softcap.unwrap_or(0.0).to_le_bytes())?;
            for half in l.keys.iter().chain(&l.values) {
                put(&half.to_bits().to_le_bytes())?;
            }
            for call in &l.calls {
                put(&(call.position as u32).to_le_bytes())?;
                for q in &call.queries {
                    put(&q.to_le_bytes())?;
                }
            }
        }
        w.flush().map_err(io)
    }

    /// Reads what [`Self::write`] wrote.
    pub fn read(path: &Path) -> Result<Self, CaptureError> {
        let name = || path.display().to_string();
        let io = |source: std::io::Error| match source.kind() {
            std::io::ErrorKind::UnexpectedEof => CaptureError::NotACapture { path: name() },
            _ => CaptureError::Io { path: name(), source },
        };
        let mut r = BufReader::new(std::fs::File::open(path).map_err(io)?);
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).map_err(io)?;
        if &magic != MAGIC {
            return Err(CaptureError::NotACapture { path: name() });
        }
        let n_layers = read_u32(&mut r).map_err(io)?;
        let mut layers = Vec::new();
        for _ in 0..n_layers {
            let mut n = [0usize; 7];
            for x in &mut n {
                *x = read_u32(&mut r).map_err(io)? as usize;
            }
            let [layer, n_kv_head, n_head, dim_k, dim_v, len, n_calls] = n;
            let scale = f32::from_bits(read_u32(&mut r).map_err(io)?);
            let softcap = Some(f32::from_bits(read_u32(&mut r).map_err(io)?)).filter(|&c| c != 0.0);
            let mut halves = |count: usize| -> std::io::Result<Vec<f16>> {
                let mut bytes = vec![0u8; 2 * count];
                r.read_exact(&mut bytes)?;
                Ok(bytes.chunks_exact(2).map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect())
            };
            let keys = halves(len * n_kv_head * dim_k).map_err(io)?;
            let values = halves(len * n_kv_head * dim_v).map_err(io)?;
            let mut calls = Vec::with_capacity(n_calls);
            for _ in 0..n_calls {
                let position = read_u32(&mut r).map_err(io)? as usize;
                let mut bytes = vec![0u8; 4 * n_head * dim_k];
                r.read_exact(&mut bytes).map_err(io)?;
                let queries = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                if position >= len {
                    return Err(CaptureError::NotACapture { path: name() });
                }
                calls.push(CapturedCall { position, queries });
            }
            let scorer = Scorer { scale, softcap };
            layers.push(CapturedLayer { layer, n_kv_head, n_head, dim_k, dim_v, scorer, keys, values, calls });
        }
        Ok(Self { layers })
    }
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word).map(|()| u32::from_le_bytes(word))
}

impl CapturedLayer {
    /// Positions captured.
    pub fn len(&self) -> usize {
        self.keys.len() / (self.n_kv_head * self.dim_k).max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The captured keys and values stored afresh in a cache of `storage`.
    pub fn cache(&self, storage: Storage) -> PagedLayer {
        let shape = CacheShape {
            n_kv_head: self.n_kv_head,
            head_dim_k: self.dim_k,
            head_dim_v: self.dim_v,
            windows: vec![None],
        };
        let mut layer = PagedLayer::new(storage, &shape, None, self.len(), 1);
        for pos in 0..self.len() {
            layer.store(pos, &self.row_keys(pos), &self.row_values(pos));
        }
        layer
    }

    /// Every KV head's key at `pos`, in f32.
    pub fn row_keys(&self, pos: usize) -> Vec<f32> {
        let n = self.n_kv_head * self.dim_k;
        self.keys[pos * n..][..n].iter().map(|h| h.to_f32()).collect()
    }

    /// Every KV head's value at `pos`, in f32.
    pub fn row_values(&self, pos: usize) -> Vec<f32> {
        let n = self.n_kv_head * self.dim_v;
        self.values[pos * n..][..n].iter().map(|h| h.to_f32()).collect()
    }

    /// The batch of `call`, with `keys` and `values` its position's rows
    /// ([`Self::row_keys`], [`Self::row_values`]).
    pub fn batch<'a>(&self, call: &'a CapturedCall, keys: &'a [f32], values: &'a [f32]) -> AttentionBatch<'a> {
        AttentionBatch {
            queries: &call.queries,
            keys,
            values,
            pos0: call.position,
            n_head: self.n_head,
            head_dim_k: self.dim_k,
            head_dim_v: self.dim_v,
            n_gqa: self.n_head / self.n_kv_head,
            scorer: self.scorer,
        }
    }
}
