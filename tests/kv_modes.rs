//! The cache modes: what they cost per token, how far what they return
//! strays from the exact keys and values, and attention over them against an
//! f64 reference.
//!
//! # The tolerance
//!
//! A number quantized in a group (a key channel over its page, or 32 of a
//! token's values) with step `Δ`, at `b` bits, comes back within
//! `2^(7-b)·Δ` of the exact f16 number (half a step at 8 bits, 8 steps at 4,
//! 32 at 2), plus one f32 rounding of the result. `Δ` is the group's range
//! over 255 rounded up to f16, so it is at most `range/255·(1 + 2^-10) +
//! 2^-24`: the test computes this from the exact numbers, knowing nothing of
//! the stored steps. Call these bounds `e` for a key channel and `f` for a
//! value.
//!
//! Attention: exact scores `s_i = q·k_i/√d`, weights `a = softmax(s)`,
//! output `o = Σ a_i·v_i`; the primed ones are from the cache. Each score
//! moves by at most `ε_i = Σ_c |q_c|·e_ic/√d ≤ ε`, so every weight ratio
//! `a'_i/a_i = e^(s'_i - s_i)/Σ_j a_j·e^(s'_j - s_j)` lies within
//! `e^(±2ε)`. Since the weights of both sum to one, for any constant `m`
//!
//! ```text
//! o' - o = Σ (a'_i - a_i)·(v'_i - m) + Σ a_i·(v'_i - v_i)
//! |o'_c - o_c| ≤ (e^(2ε) - 1)·Σ a_i·|v'_ic - m_c| + Σ a_i·f_ic
//! ```
//!
//! with `m = Σ a_i·v'_i`. The bound is for the worst case, where every
//! channel's error pushes the same way; to keep it informative each mode is
//! tested with the query scaled so that `ε` is at most 0.05 (at natural
//! scale, 2-bit keys move scores by several units in the worst case).

mod common;

use half::f16;
use sift::attn::dense::attend;
use sift::attn::{AttentionBatch, Scorer};
use sift::kv::page::{KvMode, PagedLayer, Storage, RESIDUAL, SINK};
use sift::kv::{CacheShape, PAGE};

use common::Rng;

fn shape(n_kv_head: usize, head_dim_k: usize, head_dim_v: usize) -> CacheShape {
    CacheShape { n_kv_head, head_dim_k, head_dim_v, windows: vec![None] }
}

/// Tokens' keys and values for every head, as f16 (what the cache rounds
/// them to) widened back to f32. Keys have KIVI's outlier channels: every
/// eighth channel carries an offset 20 times the others'. The first token is
/// an outlier, 30 times the others, as a model's first token often is.
struct Tokens {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl Tokens {
    fn new(seed: u64, n: usize, shape: &CacheShape) -> Self {
        let mut rng = Rng(seed);
        let (dk, dv) = (shape.n_kv_head * shape.head_dim_k, shape.n_kv_head * shape.head_dim_v);
        let offsets: Vec<f64> = (0..dk).map(|c| rng.normal() * if c % 8 == 0 { 20.0 } else { 1.0 }).collect();
        let round = |x: f64| f16::from_f64(x).to_f32();
        let outlier = |pos: usize| if pos == 0 { 30.0 } else { 1.0 };
        let keys =
            (0..n).map(|pos| offsets.iter().map(|&o| round((o + rng.normal()) * outlier(pos))).collect()).collect();
        let values = (0..n)
            .map(|pos| {
                let scale = (0.5 + rng.unit()) * outlier(pos);
                (0..dv).map(|_| round(rng.normal() * scale)).collect()
            })
            .collect();
        Self { keys, values }
    }
}

/// The most a number of `group` (exact numbers) can come back off by in
/// `mode`; `x` is the number as it came back (for its f32 rounding).
fn error_bound(mode: KvMode, group: impl Iterator<Item = f32> + Clone, x: f32) -> f64 {
    let Some(bits) = mode.bits() else { return 0.0 };
    let range = group.clone().fold(f32::NEG_INFINITY, f32::max) as f64 - group.fold(f32::INFINITY, f32::min) as f64;
    let step = range / 255.0 * (1.0 + 2f64.powi(-10)) + 2f64.powi(-24);
    2f64.powi(7 - bits.get() as i32) * step + 2f64.powi(-24) * x.abs() as f64
}

/// Whether `pos` is still exact when `len` positions are stored: the newest
/// `residual / PAGE` pages are, and the sink.
fn is_exact(layer: &PagedLayer, pos: usize, len: usize) -> bool {
    layer.mode() == KvMode::F16 || pos < layer.sink() || pos / PAGE + RESIDUAL / PAGE > (len - 1) / PAGE
}

/// Reads back every position of `range` and checks each number against its
/// bound; returns the per-position bounds `(e, f)` for attention.
fn check_rows(
    layer: &PagedLayer,
    tokens: &Tokens,
    shape: &CacheShape,
    head: usize,
    range: std::ops::Range<usize>,
    len: usize,
) -> Vec<(Vec<f64>, Vec<f64>)> {
    let (dk, dv) = (shape.head_dim_k, shape.head_dim_v);
    let mode = layer.mode();
    let (mut key, mut value) = (vec![0.0; dk], vec![0.0; dv]);
    range
        .map(|pos| {
            layer.key(head, pos, &mut key);
            layer.value(head, pos, &mut value);
            let exact_k = &tokens.keys[pos][head * dk..][..dk];
            let exact_v = &tokens.values[pos][head * dv..][..dv];
            if is_exact(layer, pos, len) {
                assert_eq!(key, exact_k, "{mode} pos {pos}: exact key");
                assert_eq!(value, exact_v, "{mode} pos {pos}: exact value");
                return (vec![0.0; dk], vec![0.0; dv]);
            }
            // The sink's keys are not among their page's.
            let page = (pos / PAGE * PAGE).max(layer.sink())..(pos / PAGE + 1) * PAGE;
            let e: Vec<f64> = (0..dk)
                .map(|c| {
                    let column = page.clone().map(|p| tokens.keys[p][head * dk + c]);
                    error_bound(mode, column, key[c])
                })
                .collect();
            let f: Vec<f64> = (0..dv)
                .map(|c| {
                    let group = exact_v[c / 32 * 32..((c / 32 + 1) * 32).min(dv)].iter().copied();
                    error_bound(mode, group, value[c])
                })
                .collect();
            for c in 0..dk {
                let err = (key[c] as f64 - exact_k[c] as f64).abs();
                assert!(err <= e[c], "{mode} pos {pos} key channel {c}: off by {err:e}, bound {:e}", e[c]);
            }
            for c in 0..dv {
                let err = (value[c] as f64 - exact_v[c] as f64).abs();
                assert!(err <= f[c], "{mode} pos {pos} value channel {c}: off by {err:e}, bound {:e}", f[c]);
            }
            (e, f)
        })
        .collect()
}

fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = w.iter().sum();
    w.iter().map(|w| w / sum).collect()
}

fn dot(a: &[f64], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x * y as f64).sum()
}

/// Attention of one query over `range` from the cache and from the exact
/// tokens, checked against the module's tolerance.
fn check_attention(layer: &PagedLayer, tokens: &Tokens, shape: &CacheShape, len: usize, seed: u64) {
    let (dk, dv) = (shape.head_dim_k, shape.head_dim_v);
    let mode = layer.mode();
    let mut rng = Rng(seed);
    for head in 0..shape.n_kv_head {
        let range = layer.visible(len - 1);
        let bounds = check_rows(layer, tokens, shape, head, range.clone(), len);
        let unit: Vec<f64> = (0..dk).map(|_| rng.normal() / (dk as f64).sqrt()).collect();
        // ε for a query: the largest score error over the positions.
        let eps_of = |q: &[f64]| {
            bounds.iter().map(|(e, _)| q.iter().zip(e).map(|(q, e)| q.abs() * e).sum::<f64>()).fold(0.0, f64::max)
        };
        let scale = (0.05 / eps_of(&unit)).min(1.0);
        let q: Vec<f64> = unit.iter().map(|x| x * scale).collect();
        let eps = eps_of(&q);

        let (mut key, mut value) = (vec![0.0; dk], vec![0.0; dv]);
        let (mut scores, mut scores_q, mut values_q) = (vec![], vec![], vec![]);
        for pos in range.clone() {
            scores.push(dot(&q, &tokens.keys[pos][head * dk..][..dk]));
            layer.key(head, pos, &mut key);
            scores_q.push(dot(&q, &key));
            layer.value(head, pos, &mut value);
            values_q.push(value.clone());
        }
        let (a, a_q) = (softmax(&scores), softmax(&scores_q));
        for c in 0..dv {
            let o: f64 = range.clone().zip(&a).map(|(pos, a)| a * tokens.values[pos][head * dv + c] as f64).sum();
            let o_q: f64 = values_q.iter().zip(&a_q).map(|(v, a)| a * v[c] as f64).sum();
            let m: f64 = values_q.iter().zip(&a).map(|(v, a)| a * v[c] as f64).sum();
            let spread: f64 = values_q.iter().zip(&a).map(|(v, a)| a * (v[c] as f64 - m).abs()).sum();
            let value_err: f64 = bounds.iter().zip(&a).map(|((_, f), a)| a * f[c]).sum();
            let tol = (2.0 * eps).exp_m1() * spread + value_err + 1e-12;
            assert!((o_q - o).abs() <= tol, "{mode} head {head} channel {c}: {o_q} vs {o}, tolerance {tol:e}");
        }
    }
}

#[test]
fn every_mode_reads_back_within_its_step_and_attends_within_tolerance() {
    let shape = shape(2, 64, 80); // 80: a partial value group
    let len = 7 * PAGE + 13;
    let tokens = Tokens::new(1, len, &shape);
    for (mode, sink) in KvMode::ALL.into_iter().flat_map(|m| [(m, 0), (m, SINK)]) {
        let mut layer =
            PagedLayer::new(Storage { mode, residual: RESIDUAL, sink, ..Storage::default() }, &shape, None, 640, 16);
        for pos in 0..len {
            layer.store(pos, &tokens.keys[pos], &tokens.values[pos]);
        }
        check_attention(&layer, &tokens, &shape, len, 2);
    }
}

/// The model's attention, [`attend`], over a layer in every mode, against
/// f64 attention over the exact tokens: the last batch of a prefill, whose
/// own keys and values are exact and whose older ones come from the cache.
///
/// The tolerance is [`check_attention`]'s, widened by what the kernels round:
/// a batch that stages coded rows reads them as f16 (half an f16 ulp,
/// `2^-11` relative, more on every key channel and value; a small batch
/// reads the codes' levels themselves), scores are f32 sums (under `10^-5`
/// of `Σ |q_c·k_c|`, added to each score's bound), and the probabilities are
/// rounded to f16 and summed in f32 (under `2^-10` of `Σ a_i·|v_ic|`). The
/// queries are f16 numbers, so rounding them changes nothing.
#[test]
fn dense_attention_matches_f64_in_every_mode() {
    // Prefill batches, which stage coded rows, and smaller ones (decoding
    // steps), which read the codes in place; under 512 visible positions the
    // groups are not split among the threads.
    check_dense_attention(2, 2, 32, 7 * PAGE + 13, Read::Staged);
    check_dense_attention(2, 2, 3, 7 * PAGE + 13, Read::InPlace);
    check_dense_attention(2, 2, 1, 7 * PAGE + 13, Read::InPlace);
    // Decoding steps and a short batch whose groups see enough positions to
    // be split among the threads.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    pool.install(|| check_dense_attention(1, 4, 1, 23 * PAGE + 5, Read::InPlace));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
    pool.install(|| check_dense_attention(1, 4, 4, 23 * PAGE + 5, Read::Staged));
}

/// How `attend` reads coded rows for a batch: from f16 staging (batches of
/// 4 tokens or more) or in place.
#[derive(Clone, Copy, PartialEq)]
enum Read {
    Staged,
    InPlace,
}

/// `attend` over `len` positions of `n_kv_head` heads of `n_gqa` queries
/// each, the last `batch` of them a batch, against f64.
fn check_dense_attention(n_kv_head: usize, n_gqa: usize, batch: usize, len: usize, read: Read) {
    let shape = shape(n_kv_head, 64, 80);
    let n_head = n_kv_head * n_gqa;
    let tokens = Tokens::new(11, len, &shape);
    let pos0 = len - batch;
    for (mode, window) in KvMode::ALL.into_iter().flat_map(|m| [(m, None), (m, Some(100))]) {
        let mut layer = PagedLayer::new(Storage { mode, ..Storage::default() }, &shape, window, len, batch);
        for pos in 0..len {
            layer.store(pos, &tokens.keys[pos], &tokens.values[pos]);
        }
        let mut rng = Rng(12);
        let cached = layer.visible(pos0).start..pos0;
        let bounds: Vec<_> =
            (0..n_kv_head).map(|h| check_rows(&layer, &tokens, &shape, h, cached.clone(), len)).collect();
        // Each query is scaled so that quantization moves no score by more than 0.05.
        let queries: Vec<f32> = (0..batch * n_head)
            .flat_map(|i| {
                let unit: Vec<f64> = (0..64).map(|_| rng.normal() / 8.0).collect();
                let eps = bounds[i % n_head / n_gqa]
                    .iter()
                    .map(|(e, _)| unit.iter().zip(e).map(|(q, e)| q.abs() * e).sum::<f64>())
                    .fold(0.0, f64::max);
                let scale = (0.05 / eps).min(1.0);
                unit.into_iter().map(move |q| f16::from_f64(q * scale).to_f32())
            })
            .collect();
        let attention = AttentionBatch {
            queries: &queries,
            keys: &tokens.keys[pos0..].concat(),
            values: &tokens.values[pos0..].concat(),
            pos0,
            n_head,
            head_dim_k: 64,
            head_dim_v: 80,
            n_gqa,
            scorer: Scorer::scaled(1.0),
        };
        let mut out = vec![0.0; batch * n_head * 80];
        attend(&attention, &layer, &mut out);

        for (i, out) in out.chunks_exact(80).enumerate() {
            let (t, head) = (i / n_head, i % n_head / n_gqa);
            let q = &queries[i * 64..][..64];
            let visible = layer.visible(pos0 + t);
            let (mut key, mut value) = (vec![0.0; 64], vec![0.0; 80]);
            let (mut scores, mut values_q, mut eps, mut value_bounds) = (vec![], vec![], 0f64, vec![]);
            for pos in visible.clone() {
                let exact_k = &tokens.keys[pos][head * 64..][..64];
                let exact_v = &tokens.values[pos][head * 80..][..80];
                let (e, f) = if pos < pos0 {
                    layer.key(head, pos, &mut key);
                    layer.value(head, pos, &mut value);
                    bounds[head][pos - cached.start].clone()
                } else {
                    key.copy_from_slice(exact_k);
                    value.copy_from_slice(exact_v);
                    (vec![0.0; 64], vec![0.0; 80])
                };
                // Exact rows are f16 already, and in place codes read as
                // their levels: only staging rounds.
                let staged = read == Read::Staged && pos < pos0;
                let half = |x: f32| if staged { f16::from_f32(x).to_f32() } else { x };
                let rounding = |x: f32| if staged { 2f64.powi(-11) * x.abs() as f64 + 2f64.powi(-25) } else { 0.0 };
                let read_k: Vec<f32> = key.iter().map(|&k| half(k)).collect();
                let read_v: Vec<f32> = value.iter().map(|&v| half(v)).collect();
                let q64: Vec<f64> = q.iter().map(|&x| x as f64).collect();
                scores.push(dot(&q64, exact_k));
                let score_bound: f64 = (0..64)
                    .map(|c| q64[c].abs() * (e[c] + rounding(key[c])) + 1e-5 * (q64[c] * read_k[c] as f64).abs())
                    .sum();
                eps = eps.max(score_bound + 1e-6);
                value_bounds.push((0..80).map(|c| f[c] + rounding(value[c])).collect::<Vec<_>>());
                values_q.push(read_v);
            }
            let a = softmax(&scores);
            for c in 0..80 {
                let o: f64 = visible.clone().zip(&a).map(|(pos, a)| a * tokens.values[pos][head * 80 + c] as f64).sum();
                let m: f64 = values_q.iter().zip(&a).map(|(v, a)| a * v[c] as f64).sum();
                let spread: f64 = values_q.iter().zip(&a).map(|(v, a)| a * (v[c] as f64 - m).abs()).sum();
                let magnitude: f64 = values_q.iter().zip(&a).map(|(v, a)| a * (v[c] as f64).abs()).sum();
                let value_err: f64 = value_bounds.iter().zip(&a).map(|(f, a)| a * f[c]).sum();
                let tol = (2.0 * eps).exp_m1() * spread + value_err + 2f64.powi(-10) * magnitude + 1e-7;
                let err = (out[c] as f64 - o).abs();
                assert!(
                    err <= tol,
                    "{mode} {window:?} token {t} head {i}: channel {c} off by {err:e}, tolerance {tol:e}"
                );
            }
        }
    }
}

/// A sliding-window layer keeps a ring of pages: after many windows'
/// worth of tokens, every position a batch's queries can see is still there.
#[test]
fn sliding_windows_keep_what_the_window_sees() {
    let shape = shape(1, 32, 32);
    // Small batches over many windows, and Gemma 3's window and batch.
    for (window, batch, len) in [(100, 8, 1504), (512, 512, 2048)] {
        check_sliding_window(&shape, window, batch, len);
    }
}

fn check_sliding_window(shape: &CacheShape, window: usize, batch: usize, len: usize) {
    let tokens = Tokens::new(3, len, shape);
    for mode in KvMode::ALL {
        let mut layer = PagedLayer::new(Storage { mode, ..Storage::default() }, shape, Some(window), 4096, batch);
        for pos0 in (0..len).step_by(batch) {
            for pos in pos0..pos0 + batch {
                layer.store(pos, &tokens.keys[pos], &tokens.values[pos]);
            }
            let end = pos0 + batch;
            check_rows(&layer, &tokens, shape, 0, layer.visible(pos0).start..end, end);
        }
        check_attention(&layer, &tokens, shape, len, 4);
    }
}

/// Sketches exist for full pages (f16) or coded ones, and bound the scores
/// of the keys the layer returns.
#[test]
fn sketches_bound_the_cached_keys() {
    let shape = shape(2, 64, 64);
    let len = 5 * PAGE + 7;
    let tokens = Tokens::new(5, len, &shape);
    let q: Vec<f32> = (0..64).map(|c| (c as f32 * 0.37).sin()).collect();
    for mode in KvMode::ALL {
        let storage = Storage { mode, key_sketch: true, ..Storage::default() };
        let mut layer = PagedLayer::new(storage, &shape, None, 1024, 16);
        for pos in 0..len {
            layer.store(pos, &tokens.keys[pos], &tokens.values[pos]);
        }
        let sketched: Vec<usize> = (0..6).filter(|&p| layer.sketch(1, p).is_some()).collect();
        let expected: Vec<usize> = if mode == KvMode::F16 { (0..5).collect() } else { (0..4).collect() };
        assert_eq!(sketched, expected, "{mode}");
        let mut key = vec![0.0; 64];
        for page in sketched {
            let bound = layer.sketch(1, page).unwrap().page_upper_bound(&q);
            // The sink's keys are kept apart from the sketch of page 0.
            for pos in (page * PAGE).max(layer.sink())..(page + 1) * PAGE {
                layer.key(1, pos, &mut key);
                let score: f64 = q.iter().zip(&key).map(|(&a, &b)| a as f64 * b as f64).sum();
                assert!(score <= bound as f64, "{mode} pos {pos}: {score} > {bound}");
            }
        }
    }
}

/// Rewriting recent positions and starting over both work; exact pages can
/// be rewritten, coded ones cannot.
#[test]
fn rewinding() {
    let shape = shape(1, 32, 32);
    let (a, b) = (Tokens::new(6, 400, &shape), Tokens::new(7, 400, &shape));
    let mut layer = PagedLayer::new(Storage { mode: KvMode::Q4, ..Storage::default() }, &shape, None, 512, 16);
    for pos in 0..300 {
        layer.store(pos, &a.keys[pos], &a.values[pos]);
    }
    layer.store(290, &b.keys[290], &b.values[290]);
    let mut key = vec![0.0; 32];
    layer.key(0, 290, &mut key);
    assert_eq!(key, b.keys[290]);
    layer.key(0, 289, &mut key);
    assert_eq!(key, a.keys[289]);

    for pos in 0..400 {
        layer.store(pos, &b.keys[pos], &b.values[pos]);
    }
    check_rows(&layer, &b, &shape, 0, 0..400, 400);
}

#[test]
#[should_panic(expected = "cannot be rewritten")]
fn coded_positions_cannot_be_rewritten() {
    let shape = shape(1, 32, 32);
    let a = Tokens::new(8, 300, &shape);
    let mut layer = PagedLayer::new(Storage { mode: KvMode::Q2, ..Storage::default() }, &shape, None, 512, 16);
    for pos in 0..300 {
        layer.store(pos, &a.keys[pos], &a.values[pos]);
    }
    layer.store(10, &a.keys[10], &a.values[10]);
}

#[test]
#[should_panic(expected = "has not been stored")]
fn unstored_positions_are_refused() {
    let shape = shape(1, 32, 32);
    let layer = PagedLayer::new(Storage::default(), &shape, None, 512, 16);
    layer.key(0, 0, &mut [0.0; 32]);
}

#[test]
fn modes_parse() {
    for mode in KvMode::ALL {
        assert_eq!(mode.to_string().parse::<KvMode>().unwrap(), mode);
    }
    let err = "q3".parse::<KvMode>().unwrap_err().to_string();
    assert!(err.contains("'q3'") && err.contains("f16, q8, q4 or q2"), "{err}");
}

/// Bytes per token of a global layer at a 32K context, everything the layer
/// allocates included (codes, minima and steps, sketch and refinement, the
/// exact residual pages), against plain f16 keys and values without any
/// sketch.
#[test]
fn memory_per_token() {
    let n_ctx = 32768;
    for (name, n_kv_head, head_dim) in [("Gemma 3", 1, 256), ("Llama", 8, 128)] {
        let shape = shape(n_kv_head, head_dim, head_dim);
        let plain = (n_kv_head * 2 * head_dim * 2) as f64;
        let ratio = |mode| {
            let layer = PagedLayer::new(Storage { mode, ..Storage::default() }, &shape, None, n_ctx, 512);
            let per_token = layer.bytes() as f64 / n_ctx as f64;
            eprintln!("{name} {mode}: {per_token:.2} bytes/token/layer, {:.4} of plain f16", per_token / plain);
            per_token / plain
        };
        let [f16, q8, q4, q2] = KvMode::ALL.map(ratio);
        assert!(q4 <= 0.30, "{name} q4: {q4}");
        assert!(q2 <= 0.20, "{name} q2: {q2}");
        assert!(q2 < q4 && q4 < q8 && q8 < f16, "{name}: {q2} {q4} {q8} {f16}");
    }
}

/// Attention calls that overlap on one thread pool (two sessions, say): a
/// thread waiting in one call's parallel loop runs the other call, and both
/// still give the results of calls made one after the other.
#[test]
fn overlapping_attention_calls_agree_with_sequential_ones() {
    let (shape, len, batch) = (shape(1, 64, 80), 40 * PAGE + 3, 64);
    let tokens = Tokens::new(21, len, &shape);
    let mut layer = PagedLayer::new(Storage { mode: KvMode::Q4, ..Storage::default() }, &shape, None, len, batch);
    for pos in 0..len {
        layer.store(pos, &tokens.keys[pos], &tokens.values[pos]);
    }
    let mut rng = Rng(22);
    let queries: Vec<f32> = (0..batch * 4 * 64).map(|_| f16::from_f64(rng.normal() / 8.0).to_f32()).collect();
    let pos0 = len - batch;
    let (keys, values) = (tokens.keys[pos0..].concat(), tokens.values[pos0..].concat());
    let attention = AttentionBatch {
        queries: &queries,
        keys: &keys,
        values: &values,
        pos0,
        n_head: 4,
        head_dim_k: 64,
        head_dim_v: 80,
        n_gqa: 4,
        scorer: Scorer::scaled(0.125),
    };
    let run = || {
        let mut out = vec![0.0; batch * 4 * 80];
        attend(&attention, &layer, &mut out);
        out
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let alone = pool.install(run);
    // Callers outside the pool, as sessions on their own threads are.
    std::thread::scope(|scope| {
        let callers: Vec<_> =
            (0..4).map(|_| scope.spawn(|| (0..8).map(|_| pool.install(run)).collect::<Vec<_>>())).collect();
        for caller in callers {
            let outs = caller.join().expect("no call panics");
            assert!(outs.iter().all(|out| *out == alone), "overlapping calls differ from a call alone");
        }
    });
}
