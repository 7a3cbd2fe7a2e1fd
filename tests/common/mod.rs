//! Shared test plumbing: where the default model and the shared references live.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use sift::gguf::GgufFile;
use sift::tokenizer::Tokenizer;

pub mod server;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The default model, fetched by `models/fetch` on first use (it is idempotent
/// and takes a lock, so parallel test binaries may all call this).
pub fn default_model() -> PathBuf {
    let path = repo_root().join("models/gemma-3-270m-Q4_K_M.gguf");
    if !path.exists() {
        let status = Command::new("bash").arg(repo_root().join("models/fetch")).status().expect("run models/fetch");
        assert!(status.success(), "models/fetch failed; the model tests need the default model");
    }
    path
}

/// `../shared`, the project's read-only references. `None` (with a visible
/// message) when this checkout has no such folder beside it.
pub fn shared_dir(test: &str) -> Option<PathBuf> {
    let dir = repo_root().join("../shared");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("SKIPPED {test}: ../shared is absent beside this checkout");
        None
    }
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The tokenizer of a GGUF file.
pub fn tokenizer(path: &Path) -> Tokenizer {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{e}"));
    Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"))
}

/// The default model's tokenizer, built once for all the tests that use it.
pub fn gemma3_tokenizer() -> &'static Tokenizer {
    static GEMMA3: OnceLock<Tokenizer> = OnceLock::new();
    GEMMA3.get_or_init(|| tokenizer(&default_model()))
}

/// A one-line error on stderr and the documented exit code.
pub fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "error is not one line: {err}");
    // Each cause once: "cannot open: <os error>", not the os error twice.
    let causes: Vec<&str> = err.trim_end().split(": ").collect();
    let repeated = causes.iter().enumerate().any(|(i, c)| causes[..i].contains(c));
    assert!(!repeated, "a cause is said twice: {err}");
    assert!(o.stdout.is_empty(), "stdout should be empty on error: {}", String::from_utf8_lossy(&o.stdout));
}

/// Runs the `sift` binary with `input` on standard input.
pub fn sift_with_stdin(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// SplitMix64: the test's own reproducible numbers.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly normal: a sum of four uniforms, centred and scaled.
    pub fn normal(&mut self) -> f64 {
        ((0..4).map(|_| self.unit()).sum::<f64>() - 2.0) * 3f64.sqrt()
    }
}

/// Set in a child run of [`on_every_isa`]: the ISA the child must run on.
const ISA_UNDER_TEST: &str = "SIFT_TEST_ISA";

/// Runs test `name` of this test binary again in a child process for every
/// ISA this CPU has (`SIFT_ISA` picks a process's kernel table once), and
/// fails if a run fails or runs no test. Does nothing inside such a child.
pub fn on_every_isa(name: &str) {
    if std::env::var_os(ISA_UNDER_TEST).is_some() {
        return;
    }
    for isa in simd::Isa::available() {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--include-ignored", "--test-threads=1"])
            .env("SIFT_ISA", isa.name())
            .env(ISA_UNDER_TEST, isa.name())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{name} on {isa}:\n{text}");
    }
}

/// In a child run of [`on_every_isa`], checks that the kernels are the
/// ISA's it was started for.
pub fn check_isa_under_test() {
    if let Ok(isa) = std::env::var(ISA_UNDER_TEST) {
        assert_eq!(simd::kernels().isa().name(), isa, "the kernel table is not the one asked for");
    }
}

/// The GPU kernel paths to test on this adapter, saying which are skipped and why.
pub fn kernel_paths(ctx: &sift::gpu::GpuContext, test: &str) -> Vec<sift::gpu::KernelPath> {
    use sift::gpu::KernelPath;
    [KernelPath::CooperativeMatrix, KernelPath::Tiled]
        .into_iter()
        .filter(|path| match path.available(ctx) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("SKIPPED {test} on the {} path: {e}", path.name());
                false
            }
        })
        .collect()
}

/// The shape of a GPU attention call as the f64 references read it: `n`
/// query rows at positions `pos0..`, Q `[n][n_head][d]`, K and V
/// `[positions][n_kv_head][d]`, all f16.
pub struct AttentionCase {
    pub n: usize,
    pub pos0: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub d: usize,
}

/// Softmax attention in f64, query row `t` of each head over the keys
/// `j ≤ t` for which `sees(kv_head, t, j)` holds, in position order.
pub fn attention_reference(
    q: &[half::f16],
    k: &[half::f16],
    v: &[half::f16],
    c: &AttentionCase,
    scale: f64,
    sees: impl Fn(usize, usize, usize) -> bool,
) -> Vec<f64> {
    let (hq, hk, d) = (c.n_head, c.n_kv_head, c.d);
    let mut out = vec![0.0; c.n * hq * d];
    for i in 0..c.n {
        let t = c.pos0 + i;
        for h in 0..hq {
            let kvh = h / (hq / hk);
            let keys: Vec<usize> = (0..=t).filter(|&j| sees(kvh, t, j)).collect();
            let qrow = &q[(i * hq + h) * d..][..d];
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let krow = &k[(j * hk + kvh) * d..][..d];
                    scale * qrow.iter().zip(krow).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let o = &mut out[(i * hq + h) * d..][..d];
            for (&j, w) in keys.iter().zip(&weights) {
                for (o, x) in o.iter_mut().zip(&v[(j * hk + kvh) * d..][..d]) {
                    *o += w / sum * x.to_f64();
                }
            }
        }
    }
    out
}

/// ‖got − want‖ / ‖want‖, NaN (failing every bound) if anything is not finite.
pub fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|g| !g.is_finite()) {
        return f64::NAN;
    }
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm).sqrt()
}

/// The GPU the GPU tests run on, opened once (a software renderer such as
/// lavapipe counts). `None`, with a visible message, where Vulkan lists no
/// adapter; with `SIFT_GPU_TESTS=required` (CI, which installs lavapipe) a
/// missing adapter fails the test instead.
pub fn gpu(test: &str) -> Option<&'static sift::gpu::GpuContext> {
    static GPU: OnceLock<Result<sift::gpu::GpuContext, String>> = OnceLock::new();
    let opened = GPU.get_or_init(|| {
        sift::gpu::GpuContext::open(sift::gpu::AdapterPolicy::AllowSoftware).map_err(|e| e.to_string())
    });
    match opened {
        Ok(gpu) => Some(gpu),
        Err(e) if std::env::var("SIFT_GPU_TESTS").is_ok_and(|v| v == "required") => {
            panic!("{test}: SIFT_GPU_TESTS=required but {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}
