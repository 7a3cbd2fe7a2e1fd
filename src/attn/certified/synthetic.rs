//! Synthetic KV caches drawn to look like long-context attention, for the
//! tests and the benchmark of certified attention: a few heavy hitters, a
//! bias toward recent positions, and heavy-tailed scores.
//!
//! Per KV head a unit *topic* direction `u` is drawn; the query heads of the
//! group look along it, `q_g = 1.5·√d·u + ξ_g` with `ξ_g ~ N(0, I)`, and each
//! key is `k_p = λ_p·z_p + β_p·u` with `z_p ~ N(0, I)` and a log-normal
//! spread `λ_p = exp(0.3·N(0, 1))`. With the usual scale `1/√d` the score is
//! about `1.5·β_p + λ_p·N(0, 3.25)`: Gaussian noise of standard deviation
//! 1.8 whose log-normal mixing makes its upper tail heavy. The alignment
//! `β_p` carries the structure:
//!
//! * recency: `β_p = 2·exp(−age/1024)`, `age` the distance to the newest
//!   position (up to +3 on the score);
//! * heavy hitters: position 0 (an attention sink) has `β = 6` and 16 others
//!   drawn uniformly `β = 5` (+7.5 to +9 on the score).
//!
//! Values are `N(0, I)` scaled per position by another `exp(0.3·N(0, 1))`.
//! Everything comes from one seed.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::attn::{AttentionBatch, Scorer};
use crate::kv::{CacheShape, PagedLayer, Storage};

/// The shape of a synthetic call.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticShape {
    pub n_kv_head: usize,
    /// Query heads per KV head.
    pub n_gqa: usize,
    /// Key and value size.
    pub dim: usize,
    /// Positions stored.
    pub len: usize,
}

impl SyntheticShape {
    /// Llama-3.1-8B's attention: 32 query heads on 8 KV heads of 128.
    pub fn llama_8b(len: usize) -> Self {
        Self { n_kv_head: 8, n_gqa: 4, dim: 128, len }
    }

    pub fn n_head(&self) -> usize {
        self.n_kv_head * self.n_gqa
    }

    pub fn scale(&self) -> f32 {
        1.0 / (self.dim as f32).sqrt()
    }

    pub fn cache_shape(&self) -> CacheShape {
        CacheShape { n_kv_head: self.n_kv_head, head_dim_k: self.dim, head_dim_v: self.dim, windows: vec![None] }
    }
}

/// A filled layer and the means to draw queries for it.
pub struct SyntheticCache {
    pub shape: SyntheticShape,
    pub layer: PagedLayer,
    /// `[kv head][dim]`: the unit topic directions.
    topics: Vec<f32>,
    rng: StdRng,
    /// The last position's keys and values (all KV heads), as stored.
    pub last_keys: Vec<f32>,
    pub last_values: Vec<f32>,
}

fn normal(rng: &mut StdRng) -> f32 {
    // Box–Muller.
    let (u, v): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

impl SyntheticCache {
    /// A layer in `storage` holding `shape.len` drawn positions.
    pub fn new(shape: SyntheticShape, storage: Storage, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let (n, d) = (shape.n_kv_head, shape.dim);
        let mut topics: Vec<f32> = (0..n * d).map(|_| normal(&mut rng)).collect();
        for topic in topics.chunks_exact_mut(d) {
            let norm = topic.iter().map(|x| x * x).sum::<f32>().sqrt();
            topic.iter_mut().for_each(|x| *x /= norm);
        }
        let hitters: Vec<usize> = (0..16).map(|_| rng.random_range(1..shape.len.max(2))).collect();
        let mut layer = PagedLayer::new(storage, &shape.cache_shape(), None, shape.len, 1);
        let (mut keys, mut values) = (vec![0.0; n * d], vec![0.0; n * d]);
        for pos in 0..shape.len {
            let age = (shape.len - 1 - pos) as f32;
            let beta = match pos {
                0 => 6.0,
                p if hitters.contains(&p) => 5.0,
                _ => 2.0 * (-age / 1024.0).exp(),
            };
            for (h, topic) in topics.chunks_exact(d).enumerate() {
                let (spread, size) = ((0.3 * normal(&mut rng)).exp(), (0.3 * normal(&mut rng)).exp());
                for c in 0..d {
                    keys[h * d + c] = spread * normal(&mut rng) + beta * topic[c];
                    values[h * d + c] = size * normal(&mut rng);
                }
            }
            layer.store(pos, &keys, &values);
        }
        Self { shape, layer, topics, rng, last_keys: keys, last_values: values }
    }

    /// A fresh draw of every query head: `n_head` rows of `dim`.
    pub fn queries(&mut self) -> Vec<f32> {
        let d = self.shape.dim;
        let along = 1.5 * (d as f32).sqrt();
        let mut queries = Vec::with_capacity(self.shape.n_head() * d);
        for topic in self.topics.chunks_exact(d) {
            for _ in 0..self.shape.n_gqa {
                queries.extend(topic.iter().map(|&u| along * u + normal(&mut self.rng)));
            }
        }
        queries
    }

    /// The decoding call of the newest position with `queries` (`n_head`
    /// rows of `dim`), as the forward pass hands it to a policy.
    pub fn decoding_batch<'a>(&'a self, queries: &'a [f32]) -> AttentionBatch<'a> {
        let shape = self.shape;
        AttentionBatch {
            queries,
            keys: &self.last_keys,
            values: &self.last_values,
            pos0: shape.len - 1,
            n_head: shape.n_head(),
            head_dim_k: shape.dim,
            head_dim_v: shape.dim,
            n_gqa: shape.n_gqa,
            scorer: Scorer::scaled(shape.scale()),
        }
    }
}
