//! Helpers shared by the integration tests: a seeded PRNG, 8-byte-aligned byte
//! buffers, random-but-valid rows, and the reference data files.
#![allow(dead_code)]

use simd::{ActivationType, WeightType};

/// SplitMix64: tiny, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Roughly normal (sum of uniforms), scaled.
    pub fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.unit()).sum::<f64>() * 1.7320508 - 3.4641016
    }
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next_u64() as u8;
        }
    }
}

/// A byte buffer whose start is 8-byte aligned (what sift's callers provide).
pub struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    pub fn zeroed(len: usize) -> Self {
        Aligned { words: vec![0; len.div_ceil(8)], len }
    }
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut a = Self::zeroed(bytes.len());
        a.copy_from_slice(bytes);
        a
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// Byte offsets of the f16 scale fields in a block of `w`.
pub fn f16_fields(w: WeightType) -> &'static [usize] {
    match w {
        WeightType::Q4_0
        | WeightType::Q5_0
        | WeightType::Q8_0
        | WeightType::IQ4_NL
        | WeightType::IQ4_XS
        | WeightType::IQ3_XXS
        | WeightType::IQ3_S => &[0],
        WeightType::Q4_1 | WeightType::Q5_1 | WeightType::Q4_K | WeightType::Q5_K => &[0, 2],
        WeightType::Q2_K => &[80, 82],
        WeightType::Q3_K => &[108],
        WeightType::Q6_K => &[208],
        WeightType::F32 | WeightType::F16 | WeightType::BF16 => &[],
    }
}

/// A finite f16 scale of moderate size, sometimes zero, negative or subnormal.
pub fn sane_f16(rng: &mut Rng) -> half::f16 {
    match rng.below(16) {
        0 => half::f16::ZERO,
        1 => half::f16::from_f32(3e-6),
        _ => half::f16::from_f64(rng.normal() * 10f64.powf(-3.0 * rng.unit())),
    }
}

/// A random f32 of varying magnitude.
pub fn random_f32(rng: &mut Rng) -> f32 {
    (rng.normal() * 10f64.powf(4.0 * rng.unit() - 2.0)) as f32
}

/// A random, valid row of `n` elements of `w` (finite scales, any quant bits).
pub fn random_weight_row(w: WeightType, n: usize, rng: &mut Rng) -> Aligned {
    let mut row = Aligned::zeroed(w.row_bytes(n).unwrap());
    match w {
        WeightType::F32 => {
            let v: Vec<f32> = (0..n).map(|_| random_f32(rng)).collect();
            row.copy_from_slice(bytemuck::cast_slice(&v));
        }
        WeightType::F16 => {
            let v: Vec<half::f16> = (0..n).map(|_| half::f16::from_f64(rng.normal() * 4.0)).collect();
            row.copy_from_slice(bytemuck::cast_slice(&v));
        }
        WeightType::BF16 => {
            let v: Vec<half::bf16> = (0..n).map(|_| half::bf16::from_f32(random_f32(rng))).collect();
            row.copy_from_slice(bytemuck::cast_slice(&v));
        }
        _ => {
            rng.fill_bytes(&mut row);
            for block in row.chunks_exact_mut(w.block_bytes()) {
                for &off in f16_fields(w) {
                    block[off..off + 2].copy_from_slice(&sane_f16(rng).to_le_bytes());
                }
            }
        }
    }
    row
}

/// A random activation row: blocks of varying scale, now and then an all-zero block or
/// one dominated by a single value.
pub fn random_activation(n: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = vec![0f32; n];
    for chunk in x.chunks_mut(32) {
        let scale = 10f64.powf(4.0 * rng.unit() - 2.0);
        match rng.below(12) {
            0 => {} // zeros
            1 => {
                let i = rng.below(chunk.len());
                chunk[i] = (rng.normal() * scale) as f32;
            }
            _ => {
                for v in chunk.iter_mut() {
                    *v = (rng.normal() * scale) as f32;
                }
            }
        }
    }
    x
}

/// Quantizes `x` for weight type `w` with the given table.
pub fn quantize_for(k: &simd::Kernels, w: WeightType, x: &[f32]) -> Aligned {
    let a = w.activation();
    let mut out = Aligned::zeroed(a.row_bytes(x.len()));
    k.quantize_activation(a, x, &mut out);
    out
}

/// Dequantizes an activation row independently of the crate: each value is `d · q`.
pub fn dequantize_activation(a: ActivationType, row: &[u8]) -> Vec<f64> {
    let mut out = Vec::new();
    match a {
        ActivationType::F32 => {
            for c in row.chunks_exact(4) {
                out.push(f32::from_le_bytes(c.try_into().unwrap()) as f64);
            }
        }
        ActivationType::Q8_0 | ActivationType::Q8_1 => {
            let (bytes, first_q) = if a == ActivationType::Q8_0 { (34, 2) } else { (36, 4) };
            for b in row.chunks_exact(bytes) {
                let d = half::f16::from_le_bytes([b[0], b[1]]).to_f64();
                out.extend(b[first_q..].iter().map(|&q| q as i8 as f64 * d));
            }
        }
        ActivationType::Q8_K => {
            for b in row.chunks_exact(292) {
                let d = f32::from_le_bytes(b[0..4].try_into().unwrap()) as f64;
                out.extend(b[4..260].iter().map(|&q| q as i8 as f64 * d));
            }
        }
    }
    out
}

/// A file of `tests/data`.
pub fn data_file(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Tables for every ISA this CPU supports.
pub fn all_tables() -> Vec<simd::Kernels> {
    simd::Isa::available().into_iter().map(|i| simd::Kernels::for_isa(i).unwrap()).collect()
}
