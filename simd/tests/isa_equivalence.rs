//! Every ISA's table must agree with the scalar one: exactly for the integer-
//! accumulating formats (they share one order of float operations), within 1e-5 of
//! Σ|w·a| for the float formats.

mod common;

use common::*;
use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, proptest, ProptestConfig, Strategy, TestCaseError};
use simd::{ActivationType, Isa, Kernels, WeightType};

fn is_float(w: WeightType) -> bool {
    w.activation() == ActivationType::F32
}

fn check_dot(w: WeightType, nb: usize, rows: usize, seed: u64) -> Result<(), TestCaseError> {
    let scalar = Kernels::for_isa(Isa::Scalar).unwrap();
    let mut rng = Rng::new(seed);
    let n = nb * w.block_elems();
    let len = w.row_bytes(n).unwrap();
    let mut all = Aligned::zeroed(len * rows);
    for r in 0..rows {
        all[r * len..(r + 1) * len].copy_from_slice(&random_weight_row(w, n, &mut rng));
    }
    let x = random_activation(n, &mut rng);
    let act = quantize_for(&scalar, w, &x);
    let mut want = vec![0f32; rows];
    scalar.dot_rows(w, &all, len, &act, n, &mut want);
    let wf = {
        let mut v = vec![0f32; n];
        scalar.dequantize_row(w, &all[..len], &mut v);
        v
    };
    for isa in Isa::available() {
        let k = Kernels::for_isa(isa).unwrap();
        prop_assert_eq!(&quantize_for(&k, w, &x)[..], &act[..], "{} activations on {}", w, isa);
        let mut got = vec![0f32; rows];
        k.dot_rows(w, &all, len, &act, n, &mut got);
        let one = k.dot(w, &all[..len], &act, n);
        if is_float(w) {
            let a = dequantize_activation(ActivationType::F32, &act);
            let mag: f64 = wf.iter().zip(&a).map(|(&p, &q)| (p as f64 * q).abs()).sum();
            prop_assert!(((one - want[0]) as f64).abs() <= 1e-5 * mag, "{} dot on {}", w, isa);
            for r in 0..rows {
                // Row magnitudes differ; bound by the largest plausible one.
                let tol = 1e-5 * (mag.max(1e-30) + (want[r] as f64).abs());
                prop_assert!(((got[r] - want[r]) as f64).abs() <= tol * 4.0, "{} row {} on {}", w, r, isa);
            }
        } else {
            prop_assert_eq!(one.to_bits(), want[0].to_bits(), "{} dot on {}: {} vs {}", w, isa, one, want[0]);
            for r in 0..rows {
                prop_assert_eq!(got[r].to_bits(), want[r].to_bits(), "{} row {} on {}", w, r, isa);
            }
        }
        let mut deq = vec![0f32; n];
        k.dequantize_row(w, &all[..len], &mut deq);
        for (i, (p, q)) in deq.iter().zip(&wf).enumerate() {
            prop_assert_eq!(p.to_bits(), q.to_bits(), "{} dequantize element {} on {}", w, i, isa);
        }
    }
    Ok(())
}

fn weight_type() -> impl Strategy<Value = WeightType> {
    prop::sample::select(WeightType::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_isa_matches_scalar(w in weight_type(), nb in 1usize..=19, rows in 1usize..=6, seed in any::<u64>()) {
        // Float formats: nb counts elements, so also cover lengths that are not a
        // multiple of any vector width.
        let nb = if w.block_elems() == 1 { nb * 37 } else if w.block_elems() == 256 { nb.min(9) } else { nb };
        check_dot(w, nb, rows, seed)?;
    }

    #[test]
    fn every_isa_quantizes_like_scalar(nb in 1usize..=9, seed in any::<u64>()) {
        let scalar = Kernels::for_isa(Isa::Scalar).unwrap();
        let mut rng = Rng::new(seed);
        let x = random_activation(nb * 256, &mut rng);
        for a in ActivationType::ALL {
            let mut want = Aligned::zeroed(a.row_bytes(x.len()));
            scalar.quantize_activation(a, &x, &mut want);
            for isa in Isa::available() {
                let mut got = Aligned::zeroed(a.row_bytes(x.len()));
                Kernels::for_isa(isa).unwrap().quantize_activation(a, &x, &mut got);
                prop_assert_eq!(&got[..], &want[..], "{:?} on {}", a, isa);
            }
        }
    }
}

#[test]
fn single_rows_and_odd_block_counts() {
    for w in WeightType::ALL {
        for nb in [1, 3, 5, 9, 11] {
            check_dot(w, nb, 1, nb as u64 * 1000 + w.ggml_id() as u64).unwrap();
            check_dot(w, nb, 3, nb as u64 * 7 + 1).unwrap();
        }
    }
}

#[test]
fn isa_selection() {
    let avail = Isa::available();
    assert_eq!(avail[0], Isa::Scalar);
    assert_eq!(Isa::best(), *avail.last().unwrap());
    for isa in Isa::ALL {
        assert_eq!(Kernels::for_isa(isa).is_some(), avail.contains(&isa));
        assert_eq!(isa.name().parse::<Isa>(), Ok(isa));
    }
    assert!("sse9".parse::<Isa>().is_err());
    assert_eq!(Kernels::for_isa(Isa::Scalar).unwrap().isa(), Isa::Scalar);
}
