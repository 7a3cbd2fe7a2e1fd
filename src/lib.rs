//! sift: CPU-first inference for GGUF language models.
//!
//! Reading order: [`gguf`] maps a model file; [`model`] turns its metadata and
//! tensors into a transformer and runs the forward pass top-down, calling
//! [`matmul`] for quantized products and [`attn`] for attention over the
//! [`kv`] cache; [`engine`] drives prefill and decoding for a session, and [`rectify`] refreshes
//! what sparse decoding wrote to the cache;
//! [`sample`] picks tokens, within what a [`structured`] output's grammar allows (and [`tools`]
//! asks for calls that way);
//! [`tokenizer`] maps text to ids and back; [`generate`] runs the loop of the two, and [`chat`]
//! renders conversations for it;
//! [`conversation`] keeps a session's cache across the requests of a conversation, for the
//! command line and for [`serve`], the HTTP server, which also [`embed`]s texts; [`audit`] records a
//! generation token by token.

// The docs are read with private items (`cargo doc --document-private-items`):
// a module's notes name its private helpers.
#![allow(rustdoc::private_intra_doc_links)]

pub mod attn;
pub mod audit;
pub mod chat;
pub mod conversation;
pub mod embed;
pub mod engine;
pub mod generate;
pub mod gguf;
pub mod gpu;
pub mod kv;
pub mod matmul;
pub mod model;
pub mod perplexity;
pub mod prompt_cache;
pub mod rectify;
pub mod sample;
pub mod serve;
pub mod structured;
pub mod threads;
pub mod tokenizer;
pub mod tools;
