//! The tokenizer against llama.cpp: its test vectors for five vocabularies plus Gemma 3, the
//! prompt ids of the reference runs, decoding, streaming, and broken vocabularies.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sift::gguf::GgufFile;
use sift::tokenizer::{TextStream, Tokenizer, TokenizerError};

/// Between two test inputs in a `.inp` file.
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

use common::{gemma3_tokenizer as gemma3, tokenizer as load};

fn vectors_dir(test: &str) -> Option<PathBuf> {
    Some(common::shared_dir(test)?.join("data/tokenizer-vectors"))
}

/// llama.cpp's cases for `name`: the inputs split on the separator (a separator at the very end
/// closes the last input rather than opening an empty one), and one line of expected ids each.
fn cases(dir: &Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        let path = dir.join(format!("{name}.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let inputs = read("inp");
    let inputs = inputs.strip_suffix(SEPARATOR).unwrap_or(&inputs);
    let expected: Vec<Vec<u32>> = read("out")
        .lines()
        .map(|line| line.split_whitespace().map(|id| id.parse().expect("a token id")).collect())
        .collect();
    let inputs: Vec<String> = inputs.split(SEPARATOR).map(String::from).collect();
    assert_eq!(inputs.len(), expected.len(), "{name}: inputs and expected lines differ in number");
    inputs.into_iter().zip(expected).collect()
}

/// Every case of `name` tokenizes (no BOS, specials as plain text) to llama.cpp's ids, and
/// decoding those ids gives the input back.
fn check_vectors(tokenizer: &Tokenizer, dir: &Path, name: &str) {
    let cases = cases(dir, name);
    let mut failures = Vec::new();
    for (text, expected) in &cases {
        let ids = tokenizer.encode(text, false, false).unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
        if &ids != expected {
            failures.push(format!("{text:?}\n    llama.cpp {expected:?}\n    sift      {ids:?}"));
        } else if tokenizer.decode(&ids) != *text {
            failures.push(format!("{text:?} decodes to {:?}", tokenizer.decode(&ids)));
        }
    }
    assert!(failures.is_empty(), "{name}: {} of {} cases fail:\n{}", failures.len(), cases.len(), failures.join("\n"));
    eprintln!("{name}: all {} cases match llama.cpp", cases.len());
}

fn vocabulary(test: &str, vocab: &str) -> Option<Tokenizer> {
    let dir = vectors_dir(test)?;
    let name = format!("ggml-vocab-{vocab}.gguf");
    let tokenizer = load(&dir.join(&name));
    check_vectors(&tokenizer, &dir, &name);
    Some(tokenizer)
}

#[test]
fn llama_spm_vocabulary() {
    vocabulary("llama_spm_vocabulary", "llama-spm");
}

#[test]
fn llama_bpe_vocabulary() {
    vocabulary("llama_bpe_vocabulary", "llama-bpe");
}

#[test]
fn qwen2_vocabulary() {
    let qwen = vocabulary("qwen2_vocabulary", "qwen2");
    assert!(qwen.is_none_or(|qwen| qwen.chat_template().is_some_and(|template| template.contains("<|im_start|>"))));
}

#[test]
fn gpt2_vocabulary() {
    vocabulary("gpt2_vocabulary", "gpt-2");
}

#[test]
fn gemma4_vocabulary() {
    vocabulary("gemma4_vocabulary", "gemma-4");
}

#[test]
fn gemma3_vocabulary() {
    let Some(dir) = vectors_dir("gemma3_vocabulary") else { return };
    check_vectors(gemma3(), &dir, "gemma-3-270m-Q4_K_M.gguf");
}

/// The reference runs' prompts, tokenized with BOS as llama.cpp did.
fn prompt_ids(tokenizer: &Tokenizer, reference: &Path) {
    let json = common::read_json(reference);
    let variants = json["variants"].as_object().expect("variants");
    for case in variants.values().flat_map(|variant| variant["cases"].as_array().expect("cases")) {
        let prompt = case["prompt"].as_str().expect("prompt");
        let expected: Vec<u32> =
            case["prompt_ids"].as_array().expect("prompt_ids").iter().map(|id| id.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode(prompt, true, false).unwrap(), expected, "{}: {prompt:?}", reference.display());
    }
}

#[test]
fn gemma3_prompts() {
    let Some(shared) = common::shared_dir("gemma3_prompts") else { return };
    prompt_ids(gemma3(), &shared.join("anchors/reference/gemma3-270m-greedy.json"));
}

/// A whole book, CRLF line ends and all, counted as `llama-tokenize --show-count` did.
#[test]
fn gemma3_book() {
    let Some(shared) = common::shared_dir("gemma3_book") else { return };
    let book = std::fs::read_to_string(shared.join("data/pg19/10321.txt")).unwrap();
    let gemma = gemma3();
    let start = Instant::now();
    let ids = gemma.encode(&book, true, true).unwrap();
    eprintln!("Gemma 3: {} bytes in {} tokens, {:.2?}", book.len(), ids.len(), start.elapsed());
    assert_eq!(ids.len(), 89_935);
    assert_eq!(gemma.decode(&ids[1..]), book);
}

#[test]
fn tiny_llama_prompts() {
    let Some(shared) = common::shared_dir("tiny_llama_prompts") else { return };
    let tokenizer = load(&shared.join("anchors/models/tiny-llama.gguf"));
    prompt_ids(&tokenizer, &shared.join("anchors/reference/tiny-llama-greedy.json"));
}

#[test]
fn tiny_qwen2_prompts() {
    let Some(shared) = common::shared_dir("tiny_qwen2_prompts") else { return };
    let qwen = load(&shared.join("anchors/models/tiny-qwen2.gguf"));
    prompt_ids(&qwen, &shared.join("anchors/reference/tiny-qwen2-greedy.json"));
    // The end-of-generation set llama.cpp reported for this vocabulary; 128247 is a plain "</s>".
    let eog: Vec<u32> = (0..qwen.vocab_size() as u32).filter(|&id| qwen.is_eog(id)).collect();
    assert_eq!(eog, [128_247, 151_643, 151_645]);
    assert_eq!(qwen.bos(), Some(151_643));
}

/// A wall-clock bound, so it is run by hand on a quiet machine (`--ignored`): under CI's load the
/// build of the 262,144-token vocabulary has taken 6.8 s.
#[test]
#[ignore = "wall-clock bound; run on a quiet machine"]
fn gemma3_tokenizer_builds_quickly() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let start = Instant::now();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let took = start.elapsed();
    eprintln!("Gemma 3 tokenizer, {} tokens, built in {took:.2?}", tokenizer.vocab_size());
    assert!(took < Duration::from_secs(5), "building the Gemma 3 tokenizer took {took:.2?}");
}

#[test]
fn gemma3_special_tokens() {
    let gemma = gemma3();
    assert_eq!((gemma.vocab_size(), gemma.bos(), gemma.eos()), (262_144, Some(2), Some(1)));
    let eog: Vec<u32> = (0..262_144).filter(|&id| gemma.is_eog(id)).collect();
    assert_eq!(eog, [1, 106, 212]);

    let turn = "<start_of_turn>user\nHi<end_of_turn>\n";
    let parsed = gemma.encode(turn, true, true).unwrap();
    assert_eq!(parsed[..3], [2, 105, 2364]);
    assert_eq!(parsed[parsed.len() - 2..], [106, 107]);
    assert_eq!(gemma.decode(&parsed), format!("<bos>{turn}"));
    // As plain text the markers are spelled out, but "\n" is a user-defined token either way.
    let plain = gemma.encode(turn, false, false).unwrap();
    assert!(!plain.contains(&105) && !plain.contains(&106) && plain.contains(&107));
    assert_eq!(gemma.decode(&plain), turn);
    // "</s>" became a control token when llama.cpp made it end generation; "<s>" stays user-defined.
    assert_eq!(gemma.encode("<s>", false, false).unwrap(), [203]);
    assert_ne!(gemma.encode("</s>", false, false).unwrap(), [212]);
    assert_eq!(gemma.encode("</s>", false, true).unwrap(), [212]);
}

#[test]
fn stream_holds_back_split_characters() {
    let Some(dir) = vectors_dir("stream_holds_back_split_characters") else { return };
    // Llama's 32000 tokens have no 🦙: after the prefix space it is spelled as four byte tokens.
    let llama = load(&dir.join("ggml-vocab-llama-spm.gguf"));
    let ids = llama.encode("🦙 and ü", false, false).unwrap();
    let mut stream = TextStream::new(&llama);
    let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
    assert_eq!(pieces[..6], [" ", "", "", "", "🦙", " and"], "{ids:?}");
    assert_eq!(pieces.concat() + &stream.finish(), " 🦙 and ü");
    assert_eq!(llama.decode(&ids), "🦙 and ü");

    let mut cut = TextStream::new(&llama);
    assert_eq!(cut.push(ids[1]) + &cut.push(ids[2]), "");
    assert_eq!(cut.finish(), "\u{FFFD}");
}

/// A GGUF file of metadata only.
struct TempGguf(PathBuf);

#[derive(Clone, Copy)]
enum Value<'a> {
    U32(u32),
    Str(&'a str),
    Strs(&'a [&'a str]),
    F32s(&'a [f32]),
}

impl TempGguf {
    fn new(name: &str, kvs: &[(&str, Value)]) -> Self {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (key, value) in kvs {
            string(&mut out, key);
            match value {
                Value::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Value::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Value::Strs(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|s| string(&mut out, s));
                }
                Value::F32s(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(6u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
            }
        }
        let path = std::env::temp_dir().join(format!("sift-tokenizer-{}-{name}.gguf", std::process::id()));
        std::fs::write(&path, out).unwrap();
        Self(path)
    }

    fn tokenizer(&self) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_gguf(&GgufFile::open(&self.0).unwrap())
    }
}

impl Drop for TempGguf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Loading a vocabulary made of `kvs` fails, saying `message`.
fn fails(name: &str, kvs: &[(&str, Value)], message: &str) -> TokenizerError {
    let error = TempGguf::new(name, kvs).tokenizer().err().unwrap_or_else(|| panic!("{name}: loaded"));
    assert!(error.to_string().contains(message), "{name}: {error}");
    error
}

#[test]
fn broken_vocabularies_are_errors() {
    use Value::{F32s, Str, Strs, U32};
    let llama = ("tokenizer.ggml.model", Str("llama"));
    let tokens = ("tokenizer.ggml.tokens", Strs(&["<unk>", "a"]));
    fails("no-model", &[("general.architecture", Str("llama"))], "missing metadata key 'tokenizer.ggml.model'");
    fails("model-type", &[("tokenizer.ggml.model", U32(1))], "'tokenizer.ggml.model' should be a string");
    fails("no-tokens", &[llama], "missing metadata key 'tokenizer.ggml.tokens'");
    let types = ("tokenizer.ggml.token_type", Strs(&["normal", "normal"]));
    fails("type-type", &[llama, tokens, types], "'tokenizer.ggml.token_type' should be an array of integers");
    let scores = ("tokenizer.ggml.scores", F32s(&[0.0]));
    fails("short-scores", &[llama, tokens, scores], "'tokenizer.ggml.scores' has 1 entries for 2 tokens");
    fails("twice", &[llama, ("tokenizer.ggml.tokens", Strs(&["a", "a"]))], "token 1 repeats token 0");
    fails(
        "no-merges",
        &[("tokenizer.ggml.model", Str("gpt2")), tokens],
        "missing metadata key 'tokenizer.ggml.merges'",
    );
    let gemma4 = [("tokenizer.ggml.model", Str("gemma4")), tokens, ("tokenizer.ggml.merges", Strs(&[]))];
    fails("no-bos", &gemma4, "adds a BOS token, but 'tokenizer.ggml.bos_token_id' is not set");
    let bert = fails("bert", &[("tokenizer.ggml.model", Str("bert")), tokens], "'bert' is not supported");
    assert!(matches!(bert, TokenizerError::UnsupportedModel { .. }));
}
