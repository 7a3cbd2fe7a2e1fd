//! The one place where a model file becomes memory. Everything else reads
//! weights through the `&[u8]` this hands out.
//!
//! A decoding step streams every weight once, so it pays a TLB miss per 4 KiB
//! page of weights when the file is mapped. Read into anonymous memory backed
//! by transparent huge pages (2 MiB), the same stream runs about a tenth
//! faster on Zen 4, for the price of reading the whole file at start and
//! holding a private copy. [`Residence`] chooses.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use memmap2::{Mmap, MmapMut};

/// Where a model's bytes live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Residence {
    /// Huge pages if the kernel offers them (transparent huge pages
    /// `always` or `madvise`) and the file takes under half of the memory
    /// available; the mapped file otherwise.
    #[default]
    Auto,
    /// The file, mapped: pages load on first touch and stay shared with the
    /// page cache.
    Mapped,
    /// A private copy in anonymous memory advised for huge pages.
    HugePages,
}

/// A read-only view of a whole file, mapped or copied.
pub struct MappedFile {
    map: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path, residence: Residence) -> std::io::Result<Self> {
        let mut file = File::open(path)?;
        let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
        let copy = match residence {
            Residence::Mapped => false,
            Residence::HugePages => true,
            Residence::Auto => huge_pages_offered() && available_memory().is_some_and(|avail| len < avail / 2),
        };
        if copy && len > 0 {
            return Self::copy(&mut file, len);
        }
        // SAFETY: the map is read-only and private to this process. A file
        // truncated by another process while mapped would fault on access; that
        // is the documented limit of memory-mapped model loading (llama.cpp has
        // the same), and every range we index was checked against the length
        // the map had when it was created.
        let map = unsafe { Mmap::map(&file)? };
        Ok(Self { map })
    }

    /// `len` bytes of `file` read into anonymous memory advised for huge
    /// pages, then made read-only.
    fn copy(file: &mut File, len: usize) -> std::io::Result<Self> {
        let mut map = MmapMut::map_anon(len)?;
        #[cfg(target_os = "linux")]
        map.advise(memmap2::Advice::HugePage)?;
        file.read_exact(&mut map)?;
        Ok(Self { map: map.make_read_only()? })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Whether `madvise(MADV_HUGEPAGE)` can give this process huge pages.
fn huge_pages_offered() -> bool {
    let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    cfg!(target_os = "linux") && (setting.contains("[always]") || setting.contains("[madvise]"))
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
