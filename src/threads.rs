//! The worker pool: one rayon pool for the whole process, its threads pinned
//! to cores so the per-core caches keep the weights each thread streams.

/// Physical cores, the default thread count (hyper-threads share the vector
/// units that matmuls saturate, so they rarely help).
pub fn default_threads() -> usize {
    num_cpus::get_physical().max(1)
}

/// Builds the global pool with `n` threads pinned to the first `n` cores.
/// Idempotent: the first call wins (rayon's global pool can be built once).
pub fn init(n: usize) -> usize {
    let n = n.max(1);
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    // An error means the pool already exists (a test harness, a second call): keep it.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("sift-worker-{i}"))
        .start_handler(move |i| {
            if let Some(core) = cores.get(i % cores.len().max(1)) {
                core_affinity::set_for_current(*core);
            }
        })
        .build_global();
    rayon::current_num_threads()
}

/// Runs `f` on a worker of the pool and waits for it. The parallel loops in
/// `f` then share their work with the other workers by stealing, instead of
/// this thread handing every loop to the pool and sleeping until it is done:
/// a decoded token runs about a hundred loops, and each such hand-off costs a
/// futex wake-up and wait.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
