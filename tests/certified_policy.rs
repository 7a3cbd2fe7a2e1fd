//! Certified attention over a real paged cache (f16 with sketches, and q4),
//! against exact attention in f64 on the same cache (the audit's), and its
//! candidate bounds against exact scores.
//!
//! The caches are [`synthetic`](sift::attn::certified::synthetic)'s: 4,096
//! positions, 2 KV heads of 2 query heads each, keys and values of 64. A
//! configuration fails when its count of certified calls with an error above
//! ε is implausible under δ: its upper tail under Binomial(calls, δ) is
//! below 10^−6 (12 configurations: a valid method fails with probability
//! under 1.2·10^−5).

use sift::attn::audit::{AuditTable, Audited};
use sift::attn::certified::candidates::{CacheHead, GroupReads, GroupScan};
use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Grid, HeadKeys, Params, PerturbationSeed, Perturbations};
use sift::attn::{AttentionPolicy, HeadRecord, LayerCall, Measure, Split};
use sift::kv::{KvMode, Storage};

const SHAPE: SyntheticShape = SyntheticShape { n_kv_head: 2, n_gqa: 2, dim: 64, len: 4096 };

fn storage(mode: KvMode) -> Storage {
    Storage { mode, key_sketch: true, ..Storage::default() }
}

/// `ln P(Binomial(n, p) ≥ k)`.
fn log_upper_tail(n: u64, p: f64, k: u64) -> f64 {
    let log_choose = |i: u64| -> f64 { (1..=i).map(|x| ((n - i + x) as f64 / x as f64).ln()).sum() };
    let terms: Vec<f64> = (k..=n).map(|i| log_choose(i) + i as f64 * p.ln() + (n - i) as f64 * (-p).ln_1p()).collect();
    let top = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    top + terms.iter().map(|t| (t - top).exp()).sum::<f64>().ln()
}

/// `steps` decoding calls of `policy` on `cache`, fresh queries each.
fn run(cache: &mut SyntheticCache, policy: &mut dyn AttentionPolicy, steps: u64) -> Vec<HeadRecord> {
    let shape = cache.shape;
    let mut out = vec![0.0; shape.n_head() * shape.dim];
    let mut records = Vec::new();
    for step in 0..steps {
        let queries = cache.queries();
        let batch = cache.decoding_batch(&queries);
        let call = LayerCall { layer: 0, step, batch: &batch, cache: &cache.layer };
        policy.attend(&call, &mut out, &mut records);
    }
    records
}

#[test]
fn certified_policy_is_within_epsilon_on_paged_caches() {
    const STEPS: u64 = 60;
    for mode in [KvMode::F16, KvMode::Q4] {
        let mut cache = SyntheticCache::new(SHAPE, storage(mode), 11);
        for measure in Measure::ALL {
            for delta in [0.2, 1e-3] {
                let params = Params { eps: 0.1, delta, measure, grid: Grid::default() };
                let certified = CertifiedPolicy::new(params, PerturbationSeed { seed: 5, fixed: false });
                let mut audited = Audited::new(Box::new(certified), measure);
                let records = run(&mut cache, &mut audited, STEPS);
                let table = AuditTable::of("certified", &records, params.eps);
                let calls = STEPS * SHAPE.n_head() as u64;
                assert_eq!(table.calls as u64, calls, "every head of every call is audited");
                let violations = table.violations as u64;
                let tail = if violations == 0 { 0.0 } else { log_upper_tail(calls, delta, violations) };
                assert!(tail >= 1e-6f64.ln(), "{mode} {measure} δ {delta}: {violations} violations in {calls} calls");
                eprintln!(
                    "{mode} {measure} δ {delta}: {} certified, {} fallbacks, keys read {:.3} (p90 {:.3}), \
                     bytes {:.3} of dense, error p90 {:.3} ε, max {:.3} ε, {violations} violations",
                    table.certified,
                    table.fallbacks,
                    table.keys_mean,
                    table.keys_p90,
                    table.bytes_vs_dense,
                    table.error_p90,
                    table.error_max,
                );
                assert!(table.bytes_vs_dense < 1.0, "{mode} {measure}: certified read more than dense");
            }
        }
    }
}

/// Every pool key's bounds hold its exact score (f64, from the key as the
/// cache returns it and the query rounded to f16) and its perturbation: the
/// scan's `p_i ≥ s_i + E_i` and largest lower bound, and the refined bounds,
/// in f16 and the quantized modes, sink page and unsketched pages included.
#[test]
fn candidate_bounds_hold_every_exact_score() {
    for mode in [KvMode::F16, KvMode::Q8, KvMode::Q4, KvMode::Q2] {
        let mut cache = SyntheticCache::new(SyntheticShape { len: 1500, ..SHAPE }, storage(mode), 3);
        let queries = cache.queries();
        let shape = cache.shape;
        let batch = cache.decoding_batch(&queries);
        let call = LayerCall { layer: 0, step: 0, batch: &batch, cache: &cache.layer };
        let split = Split::of(call.visible(0));
        let mut scan = GroupScan::default();
        let mut reads = GroupReads::default();
        let mut key = vec![0.0; shape.dim];
        let pool: Vec<u32> = (0..split.pool.len() as u32).collect();
        let mut refined = vec![0.0; pool.len()];
        for kv_head in 0..shape.n_kv_head {
            let perturbations = Perturbations::new(PerturbationSeed { seed: 1, fixed: false }, 0, kv_head, 0);
            scan.scan(&call, kv_head, &split, &perturbations);
            reads.reset(scan.keys(&split), 0..shape.n_gqa);
            for g in 0..shape.n_gqa {
                let query = scan.query(g, shape.dim).to_vec();
                let mut head = CacheHead::new(&call, kv_head, &split, &scan, g, &mut reads);
                assert_eq!(head.refines(), matches!(mode, KvMode::F16 | KvMode::Q8), "{mode}");
                head.refine(&pool, &mut refined);
                let mut largest = f64::NEG_INFINITY;
                for (i, &p) in scan.perturbed_uppers(g).iter().enumerate() {
                    let pos = split.pool.start + i;
                    cache.layer.key(kv_head, pos, &mut key);
                    let dot: f64 = query.iter().zip(&key).map(|(&q, &k)| f64::from(q) * f64::from(k)).sum();
                    let score = f64::from(shape.scale()) * dot;
                    largest = largest.max(score);
                    let perturbed = score + perturbations.exponential(pos);
                    let ctx = format!("{mode} head {kv_head}/{g} position {pos}: {perturbed}");
                    assert!(perturbed <= f64::from(p), "{ctx} above the scan's {p}");
                    if head.refines() {
                        assert!(perturbed <= refined[i], "{ctx} above the refined {}", refined[i]);
                    }
                }
                assert!(scan.lower_max(g) <= largest, "{mode}: a lower bound above every score");
            }
        }
    }
}

/// A page refined whole, as the scan does when most pages would be refined
/// anyway, gives every key the bounds of the scan and of the refinement of
/// listed rows, bit for bit, for every query head at once: the scan that
/// refines as it goes decides nothing differently.
#[test]
fn a_page_refined_whole_bounds_as_the_scan_and_the_listed_refinement() {
    use sift::kv::{Bounds, ScanQuery, PAGE};
    let bits = |b: &[Bounds]| b.iter().map(|b| (b.lower.to_bits(), b.upper.to_bits())).collect::<Vec<_>>();
    for mode in [KvMode::F16, KvMode::Q8, KvMode::Q4, KvMode::Q2] {
        let mut cache = SyntheticCache::new(SyntheticShape { len: 1500, ..SHAPE }, storage(mode), 7);
        let queries = cache.queries();
        let all: Vec<u32> = (0..PAGE as u32).collect();
        let mut pages = 0;
        for kv_head in 0..SHAPE.n_kv_head {
            let group = &queries[kv_head * SHAPE.n_gqa * SHAPE.dim..][..SHAPE.n_gqa * SHAPE.dim];
            for page in 0..1500 / PAGE {
                let Some(sketch) = cache.layer.sketch(kv_head, page) else { continue };
                let prepared: Vec<ScanQuery> = group
                    .chunks_exact(SHAPE.dim)
                    .map(|q| {
                        let mut prepared = ScanQuery::default();
                        prepared.prepare(sketch, q);
                        prepared
                    })
                    .collect();
                let len = SHAPE.n_gqa * PAGE;
                let (mut scanned, mut listed) = (vec![Bounds::default(); len], vec![Bounds::default(); len]);
                sketch.scan_heads(&prepared, &mut scanned);
                sketch.refine_heads(&prepared, &all, &mut Vec::new(), &mut listed);
                let (mut whole, mut whole_scanned) = (vec![Bounds::default(); len], vec![Bounds::default(); len]);
                sketch.refine_page_heads(&prepared, &mut whole, &mut whole_scanned);
                assert_eq!(bits(&whole_scanned), bits(&scanned), "{mode} head {kv_head} page {page}: scanned");
                assert_eq!(bits(&whole), bits(&listed), "{mode} head {kv_head} page {page}: refined");
                pages += 1;
            }
        }
        assert!(pages >= SHAPE.n_kv_head * 20, "{mode}: {pages} sketched pages checked");
    }
}
