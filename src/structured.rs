//! Structured output: replies held to a JSON Schema or a grammar.
//!
//! Before each token is sampled, every token that cannot continue a text the grammar accepts gets
//! a logit of −∞, so that whatever the sampler then does (greedy, top-k, top-p, penalties), it
//! picks one that can. End-of-generation tokens are allowed only where the text so far is
//! complete; once the grammar can take nothing more, they are all that is allowed, and the reply
//! ends there. A reply can still be cut short by the token limit, a stop string or a full context,
//! and is then incomplete.
//!
//! The grammar engine is llguidance: it compiles a JSON Schema or a Lark grammar and computes each
//! step's set of allowed tokens from a trie of the vocabulary's byte strings
//! ([`Tokenizer::token_bytes`]). Control tokens enter the trie marked as special, so that no
//! grammar's text can be spelled with them; the model's end-of-generation tokens are the trie's
//! end tokens.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// What a reply must be.
#[derive(Debug, Clone)]
pub enum Format {
    /// A JSON value valid under this JSON Schema (`{"type": "object"}`: any object).
    JsonSchema(serde_json::Value),
    /// A text of this Lark grammar, in llguidance's dialect (`start: ...`, regular expressions
    /// between slashes, `%json {...}` for a JSON Schema inside it).
    Lark(String),
}

/// Why a grammar could not be compiled or followed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(String);

impl GrammarError {
    /// llguidance's message on one line: a syntax error's message spreads over lines, with the
    /// text quoted and a caret under the place, which a one-line error leaves out.
    fn from(e: impl std::fmt::Display) -> Self {
        let message = e.to_string();
        let lines: Vec<&str> =
            message.lines().map(str::trim).filter(|l| !l.trim_matches(['^', '~']).is_empty()).collect();
        Self(lines.join(" "))
    }
}

/// Compiles grammars for one tokenizer. Building it (the vocabulary's trie, and the slices of it
/// that make each step's mask fast) takes a moment for a large vocabulary: build it once.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let n_vocab = tokenizer.vocab_size() as u32;
        let words: Vec<Vec<u8>> = (0..n_vocab)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_control(id) {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &bytes].concat()
                } else {
                    bytes
                }
            })
            .collect();
        let eog: Vec<u32> = (0..n_vocab).filter(|&id| tokenizer.is_eog(id)).collect();
        let Some(&first) = eog.first() else {
            return Err(GrammarError("the vocabulary has no end-of-generation token to end a reply with".into()));
        };
        let mut info = TokRxInfo::new(n_vocab, first);
        info.tok_bos = tokenizer.bos();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(GrammarError::from)?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// Compiles `format`; a schema or grammar llguidance cannot read is an error naming why.
    pub fn compile(&self, format: &Format) -> Result<Grammar, GrammarError> {
        let grammar = match format {
            Format::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_bounded_whitespace(schema)),
            Format::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::from(e)),
            None => Ok(Grammar { matcher }),
        }
    }
}

/// The whitespace allowed between two tokens of JSON, where a schema does not say otherwise: one
/// space, or one or two line breaks and an indent of at most 20 (llama.cpp's JSON grammars allow
/// as much). A small model left free to indent may go on writing blank lines for ever.
const JSON_WHITESPACE: &str = r"\x20|\x0A{1,2}[\x20\x09]{0,20}";

/// `schema` with llguidance's JSON options set to [`JSON_WHITESPACE`], unless it sets its own
/// (`"x-guidance": {...}`).
fn with_bounded_whitespace(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }));
    }
    schema
}

/// A compiled grammar, ready to hold any number of replies to it.
pub struct Grammar {
    /// At the start of a reply; each reply follows a copy.
    matcher: Matcher,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// A reply's way through the grammar, from its start.
    pub fn start(&self) -> GrammarState {
        GrammarState { matcher: self.matcher.deep_clone() }
    }
}

/// Where a reply stands in its grammar.
pub struct GrammarState {
    matcher: Matcher,
}

impl GrammarState {
    /// Sets the logit of every token the grammar does not allow next to −∞ (`logits` may be
    /// longer than the vocabulary: the ids past it are never allowed).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(GrammarError::from)?;
        if allowed.num_set() == 0 {
            return Err(GrammarError("the grammar allows no token here".into()));
        }
        // The mask keeps a bit per token, 32 to a word (none past the vocabulary); a word of all
        // ones leaves its 32 logits as they are.
        let words = allowed.as_slice();
        for (i, logits) in logits.chunks_mut(32).enumerate() {
            let word = words.get(i).copied().unwrap_or(0);
            if word != u32::MAX {
                for (bit, logit) in logits.iter_mut().enumerate() {
                    if word >> bit & 1 == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(())
    }

    /// Moves past `token`, which [`Self::mask`] allowed (an end-of-generation token ends the
    /// reply and is not passed here).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher.consume_token(token).map_err(GrammarError::from)
    }
}
