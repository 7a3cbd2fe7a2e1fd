//! Captured attention calls: what `sift run --capture` keeps must give back
//! the cache and the calls it was taken from, through the file.

use sift::attn::capture::{Captured, Capturing};
use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::dense::Dense;
use sift::attn::{AttentionBatch, AttentionPolicy, LayerCall, Scorer};
use sift::kv::{KvMode, Storage};

const SHAPE: SyntheticShape = SyntheticShape { n_kv_head: 2, n_gqa: 2, dim: 64, len: 1500 };

#[test]
fn a_capture_gives_back_its_cache_and_calls() {
    let storage = Storage { mode: KvMode::F16, ..Storage::default() };
    let mut cache = SyntheticCache::new(SHAPE, storage, 7);
    let (mut capturing, log) = Capturing::new(Box::new(Dense));
    let scorer = Scorer::scaled(SHAPE.scale());
    let (n_out, mut records) = (SHAPE.n_head() * SHAPE.dim, Vec::new());
    // Calls at three positions, the last the newest; one short of the
    // sparse threshold, which is not captured.
    let positions = [1499, 1200, 1497, 1022];
    let mut expected = Vec::new();
    for (step, &pos) in positions.iter().enumerate() {
        let queries = cache.queries();
        // The batch's rows are its position's, as a decoding step has them.
        let (mut keys, mut values) = (vec![0.0; SHAPE.n_kv_head * SHAPE.dim], vec![0.0; SHAPE.n_kv_head * SHAPE.dim]);
        for head in 0..SHAPE.n_kv_head {
            cache.layer.key(head, pos, &mut keys[head * SHAPE.dim..][..SHAPE.dim]);
            cache.layer.value(head, pos, &mut values[head * SHAPE.dim..][..SHAPE.dim]);
        }
        let batch = AttentionBatch {
            queries: &queries,
            keys: &keys,
            values: &values,
            pos0: pos,
            n_head: SHAPE.n_head(),
            head_dim_k: SHAPE.dim,
            head_dim_v: SHAPE.dim,
            n_gqa: SHAPE.n_gqa,
            scorer,
        };
        let call = LayerCall { layer: 3, step: step as u64, batch: &batch, cache: &cache.layer };
        let mut out = vec![0.0; n_out];
        capturing.attend(&call, &mut out, &mut records);
        expected.push((pos, queries, out));
    }
    let captured = log.captured();
    let path = std::env::temp_dir().join(format!("sift-capture-{}.bin", std::process::id()));
    captured.write(&path).unwrap();
    let read = Captured::read(&path);
    std::fs::write(&path, b"siftcap1\x01").unwrap();
    let truncated = Captured::read(&path);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(read.unwrap(), captured, "the file gives back what was written");
    assert!(truncated.unwrap_err().to_string().contains("not a capture"));

    assert_eq!(captured.layers.len(), 1);
    let layer = &captured.layers[0];
    assert_eq!((layer.layer, layer.n_kv_head, layer.n_head, layer.dim_k), (3, 2, 4, 64));
    assert_eq!(layer.len(), 1500, "every position up to the newest call's");
    assert_eq!(layer.calls.len(), 3, "the call that sees fewer than 1024 positions is not captured");
    let rebuilt = layer.cache(storage);
    let (mut a, mut b) = (vec![0.0; SHAPE.dim], vec![0.0; SHAPE.dim]);
    for pos in 0..SHAPE.len {
        for head in 0..SHAPE.n_kv_head {
            cache.layer.key(head, pos, &mut a);
            rebuilt.key(head, pos, &mut b);
            assert_eq!(a, b, "key {head} at {pos}");
            cache.layer.value(head, pos, &mut a);
            rebuilt.value(head, pos, &mut b);
            assert_eq!(a, b, "value {head} at {pos}");
        }
    }
    for (call, (pos, queries, out)) in layer.calls.iter().zip(&expected) {
        assert_eq!((call.position, &call.queries), (*pos, queries));
        let (keys, values) = (layer.row_keys(call.position), layer.row_values(call.position));
        let batch = layer.batch(call, &keys, &values);
        let mut again = vec![0.0; n_out];
        Dense.attend(&LayerCall { layer: 3, step: 0, batch: &batch, cache: &rebuilt }, &mut again, &mut records);
        assert_eq!(&again, out, "dense attention over the captured call at {pos}");
    }
}
