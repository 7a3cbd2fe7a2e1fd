//! Kernel throughput, against the machine's memory bandwidth.
//!
//! * `dot_rows/FORMAT`: one activation row against a weight matrix far bigger than the
//!   last-level cache (as a decode step streams its weights), in bytes of weights read
//!   per second. `Q8_0 head` has the Gemma 3 output head's short rows (640 columns).
//! * `memory_bandwidth`: one core summing a buffer larger still, for comparison.
//! * `dot_tile/FORMAT`: a prefill-sized product (64 tokens), in multiply-adds per
//!   second.
//! * `sketch_scan/CASE`: the key sketch's scan over pages of codes far bigger than
//!   the last-level cache (as certified attention scans a long context), page by
//!   page for a group of query heads, in bytes of codes read per second.
//! * `sketch_refine/CASE`: the page refinement certified attention runs where the
//!   sketch keeps 8-bit codes (coarse and fine codes, far bigger than the
//!   last-level cache), page by page for a group of query heads, each page's
//!   queries set up first as the policy does (`sketch_prepare` per head and
//!   page), in bytes of codes read per second; `set-up only` times the set-ups
//!   alone, as many per page.
//!
//! The kernels are the process's table (`SIFT_ISA` picks another). Run with
//! `cargo bench -p simd --bench kernels`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use half::f16;
use simd::{
    kernels, Bounds, FineConstants, RefineQuery, RefinedRows, SketchCodes, SketchLayout, SketchQuery, WeightType,
};

#[path = "../tests/common/mod.rs"]
mod common;
use common::{quantize_for, random_activation, random_weight_row, Aligned, Rng};

/// Bytes of weights per `dot_rows` matrix: well past any L3.
const MATRIX_BYTES: usize = 64 << 20;
/// Bytes summed by `memory_bandwidth`.
const BANDWIDTH_BYTES: usize = 256 << 20;
/// Columns of the benched matrices (a multiple of every block size).
const COLS: usize = 2048;

/// `rows` random rows of `cols` elements of `w`, laid end to end. Random rows are
/// costly to make, so a few are repeated: the kernels' speed does not depend on
/// the values.
fn random_matrix(w: WeightType, rows: usize, cols: usize, rng: &mut Rng) -> Aligned {
    let distinct: Vec<Aligned> = (0..16).map(|_| random_weight_row(w, cols, rng)).collect();
    let mut m = Aligned::zeroed(rows * distinct[0].len());
    for (row, src) in m.chunks_exact_mut(distinct[0].len()).zip(distinct.iter().cycle()) {
        row.copy_from_slice(src);
    }
    m
}

/// Keeps every group short, so that the whole run takes a few minutes.
fn configure(group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
}

fn dot_rows(c: &mut Criterion) {
    let k = kernels();
    let mut rng = Rng::new(1);
    let mut group = c.benchmark_group("dot_rows");
    configure(&mut group);
    let cases = [
        ("Q4_0", WeightType::Q4_0, COLS),
        ("Q4_1", WeightType::Q4_1, COLS),
        ("Q5_0", WeightType::Q5_0, COLS),
        ("Q5_1", WeightType::Q5_1, COLS),
        ("Q8_0", WeightType::Q8_0, COLS),
        ("Q8_0 head", WeightType::Q8_0, 640),
        ("Q2_K", WeightType::Q2_K, COLS),
        ("Q3_K", WeightType::Q3_K, COLS),
        ("Q4_K", WeightType::Q4_K, COLS),
        ("Q5_K", WeightType::Q5_K, COLS),
        ("Q6_K", WeightType::Q6_K, COLS),
        ("F16", WeightType::F16, COLS),
        ("BF16", WeightType::BF16, COLS),
        ("IQ4_NL", WeightType::IQ4_NL, COLS),
        ("IQ4_XS", WeightType::IQ4_XS, COLS),
        ("IQ3_XXS", WeightType::IQ3_XXS, COLS),
        ("IQ3_S", WeightType::IQ3_S, COLS),
    ];
    for (name, w, cols) in cases {
        let row_bytes = w.row_bytes(cols).expect("whole blocks");
        let rows = MATRIX_BYTES / row_bytes;
        let weights = random_matrix(w, rows, cols, &mut rng);
        let act = quantize_for(k, w, &random_activation(cols, &mut rng));
        let mut out = vec![0f32; rows];
        group.throughput(Throughput::Bytes((rows * row_bytes) as u64));
        group.bench_function(name, |b| {
            b.iter(|| k.dot_rows(w, black_box(&weights), row_bytes, black_box(&act), cols, &mut out))
        });
    }
    group.finish();
}

fn memory_bandwidth(c: &mut Criterion) {
    let buffer: Vec<u64> = (0..BANDWIDTH_BYTES as u64 / 8).collect();
    let mut group = c.benchmark_group("memory_bandwidth");
    configure(&mut group);
    group.throughput(Throughput::Bytes(BANDWIDTH_BYTES as u64));
    group.bench_function("sum u64", |b| b.iter(|| black_box(&buffer).iter().fold(0u64, |s, &v| s.wrapping_add(v))));
    group.finish();
}

fn dot_tile(c: &mut Criterion) {
    const ROWS: usize = 1024;
    const TOKENS: usize = 64;
    let k = kernels();
    let mut rng = Rng::new(2);
    let mut group = c.benchmark_group("dot_tile");
    configure(&mut group);
    group.throughput(Throughput::Elements((ROWS * COLS * TOKENS) as u64));
    for (name, w) in [
        ("Q8_0", WeightType::Q8_0),
        ("Q4_K", WeightType::Q4_K),
        ("IQ4_NL", WeightType::IQ4_NL),
        ("IQ4_XS", WeightType::IQ4_XS),
        ("IQ3_XXS", WeightType::IQ3_XXS),
        ("IQ3_S", WeightType::IQ3_S),
    ] {
        let weights = random_matrix(w, ROWS, COLS, &mut rng);
        let acts: Vec<u8> =
            (0..TOKENS).flat_map(|_| quantize_for(k, w, &random_activation(COLS, &mut rng)).to_vec()).collect();
        let acts = Aligned::from_bytes(&acts);
        let mut out = vec![0f32; ROWS * TOKENS];
        group.bench_function(name, |b| {
            b.iter(|| k.dot_tile(w, black_box(&weights), black_box(&acts), COLS, &mut out, ROWS))
        });
    }
    group.finish();
}

fn sketch_scan(c: &mut Criterion) {
    const PAGE: usize = 64;
    let k = kernels();
    let mut rng = Rng::new(3);
    let mut group = c.benchmark_group("sketch_scan");
    configure(&mut group);
    // (name, dim, bits, query heads per KV head): Llama 3.1 8B's heads (d 128, 4
    // per KV head) and Gemma 3 270M's (d 256, 4 per KV head).
    let cases = [
        ("d128 4-bit 1 head", 128, 4, 1),
        ("d128 4-bit 4 heads", 128, 4, 4),
        ("d128 2-bit 4 heads", 128, 2, 4),
        ("d256 4-bit 4 heads", 256, 4, 4),
    ];
    for (name, dim, bits, heads) in cases {
        let layout = SketchLayout { dim, bits };
        let page_bytes = PAGE * layout.row_bytes();
        let mut codes = vec![0u8; MATRIX_BYTES / page_bytes * page_bytes];
        rng.fill_bytes(&mut codes);
        let weights: Vec<Vec<i8>> = (0..heads)
            .map(|_| {
                let mut w = vec![0u8; layout.weights_len()];
                rng.fill_bytes(&mut w);
                w.into_iter().map(|b| b as i8).collect()
            })
            .collect();
        let queries: Vec<SketchQuery> =
            weights.iter().map(|w| SketchQuery { weights: w, beta: 1e-3, lower: -1.0, upper: 1.0 }).collect();
        let mut out = vec![Bounds::default(); heads * PAGE];
        group.throughput(Throughput::Bytes(codes.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                for page in black_box(&codes).chunks_exact(page_bytes) {
                    k.sketch_scan(&SketchCodes { layout, codes: page }, &queries, &mut out);
                }
            })
        });
    }
    group.finish();
}

fn sketch_refine(c: &mut Criterion) {
    const PAGE: usize = 64;
    let k = kernels();
    let mut rng = Rng::new(4);
    let mut group = c.benchmark_group("sketch_refine");
    configure(&mut group);
    // (name, dim, query heads per KV head, whether the refinement runs): as in
    // `sketch_scan`.
    let cases =
        [("d128 4 heads", 128, 4, true), ("d128 4 heads, set-up only", 128, 4, false), ("d256 4 heads", 256, 4, true)];
    for (name, dim, heads, refine) in cases {
        let layout = SketchLayout { dim, bits: 4 };
        let page_bytes = PAGE * layout.row_bytes();
        let pages = MATRIX_BYTES / 2 / page_bytes;
        let mut codes = vec![0u8; 2 * pages * page_bytes];
        rng.fill_bytes(&mut codes);
        let (coarse, fine) = codes.split_at(pages * page_bytes);
        // Per page, its channels' minima and steps; per head, its query.
        let affine: Vec<f32> =
            (0..2 * dim).map(|c| if c < dim { -rng.unit() } else { 0.1 * rng.unit() } as f32).collect();
        let (min, step) = affine.split_at(dim);
        let q: Vec<Vec<f32>> = (0..heads).map(|_| (0..dim).map(|_| rng.unit() as f32 - 0.5).collect()).collect();
        let mut planes = vec![vec![0i8; 2 * layout.weights_len()]; heads];
        let mut fields = vec![0.0f32; 4 * heads * PAGE];
        group.throughput(Throughput::Bytes(codes.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                for (coarse, fine) in black_box(coarse).chunks_exact(page_bytes).zip(fine.chunks_exact(page_bytes)) {
                    let mut constants = [FineConstants::default(); 8];
                    for ((q, planes), constants) in q.iter().zip(&mut planes).zip(&mut constants) {
                        let (weights, residuals) = planes.split_at_mut(layout.weights_len());
                        let (scales, _) = k.sketch_prepare(q, min, step, &mut weights[..dim], &mut residuals[..dim]);
                        constants.alpha = scales.alpha;
                    }
                    if !refine {
                        black_box(&constants);
                        continue;
                    }
                    let empty = SketchQuery { weights: &[], beta: 0.0, lower: 0.0, upper: 0.0 };
                    let mut views = [RefineQuery { scan: empty, residuals: &[], fine: FineConstants::default() }; 8];
                    for ((view, planes), &fine) in views.iter_mut().zip(&planes).zip(&constants) {
                        let (weights, residuals) = planes.split_at(layout.weights_len());
                        let scan = SketchQuery { weights, beta: 1e-3, lower: -1.0, upper: 1.0 };
                        *view = RefineQuery { scan, residuals, fine };
                    }
                    let (coarse, fine) = (SketchCodes { layout, codes: coarse }, SketchCodes { layout, codes: fine });
                    k.sketch_refine_page(&coarse, &fine, &views[..heads], &mut RefinedRows::of(&mut fields));
                }
            })
        });
    }
    group.finish();
}

fn attention(c: &mut Criterion) {
    const PAGE: usize = 64;
    const DIM: usize = 256;
    const HEADS: usize = 4;
    let k = kernels();
    let mut rng = Rng::new(4);
    let mut group = c.benchmark_group("attention");
    configure(&mut group);
    let halves = |n: usize, rng: &mut Rng| -> Vec<f16> { (0..n).map(|_| f16::from_f64(rng.normal())).collect() };
    // Queries and probabilities hold f16 values, as attention rounds them.
    let queries: Vec<f32> = halves(HEADS * DIM, &mut rng).iter().map(|h| h.to_f32() * 0.0625).collect();
    // (name, positions, layers whose rows are taken in turn)
    for (name, n, layers) in [("16384 cold", 16384, 8), ("512 warm", 512, 1)] {
        let rows: Vec<(Vec<f16>, Vec<f16>)> =
            (0..layers).map(|_| (halves(n * DIM, &mut rng), halves(n * DIM, &mut rng))).collect();
        let mut scores = vec![0f32; HEADS * n];
        let mut out = vec![0f32; HEADS * DIM];
        let mut layer = 0;
        group.throughput(Throughput::Bytes((2 * n * DIM * size_of::<f16>()) as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let (keys, values) = &rows[layer];
                layer = (layer + 1) % layers;
                for (p, keys) in keys.chunks_exact(PAGE * DIM).enumerate() {
                    k.scores_f16(DIM, &queries, keys, &mut scores[p * PAGE..], n);
                }
                for scores in scores.chunks_exact_mut(n) {
                    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let inv_sum = 1.0 / k.softmax_exp(scores, max);
                    scores.iter_mut().for_each(|x| *x = f16::from_f32(*x * inv_sum).to_f32());
                }
                out.fill(0.0);
                for (p, values) in values.chunks_exact(PAGE * DIM).enumerate() {
                    k.add_weighted_f16(DIM, &scores[p * PAGE..], n, values, &mut out);
                }
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, dot_rows, memory_bandwidth, dot_tile, sketch_scan, sketch_refine, attention);
criterion_main!(benches);
