//! `perplexity --f32-activations`: products without the 8-bit activation
//! rounding. A test binary of its own, since the switches are process-wide
//! (and its tests take turns with them).

mod common;

use half::f16;
use std::sync::Mutex;

use sift::matmul::{keep_dequantized_weights, set_f32_activations, MatmulScratch, Matrix};
use simd::WeightType;

use common::Rng;

/// Held by each test while it sets the process-wide switches.
static SWITCHES: Mutex<()> = Mutex::new(());

/// A Q8_0 matrix of random blocks (an f16 scale, then 32 signed bytes).
fn q8_0_matrix(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend_from_slice(&f16::from_f64(0.01 + rng.unit() * 0.02).to_le_bytes());
        data.extend((0..32).map(|_| (rng.next() % 255) as u8));
    }
    data
}

/// The largest error of `matmul` against f64 products with the dequantized
/// weights, relative to the sum of the products' magnitudes.
fn worst_error(matrix: &Matrix, x: &[f32]) -> f64 {
    let (rows, cols) = (matrix.rows, matrix.cols);
    let mut out = vec![0.0; x.len() / cols * rows];
    matrix.matmul(x, &mut out, &mut MatmulScratch::default());
    let mut row = vec![0.0; cols];
    let mut worst: f64 = 0.0;
    for r in 0..rows {
        matrix.dequantize_row(r, &mut row);
        for (t, x) in x.chunks_exact(cols).enumerate() {
            let terms = row.iter().zip(x).map(|(&w, &a)| w as f64 * a as f64);
            let (want, magnitude) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
            worst = worst.max((out[t * rows + r] as f64 - want).abs() / magnitude);
        }
    }
    worst
}

#[test]
fn f32_activations_match_f64_where_quantized_ones_do_not() {
    let _switches = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    keep_dequantized_weights(false);
    let (rows, cols) = (48, 256);
    let mut rng = Rng(3);
    let data = q8_0_matrix(rows, cols, &mut rng);
    let matrix = Matrix::new(WeightType::Q8_0, rows, cols, &data).unwrap();
    for tokens in [1, 5] {
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.normal() as f32).collect();
        set_f32_activations(false);
        let quantized = worst_error(&matrix, &x);
        set_f32_activations(true);
        let exact = worst_error(&matrix, &x);
        assert!(exact < 1e-5, "{tokens} tokens, f32 activations: relative error {exact:e}");
        assert!(quantized > 1e-4, "{tokens} tokens, 8-bit activations: relative error only {quantized:e}");
    }
    // A decoded row (its weights dequantized row by row) is a batch's row
    // (the whole matrix dequantized first), bit for bit.
    let x: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
    let (mut one, mut two) = (vec![0.0; rows], vec![0.0; 2 * rows]);
    matrix.matmul(&x, &mut one, &mut MatmulScratch::default());
    matrix.matmul(&[x.clone(), x].concat(), &mut two, &mut MatmulScratch::default());
    assert_eq!(one, two[..rows], "the decoding path is not the batched one");
    assert_eq!(one, two[rows..]);
}

/// Kept f32 weights change no result: two matrices (so that one's weights
/// are never served for the other), one row and a batch, before and after
/// the weights are kept, against products that dequantize as they go.
#[test]
fn kept_dequantized_weights_give_the_same_products() {
    let _switches = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    set_f32_activations(true);
    let (rows, cols) = (40, 256);
    let mut rng = Rng(11);
    let data: Vec<Vec<u8>> = (0..2).map(|_| q8_0_matrix(rows, cols, &mut rng)).collect();
    let matrices: Vec<Matrix> = data.iter().map(|d| Matrix::new(WeightType::Q8_0, rows, cols, d).unwrap()).collect();
    let products = |x: &[f32]| -> Vec<Vec<f32>> {
        matrices
            .iter()
            .map(|m| {
                let mut out = vec![0.0; x.len() / cols * rows];
                m.matmul(x, &mut out, &mut MatmulScratch::default());
                out
            })
            .collect()
    };
    for tokens in [1, 3] {
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.normal() as f32).collect();
        keep_dequantized_weights(false);
        let want = products(&x);
        assert_ne!(want[0], want[1], "the two matrices should differ");
        keep_dequantized_weights(true);
        assert_eq!(products(&x), want, "{tokens} tokens, the first product with kept weights");
        assert_eq!(products(&x), want, "{tokens} tokens, a product from the kept weights");
    }
    keep_dequantized_weights(false);
}
