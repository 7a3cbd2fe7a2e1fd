//! Hostile and broken GGUF files: every one must give a typed error with a
//! one-line message, never a panic or an out-of-bounds read.

use std::path::{Path, PathBuf};

use sift::gguf::{GgufError, GgufFile};
use sift::model::{Model, ModelError};

/// Writes GGUF bytes by hand, so tests can say things no well-behaved writer would.
struct RawGguf {
    bytes: Vec<u8>,
}

impl RawGguf {
    fn header(magic: &[u8; 4], version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut bytes = magic.to_vec();
        bytes.extend(version.to_le_bytes());
        bytes.extend(n_tensors.to_le_bytes());
        bytes.extend(n_kv.to_le_bytes());
        Self { bytes }
    }

    fn string(mut self, s: &str) -> Self {
        self.bytes.extend((s.len() as u64).to_le_bytes());
        self.bytes.extend(s.as_bytes());
        self
    }

    fn kv_str(self, key: &str, value: &str) -> Self {
        let mut s = self.string(key);
        s.bytes.extend(8u32.to_le_bytes());
        s.string(value)
    }

    fn kv_u32(self, key: &str, value: u32) -> Self {
        let mut s = self.string(key);
        s.bytes.extend(4u32.to_le_bytes());
        s.bytes.extend(value.to_le_bytes());
        s
    }

    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut s = self.string(name);
        s.bytes.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            s.bytes.extend(d.to_le_bytes());
        }
        s.bytes.extend(ty.to_le_bytes());
        s.bytes.extend(offset.to_le_bytes());
        s
    }

    /// Pads to the 32-byte data alignment and appends `n` data bytes.
    fn data(mut self, n: usize) -> Self {
        while !self.bytes.len().is_multiple_of(32) {
            self.bytes.push(0);
        }
        self.bytes.extend((0..n).map(|i| (i % 7) as u8));
        self
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, &self.bytes).unwrap();
        path
    }
}

fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sift-gguf-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A well-formed one-tensor file: 8 F32 values.
fn valid() -> RawGguf {
    RawGguf::header(b"GGUF", 3, 1, 1).kv_str("general.architecture", "llama").tensor("w", &[8], 0, 0).data(32)
}

fn open_err(path: &Path) -> GgufError {
    match GgufFile::open(path) {
        Ok(_) => panic!("{} opened but should not have", path.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "message is not one line: {msg}");
            assert!(msg.contains(&path.display().to_string()), "message does not name the file: {msg}");
            e
        }
    }
}

#[test]
fn the_valid_file_opens() {
    let dir = scratch_dir("valid");
    let file = GgufFile::open(valid().write(&dir, "ok.gguf")).unwrap();
    let t = file.tensor("w").unwrap();
    assert_eq!(t.data.len(), 32);
    assert_eq!(file.str("general.architecture").unwrap(), Some("llama"));
}

#[test]
fn every_truncation_is_an_error() {
    let dir = scratch_dir("truncated");
    let full = valid().bytes;
    for len in 0..full.len() {
        let path = dir.join("cut.gguf");
        std::fs::write(&path, &full[..len]).unwrap();
        let e = open_err(&path);
        if len >= 4 {
            assert!(e.to_string().contains("truncated") || e.to_string().contains("past the end"), "len {len}: {e}");
        }
    }
}

#[test]
fn wrong_magic() {
    let dir = scratch_dir("magic");
    let path = RawGguf::header(b"GGML", 3, 0, 0).write(&dir, "magic.gguf");
    assert!(matches!(open_err(&path), GgufError::BadMagic { .. }));
    let text = dir.join("text.gguf");
    std::fs::write(&text, "hello, I am not a model").unwrap();
    assert!(matches!(open_err(&text), GgufError::BadMagic { .. }));
}

#[test]
fn unsupported_version() {
    let dir = scratch_dir("version");
    let path = RawGguf::header(b"GGUF", 99, 0, 0).write(&dir, "v99.gguf");
    assert!(matches!(open_err(&path), GgufError::Malformed { .. }));
}

#[test]
fn tensor_past_end_of_file() {
    let dir = scratch_dir("past-end");
    let path = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[8], 0, 4096).data(32).write(&dir, "past.gguf");
    let e = open_err(&path);
    assert!(matches!(e, GgufError::Malformed { .. } | GgufError::BadTensor { .. }), "{e}");
}

#[test]
fn misaligned_tensor_offset() {
    let dir = scratch_dir("misaligned");
    let path = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[8], 0, 4).data(64).write(&dir, "odd.gguf");
    let e = open_err(&path);
    assert!(e.to_string().contains("align"), "{e}");
}

#[test]
fn absurd_dimensions_overflow() {
    let dir = scratch_dir("absurd");
    for dims in [&[1u64 << 40, 1 << 40][..], &[u64::MAX][..], &[1 << 62, 8][..]] {
        let path = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", dims, 0, 0).data(32).write(&dir, "big.gguf");
        open_err(&path);
    }
}

#[test]
fn absurd_counts_and_lengths() {
    let dir = scratch_dir("counts");
    // A billion tensors, a string claiming 2^60 bytes, a huge metadata count.
    let many = RawGguf::header(b"GGUF", 3, 1 << 30, 0).data(0).write(&dir, "many.gguf");
    open_err(&many);
    let mut long = RawGguf::header(b"GGUF", 3, 0, 1);
    long.bytes.extend((1u64 << 60).to_le_bytes());
    open_err(&long.write(&dir, "long.gguf"));
    let kvs = RawGguf::header(b"GGUF", 3, 0, u64::MAX).write(&dir, "kvs.gguf");
    open_err(&kvs);
}

#[test]
fn unknown_tensor_type() {
    let dir = scratch_dir("type");
    let unknown = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[32], 99, 0).data(128).write(&dir, "t99.gguf");
    open_err(&unknown);
    // IQ2_XXS is a real GGUF type that sift does not compute with.
    let iq = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[256], 16, 0).data(66).write(&dir, "iq.gguf");
    let e = open_err(&iq);
    assert!(matches!(e, GgufError::UnsupportedType { .. }));
    assert!(e.to_string().contains("(it reads F32, F16, BF16, Q4_0"), "{e}");
    // Q3_K (type 11) is read.
    let q3 = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[256], 11, 0).data(110).write(&dir, "q3.gguf");
    GgufFile::open(&q3).unwrap();
}

#[test]
fn row_not_a_whole_number_of_blocks() {
    let dir = scratch_dir("blocks");
    // Q8_0 rows must be multiples of 32 elements.
    let path = RawGguf::header(b"GGUF", 3, 1, 0).tensor("w", &[40], 8, 0).data(64).write(&dir, "q8.gguf");
    assert!(matches!(open_err(&path), GgufError::BadTensor { .. } | GgufError::Malformed { .. }));
}

#[test]
fn missing_architecture_key() {
    let dir = scratch_dir("arch");
    let path = RawGguf::header(b"GGUF", 3, 1, 0)
        .tensor("token_embd.weight", &[8, 4], 0, 0)
        .data(128)
        .write(&dir, "noarch.gguf");
    let file = GgufFile::open(&path).unwrap();
    match Model::load(&file) {
        Err(ModelError::Gguf(GgufError::MissingKey { key, .. })) => assert_eq!(key, "general.architecture"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a model without an architecture loaded"),
    }
}

#[test]
fn unknown_architecture() {
    let dir = scratch_dir("unknown-arch");
    let path = RawGguf::header(b"GGUF", 3, 1, 1)
        .kv_str("general.architecture", "mamba9")
        .tensor("token_embd.weight", &[8, 4], 0, 0)
        .data(128)
        .write(&dir, "mamba.gguf");
    let file = GgufFile::open(&path).unwrap();
    let e = Model::load(&file).err().expect("unknown architecture must not load");
    assert!(matches!(e, ModelError::UnknownArch { .. }), "{e}");
    assert!(e.to_string().contains("mamba9"), "{e}");
}

#[test]
fn wrong_key_type_and_missing_tensor() {
    let dir = scratch_dir("key-type");
    let path = RawGguf::header(b"GGUF", 3, 1, 2)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.embedding_length", 8)
        .tensor("token_embd.weight", &[8, 4], 0, 0)
        .data(128)
        .write(&dir, "partial.gguf");
    let file = GgufFile::open(&path).unwrap();
    assert!(matches!(file.str("llama.embedding_length"), Err(GgufError::WrongKeyType { .. })));
    assert!(matches!(file.tensor("output.weight"), Err(GgufError::MissingTensor { .. })));
    let e = Model::load(&file).err().expect("a model missing its keys must not load");
    assert!(matches!(e, ModelError::Gguf(GgufError::MissingKey { .. })), "{e}");
}

#[test]
fn not_a_file() {
    let dir = scratch_dir("not-a-file");
    assert!(matches!(open_err(&dir), GgufError::IsDirectory { .. }));
    assert!(matches!(open_err(&dir.join("nope.gguf")), GgufError::Io { .. }));
}
