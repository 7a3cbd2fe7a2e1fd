//! How byte-pair vocabularies cut text into words before merging, per `tokenizer.ggml.pre`.
//!
//! The regexes are llama.cpp's, which in turn come from each model's `tokenizer.json` (case-insensitive
//! contractions spelled out as character classes). Names listed together behave identically in llama.cpp.

/// One pre-tokenizer: the splitting regexes and the flags llama.cpp attaches to the name.
#[derive(Debug)]
pub(super) struct Pre {
    /// Applied in order; each one splits the pieces the previous one left, keeping both what it
    /// matched and the text in between.
    pub regexes: &'static [&'static str],
    /// A word that is a token as a whole is taken as is, without merging its characters.
    pub ignore_merges: bool,
    /// Whether a BOS token goes in front when encoding with specials.
    pub bos: Bos,
    /// The Gemma 4 style: spaces become U+2581 and text stays UTF-8 (no GPT-2 byte alphabet), with
    /// `<0xXX>` tokens for characters the vocabulary lacks.
    pub marks_spaces: bool,
}

/// Whether encoding with specials puts a BOS token first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bos {
    /// Only if `add_bos_token` says so.
    Off,
    /// Unless `add_bos_token` says otherwise.
    On,
    /// Whatever the file says: llama.cpp overrides Gemma 4 files that say no.
    Always,
}

const fn plain(regexes: &'static [&'static str]) -> Pre {
    Pre { regexes, ignore_merges: false, bos: Bos::Off, marks_spaces: false }
}

const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const PORO_REGEX: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";

static DEFAULT: Pre = plain(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"]);
static LLAMA3: Pre = Pre { ignore_merges: true, bos: Bos::On, ..plain(&[LLAMA3_REGEX]) };
static DBRX: Pre = plain(&[LLAMA3_REGEX]);
static GPT2: Pre = plain(&[GPT2_REGEX]);
static STARCODER: Pre = plain(&[r"\p{N}", GPT2_REGEX]);
static QWEN2: Pre = plain(&[
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]);
static FALCON: Pre = plain(&[
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    "[0-9][0-9][0-9]",
]);
static DEEPSEEK_CODER: Pre = plain(&[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"]);
static DEEPSEEK3: Pre = plain(&[
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
]);
static TEKKEN: Pre = Pre {
    ignore_merges: true,
    bos: Bos::On,
    ..plain(&[
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ])
};
static GPT4O: Pre = plain(&[
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]);
static PORO: Pre = plain(&[PORO_REGEX]);
static VIKING: Pre = plain(&[PORO_REGEX, r"\p{N}"]);
/// BPE over whole lines: newlines are the only split.
pub(super) static GEMMA4: Pre = Pre { bos: Bos::Always, marks_spaces: true, ..plain(&["[^\n]+|[\n]+"]) };

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value; a vocabulary without one gets
/// `default`.
pub(super) fn lookup(name: Option<&str>) -> Option<&'static Pre> {
    Some(match name.unwrap_or("default") {
        "default" => &DEFAULT,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => &LLAMA3,
        "dbrx" | "smaug-bpe" => &DBRX,
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "jina-v1-en"
        | "jina-v2-code" | "roberta-bpe" | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" | "exaone4" => &GPT2,
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => &STARCODER,
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" | "hunyuan" => &QWEN2,
        "falcon" => &FALCON,
        "deepseek-coder" => &DEEPSEEK_CODER,
        "deepseek-v3" | "hunyuan-dense" => &DEEPSEEK3,
        "tekken" => &TEKKEN,
        "gpt-4o" | "llama4" => &GPT4O,
        "poro-chat" | "bloom" | "gpt3-finnish" => &PORO,
        "viking" => &VIKING,
        "gemma4" => &GEMMA4,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;

    #[test]
    fn every_regex_compiles() {
        let names = "default llama3 dbrx gpt-2 starcoder qwen2 falcon deepseek-coder deepseek-v3 tekken gpt-4o poro-chat viking gemma4";
        for name in names.split(' ') {
            for regex in super::lookup(Some(name)).expect(name).regexes {
                let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false);
                assert!(split.is_ok(), "{name}: {regex}");
            }
        }
    }
}
