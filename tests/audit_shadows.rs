//! The audit's shadows: a policy run beside the audited one must record, call
//! for call, what it records when it is itself the audited policy on the same
//! cache and queries (the direct path, an independent run).

use sift::attn::audit::{AuditTable, Audited};
use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Grid, Params, PerturbationSeed};
use sift::attn::topk::Topk;
use sift::attn::{AttentionPolicy, HeadRecord, LayerCall, Measure};
use sift::kv::{KvMode, Storage};

const SHAPE: SyntheticShape = SyntheticShape { n_kv_head: 2, n_gqa: 2, dim: 64, len: 2048 };
const STEPS: usize = 12;

fn certified(eps: f64, measure: Measure) -> Box<dyn AttentionPolicy> {
    let params = Params { eps, delta: 1e-3, measure, grid: Grid::default() };
    Box::new(CertifiedPolicy::new(params, PerturbationSeed { seed: 9, fixed: false }))
}

/// One decoding call per query set, the records of each call after the last.
fn run(cache: &SyntheticCache, queries: &[Vec<f32>], policy: &mut dyn AttentionPolicy) -> Vec<HeadRecord> {
    let shape = cache.shape;
    let mut out = vec![0.0; shape.n_head() * shape.dim];
    let mut records = Vec::new();
    for (step, queries) in queries.iter().enumerate() {
        let batch = cache.decoding_batch(queries);
        let call = LayerCall { layer: 0, step: step as u64, batch: &batch, cache: &cache.layer };
        policy.attend(&call, &mut out, &mut records);
    }
    records
}

#[test]
fn a_shadow_records_what_it_records_when_audited_itself() {
    for mode in [KvMode::F16, KvMode::Q4] {
        let mut cache = SyntheticCache::new(SHAPE, Storage { mode, key_sketch: true, ..Storage::default() }, 4);
        let queries: Vec<Vec<f32>> = (0..STEPS).map(|_| cache.queries()).collect();
        let shadows =
            vec![certified(0.05, Measure::Output), Box::new(Topk::new(3)) as _, certified(0.2, Measure::Value)];
        let (mut audited, log) = Audited::with_shadows(certified(0.1, Measure::Value), Measure::Value, shadows);
        let driven = run(&cache, &queries, &mut audited);
        let shadowed = log.take();
        assert_eq!(shadowed.len(), 3);
        assert!(log.take().iter().all(Vec::is_empty), "taking the records empties the log");

        let alone = |policy| run(&cache, &queries, &mut Audited::new(policy, Measure::Value));
        assert_eq!(driven, alone(certified(0.1, Measure::Value)), "{mode}: shadows change the driver's records");
        let direct = [
            alone(certified(0.05, Measure::Output)),
            alone(Box::new(Topk::new(3))),
            alone(certified(0.2, Measure::Value)),
        ];
        for (i, (shadow, direct)) in shadowed.iter().zip(&direct).enumerate() {
            assert_eq!(shadow.len(), STEPS * SHAPE.n_head(), "{mode}: shadow {i} checked every head of every call");
            assert!(shadow.iter().all(|r| r.audit.is_some()), "{mode}: shadow {i}");
            assert_eq!(shadow, direct, "{mode}: shadow {i} against its own audited run");
        }
        // The configurations differ, so their records must too.
        let table = |records: &[HeadRecord]| AuditTable::of("", records, 0.1);
        assert_ne!(table(&shadowed[0]).keys_mean, table(&shadowed[2]).keys_mean, "{mode}");
    }
}
