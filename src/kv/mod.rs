//! The key/value cache: f16 keys (after RoPE) and values for every layer,
//! allocated once for the whole context.
//!
//! Layout per layer and KV head: one contiguous run of slots, each slot one
//! position's `head_dim` values, so attention for a head streams memory in
//! order. Global layers have a slot per context position. Sliding-window
//! layers keep a ring of `window + batch` slots (position `p` lives in slot
//! `p % capacity`): enough that no key a query of the current batch can see
//! is overwritten by a later token of the same batch, and their memory does
//! not grow with the context.
//!
//! [`page::PagedLayer`] stores a layer in pages of [`PAGE`] tokens in any
//! [`KvMode`] (`--kv-cache f16|q8|q4|q2`), quantized KIVI-style by [`quant`],
//! with the key [`sketch`] that bounds scores for certified attention.

pub mod page;
pub mod quant;
pub mod sketch;

pub use page::{KvMode, PagedLayer, Storage};
pub use sketch::{Bounds, KeySketch, PageKeys, ScanQuery, PAGE};

use std::ops::Range;

use half::f16;

pub struct LayerCache {
    n_kv_head: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    capacity: usize,
    window: Option<usize>,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl LayerCache {
    fn new(n_kv_head: usize, head_dim_k: usize, head_dim_v: usize, capacity: usize, window: Option<usize>) -> Self {
        Self {
            n_kv_head,
            head_dim_k,
            head_dim_v,
            capacity,
            window,
            k: vec![f16::ZERO; n_kv_head * capacity * head_dim_k],
            v: vec![f16::ZERO; n_kv_head * capacity * head_dim_v],
        }
    }

    /// Stores one token's keys and values (all KV heads, concatenated).
    pub fn store(&mut self, pos: usize, keys: &[f32], values: &[f32]) {
        let slot = pos % self.capacity;
        for h in 0..self.n_kv_head {
            let (dk, dv) = (self.head_dim_k, self.head_dim_v);
            let k_dst = &mut self.k[(h * self.capacity + slot) * dk..][..dk];
            for (d, &s) in k_dst.iter_mut().zip(&keys[h * dk..(h + 1) * dk]) {
                *d = f16::from_f32(s);
            }
            let v_dst = &mut self.v[(h * self.capacity + slot) * dv..][..dv];
            for (d, &s) in v_dst.iter_mut().zip(&values[h * dv..(h + 1) * dv]) {
                *d = f16::from_f32(s);
            }
        }
    }

    /// The positions a query at `pos` attends to: causal, and within the
    /// window on sliding layers (a key `w` or more positions back is out).
    pub fn visible(&self, pos: usize) -> std::ops::Range<usize> {
        let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        first..pos + 1
    }

    /// The key rows of `positions` for one head, in order: one run, or two
    /// where the ring wraps (the second is empty otherwise).
    pub fn keys(&self, head: usize, positions: Range<usize>) -> (&[f16], &[f16]) {
        self.runs(&self.k, self.head_dim_k, head, positions)
    }

    /// The value rows of `positions`, as [`Self::keys`] gives the keys.
    pub fn values(&self, head: usize, positions: Range<usize>) -> (&[f16], &[f16]) {
        self.runs(&self.v, self.head_dim_v, head, positions)
    }

    fn runs<'a>(&self, data: &'a [f16], dim: usize, head: usize, positions: Range<usize>) -> (&'a [f16], &'a [f16]) {
        assert!(positions.len() <= self.capacity, "more positions than the ring holds");
        let ring = &data[head * self.capacity * dim..][..self.capacity * dim];
        let start = positions.start % self.capacity;
        let first = positions.len().min(self.capacity - start);
        (&ring[start * dim..][..first * dim], &ring[..(positions.len() - first) * dim])
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<f16>()
    }
}

pub struct KvCache {
    n_ctx: usize,
    layers: Vec<LayerCache>,
}

/// The shape of a model's cache; see [`crate::model::Model::cache_shape`].
pub struct CacheShape {
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// `Some(window)` for each sliding-window layer.
    pub windows: Vec<Option<usize>>,
}

impl KvCache {
    /// `max_batch` is the most tokens one forward step appends.
    pub fn new(shape: &CacheShape, n_ctx: usize, max_batch: usize) -> Self {
        let layers = shape
            .windows
            .iter()
            .map(|&window| {
                let capacity = window.map_or(n_ctx, |w| (w + max_batch).min(n_ctx));
                LayerCache::new(shape.n_kv_head, shape.head_dim_k, shape.head_dim_v, capacity, window)
            })
            .collect();
        Self { n_ctx, layers }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn layer(&self, il: usize) -> &LayerCache {
        &self.layers[il]
    }

    pub fn layer_mut(&mut self, il: usize) -> &mut LayerCache {
        &mut self.layers[il]
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::bytes).sum()
    }
}
