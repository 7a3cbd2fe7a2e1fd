//! Rectified sparse decoding (ReSA, arXiv 2506.04108).
//!
//! A sparse policy computes each decoded token's attention approximately,
//! so the keys and values the token leaves in the cache (those of every
//! layer above the first sparse one) are approximate too, and later tokens
//! attend to them: errors compound over a long generation. Rectification
//! bounds that: every `F` decoded tokens ([`Rectify::every`]) the session
//! runs the last `F` tokens again, in one dense, causal, batched forward
//! pass at their original positions (the prefill path's matrix–matrix
//! products), attending to the whole cache, and overwrites their keys and
//! values, page sketches and value norms with the dense ones. The tokens
//! emitted, and the logits they were sampled from, are not changed. Its
//! cost is one dense `F`-token batch per `F` steps.
//!
//! The tokens a pass rewrites must still be exact in the cache
//! ([`crate::kv::PagedLayer::truncate`]): a coded page is never re-coded. So
//! a session that rectifies keeps at least `F` of the newest tokens exact in
//! the quantized modes, widening the residual window where `F` needs it
//! ([`Rectify::storage`]; the default residual of 128 tokens holds 65 or more,
//! enough for the default `F = 32`), and rectifies at most one prefill batch
//! ([`crate::engine::DEFAULT_BATCH`]), which a sliding window's ring holds.
//!
//! A window of decoded tokens none of whose attention calls read sparsely
//! (a short context, under [`crate::attn::SPARSE_MIN_VISIBLE`]) was
//! computed densely already and is not run again. Before the cache takes
//! new tokens by any other way (a prompt, a chat's next turn) the session
//! rectifies what is pending, so a continuation always starts from a clean
//! cache.
//!
//! With [`Rectify::measure_drift`], each pass also measures how far the
//! sparsely written keys and values were from the dense ones, per layer:
//! `‖K_sparse − K_dense‖ / ‖K_dense‖` over the rewritten rows of all KV
//! heads, and the same for values ([`LayerDrift`]).

use std::ops::Range;
use std::time::Duration;

use serde::Serialize;

use crate::kv::{KvCache, KvMode, Storage, PAGE};

/// How often a session rectifies, and whether it measures the drift.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rectify {
    /// Decoded tokens between passes; 0 turns rectification off.
    pub every: usize,
    /// Whether each pass measures the rewritten rows' drift ([`LayerDrift`]).
    pub measure_drift: bool,
}

/// What `--rectify-every` is when not given: the seed's 32 for a sparse
/// policy, off for dense attention.
pub const DEFAULT_EVERY: usize = 32;

impl Rectify {
    /// Every `every` tokens, without drift measurement.
    pub fn every(every: usize) -> Self {
        Self { every, measure_drift: false }
    }

    /// `storage` with a residual window wide enough that the `every` newest
    /// tokens are always exact in the quantized modes (the newest
    /// `residual − PAGE + 1` tokens at least are); the f16 mode keeps every
    /// token exact as it is.
    pub fn storage(&self, storage: Storage) -> Storage {
        if storage.mode == KvMode::F16 {
            return storage;
        }
        let needed = (self.every + PAGE - 1).next_multiple_of(PAGE);
        Storage { residual: storage.residual.max(needed), ..storage }
    }
}

/// What rectification has done over a session's life.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RectifyStats {
    /// Dense passes run.
    pub passes: u64,
    /// Tokens they rewrote.
    pub tokens: u64,
    /// Time spent in them.
    pub time: Duration,
    /// Per layer, summed over every pass (empty unless measured).
    pub drift: Vec<LayerDrift>,
}

impl RectifyStats {
    /// What happened between `earlier` (a snapshot of these stats) and now.
    pub fn since(&self, earlier: &RectifyStats) -> RectifyStats {
        let drift =
            self.drift.iter().enumerate().map(|(il, d)| earlier.drift.get(il).map_or(*d, |e| d.minus(e))).collect();
        RectifyStats {
            passes: self.passes - earlier.passes,
            tokens: self.tokens - earlier.tokens,
            time: self.time.saturating_sub(earlier.time),
            drift,
        }
    }
}

/// Squared distances and norms of rewritten rows, to give a relative L2
/// distance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Distance {
    /// `Σ ‖old − new‖²`.
    pub diff_sq: f64,
    /// `Σ ‖new‖²`.
    pub norm_sq: f64,
}

impl Distance {
    /// `‖old − new‖ / ‖new‖`; 0 where nothing was measured.
    pub fn relative(&self) -> f64 {
        if self.norm_sq > 0.0 {
            (self.diff_sq / self.norm_sq).sqrt()
        } else {
            0.0
        }
    }

    fn add(&mut self, old: &[f32], new: &[f32]) {
        for (&o, &n) in old.iter().zip(new) {
            let (o, n) = (f64::from(o), f64::from(n));
            self.diff_sq += (o - n) * (o - n);
            self.norm_sq += n * n;
        }
    }

    fn minus(&self, earlier: &Distance) -> Distance {
        Distance { diff_sq: self.diff_sq - earlier.diff_sq, norm_sq: self.norm_sq - earlier.norm_sq }
    }
}

/// How far one layer's sparsely written keys and values were from the
/// dense ones that replaced them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerDrift {
    pub keys: Distance,
    pub values: Distance,
}

impl LayerDrift {
    fn minus(&self, earlier: &LayerDrift) -> LayerDrift {
        LayerDrift { keys: self.keys.minus(&earlier.keys), values: self.values.minus(&earlier.values) }
    }
}

/// One layer's relative L2 drift, as reports print it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DriftRow {
    pub layer: usize,
    pub keys: f64,
    pub values: f64,
}

/// What rectification did, as `sift perplexity` reports it: the passes and,
/// where measured, every layer's drift (a markdown table).
#[derive(Debug, Clone, Serialize)]
pub struct RectifyReport {
    pub every: usize,
    pub passes: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub drift: Vec<DriftRow>,
}

impl RectifyReport {
    pub fn of(rectify: Rectify, stats: &RectifyStats) -> Self {
        let row =
            |(layer, d): (usize, &LayerDrift)| DriftRow { layer, keys: d.keys.relative(), values: d.values.relative() };
        Self {
            every: rectify.every,
            passes: stats.passes,
            tokens: stats.tokens,
            seconds: stats.time.as_secs_f64(),
            drift: stats.drift.iter().enumerate().map(row).collect(),
        }
    }
}

impl std::fmt::Display for RectifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "rectification every {} tokens: {} passes, {} tokens rewritten, {:.2} s",
            self.every, self.passes, self.tokens, self.seconds
        )?;
        if !self.drift.is_empty() {
            writeln!(f, "; relative L2 of the sparsely written K/V against the rewritten ones:\n")?;
            writeln!(f, "| layer | keys | values |\n| ---: | ---: | ---: |")?;
            for row in &self.drift {
                writeln!(f, "| {} | {:.2e} | {:.2e} |", row.layer, row.keys, row.values)?;
            }
        }
        Ok(())
    }
}

/// Every layer's keys and values at `positions`, as the cache returns them:
/// per layer, the keys of all KV heads, then their values.
pub fn read_rows(cache: &KvCache, n_kv_head: usize, dims: (usize, usize), positions: Range<usize>) -> Vec<Vec<f32>> {
    let (dim_k, dim_v) = dims;
    let n = positions.len() * n_kv_head;
    (0..cache.n_layers())
        .map(|il| {
            let layer = cache.layer(il);
            let mut rows = vec![0.0f32; n * (dim_k + dim_v)];
            let (keys, values) = rows.split_at_mut(n * dim_k);
            let slots = positions.clone().flat_map(|pos| (0..n_kv_head).map(move |h| (h, pos)));
            for (i, (h, pos)) in slots.enumerate() {
                layer.key(h, pos, &mut keys[i * dim_k..][..dim_k]);
                layer.value(h, pos, &mut values[i * dim_v..][..dim_v]);
            }
            rows
        })
        .collect()
}

/// Adds the distances between `old` and `new` rows ([`read_rows`] of the
/// same positions) to `drift`, layer by layer.
pub fn add_drift(drift: &mut Vec<LayerDrift>, old: &[Vec<f32>], new: &[Vec<f32>], keys_len: usize) {
    drift.resize(old.len(), LayerDrift::default());
    for ((d, old), new) in drift.iter_mut().zip(old).zip(new) {
        d.keys.add(&old[..keys_len], &new[..keys_len]);
        d.values.add(&old[keys_len..], &new[keys_len..]);
    }
}
