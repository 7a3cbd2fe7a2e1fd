//! Decomposed attention (Stream-CQSA, `sift::gpu::cqs`) against the whole
//! call on the GPU and an f64 reference on the CPU.
//!
//! Budgets are chosen from the plan so that the call must split once (every
//! piece of depth 1 fits, the whole call does not) or twice (no piece of
//! depth 1 fits, every piece of depth 2 does), on causal calls with and
//! without a sliding window, a prefill chunk whose queries are only the last
//! positions, and a non-causal call, at lengths that are not multiples of 7.
//! The decomposed output must equal the whole call's and the f64 softmax's on
//! sampled rows to f32 rounding (relative error ≤ 1e-5), and the plans have
//! rows that see no key in some piece, so the merge's empty-row rule is
//! exercised. `sift run` with a budget below a prompt's attention call
//! prefills through the pieces and generates the same greedy tokens.

mod common;

use half::f16;
use sift::gpu::attention::{Attention, AttentionShape};
use sift::gpu::cqs::plan::{Mask, Piece};
use sift::gpu::cqs::{working_bytes, AttentionCall, Cqs, CqsReport};
use sift::gpu::{GpuContext, KernelPath};

const BOUND: f64 = 1e-5;

struct Case {
    name: &'static str,
    queries: usize,
    keys: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    mask: Mask,
}

struct Inputs {
    q: Vec<f16>,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl Case {
    fn inputs(&self, seed: u64) -> Inputs {
        let mut rng = common::Rng(seed);
        let mut f16s =
            |len: usize, scale: f64| -> Vec<f16> { (0..len).map(|_| f16::from_f64(scale * rng.normal())).collect() };
        let (q_len, kv_len) = (self.queries * self.n_head * self.head_dim, self.keys * self.n_kv_head * self.head_dim);
        // Scores of a few units: a peaked softmax, which the max shift must handle.
        Inputs { q: f16s(q_len, 1.0), k: f16s(kv_len, 1.0), v: f16s(kv_len, 1.0) }
    }

    fn scale(&self) -> f32 {
        2.0 / (self.head_dim as f32).sqrt()
    }

    fn call<'a>(&self, x: &'a Inputs) -> AttentionCall<'a> {
        AttentionCall {
            q: &x.q,
            k: &x.k,
            v: &x.v,
            queries: self.queries,
            keys: self.keys,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            mask: self.mask,
            scale: self.scale(),
        }
    }

    fn bytes(&self, piece: &Piece) -> u64 {
        let queries = piece.len() - piece.first_query((self.keys - self.queries) as u32);
        working_bytes(queries, piece.len(), self.n_head, self.n_kv_head, self.head_dim)
    }

    /// The working memory of each leaf at `depth` that has queries.
    fn leaf_bytes(&self, depth: u32) -> Vec<u64> {
        let mut pieces = vec![Piece::whole(self.keys)];
        for _ in 0..depth {
            pieces = pieces.iter().flat_map(|p| p.split().unwrap()).collect();
        }
        let pos0 = (self.keys - self.queries) as u32;
        pieces.iter().filter(|p| p.first_query(pos0) < p.len()).map(|p| self.bytes(p)).collect()
    }

    /// A budget under which the call reaches `depth`, one piece resident,
    /// and whether every piece reaches it (else some stop a level above: the
    /// pieces of a prefill chunk differ in their queries).
    fn budget_for(&self, depth: u32) -> (u64, bool) {
        let fits = *self.leaf_bytes(depth).iter().max().unwrap();
        let coarser = *self.leaf_bytes(depth - 1).iter().min().unwrap();
        (fits, fits < coarser)
    }

    /// Query rows that see no key in some leaf at `depth`.
    fn empty_rows(&self, depth: u32) -> usize {
        let mut pieces = vec![Piece::whole(self.keys)];
        for _ in 0..depth {
            pieces = pieces.iter().flat_map(|p| p.split().unwrap()).collect();
        }
        let pos0 = (self.keys - self.queries) as u32;
        pieces
            .iter()
            .map(|p| {
                let seen = |i: usize| {
                    (0..p.len()).any(|j| self.mask.keeps(p.positions[i], p.groups[i], p.positions[j], p.groups[j]))
                };
                (p.first_query(pos0)..p.len()).filter(|&i| !seen(i)).count()
            })
            .sum()
    }

    /// Softmax attention in f64 of query row `i`, head `h`, over the f16 inputs.
    fn reference(&self, x: &Inputs, i: usize, h: usize) -> Vec<f64> {
        let (d, group) = (self.head_dim, self.n_head / self.n_kv_head);
        let t = (self.keys - self.queries + i) as u32;
        let q = &x.q[(i * self.n_head + h) * d..][..d];
        let visible: Vec<usize> = (0..self.keys).filter(|&j| self.mask.keeps(t, 0, j as u32, 0)).collect();
        let row = |m: &[f16], j: usize| -> Vec<f64> {
            m[(j * self.n_kv_head + h / group) * d..][..d].iter().map(|x| x.to_f64()).collect()
        };
        let scores: Vec<f64> = visible
            .iter()
            .map(|&j| self.scale() as f64 * q.iter().zip(row(&x.k, j)).map(|(a, b)| a.to_f64() * b).sum::<f64>())
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let mut out = vec![0.0; d];
        for (&j, w) in visible.iter().zip(&weights) {
            for (o, v) in out.iter_mut().zip(row(&x.v, j)) {
                *o += w / sum * v;
            }
        }
        out
    }
}

/// max |got − want| / max |want| over rows of `[rows][width]`.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|g| !g.is_finite()) {
        return f64::NAN;
    }
    let diff = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
    diff / want.iter().map(|w| w.abs()).fold(0.0, f64::max)
}

/// The whole call: the dense kernel where it applies (causal, on the tiled
/// path, whose arithmetic the pieces share), else one undecomposed piece.
fn whole_call(ctx: &GpuContext, c: &Case, x: &Inputs) -> Vec<f32> {
    let len = c.queries * c.n_head * c.head_dim;
    if !c.mask.causal {
        let cqs = Cqs::new(ctx, c.head_dim, c.n_head / c.n_kv_head, None).unwrap();
        let mut out = vec![0.0; len];
        let report = cqs.attend(ctx, &c.call(x), &mut out).unwrap();
        assert_eq!(report.depth, 0);
        return out;
    }
    let attention =
        Attention::new(&ctx.device, KernelPath::Tiled, c.head_dim as u32, (c.n_head / c.n_kv_head) as u32).unwrap();
    let shape = AttentionShape {
        n: c.queries as u32,
        pos0: (c.keys - c.queries) as u32,
        n_head: c.n_head as u32,
        n_kv_head: c.n_kv_head as u32,
        window: c.mask.window,
        scale: c.scale(),
    };
    let (q, k, v) = (ctx.upload("q", &x.q).unwrap(), ctx.upload("k", &x.k).unwrap(), ctx.upload("v", &x.v).unwrap());
    let o = ctx.upload("o", &vec![f32::NAN; len]).unwrap();
    let bind = attention.bind(&ctx.device, &q, &k, &v, &o);
    let mut batch = ctx.batch();
    let sizes = [q.size(), k.size(), v.size(), o.size()];
    batch.record("attention", |pass| attention.dispatch(pass, &bind, &shape, sizes)).unwrap();
    batch.submit();
    ctx.read(&o, 0, len).unwrap()
}

fn decomposed(ctx: &GpuContext, c: &Case, x: &Inputs, budget: u64) -> (Vec<f32>, CqsReport) {
    let cqs = Cqs::new(ctx, c.head_dim, c.n_head / c.n_kv_head, Some(budget)).unwrap();
    let mut out = vec![f32::NAN; c.queries * c.n_head * c.head_dim];
    let report = cqs.attend(ctx, &c.call(x), &mut out).unwrap();
    (out, report)
}

fn cases() -> Vec<Case> {
    let causal = Mask { causal: true, window: None };
    vec![
        Case { name: "causal", queries: 300, keys: 300, n_head: 4, n_kv_head: 1, head_dim: 64, mask: causal },
        Case {
            name: "causal, Gemma 3's heads",
            queries: 150,
            keys: 150,
            n_head: 4,
            n_kv_head: 1,
            head_dim: 256,
            mask: causal,
        },
        Case {
            name: "sliding window",
            queries: 230,
            keys: 230,
            n_head: 2,
            n_kv_head: 2,
            head_dim: 64,
            mask: Mask { causal: true, window: Some(48) },
        },
        Case { name: "prefill chunk", queries: 100, keys: 340, n_head: 4, n_kv_head: 2, head_dim: 32, mask: causal },
        Case {
            name: "not causal",
            queries: 250,
            keys: 250,
            n_head: 2,
            n_kv_head: 1,
            head_dim: 64,
            mask: Mask { causal: false, window: None },
        },
    ]
}

#[test]
fn decomposed_attention_equals_the_whole_call_and_f64() {
    let Some(ctx) = common::gpu("decomposed_attention_equals_the_whole_call_and_f64") else { return };
    if let Err(e) = KernelPath::Tiled.available(ctx) {
        eprintln!("SKIPPED decomposed_attention_equals_the_whole_call_and_f64: {e}");
        return;
    }
    for (seed, c) in cases().iter().enumerate() {
        let x = c.inputs(seed as u64 + 1);
        let whole = whole_call(ctx, c, &x);
        let sampled: Vec<usize> = (0..c.queries).step_by(7).chain([c.queries - 1]).collect();
        let width = c.n_head * c.head_dim;
        let x_ref = &x;
        let reference: Vec<f64> =
            sampled.iter().flat_map(|&i| (0..c.n_head).flat_map(move |h| c.reference(x_ref, i, h))).collect();
        let rows_of =
            |o: &[f32]| -> Vec<f32> { sampled.iter().flat_map(|&i| o[i * width..][..width].to_vec()).collect() };
        let whole_err = relative_error(&rows_of(&whole), &reference);
        assert!(whole_err <= BOUND, "{}: the whole call is {whole_err:.2e} from f64", c.name);
        for depth in [1, 2] {
            let (budget, uniform) = c.budget_for(depth);
            let (got, report) = decomposed(ctx, c, &x, budget);
            let to_whole = relative_error(&got, &whole.iter().map(|&w| w as f64).collect::<Vec<_>>());
            let to_f64 = relative_error(&rows_of(&got), &reference);
            let empty = c.empty_rows(depth);
            eprintln!(
                "{} at depth {depth} (budget {budget} bytes): {to_whole:.2e} from the whole call, {to_f64:.2e} from f64; \
                 {empty} empty rows; {report}",
                c.name
            );
            assert_eq!(report.depth, depth, "{}: depth reached", c.name);
            if uniform {
                let splits = if depth == 1 { 1 } else { 1 + c.leaf_bytes(1).len() };
                assert_eq!(report.splits, splits, "{}: pieces split", c.name);
            }
            assert!(report.peak_bytes <= budget, "{}: {} bytes resident past the budget", c.name, report.peak_bytes);
            assert!(to_whole <= BOUND, "{} depth {depth}: {to_whole:.2e} from the whole call", c.name);
            assert!(to_f64 <= BOUND, "{} depth {depth}: {to_f64:.2e} from f64", c.name);
            // (A prefill chunk's queries are the last chunks, which see keys in every piece.)
            if c.mask.causal && c.queries == c.keys {
                assert!(empty > 0, "{}: no row without keys at depth {depth}", c.name);
            }
            assert!(report.tiles[1] > 0, "{}: no tile skipped at depth {depth}", c.name);
        }
    }
}

/// A budget between two pieces and the whole call: after the whole call is
/// refused and split, the first round takes the two pieces that fit, the
/// third is evicted and `n_cap` settles at 2; the result still equals the
/// whole call.
#[test]
fn the_guardrail_lowers_n_cap_then_deepens() {
    let Some(ctx) = common::gpu("the_guardrail_lowers_n_cap_then_deepens") else { return };
    if KernelPath::Tiled.available(ctx).is_err() {
        return;
    }
    let c = &cases()[0];
    let x = c.inputs(7);
    let whole = whole_call(ctx, c, &x);
    let whole64: Vec<f64> = whole.iter().map(|&w| w as f64).collect();
    let piece = *c.leaf_bytes(1).iter().max().unwrap();
    let call = c.leaf_bytes(0)[0];
    assert!(2 * piece < call);
    let budget = (2 * piece + call) / 2;
    let (got, report) = decomposed(ctx, c, &x, budget);
    eprintln!("two pieces and some: {report}");
    assert_eq!((report.depth, report.splits), (1, 1), "{report:?}");
    assert!(report.evictions >= 1 && report.n_cap == 2 && report.peak_bytes > piece, "{report:?}");
    assert!(report.peak_bytes <= budget, "{report:?}");
    assert!(relative_error(&got, &whole64) <= BOUND);
}

#[test]
fn a_budget_below_one_token_is_an_error_not_a_panic() {
    let Some(ctx) = common::gpu("a_budget_below_one_token_is_an_error_not_a_panic") else { return };
    if KernelPath::Tiled.available(ctx).is_err() {
        return;
    }
    let c = &cases()[0];
    let x = c.inputs(3);
    let cqs = Cqs::new(ctx, c.head_dim, 4, Some(100)).unwrap();
    let mut out = vec![0.0; c.queries * c.n_head * c.head_dim];
    let err = cqs.attend(ctx, &c.call(&x), &mut out).unwrap_err().to_string();
    assert!(err.contains("budget of 100 bytes"), "{err}");
}

/// A prompt whose attention calls need about 0.7 MB each, under a budget of
/// 512 KiB: the GPU prefill decomposes them, and greedy decoding after it
/// gives the tokens it gives after the undecomposed GPU prefill.
#[test]
fn sift_run_past_the_budget_prefills_in_pieces_and_generates_the_same_tokens() {
    let test = "sift_run_past_the_budget_prefills_in_pieces_and_generates_the_same_tokens";
    let Some(_) = common::gpu(test) else { return };
    let model = common::default_model();
    let model = model.to_str().unwrap();
    let sentences = [
        "The lighthouse keeper counted the ships that passed each night.",
        "In the morning the harbour filled with fishermen and their nets.",
        "A storm came from the west and the bells of the town rang.",
        "Nobody remembered who had built the old stone bridge.",
    ];
    let prompt: String = (0..7).map(|i| sentences[i % 4]).collect::<Vec<_>>().join(" ");
    let run = |budget: Option<&str>| {
        let mut args = vec!["run", "-m", model, "--gpu", "on", "--temp", "0", "-n", "12", "--json", "-p", &prompt];
        if let Some(b) = budget {
            args.extend(["--gpu-mem-budget", b]);
        }
        let out = common::sift_with_stdin(&args, b"");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "sift run failed: {stderr}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (json, stderr)
    };
    let (whole, whole_log) = run(None);
    let (pieces, log) = run(Some("512K"));
    let prompt_tokens = whole["prompt_tokens"].as_u64().unwrap() as usize;
    // Gemma 3 270M: 4 query heads, 1 KV head, 256 dimensions.
    let call = working_bytes(prompt_tokens, prompt_tokens, 4, 1, 256);
    eprintln!("{prompt_tokens} prompt tokens, {call} bytes per attention call; {log}");
    assert!(call > 512 << 10, "the prompt's attention call fits the budget");
    assert!(!whole_log.contains("decomposed"), "{whole_log}");
    assert!(log.contains("decomposed to depth 1"), "{log}");
    assert_eq!(pieces["token_ids"], whole["token_ids"], "greedy tokens after the decomposed prefill");
}

#[test]
fn a_bad_budget_is_a_usage_error() {
    for bad in ["0", "12Q", "99999999999G"] {
        let out = common::sift_with_stdin(&["run", "--gpu-mem-budget", bad, "-p", "hi"], b"");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        assert!(stderr.contains("--gpu-mem-budget"), "{bad}: {stderr}");
    }
}
