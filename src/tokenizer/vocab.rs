//! The vocabulary tables of a GGUF file, read and adjusted the way llama.cpp's loader does.

use std::collections::{BTreeSet, HashMap};
use std::ops::{BitOr, BitOrAssign};

use super::pre::{self, Bos, Pre};
use super::TokenizerError;
use crate::gguf::{self, GgufError, GgufFile};

/// llama.cpp's token attributes. A set, not a single type: the loader can make a user-defined
/// token control as well.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Attr(u8);

impl Attr {
    pub const UNDEFINED: Attr = Attr(0);
    pub const NORMAL: Attr = Attr(1);
    pub const UNKNOWN: Attr = Attr(2);
    pub const CONTROL: Attr = Attr(4);
    pub const USER_DEFINED: Attr = Attr(8);
    pub const UNUSED: Attr = Attr(16);
    pub const BYTE: Attr = Attr(32);

    /// From `tokenizer.ggml.token_type`.
    fn from_type(token_type: i64) -> Attr {
        match token_type {
            1 => Attr::NORMAL,
            2 => Attr::UNKNOWN,
            3 => Attr::CONTROL,
            4 => Attr::USER_DEFINED,
            5 => Attr::UNUSED,
            6 => Attr::BYTE,
            _ => Attr::UNDEFINED,
        }
    }

    /// Whether any of the attributes in `set` is present.
    pub fn has(self, set: Attr) -> bool {
        self.0 & set.0 != 0
    }
}

impl BitOr for Attr {
    type Output = Attr;
    fn bitor(self, other: Attr) -> Attr {
        Attr(self.0 | other.0)
    }
}

impl BitOrAssign for Attr {
    fn bitor_assign(&mut self, other: Attr) {
        self.0 |= other.0;
    }
}

/// How text becomes tokens; only needed while the `tokenizers` pipeline is built.
pub(super) enum Algorithm {
    /// `llama`: SentencePiece-style, merging the pair whose merged token scores highest.
    SentencePiece { scores: Vec<f32> },
    /// `gpt2` and `gemma4`: ranked merges over the words a pre-tokenizer cut.
    Bpe { pre: &'static Pre, merges: Vec<(String, String)> },
}

/// What the tokenizer keeps of the vocabulary.
#[derive(Clone)]
pub(super) struct Vocab {
    pub tokens: Vec<String>,
    pub attrs: Vec<Attr>,
    /// Token texts write a space as U+2581, not in GPT-2's byte alphabet.
    pub marked_spaces: bool,
    /// SentencePiece's leading space: added to every stretch of text, dropped again when decoding.
    pub add_space_prefix: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// The tokens that end generation.
    pub eog: BTreeSet<u32>,
    pub chat_template: Option<String>,
}

/// Token texts that end generation whatever the file says (llama.cpp keeps this list by hand);
/// they also become control tokens.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle markers, by key or else by text (the text found becomes control); the
/// flag says whether the role also ends generation.
const FIM_ROLES: [(&str, bool, &[&str]); 6] = [
    (
        "tokenizer.ggml.fim_pre_token_id",
        false,
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_suf_token_id",
        false,
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_mid_token_id",
        false,
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    ("tokenizer.ggml.fim_pad_token_id", true, &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    ("tokenizer.ggml.fim_rep_token_id", true, &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    ("tokenizer.ggml.fim_sep_token_id", true, &["<|file_sep|>"]),
];

/// Reads the `tokenizer.*` keys of `file`.
pub(super) fn read(file: &GgufFile) -> Result<(Vocab, Algorithm), TokenizerError> {
    let model = required(file, "tokenizer.ggml.model", GgufFile::str)?;
    let tokens = token_texts(file)?;
    let n = tokens.len();
    let ids = index(file, &tokens)?;
    let mut attrs = match file.i64_array("tokenizer.ggml.token_type")? {
        Some(types) => {
            per_token(file, "tokenizer.ggml.token_type", types, n)?.into_iter().map(Attr::from_type).collect()
        }
        None => vec![Attr::NORMAL; n],
    };

    // llama.cpp's default BOS, EOS and unknown ids, used where the file names none.
    let (algorithm, [bos, eos, unk]) = match model {
        "llama" => {
            let scores = match file.f32_array("tokenizer.ggml.scores")? {
                Some(scores) => per_token(file, "tokenizer.ggml.scores", scores, n)?,
                None => vec![0.0; n],
            };
            (Algorithm::SentencePiece { scores }, [Some(1), Some(2), Some(0)])
        }
        "gpt2" => {
            let name = file.str("tokenizer.ggml.pre")?;
            let pre = pre::lookup(name).ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
                path: file.path().to_path_buf(),
                pre: name.unwrap_or_default().into(),
            })?;
            (Algorithm::Bpe { pre, merges: read_merges(file)? }, [Some(11), Some(11), None])
        }
        "gemma4" => (Algorithm::Bpe { pre: &pre::GEMMA4, merges: read_merges(file)? }, [None; 3]),
        other => return Err(TokenizerError::UnsupportedModel { path: file.path().to_path_buf(), model: other.into() }),
    };
    let (bos_default, marked_spaces, space_prefix_default) = match &algorithm {
        Algorithm::SentencePiece { .. } => (Bos::On, true, true),
        Algorithm::Bpe { pre, .. } => (pre.bos, pre.marks_spaces, false),
    };
    let bos = special_id(file, "tokenizer.ggml.bos_token_id", n, bos)?;
    let eos = special_id(file, "tokenizer.ggml.eos_token_id", n, eos)?;
    let unk = special_id(file, "tokenizer.ggml.unknown_token_id", n, unk)?;
    let eog = generation_ends(file, &ids, &mut attrs, eos)?;

    let add_bos = match bos_default {
        Bos::Always => true,
        default => file.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default == Bos::On),
    };
    let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    for (adds, id, role, key) in
        [(add_bos, bos, "BOS", "tokenizer.ggml.bos_token_id"), (add_eos, eos, "EOS", "tokenizer.ggml.eos_token_id")]
    {
        if adds && id.is_none() {
            return Err(TokenizerError::MissingSpecial { path: file.path().to_path_buf(), role, key });
        }
    }

    let vocab = Vocab {
        add_space_prefix: file.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(space_prefix_default),
        chat_template: file.str("tokenizer.chat_template")?.map(String::from),
        tokens,
        attrs,
        marked_spaces,
        bos,
        eos,
        unk,
        add_bos,
        add_eos,
        eog,
    };
    Ok((vocab, algorithm))
}

/// `tokenizer.ggml.tokens`; llama.cpp names empty tokens rather than leave them unmatchable.
fn token_texts(file: &GgufFile) -> Result<Vec<String>, TokenizerError> {
    let texts = required(file, "tokenizer.ggml.tokens", GgufFile::str_array)?;
    let name = |(id, text): (usize, &str)| if text.is_empty() { format!("[EMPTY_{id}]") } else { text.to_owned() };
    Ok(texts.into_iter().enumerate().map(name).collect())
}

/// Token ids by text; two tokens with one text are an error, as in llama.cpp.
fn index<'a>(file: &GgufFile, tokens: &'a [String]) -> Result<HashMap<&'a str, u32>, TokenizerError> {
    let mut ids = HashMap::with_capacity(tokens.len());
    for (id, text) in (0..).zip(tokens) {
        if let Some(first) = ids.insert(text.as_str(), id) {
            let path = file.path().to_path_buf();
            return Err(TokenizerError::DuplicateToken { path, text: text.clone(), first, id });
        }
    }
    Ok(ids)
}

/// A table with a value per token: longer is tolerated, shorter is not.
fn per_token<T>(file: &GgufFile, key: &'static str, mut values: Vec<T>, n: usize) -> Result<Vec<T>, TokenizerError> {
    if values.len() < n {
        return Err(TokenizerError::TooShort { path: file.path().to_path_buf(), key, len: values.len(), tokens: n });
    }
    values.truncate(n);
    Ok(values)
}

/// A special token's id from `key`, else `default`. Like llama.cpp, ids out of range are ignored.
fn special_id(file: &GgufFile, key: &str, n: usize, default: Option<u32>) -> Result<Option<u32>, TokenizerError> {
    let in_range = |id: u64| (id < n as u64).then_some(id as u32);
    Ok(file.u64(key)?.and_then(in_range).or(default.and_then(|id| in_range(id.into()))))
}

/// The tokens that end generation, found as llama.cpp's loader finds them: by key, by a list of
/// texts (which also makes them control tokens), minus two model-specific exceptions.
fn generation_ends(
    file: &GgufFile,
    ids: &HashMap<&str, u32>,
    attrs: &mut [Attr],
    eos: Option<u32>,
) -> Result<BTreeSet<u32>, TokenizerError> {
    let n = attrs.len();
    let mut eog = BTreeSet::new();
    for (key, ends_generation, texts) in FIM_ROLES {
        let id = match special_id(file, key, n, None)? {
            Some(id) => Some(id),
            None => {
                let found = texts.iter().filter_map(|text| ids.get(text).copied()).min();
                if let Some(id) = found {
                    attrs[id as usize] |= Attr::CONTROL;
                }
                found
            }
        };
        if ends_generation {
            eog.extend(id);
        }
    }
    for text in EOG_TEXTS {
        if let Some(&id) = ids.get(text) {
            eog.insert(id);
            attrs[id as usize] |= Attr::CONTROL;
        }
    }
    // gpt-oss: these markers are always rendered and matched as plain user-defined tokens.
    for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(&id) = ids.get(text) {
            attrs[id as usize] = Attr::USER_DEFINED;
        }
    }
    let eot = special_id(file, "tokenizer.ggml.eot_token_id", n, None)?;
    let eom = special_id(file, "tokenizer.ggml.eom_token_id", n, None)?;
    eog.extend([eos, eot, eom].into_iter().flatten());

    let in_eog = |eog: &BTreeSet<u32>, text: &str| ids.get(text).copied().filter(|id| eog.contains(id));
    // Harmony-style vocabularies end a message with <|end|> but generation only with <|return|>
    // or a tool call.
    let has_call = in_eog(&eog, "<|call|>").or(in_eog(&eog, "<|calls|>")).is_some();
    let has_stop = in_eog(&eog, "<|return|>").or(in_eog(&eog, "<|flush|>")).is_some();
    if let Some(end) = in_eog(&eog, "<|end|>").filter(|_| has_call && has_stop) {
        eog.remove(&end);
        attrs[end as usize] = Attr::USER_DEFINED;
    }
    // Gemma 4 has a plain-text </s>.
    if let Some(s) = in_eog(&eog, "</s>").filter(|_| in_eog(&eog, "<|tool_response>").is_some()) {
        eog.remove(&s);
        attrs[s as usize] = Attr::NORMAL;
    }
    Ok(eog)
}

/// `tokenizer.ggml.merges`: "left right", cut at the first space after the first character (a
/// merge can begin with a space).
fn read_merges(file: &GgufFile) -> Result<Vec<(String, String)>, TokenizerError> {
    let merges = required(file, "tokenizer.ggml.merges", GgufFile::str_array)?;
    Ok(merges
        .into_iter()
        .filter_map(|merge| {
            let (cut, _) = merge.char_indices().skip(1).find(|&(_, c)| c == ' ')?;
            Some((merge[..cut].to_owned(), merge[cut + 1..].to_owned()))
        })
        .collect())
}

/// A key that must be there. (`GgufFile::required` cannot hand out values borrowed from the file.)
fn required<'a, T>(
    file: &'a GgufFile,
    key: &str,
    get: impl FnOnce(&'a GgufFile, &str) -> gguf::Result<Option<T>>,
) -> Result<T, TokenizerError> {
    get(file, key)?.ok_or_else(|| GgufError::MissingKey { path: file.path().to_path_buf(), key: key.to_owned() }.into())
}
