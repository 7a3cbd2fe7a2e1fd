//! Any bytes given to the GGUF loader, and then to the model and tokenizer
//! builders, must produce a value or an error, never a panic or a bad read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sift::gguf::GgufFile;
use sift::model::Model;
use sift::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    // The loader maps files, so the input goes through one (in memory on Linux).
    let path = std::env::temp_dir().join(format!("sift-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, data).expect("write the fuzz input");
    if let Ok(file) = GgufFile::open(&path) {
        let _ = Model::load(&file);
        let _ = Tokenizer::from_gguf(&file);
    }
});
