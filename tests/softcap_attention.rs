//! Soft-capped attention scores (Gemma 2's `cap · tanh(s / cap)`) through
//! every attention policy, against references computed here in f64 from the
//! keys and values as the cache returns them and the query rounded to f16,
//! as every policy rounds it.
//!
//! The caches are the certified policy's synthetic ones: heavy hitters
//! score 7.5 to 9 and the bulk about ±4, so a cap of 5 bends the scores that
//! carry most of the attention (to about 4.6 to 4.8) and flattens the
//! softmax: each test first checks that the capped reference is far from
//! the uncapped one, so that a policy ignoring the cap would fail it.
//!
//! Tolerances are those of `tests/attention_policies.rs` (f32 sums, f16
//! probabilities: 10^-3 of the largest value). The certified test counts
//! the calls certified with an error above ε by this test's own reference
//! and fails when that count is implausible under δ: its upper tail under
//! Binomial(calls, δ) below 10^-6 (4 configurations: a valid method fails
//! with probability under 4·10^-6).

use half::f16;
use sift::attn::audit::Audited;
use sift::attn::certified::candidates::GroupScan;
use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Grid, Params, PerturbationSeed, Perturbations};
use sift::attn::dense::Dense;
use sift::attn::topk::Topk;
use sift::attn::{AttentionBatch, AttentionPolicy, HeadRecord, LayerCall, Measure, Scorer, Split};
use sift::kv::{KvMode, PagedLayer, Storage};

const SHAPE: SyntheticShape = SyntheticShape { n_kv_head: 2, n_gqa: 2, dim: 64, len: 1500 };
const CAP: f32 = 5.0;

fn capped() -> Scorer {
    Scorer { scale: SHAPE.scale(), softcap: Some(CAP) }
}

fn cache(mode: KvMode, seed: u64) -> SyntheticCache {
    SyntheticCache::new(SHAPE, Storage { mode, key_sketch: true, ..Storage::default() }, seed)
}

/// `policy`'s output and records for a decoding step of `queries` over `cache`.
fn attend(
    cache: &SyntheticCache,
    queries: &[f32],
    scorer: Scorer,
    step: u64,
    policy: &mut dyn AttentionPolicy,
) -> (Vec<f32>, Vec<HeadRecord>) {
    let batch = AttentionBatch {
        queries,
        keys: &cache.last_keys,
        values: &cache.last_values,
        pos0: SHAPE.len - 1,
        n_head: SHAPE.n_head(),
        head_dim_k: SHAPE.dim,
        head_dim_v: SHAPE.dim,
        n_gqa: SHAPE.n_gqa,
        scorer,
    };
    let call = LayerCall { layer: 0, step, batch: &batch, cache: &cache.layer };
    let (mut out, mut records) = (vec![0.0; SHAPE.n_head() * SHAPE.dim], Vec::new());
    policy.attend(&call, &mut out, &mut records);
    (out, records)
}

/// Query head `head` of `queries`, rounded to f16.
fn query(queries: &[f32], head: usize) -> Vec<f32> {
    queries[head * SHAPE.dim..][..SHAPE.dim].iter().map(|&q| f16::from_f32(q).to_f32()).collect()
}

/// The dot product of a query and the key at `pos`, in f64.
fn dot(layer: &PagedLayer, kv_head: usize, pos: usize, q: &[f32]) -> f64 {
    let mut key = vec![0.0; SHAPE.dim];
    layer.key(kv_head, pos, &mut key);
    q.iter().zip(&key).map(|(&q, &k)| f64::from(q) * f64::from(k)).sum()
}

/// Exact attention of one query head over every position, in f64, scores
/// capped at `cap` when given.
struct Reference {
    output: Vec<f64>,
    /// `M = sqrt(Σ a_i ‖v_i‖²)`.
    value_scale: f64,
    v_max: f64,
}

fn reference(layer: &PagedLayer, head: usize, q: &[f32], cap: Option<f64>) -> Reference {
    let kv_head = head / SHAPE.n_gqa;
    let scale = f64::from(SHAPE.scale());
    let scores: Vec<f64> = (0..SHAPE.len)
        .map(|pos| {
            let s = scale * dot(layer, kv_head, pos, q);
            cap.map_or(s, |cap| cap * (s / cap).tanh())
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (mut d, mut square, mut v_max, mut output) = (0.0, 0.0, 0f64, vec![0.0; SHAPE.dim]);
    let mut value = vec![0.0; SHAPE.dim];
    for (pos, &s) in scores.iter().enumerate() {
        layer.value(kv_head, pos, &mut value);
        let w = (s - max).exp();
        d += w;
        square += w * value.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
        v_max = value.iter().fold(v_max, |m, &v| m.max(f64::from(v).abs()));
        output.iter_mut().zip(&value).for_each(|(o, &v)| *o += w * f64::from(v));
    }
    output.iter_mut().for_each(|o| *o /= d);
    Reference { output, value_scale: (square / d).sqrt(), v_max }
}

fn distance(out: &[f32], reference: &[f64]) -> f64 {
    out.iter().zip(reference).map(|(&o, r)| (f64::from(o) - r).powi(2)).sum::<f64>().sqrt()
}

/// Dense attention, and top-k reading every page (so dense attention over
/// its own reads), are the capped reference, and not the uncapped one.
#[test]
fn dense_and_topk_score_through_the_cap() {
    for mode in [KvMode::F16, KvMode::Q4] {
        let mut cache = cache(mode, 21);
        let queries = cache.queries();
        let policies: [(&str, Box<dyn AttentionPolicy>); 2] =
            [("dense", Box::new(Dense)), ("topk", Box::new(Topk::new(SHAPE.len)))];
        for (name, mut policy) in policies {
            let (out, records) = attend(&cache, &queries, capped(), 0, policy.as_mut());
            for head in 0..SHAPE.n_head() {
                let q = query(&queries, head);
                let exact = reference(&cache.layer, head, &q, Some(f64::from(CAP)));
                let uncapped = reference(&cache.layer, head, &q, None);
                let tolerance = 1e-3 * exact.v_max;
                let out = &out[head * SHAPE.dim..][..SHAPE.dim];
                for (c, (&o, &r)) in out.iter().zip(&exact.output).enumerate() {
                    assert!((f64::from(o) - r).abs() <= tolerance, "{mode} {name} head {head} channel {c}: {o} vs {r}");
                }
                let apart = distance(out, &uncapped.output);
                assert!(apart > 20.0 * tolerance, "{mode} {name} head {head}: the cap moves the output by {apart}");
                assert_eq!(records[head].keys_read, SHAPE.len, "{mode} {name} head {head}");
            }
        }
    }
}

/// Every pool key's bounds hold its exact capped score, in every cache mode.
#[test]
fn candidate_bounds_hold_every_capped_score() {
    for mode in [KvMode::F16, KvMode::Q8, KvMode::Q4, KvMode::Q2] {
        let mut cache = cache(mode, 3);
        let queries = cache.queries();
        let batch = AttentionBatch {
            queries: &queries,
            keys: &cache.last_keys,
            values: &cache.last_values,
            pos0: SHAPE.len - 1,
            n_head: SHAPE.n_head(),
            head_dim_k: SHAPE.dim,
            head_dim_v: SHAPE.dim,
            n_gqa: SHAPE.n_gqa,
            scorer: capped(),
        };
        let call = LayerCall { layer: 0, step: 0, batch: &batch, cache: &cache.layer };
        let split = Split::of(call.visible(0));
        let mut scan = GroupScan::default();
        let (scale, cap) = (f64::from(SHAPE.scale()), f64::from(CAP));
        let mut bent = 0;
        for kv_head in 0..SHAPE.n_kv_head {
            let perturbations = Perturbations::new(PerturbationSeed { seed: 1, fixed: false }, 0, kv_head, 0);
            scan.scan(&call, kv_head, &split, &perturbations);
            for g in 0..SHAPE.n_gqa {
                let q = scan.query(g, SHAPE.dim);
                for (i, &(lower, upper)) in scan.bounds(g).iter().enumerate() {
                    let pos = split.pool.start + i;
                    let s = scale * dot(&cache.layer, kv_head, pos, q);
                    let score = cap * (s / cap).tanh();
                    bent += usize::from(s - score > 1.0);
                    assert!(
                        lower <= score && score <= upper,
                        "{mode} head {kv_head}/{g} position {pos}: {score} outside [{lower}, {upper}]"
                    );
                    // Keys no sketch bounds (unsketched pages) keep infinite bounds.
                    assert!(upper.is_infinite() || upper <= cap + 1e-4, "{mode}: a capped bound {upper} above the cap");
                }
            }
        }
        assert!(bent > 0, "{mode}: no score is bent by the cap");
    }
}

/// Certified attention with capped scores: the calls certified with an
/// error above ε (value measure, by this test's reference) are as rare as δ
/// allows, and the audit, which scores through the cap too, measures this
/// test's errors.
#[test]
fn certified_attention_is_within_epsilon_of_capped_attention() {
    const STEPS: u64 = 40;
    let log_upper_tail = |n: u64, p: f64, k: u64| {
        let log_choose = |i: u64| -> f64 { (1..=i).map(|x| ((n - i + x) as f64 / x as f64).ln()).sum() };
        let terms: Vec<f64> =
            (k..=n).map(|i| log_choose(i) + i as f64 * p.ln() + (n - i) as f64 * (-p).ln_1p()).collect();
        let top = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        top + terms.iter().map(|t| (t - top).exp()).sum::<f64>().ln()
    };
    for mode in [KvMode::F16, KvMode::Q4] {
        for delta in [0.2, 1e-3] {
            let mut cache = cache(mode, 11);
            let params = Params { eps: 0.1, delta, measure: Measure::Value, grid: Grid::default() };
            let certified = CertifiedPolicy::new(params, PerturbationSeed { seed: 5, fixed: false });
            let mut audited = Audited::new(Box::new(certified), Measure::Value);
            let (mut certified_calls, mut violations) = (0, 0);
            for step in 0..STEPS {
                let queries = cache.queries();
                let (out, records) = attend(&cache, &queries, capped(), step, &mut audited);
                for record in &records {
                    let head = record.head;
                    let exact = reference(&cache.layer, head, &query(&queries, head), Some(f64::from(CAP)));
                    let error = distance(&out[head * SHAPE.dim..][..SHAPE.dim], &exact.output) / exact.value_scale;
                    let audit = record.audit.expect("a decoding step over 1500 positions is audited");
                    assert!(
                        (audit.error - error).abs() <= 1e-3 * error + 1e-6,
                        "{mode} δ {delta} step {step} head {head}: audit {} vs {error}",
                        audit.error
                    );
                    if !record.fallback && record.certificate.epsilon.is_finite() {
                        certified_calls += 1;
                        violations += u64::from(error > params.eps);
                    }
                }
            }
            let calls = STEPS * SHAPE.n_head() as u64;
            let tail = if violations == 0 { 0.0 } else { log_upper_tail(calls, delta, violations) };
            eprintln!("{mode} δ {delta}: {certified_calls} of {calls} calls certified, {violations} above ε");
            assert!(certified_calls > 0, "{mode} δ {delta}: nothing certified");
            assert!(tail >= 1e-6f64.ln(), "{mode} δ {delta}: {violations} violations in {calls} calls");
        }
    }
}
