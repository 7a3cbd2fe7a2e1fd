//! What a sparse attention policy reads from the cache: which keys a sketch
//! bounds and which it must read exactly ([`PagedLayer::key_cover`]), the
//! scan's bounds against the keys the cache returns (the sink page and the
//! exact pages included, on every kernel table), the value norms kept per
//! page against the values returned, and the f16 mode's sketch kept only
//! when asked for.
//!
//! The references are independent of the code under test: which positions
//! are coded comes from [`PagedLayer::coded`], scores are f64 dots of the
//! keys [`PagedLayer::key`] returns (exact products of f32 by f32 in f64,
//! far inside the sketch's slack), norms are f64 sums over the values
//! [`PagedLayer::value`] and [`PagedLayer::value_rows`] return.

mod common;

use std::ops::Range;

use half::f16;
use sift::kv::page::{KvMode, PagedLayer, Storage, SINK};
use sift::kv::{Bounds, CacheShape, KeyCover, Rows, ScanQuery, PAGE};

use common::Rng;

/// Query heads per KV head in the scans.
const GROUP: usize = 4;

fn shape(n_kv_head: usize, head_dim_k: usize, head_dim_v: usize) -> CacheShape {
    CacheShape { n_kv_head, head_dim_k, head_dim_v, windows: vec![None] }
}

/// A layer holding `len` tokens of random keys and values, with outlier
/// channels in the keys and a first token 30 times the others (a sink such
/// as models have).
fn filled(storage: Storage, shape: &CacheShape, len: usize, seed: u64) -> PagedLayer {
    let mut rng = Rng(seed);
    let (dk, dv) = (shape.n_kv_head * shape.head_dim_k, shape.n_kv_head * shape.head_dim_v);
    let offsets: Vec<f64> = (0..dk).map(|c| rng.normal() * if c % 8 == 0 { 20.0 } else { 1.0 }).collect();
    let mut layer = PagedLayer::new(storage, shape, None, 16 * PAGE, 16);
    for pos in 0..len {
        let outlier = if pos == 0 { 30.0 } else { 1.0 };
        let keys: Vec<f32> = offsets.iter().map(|&o| ((o + rng.normal()) * outlier) as f32).collect();
        let values: Vec<f32> = (0..dv).map(|_| (rng.normal() * (0.5 + rng.unit()) * outlier) as f32).collect();
        layer.store(pos, &keys, &values);
    }
    layer
}

fn storages() -> Vec<Storage> {
    let mut all: Vec<Storage> = KvMode::ALL.into_iter().map(Storage::from).collect();
    all.push(Storage { key_sketch: true, ..Storage::default() });
    all
}

/// Whether a sketch bounds the key at `pos`, by the rule the API documents:
/// full pages in the f16 mode with sketches kept, coded pages otherwise,
/// but for the sinks.
fn bounded(layer: &PagedLayer, storage: Storage, len: usize, pos: usize) -> bool {
    let page = pos / PAGE;
    if storage.mode == KvMode::F16 {
        storage.key_sketch && (page + 1) * PAGE <= len
    } else {
        layer.coded().contains(&pos) && !(layer.coded().start == 0 && pos < SINK)
    }
}

#[test]
fn cover_splits_positions_into_bounded_and_exact() {
    let shape = shape(2, 33, 16);
    for storage in storages() {
        for len in [1, PAGE - 1, PAGE, 3 * PAGE + 5, 7 * PAGE + 13] {
            let layer = filled(storage, &shape, len, 3);
            for range in [0..len, 1.min(len)..len, len / 3..len, len / 2..len / 2 + 1] {
                let parts: Vec<KeyCover> = layer.key_cover(1, range.clone()).collect();
                let mut next = range.start;
                let mut last_exact = false;
                for part in &parts {
                    let (positions, sketched): (Range<usize>, bool) = match part {
                        KeyCover::Sketched { page, rows, sketch } => {
                            assert!(rows.end <= PAGE && !rows.is_empty());
                            assert!(std::ptr::eq(*sketch, layer.sketch(1, *page).unwrap()));
                            (page * PAGE + rows.start..page * PAGE + rows.end, true)
                        }
                        KeyCover::Exact(positions) => {
                            assert!(!last_exact, "{storage:?}: exact runs side by side");
                            (positions.clone(), false)
                        }
                    };
                    last_exact = !sketched;
                    assert_eq!(positions.start, next, "{storage:?} {range:?}: the parts leave a gap");
                    for pos in positions.clone() {
                        assert_eq!(sketched, bounded(&layer, storage, len, pos), "{storage:?} len {len} pos {pos}");
                    }
                    next = positions.end;
                }
                assert_eq!(next, range.end, "{storage:?} {range:?}: the parts stop short");
            }
        }
    }
}

/// The scan's bounds (several query heads at once, and one at a time) and
/// the refined ones hold for every key a sketch is said to bound; and the
/// sinks, said not to be, are indeed outside their placeholders' bounds.
#[test]
fn scanned_bounds_hold_for_the_keys_returned() {
    common::check_isa_under_test();
    for (dk, seed) in [(64, 1), (33, 2), (256, 3)] {
        let shape = shape(2, dk, 8);
        let len = 6 * PAGE + 9;
        let mut rng = Rng(seed);
        for storage in storages().into_iter().filter(Storage::sketches) {
            let layer = filled(storage, &shape, len, seed);
            let mut sinks_outside = 0;
            for head in 0..2 {
                for scale in [1e-3, 1.0, 30.0] {
                    let q: Vec<Vec<f32>> =
                        (0..GROUP).map(|_| (0..dk).map(|_| (rng.normal() * scale) as f32).collect()).collect();
                    let mut queries: Vec<ScanQuery> = (0..GROUP).map(|_| ScanQuery::default()).collect();
                    let mut bounds = vec![Bounds::default(); GROUP * PAGE];
                    let mut one = vec![Bounds::default(); PAGE];
                    let mut key = vec![0.0; dk];
                    for part in layer.key_cover(head, 0..len) {
                        let KeyCover::Sketched { page, sketch, rows } = part else { continue };
                        for (query, q) in queries.iter_mut().zip(&q) {
                            query.prepare(sketch, q);
                        }
                        sketch.scan_heads(&queries, &mut bounds);
                        for (h, (query, q)) in queries.iter().zip(&q).enumerate() {
                            sketch.scan(query, &mut one);
                            assert_eq!(one, bounds[h * PAGE..][..PAGE], "one head and a group scan alike");
                            for i in 0..PAGE {
                                let pos = page * PAGE + i;
                                layer.key(head, pos, &mut key);
                                let score: f64 = q.iter().zip(&key).map(|(&a, &b)| a as f64 * b as f64).sum();
                                let (coarse, fine) = (bounds[h * PAGE + i], sketch.refine(query, i));
                                let holds = |b: Bounds| b.lower as f64 <= score && score <= b.upper as f64;
                                if rows.contains(&i) {
                                    let ctx = format!("{storage:?} d {dk} head {head} pos {pos}: {score:e}");
                                    assert!(holds(coarse), "{ctx} outside the scan's {coarse:?}");
                                    assert!(holds(fine), "{ctx} outside the refined {fine:?}");
                                } else if !holds(coarse) {
                                    sinks_outside += 1;
                                }
                            }
                        }
                    }
                }
            }
            if storage.mode != KvMode::F16 {
                assert!(sinks_outside > 0, "{storage:?}: the sinks' placeholders happened to bound them");
            }
        }
    }
}

#[test]
fn scanned_bounds_hold_on_every_isa() {
    common::on_every_isa("scanned_bounds_hold_for_the_keys_returned");
}

/// The largest norm of a page's values as the cache returns them, in f64:
/// one at a time in f32, and in stretches as f16.
fn largest_norm(layer: &PagedLayer, head: usize, page: usize, len: usize, dv: usize) -> f64 {
    let positions = page * PAGE..len.min((page + 1) * PAGE);
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|x| x * x).sum::<f64>().sqrt();
    let mut largest: f64 = 0.0;
    let mut value = vec![0.0; dv];
    for pos in positions.clone() {
        layer.value(head, pos, &mut value);
        largest = largest.max(norm(&mut value.iter().map(|&x| x as f64)));
    }
    let mut affine = Vec::new();
    for rows in layer.value_rows(head, positions) {
        let halves = match rows {
            Rows::Exact(halves) => halves.to_vec(),
            Rows::Coded(values, rows) => {
                let mut out = vec![f16::ZERO; rows.len() * dv];
                values.dequantize_rows(rows, &mut out, &mut affine);
                out
            }
        };
        for row in halves.chunks_exact(dv) {
            largest = largest.max(norm(&mut row.iter().map(|x| x.to_f64())));
        }
    }
    largest
}

fn check_norms(layer: &PagedLayer, storage: Storage, len: usize, dv: usize) {
    for head in 0..2 {
        for page in layer.coded().start / PAGE..len.div_ceil(PAGE) {
            let (kept, want) = (layer.value_norm(head, page) as f64, largest_norm(layer, head, page, len, dv));
            assert!(kept >= want, "{storage:?} head {head} page {page}: {kept} below the norm {want}");
            assert!(kept <= want * (1.0 + 2f64.powi(-20)), "{storage:?} head {head} page {page}: {kept} vs {want}");
        }
    }
}

/// Tight bounds: at least each page's largest norm, and no more than a part
/// in 2^20 above it, as values are stored, coded and rewound.
#[test]
fn value_norms_bound_the_values_returned() {
    for dv in [16, 33, 256] {
        let shape = shape(2, 8, dv);
        for storage in storages() {
            let len = 5 * PAGE + 20;
            let mut layer = filled(storage, &shape, len, 9);
            check_norms(&layer, storage, len, dv);
            // A huge value, forgotten again: the page's bound must drop.
            let rewind = len - 10;
            let (keys, big) = (vec![0.5; 2 * 8], vec![1e4; 2 * dv]);
            layer.store(rewind, &keys, &big);
            check_norms(&layer, storage, rewind + 1, dv);
            layer.store(rewind, &keys, &vec![0.25; 2 * dv]);
            check_norms(&layer, storage, rewind + 1, dv);
        }
    }
}

/// The f16 mode keeps a sketch of every full page only when asked, and its
/// bytes say so; the quantized modes' codes are their sketch either way.
#[test]
fn f16_sketches_only_when_asked() {
    let shape = shape(2, 64, 64);
    let len = 4 * PAGE + 1;
    for mode in KvMode::ALL {
        let plain = filled(Storage::from(mode), &shape, len, 5);
        let sketched = filled(Storage { mode, key_sketch: true, ..Storage::default() }, &shape, len, 5);
        let pages = |layer: &PagedLayer| (0..5).filter(|&p| layer.sketch(0, p).is_some()).count();
        let sketch_bytes =
            |layer: &PagedLayer| (0..5).filter_map(|p| layer.sketch(0, p)).map(|s| s.bytes()).sum::<usize>();
        if mode == KvMode::F16 {
            assert_eq!((pages(&plain), pages(&sketched)), (0, 4));
            assert!(plain.key_cover(0, 0..len).all(|part| matches!(part, KeyCover::Exact(_))));
            let per_page = sketch_bytes(&sketched) / 4;
            // Every slot of the 16 pages of room, for both heads.
            assert_eq!(sketched.bytes() - plain.bytes(), 16 * 2 * per_page);
            assert_eq!(plain.bytes(), 16 * 2 * PAGE * (64 + 64) * 2);
        } else {
            assert_eq!(pages(&plain), pages(&sketched), "{mode}");
            assert_eq!(plain.bytes(), sketched.bytes(), "{mode}");
        }
        let cost = |storage: Storage| PagedLayer::page_bytes(storage, &shape) as f64 * 2.0 / PAGE as f64;
        for storage in [Storage::from(mode), Storage { mode, key_sketch: true, ..Storage::default() }] {
            assert_eq!(shape.bytes_per_token(storage), cost(storage), "{storage:?}");
        }
        assert_eq!(shape.bytes_per_token(mode), cost(Storage::from(mode)));
    }
}
