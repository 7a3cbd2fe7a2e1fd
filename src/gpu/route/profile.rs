//! The latency profile: measured sparse-attention kernel times per
//! (pattern, budget, length bucket) on one adapter, which the router uses in
//! place of FLOP counts.
//!
//! `sift gpu-profile` measures it and writes it to a file named after the
//! adapter, the driver, the kernel path, the head shape and a digest of the
//! attention kernels' and the probe's source and the candidate library (under
//! `$SIFT_CACHE_DIR`, else `$XDG_CACHE_HOME/sift`, else `~/.cache/sift`);
//! a routed prefill reads it, and refuses to route without one. Each entry is
//! the median GPU time of one dispatch over every KV head of the shape,
//! divided by their number, for a mask of that pattern and budget whose
//! content is synthetic (vertical-slash columns spread uniformly, half of its
//! diagonals next to the main one and half spread; block-sparse blocks spread
//! uniformly), with the keys that mask visits. The kernel's time follows the
//! keys a query block lists, so the router prices a real mask at the
//! measured time per visited key of its pattern and budget: for A-shape and
//! block-sparse the budget fixes the keys, for vertical-slash it does not
//! (diagonals far apart cover more key blocks than adjacent ones). The
//! probe's and index builders' time per layer is measured at each bucket
//! too. Between buckets times are interpolated linearly in the length;
//! beyond the measured ones they are scaled by the length (by its square for
//! dense, not at all per key).

use std::path::{Path, PathBuf};

use half::f16;
use serde::{Deserialize, Serialize};

use super::candidates::{Candidate, HeadLines, Pattern};
use super::index::{BlockSparse, Mask, SparseIndex, Union, VerticalSlash};
use super::probe::{ProbeKernels, ProbeRows, COLUMNS};
use crate::gpu::attention::{Attention, AttentionShape, BLOCK};
use crate::gpu::{GpuContext, GpuError, KernelPath};

/// GPU time each measurement runs untimed first, ms.
const WARM_UP_MS: f64 = 300.0;

/// The length buckets `sift gpu-profile` measures by default.
pub const BUCKETS: [u32; 6] = [4096, 8192, 16384, 32768, 65536, 131072];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyProfile {
    pub adapter: String,
    pub driver: String,
    pub path: String,
    pub head_dim: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub entries: Vec<Entry>,
    /// The probe and index builders, per layer.
    pub probe: Vec<ProbeEntry>,
    /// The sparse kernel listing every key block up to the diagonal, per KV
    /// head: not a candidate, the measure of the kernel's own price per key
    /// against the dense kernel's (absent from older profiles).
    #[serde(default)]
    pub listed_dense: Vec<ProbeEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub pattern: Pattern,
    pub budget: [u32; 2],
    pub tokens: u32,
    /// Median kernel time per KV head, µs.
    pub us: f64,
    /// Keys the measured mask visits per KV head ([`Mask::visited_keys`]);
    /// 0 in profiles written before it was recorded.
    #[serde(default)]
    pub keys: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProbeEntry {
    pub tokens: u32,
    pub us: f64,
}

impl LatencyProfile {
    /// Where the profile of this adapter and head shape lives. The name holds
    /// a digest of the attention kernels' and the probe's WGSL as this build
    /// compiles them and of the candidate library, so a build whose kernels
    /// changed (and with them the time per key the router prices each pattern
    /// at, or the probe's) or whose library did measures its own profile
    /// instead of reading an older build's.
    pub fn file(ctx: &GpuContext, path: KernelPath, head_dim: u32, n_head: u32, n_kv_head: u32) -> PathBuf {
        let name = format!(
            "gpu-profile-{}-{}-{}-{}-d{head_dim}-h{n_head}x{n_kv_head}-k{:016x}.json",
            ctx.info.name,
            ctx.info.driver,
            ctx.info.driver_info,
            path.name(),
            kernels_digest(path, head_dim)
        );
        let safe: String =
            name.chars().map(|c| if c.is_ascii_alphanumeric() || ".-_".contains(c) { c } else { '_' }).collect();
        cache_dir().join(safe)
    }

    pub fn load(file: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))
    }

    pub fn save(&self, file: &Path) -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(file, serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n")
    }

    /// The kernel time per KV head of `c` over `tokens` positions, µs.
    pub fn time_us(&self, c: Candidate, tokens: u32) -> Option<f64> {
        let points: Vec<(u32, f64)> = self
            .entries
            .iter()
            .filter(|e| e.pattern == c.pattern && e.budget == c.budget)
            .map(|e| (e.tokens, e.us))
            .collect();
        let power = if c.pattern == Pattern::Dense { 2 } else { 1 };
        interpolate(&points, tokens, power)
    }

    /// The kernel time per KV head of `mask`, candidate `c`'s mask for the
    /// query blocks `query_blocks` of a call over `tokens` positions, µs: the
    /// measured time per visited key of `c` at this length times the keys
    /// `mask` visits. So a chunk of a few query blocks is priced for those
    /// (dense included); and the keys a budget takes are fixed for A-shape and
    /// block-sparse, but vertical-slash's diagonals cover more key blocks the
    /// further apart they are. Profiles without key counts price whole calls.
    pub fn mask_time_us(
        &self,
        c: Candidate,
        mask: &Mask,
        query_blocks: std::ops::Range<u32>,
        tokens: u32,
    ) -> Option<f64> {
        let per_key: Vec<(u32, f64)> = self
            .entries
            .iter()
            .filter(|e| e.pattern == c.pattern && e.budget == c.budget && e.keys > 0.0)
            .map(|e| (e.tokens, e.us / e.keys))
            .collect();
        match interpolate(&per_key, tokens, 0) {
            None => self.time_us(c, tokens),
            Some(us_per_key) => Some(us_per_key * mask.visited_keys(query_blocks)),
        }
    }

    /// The probe's and index builders' time per layer, µs.
    pub fn probe_us(&self, tokens: u32) -> Option<f64> {
        let points: Vec<(u32, f64)> = self.probe.iter().map(|e| (e.tokens, e.us)).collect();
        interpolate(&points, tokens, 1)
    }

    /// Measures every candidate of the library at every bucket up to
    /// `max_tokens`, `runs` timed runs after a warm-up.
    pub fn measure(
        ctx: &GpuContext,
        path: KernelPath,
        (n_head, n_kv_head, head_dim): (u32, u32, u32),
        buckets: &[u32],
        runs: usize,
    ) -> Result<Self, GpuError> {
        let kernel_error =
            |e: crate::gpu::KernelError| GpuError::Kernel { kernel: "gpu-profile".into(), reason: e.to_string() };
        let attention = Attention::sparse(&ctx.device, path, head_dim, n_head / n_kv_head).map_err(kernel_error)?;
        let dense = Attention::new(&ctx.device, path, head_dim, n_head / n_kv_head).map_err(kernel_error)?;
        // Chunks of queries whose f32 output fits one binding, in whole blocks.
        let binding = ctx.limits.max_storage_buffer_binding_size.min(ctx.limits.max_buffer_size);
        let widest = ((binding / (n_head as u64 * head_dim as u64 * 4)) as u32 / BLOCK * BLOCK).max(BLOCK);
        let probe = ProbeKernels::new(ctx, head_dim)?;
        let mut profile = Self {
            adapter: ctx.info.name.clone(),
            driver: format!("{} {}", ctx.info.driver, ctx.info.driver_info),
            path: path.name().into(),
            head_dim,
            n_head,
            n_kv_head,
            entries: Vec::new(),
            probe: Vec::new(),
            listed_dense: Vec::new(),
        };
        let d = head_dim as usize;
        for &n in buckets {
            eprintln!("gpu-profile: {n} tokens");
            let scale = 1.0 / (head_dim as f32).sqrt();
            let shapes: Vec<AttentionShape> = (0..n)
                .step_by(widest as usize)
                .map(|pos0| AttentionShape { n: widest.min(n - pos0), pos0, n_head, n_kv_head, window: None, scale })
                .collect();
            let shape = shapes[0];
            let rows = attention.query_rows(&shape) as usize;
            let keys = n.next_multiple_of(BLOCK) as usize;
            let noise = |len: usize, seed: u64| -> Vec<f16> {
                let mut s = seed;
                (0..len)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        f16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                    })
                    .collect()
            };
            let q = ctx.upload("profile q", &noise(rows * n_head as usize * d, 1))?;
            let k = ctx.upload("profile k", &noise(keys * n_kv_head as usize * d, 2))?;
            let v = ctx.upload("profile v", &noise(keys * n_kv_head as usize * d, 3))?;
            let o = ctx.storage::<f32>("profile o", rows * n_head as usize * d)?;
            // The median time of a mask's dispatches over every chunk, after
            // a warm-up of at least WARM_UP_MS of them (the clock climbs back
            // from idle over some 0.1–0.5 s of work).
            let time = |mask: &Mask, sparse: bool| -> Result<f64, GpuError> {
                let masks = vec![Some(mask); n_kv_head as usize];
                let gpu_index = SparseIndex::new(&masks, n).upload(ctx)?;
                let buffers = gpu_index.buffers();
                let bind = match sparse {
                    false => dense.bind(&ctx.device, &q, &k, &v, &o),
                    true => attention.bind_sparse(&ctx.device, [&q, &k, &v, &o], &buffers),
                };
                let sizes = [q.size(), k.size(), v.size(), o.size()];
                let run = || -> Result<f64, GpuError> {
                    let mut batch = ctx.batch();
                    batch.mark();
                    for shape in &shapes {
                        batch
                            .record("attention", |pass| match sparse {
                                false => dense.dispatch(pass, &bind, shape, sizes),
                                true => attention.dispatch_sparse(pass, &bind, shape, sizes, &buffers),
                            })
                            .map_err(kernel_error)?;
                    }
                    batch.mark();
                    let started = std::time::Instant::now();
                    let marks = batch.submit_timed()?;
                    Ok(marks.and_then(|m| m.first().copied()).unwrap_or_else(|| started.elapsed().as_secs_f64() * 1e3))
                };
                let mut warm = 0.0;
                while warm < WARM_UP_MS {
                    let ms = run()?;
                    // A software adapter's every run is long; one warms nothing.
                    warm += ms.max(WARM_UP_MS / 4.0);
                }
                let samples = (0..runs).map(|_| run()).collect::<Result<Vec<f64>, _>>()?;
                gpu_index.recycle(ctx);
                Ok(median(&samples))
            };
            for c in Candidate::library() {
                let mask = synthetic_mask(c, n);
                // Dense is timed on the dense kernel, which is what a dense layer runs.
                let us = time(&mask, c.pattern != Pattern::Dense)? * 1e3 / n_kv_head as f64;
                let keys = mask.visited_keys(0..n.div_ceil(BLOCK));
                profile.entries.push(Entry { pattern: c.pattern, budget: c.budget, tokens: n, us, keys });
            }
            // Every key block through the sparse kernel: the same keys as the
            // dense kernel's, so the two times' ratio is the sparse kernel's
            // own price per key, apart from which blocks a mask lists.
            let us = time(&Mask::Dense, true)? * 1e3 / n_kv_head as f64;
            profile.listed_dense.push(ProbeEntry { tokens: n, us });
            let probe_rows = ProbeRows::new(0, shape.n, 32, 16);
            let mut samples = Vec::new();
            for run in 0..=runs {
                let mut p = probe.run(ctx, &shape, &probe_rows, &q, &k)?;
                let lines: Vec<HeadLines> = (0..n_kv_head as usize).map(|h| HeadLines::new(&p, h)).collect();
                let ranked: Vec<&[u32]> = lines.iter().map(|l| &l.columns[..]).collect();
                probe.column_masses(ctx, &shape, &probe_rows, &q, &k, &mut p, &ranked)?;
                if run > 0 {
                    samples.push(p.probe_ms + p.index_ms);
                }
                p.release(ctx);
            }
            profile.probe.push(ProbeEntry { tokens: n, us: median(&samples) * 1e3 });
            for b in [q, k, v, o] {
                ctx.recycle(b);
            }
        }
        Ok(profile)
    }
}

/// FNV-1a over the dense and the sparse attention kernel's source and header
/// on `path` at `head_dim`, the probe's shaders and the candidate library:
/// stable across builds and toolchains, changed by any edit of the shaders
/// they are made of, and by a library with other candidates (which an older
/// profile has no times for).
fn kernels_digest(path: KernelPath, head_dim: u32) -> u64 {
    let library = format!("{:?}", Candidate::library());
    [false, true]
        .into_iter()
        .map(|sparse| crate::gpu::attention::shader(path, head_dim, 1, sparse))
        .flat_map(|(source, header)| header.into_bytes().into_iter().chain(source.bytes()))
        .chain(super::probe::SOURCES.iter().flat_map(|s| s.bytes()))
        .chain(library.into_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3))
}

/// `$SIFT_CACHE_DIR`, else `$XDG_CACHE_HOME/sift`, else `~/.cache/sift`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SIFT_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("sift")))
        .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/sift")))
        .unwrap_or_else(|| PathBuf::from(".sift-cache"))
}

/// The median of `samples` (the upper one of an even count; 0 for none).
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

/// Linear between measured lengths; proportional to `tokens^power` outside them.
fn interpolate(points: &[(u32, f64)], tokens: u32, power: i32) -> Option<f64> {
    let mut points = points.to_vec();
    points.sort_by_key(|p| p.0);
    let (first, last) = (*points.first()?, *points.last()?);
    let x = tokens as f64;
    if tokens <= first.0 {
        return Some(first.1 * (x / first.0 as f64).powi(power));
    }
    if tokens >= last.0 {
        return Some(last.1 * (x / last.0 as f64).powi(power));
    }
    let i = points.iter().position(|p| p.0 >= tokens)?;
    let ((x0, y0), (x1, y1)) = (points[i - 1], points[i]);
    Some(y0 + (y1 - y0) * (x - x0 as f64) / (x1 - x0) as f64)
}

/// A mask of `c`'s pattern and budget with made-up content over `n` positions.
fn synthetic_mask(c: Candidate, n: u32) -> Mask {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
    let mut next = |below: u32| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % below.max(1) as u64) as u32
    };
    match c.pattern {
        Pattern::Dense => Mask::Dense,
        Pattern::AShape => Mask::AShape { sink_blocks: c.budget[0], local_blocks: c.budget[1] },
        Pattern::VerticalSlash => Mask::VerticalSlash(synthetic_slash(c.budget, n, &mut next)),
        Pattern::BlockSparse => {
            Mask::BlockSparse(BlockSparse::new(&distinct_blocks(n, c.budget[0] as usize, &mut next)))
        }
        // Every block listed in a random order, so that the union takes its
        // `extra` from them whatever the diagonals cover (the GPU's lists hold
        // 800).
        Pattern::Union => Mask::Union(Union {
            slash: synthetic_slash([COLUMNS as u32, c.budget[1]], n, &mut next),
            ranked: BlockSparse::new(&distinct_blocks(n, usize::MAX, &mut next)),
            extra: c.budget[0] as usize,
        }),
    }
}

/// Vertical-slash with `budget` (columns, diagonals) over `n` positions:
/// columns spread uniformly, half of the diagonals next to the main one and
/// half spread.
fn synthetic_slash(budget: [u32; 2], n: u32, next: &mut impl FnMut(u32) -> u32) -> VerticalSlash {
    let near = budget[1] / 2;
    let mut diagonals: Vec<u32> = (0..near.min(n)).collect();
    diagonals.extend((near..budget[1]).map(|_| next(n)));
    let columns: Vec<u32> = (0..budget[0]).map(|_| next(n)).collect();
    VerticalSlash::new(columns, diagonals)
}

/// Per query block of `n` positions, up to `take` distinct blocks between the
/// sink block and the diagonal, as the GPU's selection lists them, so that a
/// mask visits the keys it is counted for (drawn with repeats, a budget near
/// the number of blocks would visit far fewer).
fn distinct_blocks(n: u32, take: usize, next: &mut impl FnMut(u32) -> u32) -> Vec<Vec<u32>> {
    (0..n.div_ceil(BLOCK))
        .map(|b| {
            let mut pool: Vec<u32> = (1..b).collect();
            let take = take.min(pool.len());
            for i in 0..take {
                let j = i + next((pool.len() - i) as u32) as usize;
                pool.swap(i, j);
            }
            pool.truncate(take);
            pool
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_digest_follows_the_compiled_source() {
        let tiled = kernels_digest(KernelPath::Tiled, 128);
        assert_eq!(tiled, kernels_digest(KernelPath::Tiled, 128));
        assert_ne!(tiled, kernels_digest(KernelPath::Tiled, 256), "the header's D");
        assert_ne!(tiled, kernels_digest(KernelPath::CooperativeMatrix, 128), "another shader");
    }

    #[test]
    fn times_interpolate_between_buckets_and_scale_past_them() {
        let points = [(1000, 10.0), (2000, 30.0)];
        assert_eq!(interpolate(&points, 1500, 1), Some(20.0));
        assert_eq!(interpolate(&points, 500, 1), Some(5.0));
        assert_eq!(interpolate(&points, 4000, 2), Some(120.0));
        assert_eq!(interpolate(&[], 4000, 2), None);
    }

    #[test]
    fn synthetic_masks_keep_their_budgets() {
        let (mut blocks, mut columns) = (Vec::new(), Vec::new());
        for budget in [4, 800] {
            let c = Candidate { pattern: Pattern::BlockSparse, budget: [budget, 0] };
            let mask = synthetic_mask(c, 1024 * 64);
            for b in (0..16).chain([799, 900, 1023]) {
                mask.keys(b, &mut blocks, &mut columns);
                // The sink block, the diagonal and the budget's distinct blocks between them.
                let want = (b as usize + 1).min(budget as usize + 2);
                assert_eq!(blocks.len(), want, "budget {budget}, query block {b}: {blocks:?}");
                assert_eq!(mask.visited_keys(b..b + 1), (want * BLOCK as usize) as f64);
            }
        }
    }

    #[test]
    fn a_synthetic_union_visits_the_keys_it_is_counted_for() {
        let (mut blocks, mut columns) = (Vec::new(), Vec::new());
        for budget in [[100, 256], [400, 2048]] {
            let mask = synthetic_mask(Candidate { pattern: Pattern::Union, budget }, 600 * 64);
            let listed: usize = (0..600)
                .map(|b| {
                    mask.keys(b, &mut blocks, &mut columns);
                    blocks.len() * BLOCK as usize
                })
                .sum();
            // Columns count whether or not a listed block holds them.
            let counted = mask.visited_keys(0..600)
                - (0..600).map(|b| mask.columns().partition_point(|&j| j < (b + 1) * BLOCK)).sum::<usize>() as f64;
            assert_eq!(counted, listed as f64, "{budget:?}");
        }
    }

    #[test]
    fn a_mask_is_timed_by_the_keys_it_visits() {
        let c = Candidate { pattern: Pattern::VerticalSlash, budget: [16, 64] };
        let near = Mask::VerticalSlash(VerticalSlash::new(vec![], (0..64).collect()));
        let spread = Mask::VerticalSlash(VerticalSlash::new(vec![], (0..64).map(|i| i * 64 + 32).collect()));
        let keys = near.visited_keys(0..64);
        let profile = LatencyProfile {
            adapter: String::new(),
            driver: String::new(),
            path: String::new(),
            head_dim: 64,
            n_head: 1,
            n_kv_head: 1,
            entries: vec![Entry { pattern: c.pattern, budget: c.budget, tokens: 4096, us: 100.0, keys }],
            probe: vec![],
            listed_dense: vec![],
        };
        assert_eq!(profile.mask_time_us(c, &near, 0..64, 4096), Some(100.0));
        let t = profile.mask_time_us(c, &spread, 0..64, 4096).unwrap();
        assert!(t > 1000.0, "{t}");
        // The same per key at twice the length, over twice the blocks.
        assert!(profile.mask_time_us(c, &near, 0..128, 8192).unwrap() > 200.0);
        // A chunk of the last 4 query blocks is priced for those.
        let tail = profile.mask_time_us(c, &near, 60..64, 4096).unwrap();
        assert!((tail - 100.0 * near.visited_keys(60..64) / keys).abs() < 1e-9, "{tail}");
    }
}
