//! Attention over an f16 key/value cache: the scores of a group of queries against a
//! run of keys, the softmax's exponentials, and the probability-weighted sums of a run
//! of values. A group is the query heads that share one KV head (grouped-query
//! attention): each key and value is read and widened once for all of them. And the
//! reader of the quantized cache's rows: affine codes back to the f16 numbers the
//! other kernels take.
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

use crate::dispatch::CodeRow;
use crate::formats::f16_to_f32;
use crate::formats::float32::fold;

/// Value rows walked per block: the block's rows stay in L1 while every strip of the
/// output passes over them, so each row is read from memory once.
const VALUE_BLOCK: usize = 32;

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
    /// The first `L` codes of `bits` bits (2, 4 or 8) packed lowest bits
    /// first in `packed` (at least `L · bits / 8` bytes), as f32.
    unsafe fn load_codes(packed: &[u8], bits: u32) -> Self;
    /// The lanes rounded to the nearest f16 (ties to even).
    unsafe fn store_f16(self, out: &mut [f16; L]);
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
    #[inline(always)]
    unsafe fn load_codes(packed: &[u8], bits: u32) -> Self {
        let mut out = [0.0; 16];
        for (j, o) in out.iter_mut().enumerate() {
            *o = f32::from(code(packed, j, bits));
        }
        Portable(out)
    }
    #[inline(always)]
    unsafe fn store_f16(self, out: &mut [f16; 16]) {
        for (o, &x) in out.iter_mut().zip(&self.0) {
            *o = f16::from_f32(x);
        }
    }
}

/// Code `j` of `bits` bits in `packed` (lowest bits first).
#[inline(always)]
pub(crate) fn code(packed: &[u8], j: usize, bits: u32) -> u8 {
    let bit = j * bits as usize;
    (packed[bit / 8] >> (bit % 8)) & ((1u16 << bits) - 1) as u8
}

/// `x` followed by `fill` up to `L` elements.
#[inline(always)]
fn pad<T: Copy, const L: usize>(x: &[T], fill: T) -> [T; L] {
    let mut out = [fill; L];
    out[..x.len()].copy_from_slice(x);
    out
}

/// Calls `$group::<V, L, G, W>(args)` while `$left` heads remain, on groups
/// of `G` = 4, 2 or 1 heads, with `W` (the keys or value vectors per pass)
/// chosen so that `G · W` accumulators fit the registers.
macro_rules! in_groups {
    ($left:expr, $group:ident::<$V:ident, $L:ident>($($arg:expr),*)) => {
        // SAFETY (every arm): the caller's ISA guarantee is passed on.
        loop {
            match $left {
                0 => break,
                1 => unsafe { $group::<$V, $L, 1, 4>($($arg),*) },
                2 | 3 => unsafe { $group::<$V, $L, 2, 4>($($arg),*) },
                _ => unsafe { $group::<$V, $L, 4, 2>($($arg),*) },
            }
        }
    };
}

/// `out[h · stride + j] = queries[h] · keys[j]` for each query `h` and key `j`, where
/// `queries` and `keys` hold rows of `dim` elements.
///
/// The queries are taken a group at a time (those of one KV head, in attention), so
/// that each key is loaded and widened once for the whole group.
///
/// # Safety
/// As [`Lanes`]. `dim > 0`; `queries.len()` and `keys.len()` are multiples of `dim`;
/// `stride ≥ keys.len() / dim` and `out` reaches the last query's last key.
#[inline(always)]
pub(crate) unsafe fn scores<V: Lanes<L>, const L: usize>(
    dim: usize,
    queries: &[f32],
    keys: &[f16],
    out: &mut [f32],
    stride: usize,
) {
    let n = keys.len() / dim;
    if n == 0 {
        return;
    }
    let mut queries = queries.chunks_exact(dim);
    let mut outs = out.chunks_mut(stride).map(|o| &mut o[..n]);
    in_groups!(queries.len(), score_group::<V, L>(&mut queries, keys, &mut outs));
}

/// The next `G` items of a group's rows; [`in_groups!`] leaves that many.
#[inline(always)]
fn next_group<T, const G: usize>(items: &mut impl Iterator<Item = T>) -> [T; G] {
    core::array::from_fn(|_| items.next().expect("a whole group is left"))
}

/// The scores of the next `G` queries against every key, `R` keys per pass.
///
/// # Safety
/// As [`Lanes`]; at least `G` queries and outputs are left.
#[inline(always)]
unsafe fn score_group<'a, V: Lanes<L>, const L: usize, const G: usize, const R: usize>(
    queries: &mut impl Iterator<Item = &'a [f32]>,
    keys: &[f16],
    outs: &mut impl Iterator<Item = &'a mut [f32]>,
) {
    let (qs, mut outs): ([&[f32]; G], [&mut [f32]; G]) = (next_group(queries), next_group(outs));
    let dim = qs[0].len();
    let n = outs[0].len();
    let mut j = 0;
    while j + R <= n {
        let rows = core::array::from_fn(|r| &keys[(j + r) * dim..][..dim]);
        // SAFETY: the caller's ISA guarantee is passed on.
        let sums = unsafe { score_keys::<V, L, G, R>(qs, rows) };
        for (out, sums) in outs.iter_mut().zip(sums) {
            out[j..j + R].copy_from_slice(&sums);
        }
        j += R;
    }
    for j in j..n {
        // SAFETY: as above.
        let sums = unsafe { score_keys::<V, L, G, 1>(qs, [&keys[j * dim..][..dim]]) };
        for (out, [s]) in outs.iter_mut().zip(sums) {
            out[j] = s;
        }
    }
}

/// `q · key` for each of `G` queries and `R` keys of `dim` elements, in one pass: each
/// (query, key) pair keeps its own accumulator, so the pass runs `G · R` independent
/// multiply-add chains, and every key vector is widened once.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn score_keys<V: Lanes<L>, const L: usize, const G: usize, const R: usize>(
    queries: [&[f32]; G],
    keys: [&[f16]; R],
) -> [[f32; R]; G] {
    let queries = queries.map(|q| q.as_chunks::<L>());
    let keys = keys.map(|k| k.as_chunks::<L>());
    let (chunks, tail) = (keys[0].0.len(), keys[0].1.len());
    assert!(queries.iter().all(|(body, rest)| body.len() == chunks && rest.len() == tail));
    assert!(keys.iter().all(|(body, rest)| body.len() == chunks && rest.len() == tail));
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [[V::splat(0.0); R]; G];
        for c in 0..chunks {
            let mut k = [V::splat(0.0); R];
            for (k, (body, _)) in k.iter_mut().zip(&keys) {
                *k = V::load_f16(&body[c]);
            }
            for (acc, (body, _)) in acc.iter_mut().zip(&queries) {
                let q = V::load(&body[c]);
                for (acc, k) in acc.iter_mut().zip(&k) {
                    *acc = k.mul_add(q, *acc);
                }
            }
        }
        if tail > 0 {
            let mut k = [V::splat(0.0); R];
            for (k, (_, rest)) in k.iter_mut().zip(&keys) {
                *k = V::load_f16(&pad(rest, f16::ZERO));
            }
            for (acc, (_, rest)) in acc.iter_mut().zip(&queries) {
                let q = V::load(&pad(rest, 0.0));
                for (acc, k) in acc.iter_mut().zip(&k) {
                    *acc = k.mul_add(q, *acc);
                }
            }
        }
        let mut sums = [[0.0; R]; G];
        for (sums, acc) in sums.iter_mut().zip(acc) {
            for (s, a) in sums.iter_mut().zip(acc) {
                *s = a.sum();
            }
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

/// `out[h] += Σⱼ weights[h · stride + j] · values[j]` for each output row `h`, where
/// `values` and `out` hold rows of `dim` elements.
///
/// The output rows are taken a group at a time (the query heads of one KV head, in
/// attention), so that each value vector is loaded and widened once for the group. The
/// rows are walked [`VALUE_BLOCK`] at a time, and each block strip by strip: a strip of
/// output vectors stays in registers while the block's rows are added into it. Every
/// output element still sums its rows in order.
///
/// # Safety
/// As [`Lanes`]. `dim > 0`; `values.len()` and `out.len()` are multiples of `dim`;
/// `stride ≥ values.len() / dim` and `weights` reaches the last row's last weight.
#[inline(always)]
pub(crate) unsafe fn add_weighted<V: Lanes<L>, const L: usize>(
    dim: usize,
    weights: &[f32],
    stride: usize,
    values: &[f16],
    out: &mut [f32],
) {
    let n = values.len() / dim;
    if n == 0 {
        return;
    }
    let mut weights = weights.chunks(stride).map(|w| &w[..n]);
    let mut outs = out.chunks_exact_mut(dim);
    in_groups!(outs.len(), add_weighted_group::<V, L>(&mut weights, values, &mut outs));
}

/// The weighted sums of the next `G` output rows, in strips of `C` vectors.
///
/// # Safety
/// As [`Lanes`]; at least `G` weight rows and outputs are left.
#[inline(always)]
unsafe fn add_weighted_group<'a, V: Lanes<L>, const L: usize, const G: usize, const C: usize>(
    weights: &mut impl Iterator<Item = &'a [f32]>,
    values: &[f16],
    outs: &mut impl Iterator<Item = &'a mut [f32]>,
) {
    let (weights, mut outs): ([&[f32]; G], [&mut [f32]; G]) = (next_group(weights), next_group(outs));
    let dim = outs[0].len();
    let n = weights[0].len();
    let (strips, narrow) = (dim / L / C, dim / L % C);
    for first in (0..n).step_by(VALUE_BLOCK) {
        let rows = first..n.min(first + VALUE_BLOCK);
        let block = &values[rows.start * dim..rows.end * dim];
        let block_weights = weights.map(|w| &w[rows.clone()]);
        let mut col = 0;
        for _ in 0..strips {
            // SAFETY: the caller's ISA guarantee is passed on.
            unsafe { add_weighted_strip::<V, L, G, C>(block_weights, block, col, &mut outs) };
            col += C * L;
        }
        for _ in 0..narrow {
            // SAFETY: as above.
            unsafe { add_weighted_strip::<V, L, G, 1>(block_weights, block, col, &mut outs) };
            col += L;
        }
        if col < dim {
            // SAFETY: as above.
            unsafe { add_weighted_tail::<V, L, G>(block_weights, block, col, &mut outs) };
        }
    }
}

/// `outs[h][col..col + C·L] += Σⱼ weights[h][j] · rows[j][col..col + C·L]`.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn add_weighted_strip<V: Lanes<L>, const L: usize, const G: usize, const C: usize>(
    weights: [&[f32]; G],
    rows: &[f16],
    col: usize,
    outs: &mut [&mut [f32]; G],
) {
    let dim = outs[0].len();
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [[V::splat(0.0); C]; G];
        for (acc, out) in acc.iter_mut().zip(&*outs) {
            let (strip, _) = out[col..][..C * L].as_chunks::<L>();
            for (acc, o) in acc.iter_mut().zip(strip) {
                *acc = V::load(o);
            }
        }
        for (j, row) in rows.chunks_exact(dim).enumerate() {
            let mut v = [V::splat(0.0); C];
            let (strip, _) = row[col..][..C * L].as_chunks::<L>();
            for (v, x) in v.iter_mut().zip(strip) {
                *v = V::load_f16(x);
            }
            for (acc, w) in acc.iter_mut().zip(&weights) {
                let w = V::splat(w[j]);
                for (acc, v) in acc.iter_mut().zip(&v) {
                    *acc = v.mul_add(w, *acc);
                }
            }
        }
        for (acc, out) in acc.into_iter().zip(outs.iter_mut()) {
            let (strip, _) = out[col..][..C * L].as_chunks_mut::<L>();
            for (acc, o) in acc.into_iter().zip(strip) {
                acc.store(o);
            }
        }
    }
}

/// [`add_weighted_strip`] for the last `dim − col < L` columns, through padded vectors.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn add_weighted_tail<V: Lanes<L>, const L: usize, const G: usize>(
    weights: [&[f32]; G],
    rows: &[f16],
    col: usize,
    outs: &mut [&mut [f32]; G],
) {
    let dim = outs[0].len();
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        for (out, w) in outs.iter_mut().zip(&weights) {
            let mut padded = pad(&out[col..], 0.0);
            let mut acc = V::load(&padded);
            for (row, &w) in rows.chunks_exact(dim).zip(*w) {
                acc = V::load_f16(&pad(&row[col..], f16::ZERO)).mul_add(V::splat(w), acc);
            }
            acc.store(&mut padded);
            out[col..].copy_from_slice(&padded[..dim - col]);
        }
    }
}

/// The f16 levels of one row of affine codes (the quantized KV cache's):
/// `out[j] = f16(min[j / group] + step[j / group] · (c_j · span + (span − 1)/2))`
/// with `c_j` the `j`-th code of `bits` bits in `codes`, or, given `fine`,
/// `16 · c_j + f_j` with `f_j` its 4-bit code there; `span` is `2^(8 − b)` for
/// codes of `b` bits in all (8 with `fine`). The product is exact in f32 and
/// the sum rounds once, then the f16 rounding: as `sift`'s scalar reader.
///
/// # Safety
/// As [`Lanes`]. `bits` is 2, 4 or 8 (4 with `fine`); `codes` (and `fine`)
/// hold at least `out.len()` codes; `group` is 1 or a multiple of `L`, and
/// `min` and `step` hold `out.len().div_ceil(group)` numbers.
#[inline(always)]
pub(crate) unsafe fn levels_f16<V: Lanes<L>, const L: usize>(row: &CodeRow, out: &mut [f16]) {
    let CodeRow { codes, bits, fine, group, min, step } = *row;
    let kept = if fine.is_some() { 8 } else { bits };
    let span = (1u32 << (8 - kept)) as f32;
    let half = (span - 1.0) / 2.0;
    for j in (0..out.len()).step_by(L) {
        // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
        unsafe {
            let mut c = code_lanes::<V, L>(codes, j, bits);
            if let Some(fine) = fine {
                c = c.mul(V::splat(16.0)).add(code_lanes::<V, L>(fine, j, 4));
            }
            let offset = c.mul(V::splat(span)).add(V::splat(half));
            let level = affine_lanes::<V, L>(min, j, group).add(affine_lanes::<V, L>(step, j, group).mul(offset));
            match out[j..].first_chunk_mut::<L>() {
                Some(o) => level.store_f16(o),
                None => {
                    let mut padded = [f16::ZERO; L];
                    level.store_f16(&mut padded);
                    let tail = &mut out[j..];
                    tail.copy_from_slice(&padded[..tail.len()]);
                }
            }
        }
    }
}

/// Codes `j..j + L` of `width` bits in `packed` as lanes (zeros past its end).
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn code_lanes<V: Lanes<L>, const L: usize>(packed: &[u8], j: usize, width: u32) -> V {
    let (at, len) = (j * width as usize / 8, L * width as usize / 8);
    let rest = &packed[at..];
    // SAFETY (both arms): the caller's ISA guarantee is passed on.
    if rest.len() >= len {
        unsafe { V::load_codes(rest, width) }
    } else {
        let bytes: [u8; 16] = pad(rest, 0);
        unsafe { V::load_codes(&bytes[..len], width) }
    }
}

/// The minima (or steps) of elements `j..j + L`, one per `group` elements
/// (zeros past the end of `x` when `group` is 1).
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn affine_lanes<V: Lanes<L>, const L: usize>(x: &[f32], j: usize, group: usize) -> V {
    // SAFETY: the caller's ISA guarantee is passed on.
    unsafe {
        if group == 1 {
            match x[j..].first_chunk::<L>() {
                Some(x) => V::load(x),
                None => V::load(&pad(&x[j..], 0.0)),
            }
        } else {
            V::splat(x[j / group])
        }
    }
}

/// The portable table's entries.
pub(crate) mod portable {
    use super::*;

    /// Table entry: [`scores`](super::scores) (lengths checked by the caller).
    pub(crate) fn scores(dim: usize, queries: &[f32], keys: &[f16], out: &mut [f32], stride: usize) {
        // SAFETY: `Portable` uses no ISA-specific instructions.
        unsafe { super::scores::<Portable, 16>(dim, queries, keys, out, stride) }
    }

    /// Table entry: [`softmax_exp`](super::softmax_exp).
    pub(crate) fn softmax_exp(x: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { super::softmax_exp::<Portable, 16>(x, max) }
    }

    /// Table entry: [`levels_f16`](super::levels_f16) (lengths checked by the caller).
    pub(crate) fn levels_f16(row: &CodeRow, out: &mut [f16]) {
        // SAFETY: as above.
        unsafe { super::levels_f16::<Portable, 16>(row, out) }
    }

    /// Table entry: [`add_weighted`](super::add_weighted) (lengths checked by the caller).
    pub(crate) fn add_weighted(dim: usize, weights: &[f32], stride: usize, values: &[f16], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { super::add_weighted::<Portable, 16>(dim, weights, stride, values, out) }
    }
}
