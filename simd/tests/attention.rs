//! The attention kernels on every ISA against f64 references: scores and weighted sums
//! of f16 rows and of coded rows (over the scalar reader's levels) within 1e-5 of
//! Σ|products|, exponentials within 2e-7 relative, f16 levels bit for bit, and the f64
//! sums of a sparse attention's estimates bit for bit those of plain f64 arithmetic in
//! the order the kernels state.

mod common;

use common::*;
use half::f16;
use proptest::prelude::{any, prop_assert, proptest, ProptestConfig, TestCaseError};
use simd::CodeRows;

/// An f16 in roughly [-4, 4], as attention keys, values and rounded queries are.
fn random_f16(rng: &mut Rng) -> f16 {
    f16::from_f64(rng.normal())
}

fn random_f16s(n: usize, rng: &mut Rng) -> Vec<f16> {
    (0..n).map(|_| random_f16(rng)).collect()
}

/// Whether `got` is within `rel` of `want` relative to the magnitude `mag` of the terms
/// that were summed.
fn close(got: f32, want: f64, mag: f64, rel: f64) -> bool {
    (got as f64 - want).abs() <= rel * mag + 1e-30
}

/// The rows a kernel reads: f16 rows, or coded ones, with the numbers the kernels
/// must take them for.
enum Rows {
    Halves(Vec<f16>),
    Coded(Codes),
}

/// A coded rows' format: bits, fine codes, group.
type Format = (u32, bool, usize);

impl Rows {
    /// `n` random rows of `dim`: f16, or coded in `format`.
    fn new(n: usize, dim: usize, format: Option<Format>, rng: &mut Rng) -> Self {
        match format {
            None => Rows::Halves(random_f16s(n * dim, rng)),
            Some((bits, fine, group)) => Rows::Coded(Codes::new(n, dim, bits, fine, group, rng)),
        }
    }

    /// The numbers the kernels must read, exactly.
    fn numbers(&self) -> Vec<f32> {
        match self {
            Rows::Halves(halves) => halves.iter().map(|h| h.to_f32()).collect(),
            Rows::Coded(codes) => codes.levels(),
        }
    }

    fn scores(&self, k: &simd::Kernels, dim: usize, queries: &[f32], out: &mut [f32], stride: usize) {
        match self {
            Rows::Halves(keys) => k.scores_f16(dim, queries, keys, out, stride),
            Rows::Coded(codes) => k.scores_coded(queries, &codes.rows(), out, stride),
        }
    }

    fn add_weighted(&self, k: &simd::Kernels, dim: usize, weights: &[f32], stride: usize, out: &mut [f32]) {
        match self {
            Rows::Halves(values) => k.add_weighted_f16(dim, weights, stride, values, out),
            Rows::Coded(codes) => k.add_weighted_coded(weights, stride, &codes.rows(), out),
        }
    }
}

/// `heads` queries against `n` keys of `dim` (f16, or coded in `format`), scores in
/// rows of `n + gap`: every table within 1e-5 of f64 over the numbers the keys stand
/// for, and each query's scores the same bits whether scored in the group or alone.
fn check_scores(
    dim: usize,
    heads: usize,
    n: usize,
    gap: usize,
    format: Option<Format>,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let queries: Vec<f32> = random_f16s(heads * dim, &mut rng).iter().map(|h| h.to_f32()).collect();
    let keys = Rows::new(n, dim, format, &mut rng);
    let numbers = keys.numbers();
    let stride = n + gap;
    for k in all_tables() {
        let mut out = vec![f32::NAN; heads * stride];
        keys.scores(&k, dim, &queries, &mut out, stride);
        for (h, q) in queries.chunks_exact(dim).enumerate() {
            let row = &out[h * stride..][..n];
            for (j, (&got, key)) in row.iter().zip(numbers.chunks_exact(dim)).enumerate() {
                let terms = q.iter().zip(key).map(|(&a, &b)| a as f64 * b as f64);
                let (want, mag) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                prop_assert!(
                    close(got, want, mag, 1e-5),
                    "head {h} of {heads}, key {j} of {n}, dim {dim}, format {format:?} on {}: {got} vs {want}",
                    k.isa()
                );
            }
            let mut alone = vec![0.0; n];
            keys.scores(&k, dim, q, &mut alone, n);
            prop_assert!(bits_of(&alone) == bits_of(row), "head {h} of {heads} scored alone differs on {}", k.isa());
        }
    }
    Ok(())
}

/// `heads` output rows over `n` value rows, weights in rows of `n + gap`: as
/// [`check_scores`].
fn check_add_weighted(
    dim: usize,
    heads: usize,
    n: usize,
    gap: usize,
    format: Option<Format>,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let stride = n + gap;
    // Probabilities, rounded to f16 as attention's are.
    let weights: Vec<f32> = (0..heads * stride).map(|_| f16::from_f64(rng.unit()).to_f32()).collect();
    let values = Rows::new(n, dim, format, &mut rng);
    let numbers = values.numbers();
    let start: Vec<f32> = (0..heads * dim).map(|_| rng.normal() as f32).collect();
    for k in all_tables() {
        let mut out = start.clone();
        values.add_weighted(&k, dim, &weights, stride, &mut out);
        for h in 0..heads {
            let (w, start, got) = (&weights[h * stride..][..n], &start[h * dim..][..dim], &out[h * dim..][..dim]);
            for (i, &got) in got.iter().enumerate() {
                let terms = w.iter().zip(numbers.chunks_exact(dim)).map(|(&w, v)| w as f64 * v[i] as f64);
                let first = (start[i] as f64, (start[i] as f64).abs());
                let (want, mag) = terms.fold(first, |(s, m), t| (s + t, m + t.abs()));
                prop_assert!(
                    close(got, want, mag, 1e-5),
                    "head {h} of {heads}, column {i} of {dim}, {n} rows, format {format:?} on {}: {got} vs {want}",
                    k.isa()
                );
            }
            let mut alone = start.to_vec();
            values.add_weighted(&k, dim, w, n, &mut alone);
            prop_assert!(bits_of(&alone) == bits_of(got), "head {h} of {heads} summed alone differs on {}", k.isa());
        }
    }
    Ok(())
}

fn bits_of(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

fn check_softmax_exp(n: usize, seed: u64) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let x: Vec<f32> = (0..n).map(|_| (rng.normal() * 10.0) as f32).collect();
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for k in all_tables() {
        let mut e = x.clone();
        let sum = k.softmax_exp(&mut e, max);
        let mut want_sum = 0.0;
        for (&got, &x) in e.iter().zip(&x) {
            // The kernel subtracts in f32; the reference exponentiates that argument.
            let want = ((x - max) as f64).exp();
            want_sum += want;
            prop_assert!(close(got, want, want, 2e-7), "exp({}) on {}: {got} vs {want}", x - max, k.isa());
        }
        prop_assert!(close(sum, want_sum, want_sum, 1e-6), "sum of {n} on {}: {sum} vs {want_sum}", k.isa());
    }
    Ok(())
}

/// `add_scaled_f64` and `squared_norm_f64` against the same sums written out here,
/// bit for bit: each coordinate's product then sum; the squares in eight partial sums
/// (coordinate `d` into `d mod 8`) then added in order.
fn check_f64_sums(n: usize, seed: u64) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * 3.0) as f32).collect();
    let start: Vec<f64> = (0..n).map(|_| rng.normal() * 100.0).collect();
    let mut partials = [0.0f64; 8];
    for (d, &x) in v.iter().enumerate() {
        partials[d % 8] += f64::from(x) * f64::from(x);
    }
    let want_norm = partials.iter().fold(0.0, |a, &b| a + b);
    for w in [1.0, -1.0, rng.normal()] {
        let want: Vec<u64> = start.iter().zip(&v).map(|(&s, &x)| (s + w * f64::from(x)).to_bits()).collect();
        for k in all_tables() {
            let mut sum = start.clone();
            k.add_scaled_f64(w, &v, &mut sum);
            let got: Vec<u64> = sum.iter().map(|s| s.to_bits()).collect();
            prop_assert!(got == want, "add_scaled_f64 of {n} with w = {w} on {}", k.isa());
            let norm = k.squared_norm_f64(&v);
            prop_assert!(norm.to_bits() == want_norm.to_bits(), "‖v‖² of {n} on {}: {norm} vs {want_norm}", k.isa());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn f64_sums_are_plain_f64_arithmetic(n in 0usize..=300, seed in any::<u64>()) {
        check_f64_sums(n, seed)?;
    }

    #[test]
    fn scores_match_f64(
        dim in 1usize..=300, heads in 1usize..=8, n in 0usize..=13, gap in 0usize..=3, seed in any::<u64>()
    ) {
        check_scores(dim, heads, n, gap, None, seed)?;
    }

    #[test]
    fn add_weighted_matches_f64(
        dim in 1usize..=300, heads in 1usize..=8, n in 0usize..=70, gap in 0usize..=3, seed in any::<u64>()
    ) {
        check_add_weighted(dim, heads, n, gap, None, seed)?;
    }

    #[test]
    fn softmax_exp_matches_f64(n in 0usize..=70, seed in any::<u64>()) {
        check_softmax_exp(n, seed)?;
    }
}

/// Head sizes models use, and the edges of every vector width and unroll.
#[test]
fn head_sizes_and_edges() {
    for dim in [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 256] {
        for n in [1, 3, 4, 5, 8, 9] {
            let seed = (dim * 100 + n) as u64;
            for heads in [1, 2, 3, 4, 5, 7, 8] {
                check_scores(dim, heads, n, heads % 3, None, seed).unwrap();
                check_add_weighted(dim, heads, n, heads % 2, None, seed).unwrap();
            }
        }
    }
}

/// Every 997th f32 argument from −87.3 (whose exp is the smallest normal f32) to 88,
/// against f64.
#[test]
fn exp_is_accurate_over_its_range() {
    let lo = f32::MIN_POSITIVE.ln();
    let x: Vec<f32> = ((-0f32).to_bits()..=lo.to_bits())
        .chain(0f32.to_bits()..=88f32.to_bits())
        .step_by(997)
        .map(f32::from_bits)
        .collect();
    for k in all_tables() {
        let mut e = x.clone();
        k.softmax_exp(&mut e, 0.0);
        let worst = x
            .iter()
            .zip(&e)
            .map(|(&x, &got)| ((got as f64 - (x as f64).exp()) / (x as f64).exp()).abs())
            .fold(0.0, f64::max);
        assert!(worst < 2e-7, "max relative error {worst:e} on {}", k.isa());
    }
}

#[test]
fn exp_flushes_tiny_results_and_ignores_padding() {
    for k in all_tables() {
        let mut x = [0.0, -90.0, -1e30, f32::NEG_INFINITY, -1.0];
        let sum = k.softmax_exp(&mut x, 0.0);
        assert_eq!(&x[..4], &[1.0, 0.0, 0.0, 0.0], "on {}", k.isa());
        assert!(close(x[4], (-1f64).exp(), 1.0, 2e-7), "on {}", k.isa());
        assert_eq!(sum, x[0] + x[4], "on {}", k.isa());
    }
}

/// Random rows of affine codes in one of the cache's formats, with the reference
/// reader of their levels.
struct Codes {
    dim: usize,
    bits: u32,
    codes: Vec<u8>,
    fine: Option<Vec<u8>>,
    group: usize,
    min: Vec<f32>,
    step: Vec<f32>,
}

impl Codes {
    /// `rows` rows of `dim` codes of `bits` bits (4 with `fine`), minima and steps
    /// per channel (`group` 1) or per row and group.
    fn new(rows: usize, dim: usize, bits: u32, with_fine: bool, group: usize, rng: &mut Rng) -> Self {
        let mut bytes = |len: usize| (0..len).map(|_| (rng.unit() * 256.0) as u8).collect::<Vec<u8>>();
        let codes = bytes(rows * (dim * bits as usize).div_ceil(8));
        let fine = with_fine.then(|| bytes(rows * dim.div_ceil(2)));
        let affine = if group == 1 { dim } else { rows * dim.div_ceil(group) };
        // Minima and steps as the cache stores them: f16 numbers.
        let min = (0..affine).map(|_| f16::from_f64(rng.normal() * 4.0).to_f32()).collect();
        let step = (0..affine).map(|_| f16::from_f64(rng.unit() / 16.0).to_f32()).collect();
        Codes { dim, bits, codes, fine, group, min, step }
    }

    fn rows(&self) -> CodeRows<'_> {
        let Codes { dim, bits, group, .. } = *self;
        CodeRows { dim, codes: &self.codes, bits, fine: self.fine.as_deref(), group, min: &self.min, step: &self.step }
    }

    /// Every row's levels, one element at a time: `sift`'s scalar reader's
    /// formula, `min + step · (c · span + (span − 1)/2)` in f32.
    fn levels(&self) -> Vec<f32> {
        let code = |packed: &[u8], j: usize, width: u32| {
            let bit = j * width as usize;
            (packed[bit / 8] >> (bit % 8)) & ((1u16 << width) - 1) as u8
        };
        let dim = self.dim;
        let kept = if self.fine.is_some() { 8 } else { self.bits };
        let span = (1u32 << (8 - kept)) as f32;
        let (row_bytes, groups) = ((dim * self.bits as usize).div_ceil(8), dim.div_ceil(self.group));
        let rows = self.codes.len() / row_bytes;
        (0..rows * dim)
            .map(|i| {
                let (r, j) = (i / dim, i % dim);
                let coarse = code(&self.codes[r * row_bytes..], j, self.bits);
                let c = match &self.fine {
                    Some(fine) => coarse << 4 | code(&fine[r * dim.div_ceil(2)..], j, 4),
                    None => coarse,
                };
                let g = if self.group == 1 { j } else { r * groups + j / self.group };
                self.min[g] + self.step[g] * (f32::from(c) * span + (span - 1.0) / 2.0)
            })
            .collect()
    }
}

/// The formats the cache uses: (bits, fine) for index `width`, and its groups.
fn format(width: usize, per_row: bool) -> Format {
    let (bits, fine) = [(2, false), (4, false), (8, false), (4, true)][width];
    (bits, fine, if per_row { 32 } else { 1 })
}

fn check_levels(rows: usize, dim: usize, width: usize, per_row: bool, seed: u64) -> Result<(), TestCaseError> {
    let (bits, fine, group) = format(width, per_row);
    let codes = Codes::new(rows, dim, bits, fine, group, &mut Rng::new(seed));
    let want: Vec<u16> = codes.levels().iter().map(|&x| f16::from_f32(x).to_bits()).collect();
    for k in all_tables() {
        let mut out = vec![f16::NAN; rows * dim];
        k.levels_f16(&codes.rows(), &mut out);
        let got: Vec<u16> = out.iter().map(|x| x.to_bits()).collect();
        prop_assert!(got == want, "{rows}×{dim} {bits}-bit codes (fine: {fine}), groups of {group} on {}", k.isa());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The quantized cache's reader gives the reference's bits on every table,
    /// for every width, with and without fine codes, per channel and per row.
    #[test]
    fn levels_match_the_reference(
        rows in 0usize..=5, dim in 1usize..=300, width in 0usize..4, per_row in any::<bool>(), seed in any::<u64>()
    ) {
        check_levels(rows, dim, width, per_row, seed)?;
    }

    #[test]
    fn coded_scores_match_f64(
        dim in 1usize..=300, heads in 1usize..=5, n in 0usize..=13, gap in 0usize..=3,
        width in 0usize..4, per_row in any::<bool>(), seed in any::<u64>()
    ) {
        check_scores(dim, heads, n, gap, Some(format(width, per_row)), seed)?;
    }

    #[test]
    fn coded_weighted_sums_match_f64(
        dim in 1usize..=300, heads in 1usize..=5, n in 0usize..=70, gap in 0usize..=3,
        width in 0usize..4, per_row in any::<bool>(), seed in any::<u64>()
    ) {
        check_add_weighted(dim, heads, n, gap, Some(format(width, per_row)), seed)?;
    }
}

/// The coded kernels at head sizes models use and the edges of every vector width,
/// unroll and value group, in every format.
#[test]
fn coded_head_sizes_and_edges() {
    for dim in [1, 15, 16, 17, 31, 32, 33, 64, 80, 127, 128, 256] {
        for n in [1, 4, 5, 33] {
            for width in 0..4 {
                for per_row in [false, true] {
                    let seed = (dim * 1000 + n * 10 + width) as u64;
                    check_levels(n, dim, width, per_row, seed).unwrap();
                    for heads in 1..=5 {
                        check_scores(dim, heads, n, heads % 3, Some(format(width, per_row)), seed).unwrap();
                        check_add_weighted(dim, heads, n, heads % 2, Some(format(width, per_row)), seed).unwrap();
                    }
                }
            }
        }
    }
}
