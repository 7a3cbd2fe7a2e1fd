//! The one place where a model file becomes memory. Everything else reads
//! weights through the `&[u8]` this hands out.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

/// A read-only memory map of a whole file.
pub struct MappedFile {
    map: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only and private to this process. A file
        // truncated by another process while mapped would fault on access; that
        // is the documented limit of memory-mapped model loading (llama.cpp has
        // the same), and every range we index was checked against the length
        // the map had when it was created.
        let map = unsafe { Mmap::map(&file)? };
        Ok(Self { map })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}
