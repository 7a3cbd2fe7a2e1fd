//! The sketch scan on every ISA against a reference in plain integer
//! arithmetic: the integer dots exactly, for random codes and weights (every
//! i8, −128 included), rows not a multiple of any block, odd dimensions and
//! rows whose codes end inside a vector; the bounds bit for bit, as
//! `SketchQuery::bounds` of the reference dot.

mod common;

use common::Rng;
use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, proptest, ProptestConfig, TestCaseError};
use simd::{
    Bounds, FineConstants, Isa, Kernels, RefineQuery, RefinedBounds, RefinedRows, SketchCodes, SketchLayout,
    SketchQuery,
};

/// Code `c` of a row packed lowest bits first.
fn code(row: &[u8], c: usize, bits: u32) -> i32 {
    let at = c * bits as usize;
    i32::from((row[at / 8] >> (at % 8)) & ((1u8 << bits) - 1))
}

/// `dim` random codes per row, packed, with the unused bits of the last byte
/// zero (as the cache packs them).
fn random_codes(rng: &mut Rng, layout: SketchLayout, rows: usize) -> Vec<u8> {
    let len = layout.row_bytes();
    let mut codes = vec![0u8; rows * len];
    for row in codes.chunks_exact_mut(len) {
        for c in 0..layout.dim {
            let at = c * layout.bits as usize;
            row[at / 8] |= (rng.below(1 << layout.bits) as u8) << (at % 8);
        }
    }
    codes
}

/// Random weights for channels `0..dim` in their slots, zero elsewhere; a
/// third of the queries draw from the extremes only.
fn random_weights(rng: &mut Rng, layout: SketchLayout) -> Vec<i8> {
    let extreme = rng.below(3) == 0;
    let mut weights = vec![0i8; layout.weights_len()];
    for c in 0..layout.dim {
        weights[layout.weight_slot(c)] = if extreme { [-128, -127, 127][rng.below(3)] } else { rng.next_u64() as i8 };
    }
    weights
}

fn check_scan(seed: u64, dim: usize, bits: u32, rows: usize, heads: usize) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let layout = SketchLayout { dim, bits };
    let codes = random_codes(&mut rng, layout, rows);
    let weights: Vec<Vec<i8>> = (0..heads).map(|_| random_weights(&mut rng, layout)).collect();
    let queries: Vec<SketchQuery> = weights
        .iter()
        .map(|w| SketchQuery {
            weights: w,
            beta: (rng.normal() * 1e-3) as f32,
            lower: (rng.normal() - 4.0) as f32,
            upper: (rng.normal() + 4.0) as f32,
        })
        .collect();
    let len = layout.row_bytes();
    let want: Vec<i32> = queries
        .iter()
        .flat_map(|q| {
            codes.chunks_exact(len).map(|row| {
                (0..dim).map(|c| code(row, c, bits) * i32::from(q.weights[layout.weight_slot(c)])).sum::<i32>()
            })
        })
        .collect();
    let want_bounds: Vec<Bounds> = want.iter().enumerate().map(|(k, &dot)| queries[k / rows].bounds(dot)).collect();
    let sketch = SketchCodes { layout, codes: &codes };
    for isa in Isa::available() {
        let k = Kernels::for_isa(isa).unwrap();
        let mut dots = vec![i32::MIN; heads * rows];
        k.sketch_dots(&sketch, &queries, &mut dots);
        prop_assert_eq!(&dots, &want, "dots on {}: {} heads, {} rows of {} {}-bit codes", isa, heads, rows, dim, bits);
        let mut bounds = vec![Bounds { lower: f32::NAN, upper: f32::NAN }; heads * rows];
        k.sketch_scan(&sketch, &queries, &mut bounds);
        let bits_of = |b: &[Bounds]| b.iter().map(|b| (b.lower.to_bits(), b.upper.to_bits())).collect::<Vec<_>>();
        prop_assert_eq!(bits_of(&bounds), bits_of(&want_bounds), "bounds on {}", isa);
        if rows > 0 {
            // Listed rows, in any order and repeated, as a refinement reads them.
            let listed: Vec<u32> = (0..rows + 5).map(|_| rng.below(rows) as u32).collect();
            let want_at: Vec<i32> = (0..heads)
                .flat_map(|h| listed.iter().map(|&r| want[h * rows + r as usize]).collect::<Vec<_>>())
                .collect();
            let mut at = vec![i32::MIN; heads * listed.len()];
            k.sketch_dots_at(&sketch, &queries, &listed, &mut at);
            prop_assert_eq!(&at, &want_at, "listed rows on {}", isa);
        }
    }
    Ok(())
}

/// The refinement of a page on every ISA against a reference in plain
/// integer arithmetic: the three integer dots of every row (coarse codes with
/// the weights, 8-bit codes `16·coarse + fine` with the weights and with the
/// residuals), turned into bounds by `RefineQuery::bounds`, bit for bit;
/// random codes, weights and residuals (every i8), dimensions that end
/// inside a vector, rows that end inside a block.
fn check_refine(seed: u64, dim: usize, rows: usize, heads: usize) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let layout = SketchLayout { dim, bits: 4 };
    let (coarse, fine) = (random_codes(&mut rng, layout, rows), random_codes(&mut rng, layout, rows));
    let planes: Vec<[Vec<i8>; 2]> =
        (0..heads).map(|_| [random_weights(&mut rng, layout), random_weights(&mut rng, layout)]).collect();
    let mut constant = |centre: f64| (rng.normal() + centre) as f32;
    let queries: Vec<RefineQuery> = planes
        .iter()
        .map(|[weights, residuals]| RefineQuery {
            scan: SketchQuery { weights, beta: constant(0.0) * 1e-3, lower: constant(-4.0), upper: constant(4.0) },
            residuals,
            fine: FineConstants {
                alpha: constant(0.0) * 1e-4,
                alpha2: constant(0.0) * 1e-6,
                lower: constant(-1.0),
                upper: constant(1.0),
            },
        })
        .collect();
    let len = layout.row_bytes();
    let want: Vec<RefinedBounds> = queries
        .iter()
        .flat_map(|q| {
            coarse.chunks_exact(len).zip(fine.chunks_exact(len)).map(|(c, f)| {
                let dot = |codes: &dyn Fn(usize) -> i64, weights: &[i8]| -> i64 {
                    (0..dim).map(|ch| codes(ch) * i64::from(weights[layout.weight_slot(ch)])).sum()
                };
                let coarse_code = |ch| i64::from(code(c, ch, 4));
                let code8 = |ch| 16 * i64::from(code(c, ch, 4)) + i64::from(code(f, ch, 4));
                let coarse_dot = dot(&coarse_code, q.scan.weights) as i32;
                q.bounds(coarse_dot, dot(&code8, q.scan.weights), dot(&code8, q.residuals))
            })
        })
        .collect();
    let bits_of = |b: &[RefinedBounds]| {
        b.iter()
            .flat_map(|b| [b.refined.lower, b.refined.upper, b.scanned.lower, b.scanned.upper].map(f32::to_bits))
            .collect::<Vec<_>>()
    };
    let (coarse, fine) = (SketchCodes { layout, codes: &coarse }, SketchCodes { layout, codes: &fine });
    for isa in Isa::available() {
        let mut fields = vec![f32::NAN; 4 * heads * rows];
        let mut out = RefinedRows::of(&mut fields);
        Kernels::for_isa(isa).unwrap().sketch_refine_page(&coarse, &fine, &queries, &mut out);
        let out: Vec<RefinedBounds> = (0..heads * rows).map(|k| out.get(k)).collect();
        prop_assert_eq!(
            bits_of(&out),
            bits_of(&want),
            "refinement on {}: {} heads, {} rows of {}",
            isa,
            heads,
            rows,
            dim
        );
    }
    Ok(())
}

/// The first levels on every ISA against a plain search: random numbers,
/// some equal to a threshold, infinities and NaN among them, falling
/// thresholds (some equal), every length up to a few vectors past a block.
fn check_levels(seed: u64, len: usize, levels: usize) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let mut thresholds: Vec<f32> = (0..levels).map(|_| (3.0 * rng.normal()) as f32).collect();
    thresholds.sort_by(|a, b| b.total_cmp(a));
    if levels > 2 {
        thresholds[1] = thresholds[2];
    }
    let values: Vec<f32> = (0..len)
        .map(|_| match rng.below(10) {
            0 if levels > 0 => thresholds[rng.below(levels)],
            1 => [f32::NEG_INFINITY, f32::INFINITY, f32::NAN][rng.below(3)],
            _ => (3.0 * rng.normal()) as f32,
        })
        .collect();
    let want: Vec<u8> =
        values.iter().map(|&v| thresholds.iter().position(|&t| v >= t).unwrap_or(levels) as u8).collect();
    for isa in Isa::available() {
        let mut out = vec![u8::MAX; len];
        Kernels::for_isa(isa).unwrap().first_levels(&values, &thresholds, &mut out);
        prop_assert_eq!(&out, &want, "levels on {} of {} numbers, {} thresholds", isa, len, levels);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_isa_scans_as_the_reference(
        seed in any::<u64>(),
        dim in prop::sample::select(vec![1usize, 2, 3, 5, 7, 31, 33, 63, 64, 65, 96, 127, 128, 129, 200, 256, 257, 512]),
        bits in prop::sample::select(vec![2u32, 4]),
        rows in prop::sample::select(vec![0usize, 1, 2, 3, 7, 8, 9, 63, 64, 65, 130]),
        heads in 1usize..=7,
    ) {
        check_scan(seed, dim, bits, rows, heads)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_isa_refines_a_page_as_the_reference(
        seed in any::<u64>(),
        dim in prop::sample::select(vec![1usize, 2, 3, 7, 63, 64, 65, 127, 128, 129, 256, 257, 511, 512, 513, 1031]),
        rows in prop::sample::select(vec![0usize, 1, 7, 8, 9, 63, 64]),
        heads in 1usize..=9,
    ) {
        check_refine(seed, dim, rows, heads)?;
    }
}

/// The set-up on every ISA gives the portable table's bits, and its sums are
/// those of its own weights within f32's rounding of sums of that many terms
/// (against f64 sums of the same terms): for queries and channel ranges of
/// every scale, zeros, and lengths that end inside a vector.
fn check_prepare(seed: u64, dim: usize, scale: f64) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let q: Vec<f32> = (0..dim).map(|_| if rng.below(9) == 0 { 0.0 } else { (rng.normal() * scale) as f32 }).collect();
    let min: Vec<f32> = (0..dim).map(|_| (rng.normal() * 3.0) as f32).collect();
    let step: Vec<f32> = (0..dim).map(|_| (rng.normal().abs() * 0.05) as f32).collect();
    let run = |k: &Kernels| {
        let (mut w, mut r) = (vec![0i8; dim], vec![0i8; dim]);
        let (scales, sums) = k.sketch_prepare(&q, &min, &step, &mut w, &mut r);
        (scales, sums, w, r)
    };
    let (scales, sums, w, r) = run(&Kernels::for_isa(Isa::Scalar).unwrap());
    for isa in Isa::available() {
        let (s2, sums2, w2, r2) = run(&Kernels::for_isa(isa).unwrap());
        prop_assert_eq!(s2, scales, "scales on {}", isa);
        prop_assert_eq!(format!("{sums2:?}"), format!("{sums:?}"), "sums on {}", isa);
        prop_assert_eq!(&w2, &w, "weights on {}", isa);
        prop_assert_eq!(&r2, &r, "residuals on {}", isa);
    }
    // The sums of the weights' own terms, in f64.
    let (alpha, alpha2) = (f64::from(scales.alpha), f64::from(scales.alpha2));
    let (mut centre, mut a_abs, mut weights, mut magnitude) = (0.0, 0.0, 0.0, 0.0);
    for c in 0..dim {
        let a = f64::from(q[c]) * f64::from(step[c]);
        prop_assert!(
            (f64::from(w[c]) - a / alpha).abs() <= 0.5 + 1e-3 || alpha == 0.0,
            "weight {} of {}",
            w[c],
            a / alpha
        );
        let delta = a - alpha * f64::from(w[c]);
        prop_assert!(
            (f64::from(r[c]) - delta / alpha2).abs() <= 0.5 + 1e-2 || alpha == 0.0,
            "residual of {}",
            delta / alpha2
        );
        centre += f64::from(q[c]) * f64::from(min[c]);
        a_abs += a.abs();
        weights += f64::from(w[c]).abs();
        magnitude += (f64::from(q[c]) * f64::from(min[c])).abs() + a.abs();
    }
    let tolerance = (dim as f64 + 4.0) * 2f64.powi(-23) * magnitude;
    prop_assert!((f64::from(sums.centre) - centre).abs() <= tolerance, "centre {} vs {centre}", sums.centre);
    prop_assert!((f64::from(sums.a_abs) - a_abs).abs() <= tolerance, "Σ|a| {} vs {a_abs}", sums.a_abs);
    prop_assert_eq!(f64::from(sums.weights), weights);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_isa_prepares_as_the_portable_table(
        seed in any::<u64>(),
        dim in prop::sample::select(vec![1usize, 2, 7, 8, 9, 15, 16, 17, 33, 64, 100, 128, 256]),
        scale in prop::sample::select(vec![0.0, 1e-30, 1e-3, 1.0, 40.0, 1e20]),
    ) {
        check_prepare(seed, dim, scale)?;
    }

    #[test]
    fn every_isa_finds_first_levels_as_a_search(seed in any::<u64>(), len in 0usize..300, levels in 0usize..60) {
        check_levels(seed, len, levels)?;
    }
}

/// Every group size (1 to 4 heads and the groups after a first one), both
/// widths, and a page of the shapes the models have, whatever proptest draws.
#[test]
fn every_group_and_width() {
    for heads in 1..=9 {
        for bits in [2, 4] {
            for dim in [64, 128, 256, 5] {
                check_scan(heads as u64 * 31 + dim as u64, dim, bits, 64, heads).unwrap();
            }
        }
    }
}

/// The largest dot there can be: every code at its top and every weight −128,
/// over the widest rows allowed... of a size a test can hold.
#[test]
fn extreme_dots_are_exact() {
    for bits in [2, 4] {
        let layout = SketchLayout { dim: 4096, bits };
        let codes = vec![0xffu8; 3 * layout.row_bytes()];
        let weights = vec![-128i8; layout.weights_len()];
        let query = SketchQuery { weights: &weights, beta: 1.0, lower: 0.0, upper: 0.0 };
        let want = -128 * ((1 << bits) - 1) * 4096;
        for isa in Isa::available() {
            let mut dots = [0; 3];
            Kernels::for_isa(isa).unwrap().sketch_dots(&SketchCodes { layout, codes: &codes }, &[query], &mut dots);
            assert_eq!(dots, [want; 3], "{bits}-bit on {isa}");
        }
    }
}

/// The refinement at the largest dots it allows: every code 15 (8-bit codes
/// 255) and every weight and residual −128, over the longest rows it takes
/// (2^16 codes), so that every partial sum any table keeps is at its
/// largest; the bounds are those of the exact dots.
#[test]
fn extreme_refined_dots_are_exact() {
    let layout = SketchLayout { dim: 1 << 16, bits: 4 };
    let codes = vec![0xffu8; 2 * layout.row_bytes()];
    let weights = vec![-128i8; layout.weights_len()];
    let scan = SketchQuery { weights: &weights, beta: 1.0, lower: 0.0, upper: 0.0 };
    let fine = FineConstants { alpha: 1.0, alpha2: 0.5, lower: 0.0, upper: 0.0 };
    let query = RefineQuery { scan, residuals: &weights, fine };
    let dim = 1i64 << 16;
    let want = query.bounds((-128 * 15 * dim) as i32, -128 * 255 * dim, -128 * 255 * dim);
    let codes = SketchCodes { layout, codes: &codes };
    for isa in Isa::available() {
        let mut fields = vec![f32::NAN; 4 * 2];
        let mut out = RefinedRows::of(&mut fields);
        Kernels::for_isa(isa).unwrap().sketch_refine_page(&codes, &codes, &[query], &mut out);
        for row in 0..2 {
            assert_eq!(out.get(row), want, "row {row} on {isa}");
        }
    }
}

/// Contract violations are panics with a message, never wrong answers.
#[test]
#[should_panic(expected = "weights")]
fn a_query_of_the_wrong_size_is_refused() {
    let layout = SketchLayout { dim: 64, bits: 4 };
    let codes = vec![0u8; 64 * layout.row_bytes()];
    let weights = vec![0i8; 63];
    let query = SketchQuery { weights: &weights, beta: 1.0, lower: 0.0, upper: 0.0 };
    let mut out = vec![0; 64];
    simd::kernels().sketch_dots(&SketchCodes { layout, codes: &codes }, &[query], &mut out);
}
