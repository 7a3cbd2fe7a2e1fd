//! GGUF model files.
//!
//! The file is mapped once ([`mmap`]); gguf-rs-lib parses the header, the
//! metadata and the tensor table from that map; every tensor is then checked
//! (known type, row length a whole number of blocks, byte size consistent with
//! its shape, range inside the file, aligned) before anything computes on it.
//! Tensors are handed out as zero-copy [`TensorView`]s into the map.

mod mmap;

use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use gguf_rs_lib::format::metadata::MetadataValue;
use gguf_rs_lib::reader::GGUFFileReader;
use simd::WeightType;

use mmap::MappedFile;
pub use mmap::Residence;

/// Why a GGUF file could not be used. Every variant names the file, so the
/// message alone is a complete one-line diagnosis.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot open: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: is a directory, not a GGUF file")]
    IsDirectory { path: PathBuf },
    #[error("{path}: not a GGUF file (the first four bytes are not \"GGUF\")")]
    BadMagic { path: PathBuf },
    #[error("{path}: malformed GGUF: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: tensor '{tensor}' has type {ty}, which sift does not support (it reads {})", supported_types())]
    UnsupportedType { path: PathBuf, tensor: String, ty: String },
    #[error("{path}: tensor '{tensor}': {reason}")]
    BadTensor { path: PathBuf, tensor: String, reason: String },
    #[error("{path}: missing metadata key '{key}'")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key '{key}' should be {expected}")]
    WrongKeyType { path: PathBuf, key: String, expected: &'static str },
    #[error("{path}: missing tensor '{tensor}'")]
    MissingTensor { path: PathBuf, tensor: String },
}

/// The weight types sift reads, by GGML's names: "F32, F16, ..., Q6_K".
fn supported_types() -> String {
    WeightType::ALL.map(WeightType::name).join(", ")
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Where a tensor lives in the file and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub ty: WeightType,
    /// GGUF order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A tensor's bytes, borrowed from the map.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

/// An open, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: MappedFile,
    version: u32,
    metadata: HashMap<String, MetadataValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl GgufFile {
    /// Opens `path`, its bytes where [`Residence::Auto`] puts them.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_in(path, Residence::Auto)
    }

    /// Opens `path` with its bytes in `residence`.
    pub fn open_in(path: impl AsRef<Path>, residence: Residence) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if path.is_dir() {
            return Err(GgufError::IsDirectory { path });
        }
        let map = MappedFile::open(&path, residence).map_err(|source| GgufError::Io { path: path.clone(), source })?;
        let bytes = map.bytes();
        if bytes.len() < 4 || &bytes[..4] != b"GGUF" {
            return Err(GgufError::BadMagic { path });
        }
        let malformed = |reason: String| GgufError::Malformed { path: path.clone(), reason };
        let reader = GGUFFileReader::new(Cursor::new(bytes)).map_err(|e| malformed(describe_parse_error(e)))?;

        let version = reader.header().version;
        let data_start =
            to_usize(reader.tensor_data_offset()).ok_or_else(|| malformed("tensor data offset overflows".into()))?;
        let alignment = to_usize(reader.tensor_alignment()).ok_or_else(|| malformed("alignment overflows".into()))?;
        let metadata: HashMap<String, MetadataValue> =
            reader.metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect();

        let mut tensors = Vec::with_capacity(reader.tensor_count());
        for raw in reader.tensor_infos() {
            let name = raw.name().to_string();
            let bad = |reason: String| GgufError::BadTensor { path: path.clone(), tensor: name.clone(), reason };
            let ty_id = raw.tensor_type() as u32;
            let ty = WeightType::from_ggml_id(ty_id).ok_or_else(|| GgufError::UnsupportedType {
                path: path.clone(),
                tensor: name.clone(),
                ty: format!("{:?}", raw.tensor_type()),
            })?;
            let dims: Vec<usize> = raw
                .shape()
                .dims()
                .iter()
                .map(|&d| to_usize(d).filter(|&d| d > 0))
                .collect::<Option<_>>()
                .ok_or_else(|| bad(format!("dimension out of range in {:?}", raw.shape().dims())))?;
            let row_len = dims[0];
            let n_rows = dims[1..]
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
            let row_bytes = ty.row_bytes(row_len).ok_or_else(|| {
                bad(format!(
                    "row length {row_len} is not a multiple of the {}-element {} block",
                    ty.block_elems(),
                    ty.name()
                ))
            })?;
            let n_bytes = row_bytes.checked_mul(n_rows).ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
            let offset = to_usize(raw.data_offset())
                .and_then(|o| o.checked_add(data_start))
                .ok_or_else(|| bad("offset overflows".into()))?;
            if !offset.is_multiple_of(alignment) {
                return Err(bad(format!("data offset {offset} is not aligned to {alignment} bytes")));
            }
            match offset.checked_add(n_bytes) {
                Some(end) if end <= bytes.len() => {}
                _ => {
                    return Err(bad(format!(
                        "data [{offset}, {offset}+{n_bytes}) runs past the end of the file ({} bytes)",
                        bytes.len()
                    )))
                }
            }
            tensors.push(TensorInfo { name, ty, dims, offset, n_bytes });
        }
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { path, map, version, metadata, tensors, by_name })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn file_size(&self) -> usize {
        self.map.bytes().len()
    }

    /// A name for the file's content, for files made from it (prompt caches): its size and a
    /// 64-bit FNV-1a hash of its first 16 MiB (the header and vocabulary, and the first
    /// weights) and of 64 KiB at 16 places spread over the rest. Cheap even for a large model,
    /// and different for any other model file in practice.
    pub fn fingerprint(&self) -> String {
        const HEAD: usize = 16 << 20;
        const SAMPLE: usize = 64 << 10;
        let bytes = self.map.bytes();
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut add = |part: &[u8]| {
            for &b in part {
                hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        add(&bytes[..bytes.len().min(HEAD)]);
        let rest = bytes.len().saturating_sub(HEAD);
        for i in 0..16 {
            let at = HEAD + rest / 16 * i;
            add(&bytes[at.min(bytes.len())..(at + SAMPLE).min(bytes.len())]);
        }
        format!("{}:{hash:016x}", bytes.len())
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn metadata_keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.keys().map(String::as_str)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i = self
            .by_name
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })?;
        let info = &self.tensors[i];
        Ok(TensorView { info, data: &self.map.bytes()[info.offset..info.offset + info.n_bytes] })
    }

    /// A tensor that may be absent (an optional bias, a tied output head).
    pub fn optional_tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor(name).ok()
    }

    // ---- metadata, typed. `None` means absent; a present key of the wrong type is an error.

    pub fn value(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    pub fn u64(&self, key: &str) -> Result<Option<u64>> {
        self.value(key).map(|v| integer(v).ok_or_else(|| self.wrong(key, "an integer"))).transpose()
    }

    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.u64(key)?.map(|v| to_usize(v).ok_or_else(|| self.wrong(key, "an integer that fits in memory"))).transpose()
    }

    pub fn f32(&self, key: &str) -> Result<Option<f32>> {
        self.value(key)
            .map(|v| match v {
                MetadataValue::F32(x) => Some(*x),
                MetadataValue::F64(x) => Some(*x as f32),
                other => integer(other).map(|i| i as f32),
            })
            .map(|x| x.ok_or_else(|| self.wrong(key, "a number")))
            .transpose()
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.value(key)
            .map(|v| match v {
                MetadataValue::Bool(b) => Ok(*b),
                _ => Err(self.wrong(key, "a boolean")),
            })
            .transpose()
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>> {
        self.value(key)
            .map(|v| match v {
                MetadataValue::String(s) => Ok(s.as_str()),
                _ => Err(self.wrong(key, "a string")),
            })
            .transpose()
    }

    pub fn str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.array(key, "an array of strings", |v| match v {
            MetadataValue::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    pub fn f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.array(key, "an array of numbers", |v| match v {
            MetadataValue::F32(x) => Some(*x),
            MetadataValue::F64(x) => Some(*x as f32),
            other => integer(other).map(|i| i as f32),
        })
    }

    pub fn i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.array(key, "an array of integers", |v| match v {
            MetadataValue::I64(x) => Some(*x),
            other => integer(other).and_then(|u| i64::try_from(u).ok()).or(match other {
                MetadataValue::I8(x) => Some(*x as i64),
                MetadataValue::I16(x) => Some(*x as i64),
                MetadataValue::I32(x) => Some(*x as i64),
                _ => None,
            }),
        })
    }

    /// Like the getters above, but absence is an error.
    pub fn required<T>(&self, key: &str, get: impl FnOnce(&Self, &str) -> Result<Option<T>>) -> Result<T> {
        get(self, key)?.ok_or_else(|| self.missing(key))
    }

    pub fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey { path: self.path.clone(), key: key.to_string() }
    }

    fn array<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        item: impl Fn(&'a MetadataValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        self.value(key)
            .map(|v| match v {
                MetadataValue::Array(a) => {
                    a.values.iter().map(&item).collect::<Option<Vec<T>>>().ok_or_else(|| self.wrong(key, expected))
                }
                _ => Err(self.wrong(key, expected)),
            })
            .transpose()
    }

    fn wrong(&self, key: &str, expected: &'static str) -> GgufError {
        GgufError::WrongKeyType { path: self.path.clone(), key: key.to_string(), expected }
    }
}

/// Non-negative integers of any GGUF width.
fn integer(v: &MetadataValue) -> Option<u64> {
    match *v {
        MetadataValue::U8(x) => Some(x.into()),
        MetadataValue::U16(x) => Some(x.into()),
        MetadataValue::U32(x) => Some(x.into()),
        MetadataValue::U64(x) => Some(x),
        MetadataValue::I8(x) => u64::try_from(x).ok(),
        MetadataValue::I16(x) => u64::try_from(x).ok(),
        MetadataValue::I32(x) => u64::try_from(x).ok(),
        MetadataValue::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn to_usize(v: u64) -> Option<usize> {
    usize::try_from(v).ok()
}

fn describe_parse_error(e: gguf_rs_lib::error::GGUFError) -> String {
    use gguf_rs_lib::error::GGUFError as E;
    match e {
        E::UnexpectedEof => "file is truncated".to_string(),
        E::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => "file is truncated".to_string(),
        other => {
            let text = other.to_string();
            // The parser reads through a cursor, so a short read surfaces as an I/O error.
            if text.contains("failed to fill whole buffer") {
                "file is truncated".to_string()
            } else {
                text
            }
        }
    }
}
