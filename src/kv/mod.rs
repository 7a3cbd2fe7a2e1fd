//! The key/value cache: keys (after RoPE) and values of every layer, in
//! pages of [`PAGE`] tokens allocated once for the whole context.
//!
//! Each layer is a [`PagedLayer`] in the cache's [`KvMode`]
//! (`--kv-cache f16|q8|q4|q2`): exact f16 rows, or, in the quantized modes,
//! all but the newest pages quantized KIVI-style by [`quant`], with the key
//! [`sketch`] that bounds scores for certified attention. Global layers have
//! a page for every context position; sliding-window layers keep a ring of
//! the pages their window and one batch can touch, so their memory does not
//! grow with the context.

use std::io::{self, Read, Write};

pub mod page;
pub mod quant;
pub mod sketch;

pub use page::{KeyCover, KvMode, PagedLayer, Rows, Settled, Storage};
pub use sketch::{Bounds, KeySketch, PageKeys, ScanQuery, PAGE};

#[derive(Clone)]
pub struct KvCache {
    n_ctx: usize,
    mode: KvMode,
    layers: Vec<PagedLayer>,
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
    pub fn new(shape: &CacheShape, storage: Storage, n_ctx: usize, max_batch: usize) -> Self {
        let layers =
            shape.windows.iter().map(|&window| PagedLayer::new(storage, shape, window, n_ctx, max_batch)).collect();
        Self { n_ctx, mode: storage.mode, layers }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn mode(&self) -> KvMode {
        self.mode
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn layer(&self, il: usize) -> &PagedLayer {
        &self.layers[il]
    }

    pub fn layer_mut(&mut self, il: usize) -> &mut PagedLayer {
        &mut self.layers[il]
    }

    /// Every layer, to fill them in parallel.
    pub fn layers_mut(&mut self) -> &mut [PagedLayer] {
        &mut self.layers
    }

    /// Forgets positions from `len` on in every layer, so that they can be
    /// stored anew; nothing changes unless every layer can.
    pub fn truncate(&mut self, len: usize) -> Result<(), Settled> {
        self.check_truncate(len)?;
        self.layers.iter_mut().try_for_each(|layer| layer.truncate(len))
    }

    /// Whether [`Self::truncate`] to `len` would succeed.
    pub fn check_truncate(&self, len: usize) -> Result<(), Settled> {
        self.layers.iter().try_for_each(|layer| layer.check_truncate(len))
    }

    /// Writes what the cache holds, layer by layer (counters, then buffers as bytes), for
    /// [`Self::read_from`].
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        self.layers.iter().try_for_each(|layer| layer.write_to(w))
    }

    /// Reads what [`Self::write_to`] wrote, into a cache built with the same shape, storage,
    /// context and batch, which then holds positions `0..len` in every layer. After an error
    /// the cache holds nothing usable: truncate it to 0.
    pub fn read_from(&mut self, r: &mut impl Read, len: usize) -> io::Result<()> {
        self.layers.iter_mut().try_for_each(|layer| layer.read_from(r, len))
    }

    /// Everything the cache allocated.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(PagedLayer::bytes).sum()
    }
}

impl CacheShape {
    /// What each further token of context costs in `storage` (a mode
    /// alone: its default storage), all layers together: a page of the
    /// global layers over its tokens (sliding layers do not grow).
    pub fn bytes_per_token(&self, storage: impl Into<Storage>) -> f64 {
        let global = self.windows.iter().filter(|w| w.is_none()).count();
        (global * self.n_kv_head) as f64 * PagedLayer::page_bytes(storage.into(), self) as f64 / PAGE as f64
    }
}
