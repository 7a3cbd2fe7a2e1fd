//! Arbitrary text through a real SentencePiece-style vocabulary (and back):
//! encoding and decoding must never panic. The vocabulary is llama.cpp's
//! `ggml-vocab-llama-spm.gguf` from ../shared, or `SIFT_FUZZ_VOCAB`.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use sift::gguf::GgufFile;
use sift::tokenizer::{TextStream, Tokenizer};

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = std::env::var("SIFT_FUZZ_VOCAB").unwrap_or_else(|_| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/tokenizer-vectors/ggml-vocab-llama-spm.gguf").into()
        });
        let file = GgufFile::open(&path).expect("open the fuzz vocabulary");
        Tokenizer::from_gguf(&file).expect("build the fuzz tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, text)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(text);
    let tokenizer = tokenizer();
    if let Ok(ids) = tokenizer.encode(&text, flags & 1 != 0, flags & 2 != 0) {
        let _ = tokenizer.decode(&ids);
        let mut stream = TextStream::new(tokenizer);
        for &id in &ids {
            let _ = stream.push(id);
        }
        let _ = stream.finish();
    }
});
