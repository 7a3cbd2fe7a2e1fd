//! `Kernels::dot_tile` must give, for every (row, token) pair, what `Kernels::dot` gives:
//! bit for bit for the integer-accumulating formats (on every ISA, so also the scalar
//! table's value), within 1e-5 of Σ|w·a| for the float formats. Tiles are ragged on
//! purpose: row and token counts that are not multiples of any tile size (the x86
//! kernels take 16 rows × 64 tokens), and output strides with gaps that must be left
//! alone.

mod common;

use common::*;
use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, proptest, ProptestConfig, Strategy, TestCaseError};
use simd::{ActivationType, Isa, Kernels, WeightType};

/// Marks the output elements `dot_tile` must not touch.
const UNTOUCHED: f32 = -1234.5;

fn check_tile(
    w: WeightType,
    nb: usize,
    rows: usize,
    tokens: usize,
    gap: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let scalar = Kernels::for_isa(Isa::Scalar).unwrap();
    let mut rng = Rng::new(seed);
    let n = nb * w.block_elems();
    let len = w.row_bytes(n).unwrap();
    let mut weights = Aligned::zeroed(len * rows);
    for row in weights.chunks_exact_mut(len) {
        row.copy_from_slice(&random_weight_row(w, n, &mut rng));
    }
    let act_len = w.activation().row_bytes(n);
    let mut acts = Aligned::zeroed(act_len * tokens);
    for act in acts.chunks_exact_mut(act_len) {
        act.copy_from_slice(&quantize_for(&scalar, w, &random_activation(n, &mut rng)));
    }
    let stride = rows + gap;
    for isa in Isa::available() {
        let k = Kernels::for_isa(isa).unwrap();
        let mut out = vec![UNTOUCHED; (tokens - 1) * stride + rows + gap];
        k.dot_tile(w, &weights, &acts, n, &mut out, stride);
        for (i, &got) in out.iter().enumerate() {
            let (t, r) = (i / stride, i % stride);
            if t >= tokens || r >= rows {
                prop_assert_eq!(got.to_bits(), UNTOUCHED.to_bits(), "{} on {}: element {} was written", w, isa, i);
                continue;
            }
            let (row, act) = (&weights[r * len..][..len], &acts[t * act_len..][..act_len]);
            if w.activation() == ActivationType::F32 {
                let want = k.dot(w, row, act, n);
                let mut wf = vec![0f32; n];
                k.dequantize_row(w, row, &mut wf);
                let a = dequantize_activation(ActivationType::F32, act);
                let mag: f64 = wf.iter().zip(&a).map(|(&p, &q)| (p as f64 * q).abs()).sum();
                prop_assert!(
                    ((got - want) as f64).abs() <= 1e-5 * mag,
                    "{} on {}: row {} token {}: {} vs {}",
                    w,
                    isa,
                    r,
                    t,
                    got,
                    want
                );
            } else {
                let want = scalar.dot(w, row, act, n);
                prop_assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{} on {}: row {} token {}: {} vs {}",
                    w,
                    isa,
                    r,
                    t,
                    got,
                    want
                );
            }
        }
    }
    Ok(())
}

fn weight_type() -> impl Strategy<Value = WeightType> {
    prop::sample::select(WeightType::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn tiles_match_dot(
        w in weight_type(),
        nb in 1usize..=19,
        rows in 1usize..=35,
        tokens in 1usize..=140,
        gap in 0usize..=3,
        seed in any::<u64>(),
    ) {
        // As in isa_equivalence: element counts for the float formats, fewer of the big
        // K-quant blocks.
        let nb = if w.block_elems() == 1 { nb * 37 } else if w.block_elems() == 256 { nb.min(5) } else { nb };
        check_tile(w, nb, rows, tokens, gap, seed)?;
    }
}

#[test]
fn every_format_at_tile_edges() {
    for w in WeightType::ALL {
        for (rows, tokens) in [(1, 1), (4, 8), (5, 9), (3, 17), (12, 7), (16, 64), (17, 65), (32, 129)] {
            let nb = if w.block_elems() == 1 { 64 } else { 9 };
            check_tile(w, nb, rows, tokens, 1, (rows * 100 + tokens) as u64).unwrap();
        }
    }
}

#[test]
fn empty_operands_write_nothing() {
    let k = simd::kernels();
    let w = WeightType::Q8_0;
    let row = Aligned::zeroed(w.row_bytes(32).unwrap());
    let mut out = [UNTOUCHED; 2];
    k.dot_tile(w, &row, &[], 32, &mut out, 1);
    k.dot_tile(w, &[], &Aligned::zeroed(w.activation().row_bytes(32)), 32, &mut out, 1);
    assert_eq!(out, [UNTOUCHED; 2]);
}

#[test]
#[should_panic(expected = "do not fit")]
fn short_output_panics() {
    let k = simd::kernels();
    let w = WeightType::Q8_0;
    let rows = Aligned::zeroed(2 * w.row_bytes(32).unwrap());
    let acts = Aligned::zeroed(2 * w.activation().row_bytes(32));
    let mut out = [0f32; 3];
    k.dot_tile(w, &rows, &acts, 32, &mut out, 2);
}
