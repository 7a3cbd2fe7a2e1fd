//! Checks against vectors made by the `gguf` Python package (tests/data/make_vectors.py)
//! and against transcriptions of ggml's reference quantizers.

mod common;

use common::*;
use simd::{ActivationType, WeightType};

fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i} (block of 32: {}): got {g:e} ({:#010x}), want {w:e} ({:#010x})",
            i / 32,
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn check_dequant(blocks_file: &str, dequant_file: &str, w: WeightType) {
    let blocks = Aligned::from_bytes(&data_file(blocks_file));
    let want = f32s(&data_file(dequant_file));
    assert_eq!(Some(blocks.len()), w.row_bytes(want.len()), "{blocks_file}: size");
    for k in all_tables() {
        let mut got = vec![0f32; want.len()];
        k.dequantize_row(w, &blocks, &mut got);
        assert_bits_eq(&format!("{blocks_file} on {}", k.isa()), &got, &want);
        // Also from a start that is only 2-byte aligned (where the format allows it).
        if w != WeightType::F32 {
            let mut shifted = Aligned::zeroed(blocks.len() + 2);
            shifted[2..].copy_from_slice(&blocks);
            got.fill(0.0);
            k.dequantize_row(w, &shifted[2..], &mut got);
            assert_bits_eq(&format!("{blocks_file} (2-aligned) on {}", k.isa()), &got, &want);
        }
    }
}

#[test]
fn dequantize_random_blocks_matches_gguf() {
    for w in WeightType::ALL {
        check_dequant(&format!("{w}.blocks"), &format!("{w}.dequant"), w);
    }
}

#[test]
fn dequantize_gguf_quantized_blocks_matches_gguf() {
    for w in [WeightType::Q4_0, WeightType::Q4_1, WeightType::Q5_0, WeightType::Q5_1, WeightType::Q8_0] {
        check_dequant(&format!("{w}.quant.blocks"), &format!("{w}.quant.dequant"), w);
    }
}

/// ggml's x86 `quantize_row_q8_0`, transcribed: scale by `127 / amax`, round half to even.
fn q8_0_x86_reference(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xb in x.chunks(32) {
        let amax = xb.iter().fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        out.extend(half::f16::from_f32(amax / 127.0).to_le_bytes());
        out.extend(xb.iter().map(|&v| (v * id).round_ties_even() as i8 as u8));
    }
    out
}

#[test]
fn q8_0_quantization_matches_ggml_on_x86() {
    let x = f32s(&data_file("Q8_0.quant.input"));
    let want = q8_0_x86_reference(&x);
    for k in all_tables() {
        let mut got = Aligned::zeroed(ActivationType::Q8_0.row_bytes(x.len()));
        k.quantize_activation(ActivationType::Q8_0, &x, &mut got);
        for (b, (g, w)) in got.chunks(34).zip(want.chunks(34)).enumerate() {
            assert_eq!(g, w, "block {b} on {}", k.isa());
        }
    }
}

#[test]
fn q8_0_quantization_is_within_one_step_of_gguf() {
    // The `gguf` package follows ggml's portable reference rule (1/d, half away
    // from zero): the scales agree exactly, the quants by at most one step.
    let x = f32s(&data_file("Q8_0.quant.input"));
    let gguf = data_file("Q8_0.quant.blocks");
    let ours = q8_0_x86_reference(&x);
    for (b, (o, g)) in ours.chunks(34).zip(gguf.chunks(34)).enumerate() {
        assert_eq!(o[..2], g[..2], "d of block {b}");
        for (&a, &c) in o[2..].iter().zip(&g[2..]) {
            assert!((a as i8 as i32 - c as i8 as i32).abs() <= 1, "block {b}");
        }
    }
}

#[test]
fn q8_1_quantization_is_q8_0_plus_sum() {
    let x = f32s(&data_file("Q8_0.quant.input"));
    let q8_0 = q8_0_x86_reference(&x);
    for k in all_tables() {
        let mut got = Aligned::zeroed(ActivationType::Q8_1.row_bytes(x.len()));
        k.quantize_activation(ActivationType::Q8_1, &x, &mut got);
        for (b, (g, w)) in got.chunks(36).zip(q8_0.chunks(34)).enumerate() {
            assert_eq!(g[0..2], w[0..2], "d of block {b} on {}", k.isa());
            assert_eq!(g[4..], w[2..], "qs of block {b} on {}", k.isa());
            // ggml: s = fp16(sum(qs) * d) with the unrounded f32 d = amax / 127.
            let amax = x[32 * b..32 * b + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let sum: i32 = g[4..].iter().map(|&q| q as i8 as i32).sum();
            let s = half::f16::from_f32(sum as f32 * d);
            assert_eq!(g[2..4], s.to_le_bytes(), "s of block {b} on {}", k.isa());
        }
    }
}

/// ggml's `quantize_row_q8_K_ref`, transcribed.
fn q8_k_reference(x: &[f32]) -> Vec<u8> {
    fn nearest_int(f: f32) -> i32 {
        let v = f + 12582912.0;
        (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
    }
    let mut out = Vec::new();
    for xb in x.chunks(256) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut qs = [0i8; 256];
        let mut d = 0f32;
        if amax != 0.0 {
            let iscale = -127.0 / max;
            for j in 0..256 {
                qs[j] = nearest_int(iscale * xb[j]).min(127) as i8;
            }
            d = 1.0 / iscale;
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
        for g in 0..16 {
            let s: i32 = qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum();
            out.extend_from_slice(&(s as i16).to_le_bytes());
        }
    }
    out
}

#[test]
fn q8_k_quantization_matches_ggml_reference() {
    let mut inputs = vec![f32s(&data_file("Q8_0.quant.input"))];
    let mut rng = Rng::new(7);
    for _ in 0..20 {
        inputs.push(random_activation(256 * (1 + rng.below(4)), &mut rng));
    }
    // Ties of nearest_int (half to even): max = -127 makes iscale = 1.
    let mut ties = vec![0f32; 256];
    ties[0] = -127.0;
    for (j, v) in ties.iter_mut().enumerate().skip(1) {
        *v = (j as f32 - 128.0) / 2.0 + 0.25 * ((j % 2) as f32) + 0.25;
    }
    inputs.push(ties);
    // Equal magnitudes of both signs: the first one wins.
    let mut both = vec![0.5f32; 256];
    both[3] = 2.0;
    both[9] = -2.0;
    inputs.push(both.clone());
    both[3] = -2.0;
    both[9] = 2.0;
    inputs.push(both);
    for x in &inputs {
        let want = q8_k_reference(x);
        for k in all_tables() {
            let mut got = Aligned::zeroed(ActivationType::Q8_K.row_bytes(x.len()));
            k.quantize_activation(ActivationType::Q8_K, x, &mut got);
            for (b, (g, w)) in got.chunks(292).zip(want.chunks(292)).enumerate() {
                assert_eq!(g, w, "block {b} on {}", k.isa());
            }
        }
    }
}

#[test]
fn f32_activation_is_the_row_bytes() {
    let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 3.0).collect();
    for k in all_tables() {
        let mut got = Aligned::zeroed(ActivationType::F32.row_bytes(x.len()));
        k.quantize_activation(ActivationType::F32, &x, &mut got);
        assert_eq!(&got[..], bytemuck::cast_slice::<f32, u8>(&x));
    }
}

#[test]
fn type_table_matches_ggml() {
    let expect = [
        ("F32", 0, 1, 4),
        ("F16", 1, 1, 2),
        ("BF16", 30, 1, 2),
        ("Q4_0", 2, 32, 18),
        ("Q4_1", 3, 32, 20),
        ("Q5_0", 6, 32, 22),
        ("Q5_1", 7, 32, 24),
        ("Q8_0", 8, 32, 34),
        ("Q2_K", 10, 256, 84),
        ("Q3_K", 11, 256, 110),
        ("Q4_K", 12, 256, 144),
        ("Q5_K", 13, 256, 176),
        ("Q6_K", 14, 256, 210),
        ("IQ4_NL", 20, 32, 18),
        ("IQ4_XS", 23, 256, 136),
        ("IQ3_XXS", 18, 256, 98),
        ("IQ3_S", 21, 256, 110),
    ];
    assert_eq!(expect.len(), WeightType::ALL.len());
    for (w, (name, id, elems, bytes)) in WeightType::ALL.into_iter().zip(expect) {
        assert_eq!((w.name(), w.ggml_id(), w.block_elems(), w.block_bytes()), (name, id, elems, bytes));
        assert_eq!(WeightType::from_ggml_id(id), Some(w));
        assert_eq!(w.row_bytes(elems * 3), Some(bytes * 3));
        if elems > 1 {
            assert_eq!(w.row_bytes(elems + 1), None);
        }
        if bytes > elems {
            // Only these can overflow: the byte count outgrows the element count.
            assert_eq!(w.row_bytes(usize::MAX - usize::MAX % elems), None, "{name} overflow");
        }
    }
    for id in [4, 5, 9, 15, 16, 17, 19, 22, 29, 31, 1000] {
        assert_eq!(WeightType::from_ggml_id(id), None, "{id}");
    }
    for (a, elems, bytes) in [
        (ActivationType::F32, 1, 4),
        (ActivationType::Q8_0, 32, 34),
        (ActivationType::Q8_1, 32, 36),
        (ActivationType::Q8_K, 256, 292),
    ] {
        assert_eq!((a.block_elems(), a.row_bytes(elems * 5)), (elems, bytes * 5));
    }
}
