//! Dot products against an f64 reference built from dequantized rows, and ggml's
//! quantization-error bounds for the activation formats.

mod common;

use common::*;
use simd::{ActivationType, WeightType};

/// The exact value ggml's pairing defines, in f64: the weight row dequantized by the
/// crate (checked bit-exact against gguf in reference_vectors.rs) times the activation
/// dequantized here. Q4_1/Q5_1 use Q8_1's stored `s` for the minimum term, as ggml
/// does, so that term is taken from `s` rather than from the quants.
fn reference(w: WeightType, wf: &[f32], w_row: &[u8], act: &[u8]) -> (f64, f64) {
    let a = dequantize_activation(w.activation(), act);
    let mut dot = 0f64;
    let mut mag = 0f64;
    match w {
        WeightType::Q4_1 | WeightType::Q5_1 => {
            let wb = w.block_bytes();
            for (b, (wblock, ablock)) in w_row.chunks(wb).zip(act.chunks(36)).enumerate() {
                let m = half::f16::from_le_bytes([wblock[2], wblock[3]]).to_f64();
                let s = half::f16::from_le_bytes([ablock[2], ablock[3]]).to_f64();
                for i in 32 * b..32 * b + 32 {
                    dot += (wf[i] as f64 - m) * a[i];
                    mag += (wf[i] as f64 * a[i]).abs();
                }
                dot += m * s;
                mag += (m * s).abs();
            }
        }
        _ => {
            for (&x, &y) in wf.iter().zip(&a) {
                dot += x as f64 * y;
                mag += (x as f64 * y).abs();
            }
        }
    }
    (dot, mag)
}

#[test]
fn dot_matches_f64_reference() {
    let mut rng = Rng::new(0xD07);
    for k in all_tables() {
        for w in WeightType::ALL {
            let blocks: &[usize] = if w.block_elems() == 1 {
                &[1, 2, 15, 16, 17, 64, 255, 1000]
            } else if w.block_elems() == 32 {
                &[1, 2, 3, 7, 8, 9, 16, 17, 40]
            } else {
                &[1, 2, 3, 5, 8]
            };
            for &nb in blocks {
                for _ in 0..4 {
                    let n = nb * w.block_elems();
                    let w_row = random_weight_row(w, n, &mut rng);
                    let x = random_activation(n, &mut rng);
                    let act = quantize_for(&k, w, &x);
                    let mut wf = vec![0f32; n];
                    k.dequantize_row(w, &w_row, &mut wf);
                    let (want, mag) = reference(w, &wf, &w_row, &act);
                    let got = k.dot(w, &w_row, &act, n) as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * mag + 1e-30,
                        "{w} on {}, {nb} blocks: got {got:e}, want {want:e} (Σ|w·a| = {mag:e})",
                        k.isa()
                    );
                    // dot_rows over a single row is the same thing.
                    let mut out = [f32::NAN];
                    k.dot_rows(w, &w_row, w_row.len(), &act, n, &mut out);
                    assert_eq!(out[0], got as f32, "{w} dot_rows on {}", k.isa());
                }
            }
        }
    }
}

#[test]
fn dot_rows_matches_dot_with_stride() {
    let mut rng = Rng::new(0x5151);
    for k in all_tables() {
        for w in WeightType::ALL {
            let n = 3 * 256;
            let len = w.row_bytes(n).unwrap();
            for rows in [1, 2, 3, 4, 5, 7, 9] {
                for stride in [len, len + 4 * w.block_bytes().max(2)] {
                    let mut all = Aligned::zeroed(stride * rows);
                    for r in 0..rows {
                        let row = random_weight_row(w, n, &mut rng);
                        all[r * stride..r * stride + len].copy_from_slice(&row);
                    }
                    let act = quantize_for(&k, w, &random_activation(n, &mut rng));
                    // The span may end right after the last row.
                    let span = &all[..(rows - 1) * stride + len];
                    let mut out = vec![f32::NAN; rows];
                    k.dot_rows(w, span, stride, &act, n, &mut out);
                    for r in 0..rows {
                        let one = k.dot(w, &all[r * stride..r * stride + len], &act, n);
                        assert_eq!(out[r].to_bits(), one.to_bits(), "{w} on {}: row {r}/{rows}", k.isa());
                    }
                }
            }
        }
    }
}

/// ggml's test-quantize-fns data: 0.1 + 2·cos(i + offset).
fn ggml_test_data(n: usize, offset: f32) -> Vec<f32> {
    (0..n).map(|i| 0.1 + 2.0 * (i as f32 + offset).cos()).collect()
}

#[test]
fn activation_quantization_error_within_ggml_bounds() {
    // test-quantize-fns: "total error" sqrt(Σ(x − x̂)²) / n under
    // MAX_QUANTIZATION_TOTAL_ERROR (0.002), and the optimized path within
    // MAX_QUANTIZATION_REFERENCE_ERROR (0.0001) of the reference one. Stricter, ours:
    // every element within ~half a quantization step of its block (Q8_0/Q8_1 steps
    // are stored as f16, which adds up to 127·2⁻¹¹ of a step).
    let n = 4096 + 256;
    let mut x = ggml_test_data(n, 0.0);
    let mut rng = Rng::new(3);
    x.extend(random_activation(2048, &mut rng));
    let n = x.len();
    let tables = all_tables();
    for a in [ActivationType::Q8_0, ActivationType::Q8_1, ActivationType::Q8_K] {
        let mut scalar_deq = None;
        for k in &tables {
            let mut q = Aligned::zeroed(a.row_bytes(n));
            k.quantize_activation(a, &x, &mut q);
            let deq = dequantize_activation(a, &q);
            let sq: f64 = x.iter().zip(&deq).map(|(&v, &d)| (v as f64 - d).powi(2)).sum();
            let total = sq.sqrt() / n as f64;
            assert!(total < 0.002, "{a:?} on {}: total error {total}", k.isa());
            let s = scalar_deq.get_or_insert(deq.clone());
            let diff = s.iter().zip(&deq).map(|(p, q)| (p - q).powi(2)).sum::<f64>().sqrt() / n as f64;
            assert!(diff < 0.0001, "{a:?} on {}: differs from scalar by {diff}", k.isa());

            let (block, half_steps) = if a == ActivationType::Q8_K { (256, 0.501) } else { (32, 0.57) };
            for (xb, db) in x.chunks(block).zip(deq.chunks(block)) {
                let amax = xb.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
                for (&v, &d) in xb.iter().zip(db) {
                    assert!(
                        (v as f64 - d).abs() <= half_steps * amax / 127.0,
                        "{a:?} on {}: {v} became {d} (block amax {amax})",
                        k.isa()
                    );
                }
            }
        }
    }
}

#[test]
fn dot_product_error_within_ggml_bound() {
    // test-quantize-fns: |dot(quantized) − dot(f32)| / n < MAX_DOT_PRODUCT_ERROR (0.02)
    // for weights quantized from the test data. We have no weight quantizers, so this
    // uses the 8-bit path (Q8_0 weights quantized by the activation quantizer) and the
    // float formats.
    let n = 4096;
    let x = ggml_test_data(n, 0.0);
    let y = ggml_test_data(n, 1.0);
    let exact: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
    for k in all_tables() {
        let mut w = Aligned::zeroed(ActivationType::Q8_0.row_bytes(n));
        k.quantize_activation(ActivationType::Q8_0, &x, &mut w);
        let act = quantize_for(&k, WeightType::Q8_0, &y);
        let got = k.dot(WeightType::Q8_0, &w, &act, n) as f64;
        assert!((got - exact).abs() / (n as f64) < 0.02, "Q8_0 on {}", k.isa());

        let wf16: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
        let act = quantize_for(&k, WeightType::F16, &y);
        let got = k.dot(WeightType::F16, bytemuck::cast_slice(&wf16), &act, n) as f64;
        assert!((got - exact).abs() / (n as f64) < 0.02, "F16 on {}", k.isa());
    }
}

#[test]
#[should_panic(expected = "wrong byte length")]
fn dot_rejects_mismatched_rows() {
    let k = simd::kernels();
    let w = vec![0u8; 18 * 2];
    let a = Aligned::zeroed(34);
    k.dot(WeightType::Q4_0, &w, &a, 64);
}

#[test]
#[should_panic(expected = "multiple of 256")]
fn dot_rejects_partial_blocks() {
    let k = simd::kernels();
    k.dot(WeightType::Q4_K, &[], &[], 100);
}

#[test]
fn non_finite_inputs_do_not_panic() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE, 1e-45, -0.0];
    let mut rng = Rng::new(11);
    for k in all_tables() {
        for w in WeightType::ALL {
            let n = 512;
            let mut x = random_activation(n, &mut rng);
            for (i, v) in x.iter_mut().enumerate().step_by(37) {
                *v = specials[i % specials.len()];
            }
            let act = quantize_for(&k, w, &x);
            let mut w_row = random_weight_row(w, n, &mut rng);
            // Non-finite scales / values in the weights too.
            for b in w_row.chunks_exact_mut(w.block_bytes()).step_by(3) {
                match f16_fields(w).first() {
                    Some(&off) => b[off..off + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes()),
                    None => b.iter_mut().for_each(|v| *v = 0xff),
                }
            }
            let _ = k.dot(w, &w_row, &act, n);
            let mut out = vec![0f32; n];
            k.dequantize_row(w, &w_row, &mut out);
        }
    }
}
