//! Attention over the KV cache.

pub mod certified;
pub mod dense;
