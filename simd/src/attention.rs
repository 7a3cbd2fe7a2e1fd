//! Attention over an f16 key/value cache: the scores of one query against a run of
//! keys, the softmax's exponentials, and the probability-weighted sum of a run of values.
//!
//! # One body per kernel
//!
//! Each kernel is written once, generic over [`Lanes`]: a vector of `L` f32 lanes with
//! the handful of operations the kernels need. The portable table instantiates the
//! bodies with [`Portable`] (sixteen lanes in an array, which LLVM vectorizes for the
//! compile target); the x86 tables with AVX2 and AVX-512 registers (see
//! `x86/attention.rs`). Lengths that are not a multiple of `L` are handled by padding
//! the last partial vector, never by a separate scalar loop.
//!
//! # Numerics
//!
//! Sums are in f32, in an order that depends on the lane count, so tables agree to f32
//! rounding rather than bit for bit. [`exp`] is a Cephes-style polynomial: within
//! 2·10⁻⁷ relative of the true value down to `f32::MIN_POSITIVE`; below that it
//! flushes to zero.

use half::f16;

use crate::formats::f16_to_f32;
use crate::formats::float32::fold;

/// Keys scored per pass over the query: each key keeps its own accumulator, so the
/// pass runs this many independent multiply-add chains.
const KEYS_PER_PASS: usize = 4;

/// Output vectors accumulated in registers while walking the value rows.
const VALUE_COLUMNS: usize = 4;

/// A vector of `L` f32 lanes.
///
/// # Safety
/// An implementation may use the instructions of one ISA in every method; a caller must
/// run on a CPU that supports that ISA. That is the methods' only precondition.
pub(crate) trait Lanes<const L: usize>: Copy {
    /// Every lane `x`.
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(x: &[f32; L]) -> Self;
    /// The halves widened to f32 (exactly).
    unsafe fn load_f16(x: &[f16; L]) -> Self;
    unsafe fn store(self, out: &mut [f32; L]);
    unsafe fn add(self, other: Self) -> Self;
    unsafe fn sub(self, other: Self) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    /// `self · m + a`, fused where the ISA has it.
    unsafe fn mul_add(self, m: Self, a: Self) -> Self;
    unsafe fn min(self, other: Self) -> Self;
    unsafe fn max(self, other: Self) -> Self;
    /// `2ⁿ` for each lane's integral `n` in `-127..=127`; `2⁻¹²⁷` gives zero.
    unsafe fn exp2_int(self) -> Self;
    /// Sum of the lanes.
    unsafe fn sum(self) -> f32;
}

/// Sixteen lanes of plain Rust: the portable table's vector.
#[derive(Clone, Copy)]
struct Portable([f32; 16]);

impl Portable {
    /// `f` of each lane. (Plain loops: LLVM vectorizes them where it leaves
    /// `array::map` and `array::from_fn` calls alone.)
    #[inline(always)]
    fn each(self, f: impl Fn(f32) -> f32) -> Self {
        let mut out = self.0;
        for o in &mut out {
            *o = f(*o);
        }
        Portable(out)
    }

    /// `f` of each pair of lanes.
    #[inline(always)]
    fn zip(self, other: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        let mut out = self.0;
        for (o, &b) in out.iter_mut().zip(&other.0) {
            *o = f(*o, b);
        }
        Portable(out)
    }
}

impl Lanes<16> for Portable {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; 16])
    }
    #[inline(always)]
    unsafe fn load(x: &[f32; 16]) -> Self {
        Portable(*x)
    }
    #[inline(always)]
    unsafe fn load_f16(x: &[f16; 16]) -> Self {
        let mut out = [0.0; 16];
        for (o, &h) in out.iter_mut().zip(x) {
            *o = f16_to_f32(h);
        }
        Portable(out)
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 16]) {
        *out = self.0;
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        self.zip(other, |a, b| a + b)
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        self.zip(other, |a, b| a - b)
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        self.zip(other, |a, b| a * b)
    }
    #[inline(always)]
    unsafe fn mul_add(self, m: Self, a: Self) -> Self {
        // Unfused: `f32::mul_add` is a libm call on targets without FMA.
        self.zip(m, |x, m| x * m).zip(a, |xm, a| xm + a)
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        self.zip(other, f32::min)
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        self.zip(other, f32::max)
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        self.each(|n| f32::from_bits(((n as i32 + 127) as u32) << 23))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        fold(self.0)
    }
}

/// `x` followed by `fill` up to `L` elements.
#[inline(always)]
fn pad<T: Copy, const L: usize>(x: &[T], fill: T) -> [T; L] {
    let mut out = [fill; L];
    out[..x.len()].copy_from_slice(x);
    out
}

/// `out[j] = q · keys[j]`, where `keys` holds `out.len()` rows of `q.len()` elements.
///
/// # Safety
/// As [`Lanes`]. `q` must not be empty and `keys.len() == out.len() * q.len()`.
#[inline(always)]
pub(crate) unsafe fn scores<V: Lanes<L>, const L: usize>(q: &[f32], keys: &[f16], out: &mut [f32]) {
    let dim = q.len();
    let (groups, rest) = out.as_chunks_mut::<KEYS_PER_PASS>();
    let (group_keys, rest_keys) = keys.split_at(groups.len() * KEYS_PER_PASS * dim);
    for (o, keys) in groups.iter_mut().zip(group_keys.chunks_exact(KEYS_PER_PASS * dim)) {
        let rows = core::array::from_fn(|r| &keys[r * dim..][..dim]);
        // SAFETY: the caller's ISA guarantee is passed on.
        *o = unsafe { score_keys::<V, L, KEYS_PER_PASS>(q, rows) };
    }
    for (o, key) in rest.iter_mut().zip(rest_keys.chunks_exact(dim)) {
        // SAFETY: as above.
        [*o] = unsafe { score_keys::<V, L, 1>(q, [key]) };
    }
}

/// `q · key` for each of `R` keys of `q.len()` elements, in one pass over `q`.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn score_keys<V: Lanes<L>, const L: usize, const R: usize>(q: &[f32], keys: [&[f16]; R]) -> [f32; R] {
    let (q_body, q_tail) = q.as_chunks::<L>();
    let keys = keys.map(|k| k.as_chunks::<L>());
    assert!(keys.iter().all(|(body, tail)| body.len() == q_body.len() && tail.len() == q_tail.len()));
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [V::splat(0.0); R];
        for (c, q) in q_body.iter().enumerate() {
            let q = V::load(q);
            for (acc, (body, _)) in acc.iter_mut().zip(&keys) {
                *acc = V::load_f16(&body[c]).mul_add(q, *acc);
            }
        }
        if !q_tail.is_empty() {
            let q = V::load(&pad(q_tail, 0.0));
            for (acc, (_, tail)) in acc.iter_mut().zip(&keys) {
                *acc = V::load_f16(&pad(tail, f16::ZERO)).mul_add(q, *acc);
            }
        }
        let mut sums = [0.0; R];
        for (s, a) in sums.iter_mut().zip(acc) {
            *s = a.sum();
        }
        sums
    }
}

/// Replaces each `x` by `exp(x − max)` and returns the sum of the results.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
pub(crate) unsafe fn softmax_exp<V: Lanes<L>, const L: usize>(x: &mut [f32], max: f32) -> f32 {
    let (body, tail) = x.as_chunks_mut::<L>();
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let max = V::splat(max);
        let mut sum = V::splat(0.0);
        for x in body {
            let e = exp(V::load(x).sub(max));
            e.store(x);
            sum = sum.add(e);
        }
        if !tail.is_empty() {
            // Padding with −∞ adds exp(−∞) = 0 to the sum.
            let mut padded = pad(tail, f32::NEG_INFINITY);
            let e = exp(V::load(&padded).sub(max));
            e.store(&mut padded);
            tail.copy_from_slice(&padded[..tail.len()]);
            sum = sum.add(e);
        }
        sum.sum()
    }
}

/// `eˣ` in every lane (see the module's numerics note).
///
/// The Cephes single-precision algorithm: `x = n·ln 2 + r` with `n` integral and
/// `|r| ≤ ln 2 / 2`, `eʳ` by a degree-7 polynomial, scaled by `2ⁿ`.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn exp<V: Lanes<L>, const L: usize>(x: V) -> V {
    const LOG2_E: f32 = core::f32::consts::LOG2_E;
    // ln 2 in two parts; the first has so few bits that n·LN2_HI is exact.
    const LN2_HI: f32 = 355.0 / 512.0;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5·2²³ rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // Cephes' coefficients of r⁷ down to r² (the last is ½ to f32 precision).
    const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        // Beyond these, eˣ overflows or 2ⁿ leaves the normal range (n = −127 gives 0).
        let x = x.max(V::splat(-88.0)).min(V::splat(88.0));
        let n = x.mul_add(V::splat(LOG2_E), V::splat(ROUND)).sub(V::splat(ROUND));
        let r = n.mul_add(V::splat(-LN2_HI), x);
        let r = n.mul_add(V::splat(-LN2_LO), r);
        let mut p = V::splat(P[0]);
        for c in &P[1..] {
            p = p.mul_add(r, V::splat(*c));
        }
        let e = p.mul_add(r.mul(r), r).add(V::splat(1.0));
        e.mul(n.exp2_int())
    }
}

/// `out += Σⱼ weights[j] · values[j]`, where `values` holds `weights.len()` rows of
/// `out.len()` elements.
///
/// The output is walked [`VALUE_COLUMNS`] vectors at a time; for each such strip every
/// row is added into registers, and the strip is stored once.
///
/// # Safety
/// As [`Lanes`]. `out` must not be empty and `values.len() == weights.len() * out.len()`.
#[inline(always)]
pub(crate) unsafe fn add_weighted<V: Lanes<L>, const L: usize>(weights: &[f32], values: &[f16], out: &mut [f32]) {
    let dim = out.len();
    let rows = || weights.iter().copied().zip(values.chunks_exact(dim));
    let (body, tail) = out.as_chunks_mut::<L>();
    let (strips, narrow) = body.as_chunks_mut::<VALUE_COLUMNS>();
    let mut col = 0;
    for strip in strips {
        // SAFETY: the caller's ISA guarantee is passed on.
        unsafe { add_weighted_strip::<V, L, VALUE_COLUMNS>(rows(), col, strip) };
        col += VALUE_COLUMNS * L;
    }
    for strip in narrow {
        // SAFETY: as above.
        unsafe { add_weighted_strip::<V, L, 1>(rows(), col, core::array::from_mut(strip)) };
        col += L;
    }
    if !tail.is_empty() {
        // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
        unsafe {
            let mut padded = pad(tail, 0.0);
            let mut acc = V::load(&padded);
            for (w, row) in rows() {
                acc = V::load_f16(&pad(&row[col..], f16::ZERO)).mul_add(V::splat(w), acc);
            }
            acc.store(&mut padded);
            tail.copy_from_slice(&padded[..tail.len()]);
        }
    }
}

/// `strip += Σ w · row[col..col + C·L]` over `(w, row)` pairs.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn add_weighted_strip<'a, V: Lanes<L>, const L: usize, const C: usize>(
    rows: impl Iterator<Item = (f32, &'a [f16])>,
    col: usize,
    strip: &mut [[f32; L]; C],
) {
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [V::splat(0.0); C];
        for (acc, o) in acc.iter_mut().zip(&*strip) {
            *acc = V::load(o);
        }
        for (w, row) in rows {
            let w = V::splat(w);
            let (values, _) = row[col..][..C * L].as_chunks::<L>();
            for (acc, v) in acc.iter_mut().zip(values) {
                *acc = V::load_f16(v).mul_add(w, *acc);
            }
        }
        for (acc, o) in acc.into_iter().zip(strip) {
            acc.store(o);
        }
    }
}

/// The portable table's entries.
pub(crate) mod portable {
    use super::*;

    /// Table entry: [`scores`](super::scores) (lengths checked by the caller).
    pub(crate) fn scores(q: &[f32], keys: &[f16], out: &mut [f32]) {
        // SAFETY: `Portable` uses no ISA-specific instructions.
        unsafe { super::scores::<Portable, 16>(q, keys, out) }
    }

    /// Table entry: [`softmax_exp`](super::softmax_exp).
    pub(crate) fn softmax_exp(x: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { super::softmax_exp::<Portable, 16>(x, max) }
    }

    /// Table entry: [`add_weighted`](super::add_weighted) (lengths checked by the caller).
    pub(crate) fn add_weighted(weights: &[f32], values: &[f16], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { super::add_weighted::<Portable, 16>(weights, values, out) }
    }
}
