//! The `tokenizers` pipeline that tokenizes a GGUF vocabulary the way llama.cpp does.
//!
//! - Special tokens are matched in the raw text first (added tokens, never normalized).
//! - SentencePiece-style vocabularies: spaces become U+2581 (plus one in front of each stretch of
//!   text when `add_space_prefix`), then BPE over the whole stretch with merges derived from the
//!   token scores, falling back to `<0xXX>` byte tokens.
//! - BPE vocabularies: the pre-tokenizer regexes cut words, GPT-2's byte alphabet (or, Gemma 4
//!   style, U+2581 for spaces and byte fallback) and then the file's ranked merges.

use std::collections::HashSet;

use tokenizers::models::bpe::{self, BPE};
use tokenizers::normalizers::{self, Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, AddedVocabulary, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::pre::Pre;
use super::vocab::{Algorithm, Attr, Vocab};

/// The tokenizer, whose added vocabulary holds every special token (for `parse_special`), and
/// an added vocabulary of the user-defined tokens alone, which match even in plain text.
pub(super) fn build(
    vocab: &Vocab,
    algorithm: Algorithm,
) -> tokenizers::Result<(tokenizers::Tokenizer, AddedVocabulary)> {
    let ids: bpe::Vocab = vocab.tokens.iter().cloned().zip(0..).collect();
    let (model, normalizer, pre_tokenizer) = match algorithm {
        Algorithm::SentencePiece { scores } => {
            let merges = merges_from_scores(&vocab.tokens, &ids, &scores);
            let mut model = BPE::builder().vocab_and_merges(ids, merges).byte_fallback(true);
            if let Some(unk) = vocab.unk {
                model = model.unk_token(vocab.tokens[unk as usize].clone());
            }
            (model.build()?, Some(marked_spaces(vocab.add_space_prefix)?), None)
        }
        Algorithm::Bpe { pre, merges } => {
            let merges = formable(merges, &ids);
            let model = BPE::builder()
                .vocab_and_merges(ids, merges)
                .ignore_merges(pre.ignore_merges)
                .byte_fallback(pre.marks_spaces)
                .build()?;
            let normalizer = if pre.marks_spaces { Some(marked_spaces(false)?) } else { None };
            (model, normalizer, Some(words(pre)?))
        }
    };
    let mut hf = tokenizers::Tokenizer::new(model);
    hf.with_normalizer(normalizer).with_pre_tokenizer(pre_tokenizer);

    // llama.cpp matches control and unknown tokens only when parsing specials, user-defined ones always.
    let special = Attr::CONTROL | Attr::UNKNOWN;
    let added = |matches: &dyn Fn(Attr) -> bool| {
        let tokens: Vec<AddedToken> = (vocab.tokens.iter().zip(&vocab.attrs))
            .filter(|&(_, &attr)| matches(attr))
            .map(|(text, attr)| AddedToken::from(text.clone(), attr.has(special)).normalized(false))
            .collect();
        let mut added = AddedVocabulary::new();
        added.add_tokens(&tokens, hf.get_model(), None::<&NormalizerWrapper>);
        added
    };
    let every_special = added(&|attr| attr.has(special | Attr::USER_DEFINED));
    let user_defined = added(&|attr| attr.has(Attr::USER_DEFINED) && !attr.has(special));
    hf.with_added_vocabulary(every_special);
    Ok((hf, user_defined))
}

/// SentencePiece merges: every way to split a token into two tokens, ranked by the score of the
/// token they make. llama.cpp merges the best-scoring pair and, among equal scores, the leftmost
/// one; ranking longer results first among equal scores keeps equal-score runs (Llama's "▁▁▁…"
/// whitespace tokens) growing from the left, as that rule does.
fn merges_from_scores(tokens: &[String], ids: &bpe::Vocab, scores: &[f32]) -> Vec<(String, String)> {
    let mut merges: Vec<(usize, usize)> = Vec::new();
    for (id, text) in tokens.iter().enumerate() {
        for (cut, _) in text.char_indices().skip(1) {
            if ids.contains_key(&text[..cut]) && ids.contains_key(&text[cut..]) {
                merges.push((id, cut));
            }
        }
    }
    merges.sort_unstable_by(|&(a, _), &(b, _)| {
        scores[b].total_cmp(&scores[a]).then(tokens[b].len().cmp(&tokens[a].len())).then(a.cmp(&b))
    });
    merges.into_iter().map(|(id, cut)| (tokens[id][..cut].to_owned(), tokens[id][cut..].to_owned())).collect()
}

/// The merges the `tokenizers` crate accepts: both parts and the result must be tokens (true of
/// every merge in the vocabularies we test; the crate would refuse the whole list otherwise), and a
/// repeated pair keeps its first rank, as in llama.cpp.
fn formable(merges: Vec<(String, String)>, ids: &bpe::Vocab) -> Vec<(String, String)> {
    let mut seen = HashSet::new();
    merges
        .into_iter()
        .filter(|(left, right)| match (ids.get(left), ids.get(right)) {
            (Some(&l), Some(&r)) => ids.contains_key(&format!("{left}{right}")) && seen.insert((l, r)),
            _ => false,
        })
        .collect()
}

/// Spaces as U+2581, with one more in front of each stretch of text if `prefix`.
fn marked_spaces(prefix: bool) -> tokenizers::Result<NormalizerWrapper> {
    let replace = Replace::new(" ", "▁")?.into();
    Ok(if prefix {
        normalizers::Sequence::new(vec![Prepend::new("▁".into()).into(), replace]).into()
    } else {
        replace
    })
}

/// The pre-tokenizer: the regex splits, then GPT-2's byte alphabet unless spaces are marked.
fn words(pre: &Pre) -> tokenizers::Result<PreTokenizerWrapper> {
    let mut steps = Vec::with_capacity(pre.regexes.len() + 1);
    for regex in pre.regexes {
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)?;
        steps.push(split.into());
    }
    if !pre.marks_spaces {
        steps.push(ByteLevel::new(false, false, false).into());
    }
    Ok(Sequence::new(steps).into())
}
