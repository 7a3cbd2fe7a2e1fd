//! The attention policies through the seam, against references computed
//! here in f64 from the keys and values as the cache returns them
//! (`PagedLayer::key`/`value`) and the query rounded to f16, as every policy
//! rounds it:
//!
//! * dense attention as a policy is the free function bit for bit, and
//!   within its f16 arithmetic of the reference;
//! * top-k is dense attention over exactly the pages this test picks by the
//!   sketch's page bounds, the sinks and the window;
//! * the audit's errors are this test's own, on all three measures;
//! * perplexity scored through decoding steps with dense attention is the
//!   batched path's, within float noise.
//!
//! # The tolerance
//!
//! Against the reference over the same positions, the policies differ by
//! f32 sums and the f16 rounding of the probabilities (relative `2^-11`
//! each): `|ô_c − o_c| ≤ Σ_i p_i·2^-11·|v_ic| + f32 noise`, below
//! `10^-3 · max |v|`.

mod common;

use half::f16;
use sift::attn::audit::Audited;
use sift::attn::dense::{attend, Dense};
use sift::attn::topk::Topk;
use sift::attn::{AttentionBatch, AttentionPolicy, HeadRecord, LayerCall, Measure, Scorer};
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::kv::page::{KvMode, PagedLayer, Storage};
use sift::kv::{CacheShape, PAGE};
use sift::model::Model;
use sift::perplexity::{evaluate, PerplexityReport, Scoring, Windows};
use sift::tokenizer::Tokenizer;

use common::Rng;

const DIM_K: usize = 64;
const DIM_V: usize = 48;
const N_KV_HEAD: usize = 2;
const N_GQA: usize = 2;
const N_HEAD: usize = N_KV_HEAD * N_GQA;
/// Positions stored; the last is the decoding step's token.
const LEN: usize = 1500;
const SCALE: f32 = 0.125;

/// A layer of `LEN` positions whose pages differ in how well they match the
/// queries: every key leans along one direction by its page's own amount,
/// the query along it too, so that a few pages hold most of the attention.
struct Fixture {
    layer: PagedLayer,
    /// The last token's keys and values, all KV heads.
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
}

impl Fixture {
    fn new(mode: KvMode, seed: u64) -> Self {
        let shape = CacheShape { n_kv_head: N_KV_HEAD, head_dim_k: DIM_K, head_dim_v: DIM_V, windows: vec![None] };
        let storage = Storage { mode, key_sketch: true, ..Storage::default() };
        let mut layer = PagedLayer::new(storage, &shape, None, LEN, 1);
        let mut rng = Rng(seed);
        let lean: Vec<f64> = (0..LEN.div_ceil(PAGE)).map(|_| 3.0 * rng.unit().powi(4)).collect();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for pos in 0..LEN {
            keys.clear();
            values.clear();
            for _ in 0..N_KV_HEAD {
                keys.extend((0..DIM_K).map(|c| (rng.normal() + if c < 8 { lean[pos / PAGE] } else { 0.0 }) as f32));
                values.extend((0..DIM_V).map(|_| rng.normal() as f32));
            }
            layer.store(pos, &keys, &values);
        }
        let queries =
            (0..N_HEAD * DIM_K).map(|c| (rng.normal() + if c % DIM_K < 8 { 4.0 } else { 0.0 }) as f32).collect();
        Self { layer, keys, values, queries }
    }

    fn batch(&self) -> AttentionBatch<'_> {
        AttentionBatch {
            queries: &self.queries,
            keys: &self.keys,
            values: &self.values,
            pos0: LEN - 1,
            n_head: N_HEAD,
            head_dim_k: DIM_K,
            head_dim_v: DIM_V,
            n_gqa: N_GQA,
            scorer: Scorer::scaled(SCALE),
        }
    }

    /// `policy`'s output and records for the decoding step.
    fn attend(&self, policy: &mut dyn AttentionPolicy) -> (Vec<f32>, Vec<HeadRecord>) {
        let batch = self.batch();
        let call = LayerCall { layer: 3, step: 0, batch: &batch, cache: &self.layer };
        let (mut out, mut records) = (vec![0.0; N_HEAD * DIM_V], Vec::new());
        policy.attend(&call, &mut out, &mut records);
        (out, records)
    }

    /// Query head `head`, rounded to f16.
    fn query(&self, head: usize) -> Vec<f32> {
        self.queries[head * DIM_K..][..DIM_K].iter().map(|&q| f16::from_f32(q).to_f32()).collect()
    }
}

/// Exact attention of one query head over `positions`, in f64.
struct Reference {
    output: Vec<f64>,
    log_denominator: f64,
    value_scale: f64,
    /// The largest value magnitude seen.
    v_max: f64,
}

fn reference(layer: &PagedLayer, head: usize, q: &[f32], positions: &[usize]) -> Reference {
    let kv_head = head / N_GQA;
    let (mut key, mut value) = (vec![0.0; DIM_K], vec![0.0; DIM_V]);
    let scores: Vec<f64> = positions
        .iter()
        .map(|&pos| {
            layer.key(kv_head, pos, &mut key);
            f64::from(SCALE) * q.iter().zip(&key).map(|(&q, &k)| f64::from(q) * f64::from(k)).sum::<f64>()
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (mut d, mut square, mut v_max, mut output) = (0.0, 0.0, 0f64, vec![0.0; DIM_V]);
    for (&pos, &s) in positions.iter().zip(&scores) {
        layer.value(kv_head, pos, &mut value);
        let w = (s - max).exp();
        d += w;
        square += w * value.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
        v_max = value.iter().fold(v_max, |m, &v| m.max(f64::from(v).abs()));
        output.iter_mut().zip(&value).for_each(|(o, &v)| *o += w * f64::from(v));
    }
    output.iter_mut().for_each(|o| *o /= d);
    Reference { output, log_denominator: max + d.ln(), value_scale: (square / d).sqrt(), v_max }
}

fn assert_close(out: &[f32], reference: &Reference, what: &str) {
    let tolerance = 1e-3 * reference.v_max;
    for (c, (&o, &r)) in out.iter().zip(&reference.output).enumerate() {
        assert!((f64::from(o) - r).abs() <= tolerance, "{what}: channel {c}: {o} vs {r} (tolerance {tolerance})");
    }
}

#[test]
fn dense_policy_is_the_free_function_and_exact_attention() {
    for mode in [KvMode::F16, KvMode::Q4] {
        let fixture = Fixture::new(mode, 1);
        let (out, records) = fixture.attend(&mut Dense);
        let mut free = vec![0.0; N_HEAD * DIM_V];
        attend(&fixture.batch(), &fixture.layer, &mut free);
        assert_eq!(out, free, "{mode}: the policy is not the free function");
        let all: Vec<usize> = (0..LEN).collect();
        for head in 0..N_HEAD {
            let reference = reference(&fixture.layer, head, &fixture.query(head), &all);
            assert_close(&out[head * DIM_V..][..DIM_V], &reference, &format!("{mode} head {head}"));
            let record = &records[head];
            assert_eq!((record.head, record.layer, record.keys_read, record.visible), (head, 3, LEN, LEN));
        }
    }
}

/// The positions top-k must read for `head`: the first 4, the newest 64, and
/// the `k` pool pages of largest sketch bound (ties to the earlier page) with
/// every pool page that has no sketch.
fn topk_positions(layer: &PagedLayer, head: usize, q: &[f32], k: usize) -> Vec<usize> {
    let (sinks, window) = (4, LEN - 64);
    let mut bounds = Vec::new();
    let mut pages = Vec::new();
    for page in sinks / PAGE..window.div_ceil(PAGE) {
        match layer.sketch(head / N_GQA, page) {
            Some(sketch) => bounds.push((sketch.page_upper_bound(q), page)),
            None => pages.push(page),
        }
    }
    bounds.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    pages.extend(bounds.iter().take(k).map(|&(_, page)| page));
    let in_pool = |pos: &usize| (sinks..window).contains(pos);
    let mut positions: Vec<usize> = (0..sinks).chain(window..LEN).collect();
    positions.extend(pages.iter().flat_map(|&p| p * PAGE..(p + 1) * PAGE).filter(in_pool));
    positions.sort_unstable();
    positions
}

#[test]
fn topk_is_dense_attention_over_the_chosen_pages() {
    for (mode, k) in [(KvMode::F16, 3), (KvMode::Q4, 3), (KvMode::Q8, 1), (KvMode::F16, 100)] {
        let fixture = Fixture::new(mode, 2);
        let (out, records) = fixture.attend(&mut Topk::new(k));
        for head in 0..N_HEAD {
            let q = fixture.query(head);
            let positions = topk_positions(&fixture.layer, head, &q, k);
            let reference = reference(&fixture.layer, head, &q, &positions);
            assert_close(&out[head * DIM_V..][..DIM_V], &reference, &format!("{mode} k {k} head {head}"));
            let record = &records[head];
            assert_eq!(record.keys_read, positions.len(), "{mode} k {k} head {head}");
            assert!(record.certificate.epsilon.is_infinite());
            let estimate = record.estimate.expect("top-k estimates the denominator");
            assert!((estimate.log_denominator - reference.log_denominator).abs() < 1e-4);
        }
        if k == 100 {
            assert!(records.iter().all(|r| r.keys_read == LEN), "every page fits in 100");
        }
    }
}

#[test]
fn the_audit_measures_errors_as_an_independent_computation_does() {
    let fixture = Fixture::new(KvMode::F16, 3);
    let all: Vec<usize> = (0..LEN).collect();
    for measure in Measure::ALL {
        let mut audited = Audited::new(Box::new(Topk::new(2)), measure);
        let (out, records) = fixture.attend(&mut audited);
        for (head, record) in records.iter().enumerate() {
            let q = fixture.query(head);
            let exact = reference(&fixture.layer, head, &q, &all);
            let out = &out[head * DIM_V..][..DIM_V];
            let distance = out.iter().zip(&exact.output).map(|(&o, r)| (f64::from(o) - r).powi(2)).sum::<f64>().sqrt();
            let chosen = reference(&fixture.layer, head, &q, &topk_positions(&fixture.layer, head, &q, 2));
            let expected = match measure {
                Measure::Value => distance / exact.value_scale,
                Measure::Output => distance / exact.output.iter().map(|o| o * o).sum::<f64>().sqrt(),
                Measure::Denominator => (chosen.log_denominator - exact.log_denominator).exp_m1().abs(),
            };
            let checked = record.audit.expect("a decoding step over 1500 positions is audited");
            assert_eq!(checked.measure, measure);
            assert!(
                (checked.error - expected).abs() <= 1e-9 + 1e-3 * expected,
                "{measure} head {head}: {} vs {expected}",
                checked.error
            );
            assert!(expected > 1e-3, "{measure} head {head}: top-2 pages should miss some attention ({expected})");
            assert!(!checked.violated, "top-k certifies nothing, so violates nothing");
            let dense_bytes = (LEN * (DIM_K + DIM_V) * 2 / N_GQA) as f64;
            assert_eq!(checked.dense_bytes, dense_bytes);
        }
    }
}

#[test]
fn perplexity_through_decoding_steps_is_the_batched_one() {
    let Some(dir) = common::shared_dir("perplexity_through_decoding_steps_is_the_batched_one") else { return };
    let file = GgufFile::open(dir.join("anchors/models/tiny-llama.gguf")).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(&file).unwrap();
    let text = "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse, \
                I thought I would sail about a little and see the watery part of the world. "
        .repeat(20);
    let tokens = tokenizer.encode(&text, true, false).unwrap();
    let ppl = |scoring| {
        let mut session = Session::with_cache(&model, 256, 64, Storage::default());
        let windows = Windows { max: Some(2), stride: None, scoring };
        let eval = evaluate(&mut session, &tokens, tokenizer.bos(), windows, 0, None, |_| {}).unwrap();
        assert_eq!(eval.scored.len(), 2 * 127);
        PerplexityReport::of(&eval.scored, eval.windows).ppl
    };
    let (batched, decoded) = (ppl(Scoring::Batched), ppl(Scoring::Decoded));
    eprintln!("PPL batched {batched}, decoded {decoded}");
    assert!((decoded / batched - 1.0).abs() < 1e-4, "batched {batched} vs decoded {decoded}");
}

/// `sift ARGS` with the default model, `stdin` piped in.
fn sift(args: &[&str], stdin: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(args)
        .env("SIFT_MODEL", common::default_model())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// `sift run --attn topk --audit --audit-out`: every decoding step past 1024
/// positions gets a checked line per global layer and query head, and each
/// token line the step's certificate.
#[test]
fn run_writes_the_audit_of_a_sparse_policy() {
    let prompt = "The sea was calm and the sky was clear, and the ship sailed on toward the north. ".repeat(70);
    let path = std::env::temp_dir().join(format!("sift-attn-audit-{}.jsonl", std::process::id()));
    let args = ["run", "-p", "-", "--temp", "0", "-n", "3", "--attn", "topk", "--topk-pages", "2", "--audit"];
    let out = sift(&[&args[..], &["--audit-out", path.to_str().unwrap(), "--quiet"]].concat(), prompt.as_bytes());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["attention"], "topk");
    let of = |kind: &'static str| lines.iter().filter(move |l| l["type"] == kind);
    assert_eq!(of("token").count(), 3);
    // The first token comes from the prompt's batches, which are dense; the
    // two decoding steps after it are sparse on Gemma 3's 3 global layers.
    assert_eq!(of("token").next().unwrap()["attention"]["kind"], "dense");
    assert!(of("token").skip(1).all(|t| t["attention"]["kind"] == "topk" && t["attention"]["epsilon"].is_null()));
    let rows: Vec<_> = of("attention").collect();
    assert_eq!(rows.len(), 2 * 3 * 4, "2 steps x 3 global layers x 4 query heads");
    for row in rows {
        let (keys, visible) = (row["keys_read"].as_u64().unwrap(), row["visible"].as_u64().unwrap());
        assert!(visible > 1024 && keys < visible, "{row}");
        assert!(row["error"].as_f64().unwrap() >= 0.0 && row["violated"] == false, "{row}");
        assert_eq!(row["position"].as_u64().unwrap() + 1, visible, "{row}");
    }
}

#[test]
fn bad_attention_settings_are_one_line_usage_errors() {
    for (args, message) in [
        (&["--eps", "0"][..], "--eps must be a positive number"),
        (&["--delta", "1"][..], "--delta must lie strictly between 0 and 1"),
        (&["--attn", "topk", "--topk-pages", "0"][..], "--topk-pages must be at least 1"),
    ] {
        let out = sift(&[&["run", "-p", "hi", "-n", "1"][..], args].concat(), b"");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}
