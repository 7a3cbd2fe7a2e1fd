//! Attention over the KV cache.

pub mod dense;
