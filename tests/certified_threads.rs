//! Certified attention gives the same answer whatever the threads: on a
//! cache with one KV head (Gemma 3's global layers), whose pages the scan
//! splits among the threads, and on one with two KV heads of three query
//! heads each, the outputs and records (bytes read included) of a pool of
//! several threads equal, bit for bit, those of one thread, in f16 and q4.

use sift::attn::certified::synthetic::{SyntheticCache, SyntheticShape};
use sift::attn::certified::{CertifiedPolicy, Params, PerturbationSeed};
use sift::attn::{AttentionPolicy, LayerCall};
use sift::kv::{KvMode, Storage};

/// One KV head of four query heads, enough pages for four stretches; two
/// KV heads of three.
const SHAPES: [SyntheticShape; 2] = [
    SyntheticShape { n_kv_head: 1, n_gqa: 4, dim: 64, len: 6000 },
    SyntheticShape { n_kv_head: 2, n_gqa: 3, dim: 64, len: 6000 },
];

/// Outputs (as bits) and records of `steps` calls in a pool of `threads`.
fn run(shape: SyntheticShape, mode: KvMode, threads: usize, steps: u64) -> (Vec<u32>, String) {
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
        (bits, format!("{records:?}"))
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
                assert_eq!(one_records, many_records, "{ctx}: records");
            }
        }
    }
}
