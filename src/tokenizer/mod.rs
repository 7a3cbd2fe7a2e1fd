//! Text to token ids and back, with the vocabulary stored in the GGUF file.
//!
//! llama.cpp is the reference: the same text must give the same ids. The `tokenizers` crate does
//! the tokenizing; [`pipeline`] assembles it from the GGUF tables, after [`vocab`] has read them
//! with the adjustments llama.cpp's loader makes (which tokens end generation, which count as
//! control). Decoding is llama.cpp's too: a token stands for a fixed string of bytes, and text is
//! those bytes in a row.

mod pipeline;
mod pre;
mod stream;
mod vocab;

use std::path::PathBuf;

use tokenizers::{AddedVocabulary, Model, OffsetReferential, OffsetType, PreTokenizer};

use crate::gguf::{GgufError, GgufFile};
pub use stream::TextStream;
use vocab::{Attr, Vocab};

/// Why a vocabulary could not be loaded or a text not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tokenizer model '{model}' is not supported (sift reads llama, gpt2 and gemma4)")]
    UnsupportedModel { path: PathBuf, model: String },
    #[error("{path}: pre-tokenizer '{pre}' is not supported")]
    UnsupportedPreTokenizer { path: PathBuf, pre: String },
    #[error("{path}: '{key}' has {len} entries for {tokens} tokens")]
    TooShort { path: PathBuf, key: &'static str, len: usize, tokens: usize },
    #[error("{path}: token {id} repeats token {first}, {text:?}")]
    DuplicateToken { path: PathBuf, text: String, first: u32, id: u32 },
    #[error("{path}: encoding adds a {role} token, but '{key}' is not set")]
    MissingSpecial { path: PathBuf, role: &'static str, key: &'static str },
    #[error("{path}: cannot build the tokenizer: {reason}")]
    Build { path: PathBuf, reason: String },
    #[error("cannot tokenize: {0}")]
    Encode(String),
}

/// A model's tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    /// The user-defined tokens alone: what is matched in the raw text when specials are not parsed.
    user_defined: AddedVocabulary,
    vocab: Vocab,
}

impl Tokenizer {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let (vocab, algorithm) = vocab::read(file)?;
        let (hf, user_defined) = pipeline::build(&vocab, algorithm)
            .map_err(|e| TokenizerError::Build { path: file.path().to_path_buf(), reason: e.to_string() })?;
        Ok(Self { hf, user_defined, vocab })
    }

    /// llama.cpp's `llama_tokenize`. `add_special` puts BOS first and EOS last where the vocabulary
    /// asks for them; `parse_special` turns the text of a control token such as `<start_of_turn>`
    /// into that token (user-defined tokens are recognised either way).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let specials = if parse_special { self.hf.get_added_vocabulary() } else { &self.user_defined };
        let fail = |e: tokenizers::Error| TokenizerError::Encode(e.to_string());
        let mut pieces = specials.extract_and_normalize(self.hf.get_normalizer(), text);
        if let Some(pre_tokenizer) = self.hf.get_pre_tokenizer() {
            pre_tokenizer.pre_tokenize(&mut pieces).map_err(fail)?;
        }
        pieces.tokenize(|piece| self.hf.get_model().tokenize(piece.get())).map_err(fail)?;

        let bos = self.vocab.bos.filter(|_| add_special && self.vocab.add_bos);
        let eos = self.vocab.eos.filter(|_| add_special && self.vocab.add_eos);
        let splits = pieces.get_splits(OffsetReferential::Original, OffsetType::None);
        let ids = splits.into_iter().flat_map(|(_, _, tokens)| tokens.iter().flatten().map(|token| token.id));
        Ok(bos.into_iter().chain(ids).chain(eos).collect())
    }

    /// The bytes token `id` stands for: spaces for U+2581 or GPT-2's byte alphabet decoded, the
    /// byte of a `<0xXX>` token, the text itself for control and user-defined tokens. Unused and
    /// unknown ids stand for nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let (Some(text), Some(&attr)) = (self.token_text(id), self.vocab.attrs.get(id as usize)) else {
            return Vec::new();
        };
        if attr.has(Attr::CONTROL | Attr::UNKNOWN | Attr::USER_DEFINED) {
            text.as_bytes().to_vec()
        } else if attr.has(Attr::NORMAL) {
            if self.vocab.marked_spaces {
                text.replace('▁', " ").into_bytes()
            } else {
                text.chars()
                    .flat_map(|c| gpt2_byte(c).map_or_else(|| c.to_string().into_bytes(), |b| vec![b]))
                    .collect()
            }
        } else if attr.has(Attr::BYTE) {
            text.get(3..5).and_then(|hex| u8::from_str_radix(hex, 16).ok()).into_iter().collect()
        } else {
            Vec::new()
        }
    }

    /// The text of a whole sequence, as llama.cpp's `llama_detokenize` shows it with specials
    /// rendered: the tokens' bytes in a row, less the space a SentencePiece prefix put in front of
    /// the first one. Bytes that are not valid UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id)).collect();
        if self.vocab.add_space_prefix && ids.first().is_some_and(|&id| self.token_bytes(id).starts_with(b" ")) {
            bytes.remove(0);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Whether [`encode`](Self::encode) puts BOS first when asked to add specials.
    pub fn adds_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether generation stops at `id`: EOS, end of turn, end of message and the other
    /// end-of-generation tokens llama.cpp recognises.
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// Whether `id` is a control token (`<start_of_turn>`, `<eos>`) or the unknown token: one that
    /// stands for no text a model writes.
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.attrs.get(id as usize).is_some_and(|attr| attr.has(Attr::CONTROL | Attr::UNKNOWN))
    }

    /// The Jinja chat template stored with the vocabulary.
    pub fn chat_template(&self) -> Option<&str> {
        self.vocab.chat_template.as_deref()
    }

    /// The token as the vocabulary writes it, e.g. "▁the" or "Ġthe".
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }
}

/// GPT-2's byte alphabet read backwards. Printable Latin-1 characters stand for their own byte;
/// the 68 other bytes (0x00-0x20, 0x7F-0xA0, 0xAD) were moved, in order, to U+0100 onwards.
fn gpt2_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let byte = match code {
        _ if printable(code) => code,
        0x100..=0x120 => code - 0x100,
        0x121..=0x142 => code - 0x121 + 0x7F,
        0x143 => 0xAD,
        _ => return None,
    };
    u8::try_from(byte).ok()
}
