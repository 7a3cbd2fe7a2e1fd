//! The cache's rewrite seam (`PagedLayer::truncate`, then `store`), which
//! rectification overwrites sparsely written tokens through: in every mode,
//! with and without key sketches, on global and sliding-window layers, a
//! cache whose newest tokens were stored, truncated and stored anew must
//! return exactly what a cache built from scratch with the new tokens
//! returns — keys, values, value-norm bounds, sketches and their page bounds
//! — both right after the rewrite and once the rewritten pages have been
//! coded. A position whose page is coded, or has left a sliding ring, is
//! refused with a typed error and nothing changes.

mod common;

use sift::kv::page::{KvMode, PagedLayer, Storage};
use sift::kv::{CacheShape, KvCache, Settled, PAGE};

use common::Rng;

const N_KV_HEAD: usize = 2;
const DIM_K: usize = 32;
const DIM_V: usize = 24;
const N_CTX: usize = 600;
const MAX_BATCH: usize = 64;

fn shape(window: Option<usize>) -> CacheShape {
    CacheShape { n_kv_head: N_KV_HEAD, head_dim_k: DIM_K, head_dim_v: DIM_V, windows: vec![window] }
}

/// A token's keys and values, all heads; `salt` tells the rewritten ones
/// from the first ones.
fn token(pos: usize, salt: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng(pos as u64 * 7919 + salt);
    let keys = (0..N_KV_HEAD * DIM_K).map(|c| (rng.normal() * if c % 8 == 0 { 10.0 } else { 1.0 }) as f32).collect();
    let values = (0..N_KV_HEAD * DIM_V).map(|_| rng.normal() as f32).collect();
    (keys, values)
}

fn store(layer: &mut PagedLayer, positions: std::ops::Range<usize>, salt: u64) {
    for pos in positions {
        let (k, v) = token(pos, salt);
        layer.store(pos, &k, &v);
    }
}

/// Everything `layer` returns for the positions it holds, as bits.
fn contents(layer: &PagedLayer, window: Option<usize>) -> Vec<u32> {
    let len = layer.rewritable().end;
    let first = window.map_or(0, |w| len.saturating_sub(w));
    let mut out = Vec::new();
    let (mut key, mut value) = (vec![0.0f32; DIM_K], vec![0.0f32; DIM_V]);
    let query: Vec<f32> = (0..DIM_K).map(|c| (c as f32 * 0.37).sin()).collect();
    for h in 0..N_KV_HEAD {
        for pos in first..len {
            layer.key(h, pos, &mut key);
            layer.value(h, pos, &mut value);
            out.extend(key.iter().chain(&value).map(|x| x.to_bits()));
        }
        for page in first / PAGE..len.div_ceil(PAGE) {
            out.push(layer.value_norm(h, page).to_bits());
            match layer.sketch(h, page) {
                None => out.push(u32::MAX),
                Some(sketch) => {
                    out.push(sketch.page_upper_bound(&query).to_bits());
                    for row in 0..PAGE {
                        sketch.dequantize_key(row, &mut key);
                        out.extend(key.iter().map(|x| x.to_bits()));
                    }
                }
            }
        }
    }
    out
}

/// Every storage the cache offers: each mode, the f16 one with sketches too.
fn storages() -> Vec<Storage> {
    let mut all: Vec<Storage> = KvMode::ALL.into_iter().map(Storage::from).collect();
    all.push(Storage { key_sketch: true, ..Storage::default() });
    all
}

#[test]
fn rewritten_tokens_read_as_a_cache_built_with_them() {
    // (stored, rewritten from): within a page, across a page boundary, the
    // most the default residual keeps exact (65 tokens), and from 0.
    let cases = [(200, 168), (200, 190), (260, 195), (130, 65), (40, 0)];
    for storage in storages() {
        for window in [None, Some(96)] {
            for (len, from) in cases {
                let what = format!("{} sketch {} window {window:?} {from}..{len}", storage.mode, storage.key_sketch);
                let shape = shape(window);
                let mut rewritten = PagedLayer::new(storage, &shape, window, N_CTX, MAX_BATCH);
                store(&mut rewritten, 0..len, 1);
                rewritten.truncate(from).unwrap_or_else(|e| panic!("{what}: {e}"));
                store(&mut rewritten, from..len, 2);
                let mut fresh = PagedLayer::new(storage, &shape, window, N_CTX, MAX_BATCH);
                store(&mut fresh, 0..from, 1);
                store(&mut fresh, from..len, 2);
                assert_eq!(contents(&rewritten, window), contents(&fresh, window), "{what}: after the rewrite");
                // Onwards, until the rewritten pages are coded (or leave the ring).
                store(&mut rewritten, len..len + 300, 3);
                store(&mut fresh, len..len + 300, 3);
                assert_eq!(contents(&rewritten, window), contents(&fresh, window), "{what}: once coded");
            }
        }
    }
}

#[test]
fn a_rewrite_of_the_old_tokens_is_refused_and_changes_nothing() {
    for storage in storages() {
        for window in [None, Some(96)] {
            let shape = shape(window);
            let mut layer = PagedLayer::new(storage, &shape, window, N_CTX, MAX_BATCH);
            store(&mut layer, 0..400, 1);
            let rewritable = layer.rewritable();
            let what = format!("{} window {window:?}: rewritable {rewritable:?}", storage.mode);
            let exact_everywhere = storage.mode == KvMode::F16 && window.is_none();
            assert_eq!(rewritable.start == 0, exact_everywhere, "{what}");
            if storage.mode != KvMode::F16 {
                assert!(rewritable.len() > 128 - PAGE, "{what}: the residual keeps 65 tokens or more");
            }
            if rewritable.start > 1 {
                let before = contents(&layer, window);
                let pos = rewritable.start - 1;
                assert_eq!(layer.truncate(pos), Err(Settled { pos, first: rewritable.start }), "{what}");
                assert_eq!(contents(&layer, window), before, "{what}: a refused truncation changed the layer");
            }
        }
    }
}

#[test]
fn a_cache_truncates_all_its_layers_or_none() {
    // A global and a sliding layer: the ring has let go of positions the
    // global layer still holds exactly.
    let shape =
        CacheShape { n_kv_head: N_KV_HEAD, head_dim_k: DIM_K, head_dim_v: DIM_V, windows: vec![None, Some(96)] };
    let mut cache = KvCache::new(&shape, Storage::default(), N_CTX, MAX_BATCH);
    for il in 0..2 {
        store(cache.layer_mut(il), 0..400, 1);
    }
    let first = cache.layer(1).rewritable().start;
    assert!(first > 0);
    let err = cache.truncate(first - 1).expect_err("the ring no longer holds the position");
    assert_eq!(err.first, first);
    assert_eq!(cache.layer(0).rewritable(), 0..400, "the global layer was truncated all the same");
    cache.truncate(first).expect("both layers hold the position");
    assert_eq!((cache.layer(0).rewritable().end, cache.layer(1).rewritable().end), (first, first));
}
