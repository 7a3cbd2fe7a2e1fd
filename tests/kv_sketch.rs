//! The key sketch's bounds against exact scores.
//!
//! Every bound must hold for every key: the scan's (4 bits, 2 in the 2-bit
//! mode), the refined one (all kept bits) and the page's, on every kernel
//! table this CPU has. The reference is
//! `q·k` in f64, where the products of f32 by f16 are exact and a sum of at
//! most 256 terms errs by under 2^-44 of its terms' magnitudes: far inside
//! the slack of 2^-36 of the same magnitudes that the sketch adds, so a
//! reference above a bound is a real violation. The bounds also promise to
//! cover an f32 dot product in any order, which is checked too.
//!
//! Inputs are drawn from a seeded generator in shapes chosen to break
//! careless bounds: outlier channels 10^4 times the rest, f16 subnormals,
//! numbers at f16's limit, constant channels, one sign only, per-channel
//! magnitudes spread over ten decades, and queries from 10^-30 to 10^30.

mod common;

use half::f16;
use proptest::prelude::*;
use sift::kv::quant::{Bits, ValueRows};
use sift::kv::{Bounds, KeySketch, PageKeys, ScanQuery, PAGE};

const KINDS: [PageKeys; 4] =
    [PageKeys::Exact, PageKeys::Coded(Bits::Eight), PageKeys::Coded(Bits::Four), PageKeys::Coded(Bits::Two)];

use common::Rng;

#[derive(Clone, Copy, Debug)]
enum Shape {
    Normal,
    OutlierChannels,
    Subnormal,
    AtF16Limit,
    ConstantChannels,
    NegativeOnly,
    MixedDecades,
}

const SHAPES: [Shape; 7] = [
    Shape::Normal,
    Shape::OutlierChannels,
    Shape::Subnormal,
    Shape::AtF16Limit,
    Shape::ConstantChannels,
    Shape::NegativeOnly,
    Shape::MixedDecades,
];

/// `PAGE` keys of `dim` channels in `shape`, as f16.
fn keys(rng: &mut Rng, dim: usize, shape: Shape) -> Vec<f16> {
    let channel_scale: Vec<f64> = (0..dim)
        .map(|_| match shape {
            Shape::OutlierChannels if rng.unit() < 0.1 => 5.0e4,
            Shape::OutlierChannels => 5.0,
            Shape::Subnormal => 1e-6,
            Shape::AtF16Limit => 6.5e4,
            Shape::MixedDecades => 10f64.powf(rng.unit() * 10.0 - 6.0),
            _ => 1.0,
        })
        .collect();
    let constant: Vec<f64> = (0..dim).map(|_| if rng.unit() < 0.5 { rng.normal() } else { f64::NAN }).collect();
    (0..PAGE * dim)
        .map(|i| {
            let c = i % dim;
            let x = match shape {
                Shape::ConstantChannels if !constant[c].is_nan() => constant[c],
                Shape::NegativeOnly => -rng.normal().abs(),
                Shape::AtF16Limit => rng.unit() * 2.0 - 1.0,
                _ => rng.normal(),
            };
            f16::from_f64((x * channel_scale[c]).clamp(-65504.0, 65504.0))
        })
        .collect()
}

fn query(rng: &mut Rng, dim: usize, shape: Shape, scale: f64) -> Vec<f32> {
    (0..dim)
        .map(|c| match shape {
            Shape::ConstantChannels if c % 3 == 0 => 0.0,
            Shape::NegativeOnly => -(rng.normal().abs() * scale) as f32,
            Shape::OutlierChannels if c == 0 => (1e4 * scale) as f32,
            _ => (rng.normal() * scale) as f32,
        })
        .collect()
}

/// The key a page of this kind stands for, in f32 as attention reads it.
fn stored_key(sketch: &KeySketch, kind: PageKeys, keys: &[f16], i: usize, dim: usize) -> Vec<f32> {
    let mut key = vec![0.0; dim];
    match kind {
        PageKeys::Exact => key.iter_mut().zip(&keys[i * dim..]).for_each(|(k, x)| *k = x.to_f32()),
        PageKeys::Coded(_) => sketch.dequantize_key(i, &mut key),
    }
    key
}

fn dot_f64(q: &[f32], k: &[f32]) -> f64 {
    q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum()
}

fn dot_f32(q: impl Iterator<Item = f32>, k: impl Iterator<Item = f32>) -> f32 {
    q.zip(k).map(|(a, b)| a * b).sum()
}

fn check_case(seed: u64, dim: usize, shape: Shape, q_exp: i32) -> Result<(), TestCaseError> {
    let mut rng = Rng(seed);
    let keys = keys(&mut rng, dim, shape);
    let q = query(&mut rng, dim, shape, 10f64.powi(q_exp));
    for kind in KINDS {
        let sketch = KeySketch::build(&keys, dim, kind);
        let mut scan = ScanQuery::default();
        scan.prepare(&sketch, &q);
        let mut coarse = vec![Bounds { lower: 0.0, upper: 0.0 }; PAGE];
        sketch.scan(&scan, &mut coarse);
        let page = sketch.page_upper_bound(&q);
        for (i, coarse) in coarse.iter().enumerate() {
            let key = stored_key(&sketch, kind, &keys, i, dim);
            let exact = dot_f64(&q, &key);
            let forward = dot_f32(q.iter().copied(), key.iter().copied()) as f64;
            let backward = dot_f32(q.iter().rev().copied(), key.iter().rev().copied()) as f64;
            let fine = sketch.refine(&scan, i);
            let ctx = format!("{kind:?} key {i}: exact {exact:e}, scan {coarse:?}, refined {fine:?}, page {page:e}");
            for score in [exact, forward, backward] {
                prop_assert!(coarse.lower as f64 <= score && score <= coarse.upper as f64, "{ctx}");
                prop_assert!(fine.lower as f64 <= score && score <= fine.upper as f64, "{ctx}");
                prop_assert!(score <= page as f64, "{ctx}");
            }
            prop_assert!(fine.upper <= coarse.upper && fine.lower >= coarse.lower, "{ctx}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn bounds_hold(
        seed in any::<u64>(),
        dim in prop::sample::select(vec![1usize, 2, 3, 7, 16, 33, 64, 128, 256]),
        shape in prop::sample::select(SHAPES.to_vec()),
        q_exp in prop::sample::select(vec![-30, -6, -2, 0, 0, 1, 3, 6, 30]),
    ) {
        check_case(seed, dim, shape, q_exp)?;
    }
}

/// Every shape and dimension at least once, whatever proptest draws.
#[test]
fn bounds_hold_on_every_shape() {
    common::check_isa_under_test();
    for (n, shape) in SHAPES.into_iter().enumerate() {
        for dim in [1, 5, 128, 256] {
            for q_exp in [-30, -3, 0, 2, 30] {
                check_case(n as u64 * 1000 + dim as u64, dim, shape, q_exp).unwrap();
            }
        }
    }
}

/// The scan runs on the process's kernel table: the same checks on every
/// table this CPU has.
#[test]
fn bounds_hold_on_every_isa() {
    common::on_every_isa("bounds_hold_on_every_shape");
}

/// Bounds that hold are easy (infinity holds); these must also be tight.
/// On normal keys and queries, a key lies within `w` steps of its level per
/// channel, so the ideal interval is `2w·Σ |q_c|·step_c` wide: `w` is 8 for
/// exact keys at 4 bits and 1/2 at 8. The i8 query may add a little; the
/// scan must stay within 1.5 times the ideal and refining must gain 8 times.
#[test]
fn bounds_are_tight() {
    let dim = 128;
    for seed in 0..20 {
        let mut rng = Rng(seed);
        let keys = keys(&mut rng, dim, Shape::Normal);
        let q = query(&mut rng, dim, Shape::Normal, 1.0);
        let sketch = KeySketch::build(&keys, dim, PageKeys::Exact);
        let mut scan = ScanQuery::default();
        scan.prepare(&sketch, &q);
        let mut coarse = vec![Bounds { lower: 0.0, upper: 0.0 }; PAGE];
        sketch.scan(&scan, &mut coarse);

        // An upper bound on each channel's step: its range over 255, rounded
        // up to f16 (one part in 2^10, or 2^-24 below f16's normal range).
        let q_step: f64 = (0..dim)
            .map(|c| {
                let column = || keys.iter().skip(c).step_by(dim).map(|x| x.to_f64());
                let range = column().fold(f64::NEG_INFINITY, f64::max) - column().fold(f64::INFINITY, f64::min);
                (q[c] as f64).abs() * (range / 255.0 * (1.0 + 2f64.powi(-10)) + 2f64.powi(-24))
            })
            .sum();
        for (i, coarse) in coarse.iter().enumerate() {
            let fine = sketch.refine(&scan, i);
            let (coarse_width, fine_width) = (coarse.upper - coarse.lower, fine.upper - fine.lower);
            assert!(coarse_width as f64 <= 1.5 * 16.0 * q_step, "seed {seed} key {i}: {coarse:?} vs {q_step}");
            assert!(fine_width as f64 <= 1.5 * q_step, "seed {seed} key {i}: {fine:?} vs {q_step}");
            assert!(8.0 * fine_width <= coarse_width, "seed {seed} key {i}: {fine:?} vs {coarse:?}");
        }
    }
}

/// The scan reads 4-bit codes two to a byte (2-bit four to a byte); the
/// refinement adds the low nibbles; minima and steps are f16.
#[test]
fn sketch_sizes() {
    let keys = vec![f16::ONE; PAGE * 128];
    let size = |kind| KeySketch::build(&keys, 128, kind).bytes();
    assert_eq!(size(PageKeys::Exact), 128 * 4 + PAGE * 64 * 2);
    assert_eq!(size(PageKeys::Coded(Bits::Eight)), 128 * 4 + PAGE * 64 * 2);
    assert_eq!(size(PageKeys::Coded(Bits::Four)), 128 * 4 + PAGE * 64);
    assert_eq!(size(PageKeys::Coded(Bits::Two)), 128 * 4 + PAGE * 32);
}

/// Attention reads coded pages a stretch of rows at a time, in f16 through
/// the SIMD reader; those rows are the one-at-a-time reads the bounds and the
/// tolerances above are proven for, rounded to f16, bit for bit.
#[test]
fn stretches_read_as_single_rows() {
    let mut rng = Rng(7);
    for bits in [Bits::Two, Bits::Four, Bits::Eight] {
        for dim in [1, 31, 32, 33, 64, 80, 256] {
            for shape in SHAPES {
                let keys = keys(&mut rng, dim, shape);
                let sketch = KeySketch::build(&keys, dim, PageKeys::Coded(bits));
                let mut values = ValueRows::new(PAGE, dim, bits);
                for (t, row) in keys.chunks_exact(dim).enumerate() {
                    values.store(t, row);
                }
                for rows in [0..PAGE, 5..6, 17..40] {
                    let (mut keys_out, mut values_out) =
                        (vec![f16::NAN; rows.len() * dim], vec![f16::NAN; rows.len() * dim]);
                    let mut affine = Vec::new();
                    sketch.dequantize_keys(rows.clone(), &mut keys_out, &mut affine);
                    values.dequantize_rows(rows.clone(), &mut values_out, &mut affine);
                    for (i, (key, value)) in rows.zip(keys_out.chunks(dim).zip(values_out.chunks(dim))) {
                        let (mut one_key, mut one_value) = (vec![0.0; dim], vec![0.0; dim]);
                        sketch.dequantize_key(i, &mut one_key);
                        values.dequantize(i, &mut one_value);
                        let bits_of = |x: &[f16]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let halves = |x: &[f32]| x.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
                        assert_eq!(bits_of(key), bits_of(&halves(&one_key)), "{bits:?} key {i}, dim {dim}, {shape:?}");
                        assert_eq!(
                            bits_of(value),
                            bits_of(&halves(&one_value)),
                            "{bits:?} value {i}, dim {dim}, {shape:?}"
                        );
                    }
                }
            }
        }
    }
}
