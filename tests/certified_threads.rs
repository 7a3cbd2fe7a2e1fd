//! Certified attention gives the same answer whatever the threads: on a
//! cache with one KV head (Gemma 3's global layers), whose pages the scan
//! splits among the threads and whose query heads are split among them,
//! and on one with two KV heads of three query heads each, the outputs and
//! records of a pool of several threads equal, bit for bit, those of one
//! thread, in f16 and q4, but for the bytes read: a key that query heads
//! attended by two threads both score is read by each, so a pool reads at
//! least the bytes one thread reads, and no more than one read of the
//! exact set and of every key scored per query head.

use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Params, PerturbationSeed};
use sift::attn::{AttentionPolicy, HeadRecord, LayerCall};
use sift::kv::{KvMode, Storage};

/// One KV head of four query heads, enough pages for four stretches; two
/// KV heads of three.
const SHAPES: [SyntheticShape; 2] = [
    SyntheticShape { n_kv_head: 1, n_gqa: 4, dim: 64, len: 6000 },
    SyntheticShape { n_kv_head: 2, n_gqa: 3, dim: 64, len: 6000 },
];

/// Outputs (as bits) and records of `steps` calls in a pool of `threads`.
fn run(shape: SyntheticShape, mode: KvMode, threads: usize, steps: u64) -> (Vec<u32>, Vec<HeadRecord>) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
    pool.install(|| {
        let storage = Storage { mode, key_sketch: true, ..Storage::default() };
        let mut cache = SyntheticCache::new(shape, storage, 21);
        let mut policy = CertifiedPolicy::new(Params::default(), PerturbationSeed { seed: 9, fixed: false });
        let mut out = vec![0.0f32; shape.n_head() * shape.dim];
        let (mut bits, mut records) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let queries = cache.queries();
            let batch = cache.decoding_batch(&queries);
            let call = LayerCall { layer: 0, step, batch: &batch, cache: &cache.layer };
            policy.attend(&call, &mut out, &mut records);
            bits.extend(out.iter().map(|x| x.to_bits()));
        }
        (bits, records)
    })
}

#[test]
fn few_kv_heads_on_many_threads_are_one_thread_bit_for_bit() {
    for shape in SHAPES {
        for mode in [KvMode::F16, KvMode::Q4] {
            let (one, one_records) = run(shape, mode, 1, 6);
            for threads in [2, 4] {
                let (many, many_records) = run(shape, mode, threads, 6);
                let ctx = format!("{mode}, {} KV heads of {}, {threads} threads", shape.n_kv_head, shape.n_gqa);
                assert!(one == many, "{ctx}: outputs differ from one thread's");
                assert_eq!(one_records.len(), many_records.len(), "{ctx}: records");
                for (one, many) in one_records.iter().zip(&many_records) {
                    let most = one.bytes_read + (one.keys_read * shape.dim * 2) as f64;
                    let ctx = format!("{ctx}: layer {} head {}", one.layer, one.head);
                    assert!(
                        many.bytes_read >= one.bytes_read && many.bytes_read <= most,
                        "{ctx}: {} bytes read, one thread {}",
                        many.bytes_read,
                        one.bytes_read
                    );
                    let bytes_aside = HeadRecord { bytes_read: one.bytes_read, ..many.clone() };
                    assert_eq!(one, &bytes_aside, "{ctx}: records");
                }
            }
        }
    }
}
