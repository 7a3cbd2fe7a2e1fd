//! Attention over an f16 key/value cache: the scores of a group of queries against a
//! run of keys, the softmax's exponentials, and the probability-weighted sums of a run
//! of values. A group is the query heads that share one KV head (grouped-query
//! attention): each key and value is read and widened once for all of them.
//!
//! The rows come from a [`RowSource`]: f16 rows, or the quantized cache's affine
//! codes ([`CodeRows`]), read as their levels in f32 lanes where the kernels load
//! them, so that a decoding step reads the codes in place. [`levels_f16`] writes the
//! same levels out as f16, for a batch that stages them once for many queries.
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

use crate::dispatch::CodeRows;
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
    /// The first `L` 8-bit codes whose top 4 bits are 4-bit codes in `coarse` and
    /// whose low 4 are those in `fine` (packed as for `load_codes`), as f32.
    unsafe fn load_split_codes(coarse: &[u8], fine: &[u8]) -> Self;
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
    unsafe fn load_split_codes(coarse: &[u8], fine: &[u8]) -> Self {
        let mut out = [0.0; 16];
        for (j, o) in out.iter_mut().enumerate() {
            *o = f32::from(code(coarse, j, 4) << 4 | code(fine, j, 4));
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

/// Rows of numbers the kernels read `L` at a time: the cache's f16 rows, or its affine
/// codes as their levels. Each kernel is written once over it.
pub(crate) trait RowSource: Copy {
    /// One row's reader.
    type Row: LaneRow;
    /// Numbers per row.
    fn dim(&self) -> usize;
    /// Rows held.
    fn rows(&self) -> usize;
    /// Row `r`, below [`RowSource::rows`].
    fn row(&self, r: usize) -> Self::Row;
}

/// One row of a [`RowSource`].
pub(crate) trait LaneRow: Copy {
    /// Numbers `j..j + L` of the row as lanes; the row holds them all.
    ///
    /// # Safety
    /// As [`Lanes`].
    unsafe fn lanes<V: Lanes<L>, const L: usize>(self, j: usize) -> V;

    /// The row's last numbers, from `j` on (fewer than `L`), as lanes with zeros after
    /// them. Apart from the kernels' loops, so that those load whole vectors only.
    ///
    /// # Safety
    /// As [`Lanes`].
    unsafe fn tail<V: Lanes<L>, const L: usize>(self, j: usize) -> V;

    /// Asks the caches for the bytes that hold numbers `j..j + n` of the row (a
    /// hint: nothing is read).
    fn prefetch(self, j: usize, n: usize);
}

/// Rows ahead of the one they read that the kernels prefetch.
const AHEAD: usize = 8;

/// Bytes between prefetches: a cache line.
const PREFETCH_STRIDE: usize = 64;

/// Asks the L2 cache for every line of `x`, which a kernel reads soon: the
/// hardware prefetchers stop at each 4 KiB page, so a stream of rows from
/// memory would otherwise wait on most of them. Into the L2, not the L1: the
/// weighted sums keep a block of rows in the L1 while the next one arrives.
/// (Rows read one by one at scattered places, as a sparse policy reads
/// them, wait on every line without it.)
#[inline(always)]
pub fn prefetch<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let start = x.as_ptr().cast::<i8>();
        for at in (0..core::mem::size_of_val(x)).step_by(PREFETCH_STRIDE) {
            // SAFETY: a prefetch reads nothing and cannot fault; the address lies in `x`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(start.add(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Rows of `dim` halves, end to end.
#[derive(Clone, Copy)]
pub(crate) struct HalfRows<'a> {
    pub(crate) dim: usize,
    pub(crate) halves: &'a [f16],
}

impl<'a> RowSource for HalfRows<'a> {
    type Row = &'a [f16];

    fn dim(&self) -> usize {
        self.dim
    }

    fn rows(&self) -> usize {
        self.halves.len() / self.dim
    }

    #[inline(always)]
    fn row(&self, r: usize) -> &'a [f16] {
        &self.halves[r * self.dim..][..self.dim]
    }
}

impl LaneRow for &[f16] {
    #[inline(always)]
    unsafe fn lanes<V: Lanes<L>, const L: usize>(self, j: usize) -> V {
        // SAFETY: the caller's ISA guarantee is passed on.
        unsafe { V::load_f16(whole(&self[j..])) }
    }

    #[inline(always)]
    unsafe fn tail<V: Lanes<L>, const L: usize>(self, j: usize) -> V {
        // SAFETY: the caller's ISA guarantee is passed on.
        unsafe { V::load_f16(&pad(&self[j..], f16::ZERO)) }
    }

    #[inline(always)]
    fn prefetch(self, j: usize, n: usize) {
        prefetch(&self[j..j + n]);
    }
}

/// The first `L` items of `x`, which has them.
#[inline(always)]
fn whole<T, const L: usize>(x: &[T]) -> &[T; L] {
    x.first_chunk::<L>().expect("a whole vector is left")
}

/// [`CodeRows`] of one format, fixed at compile time so that the kernels' loops test
/// none of it: codes of `BITS` bits, `FINE` codes beside them or not, minima and
/// steps `SHARED` by every row (group 1) or each row's own.
#[derive(Clone, Copy)]
pub(crate) struct Coded<'a, const BITS: u32, const FINE: bool, const SHARED: bool>(CodeRows<'a>);

/// Evaluates `$body` with `$coded` the [`Coded`] rows of `$rows`'s format.
macro_rules! with_format {
    ($rows:expr, |$coded:ident| $body:expr) => {
        with_format!($rows, $coded, $body, [
            (2, false, true), (2, false, false), (4, false, true), (4, false, false),
            (4, true, true), (4, true, false), (8, false, true), (8, false, false)
        ])
    };
    ($rows:expr, $coded:ident, $body:expr, [$(($bits:literal, $fine:literal, $shared:literal)),*]) => {{
        let rows: CodeRows = *$rows;
        match (rows.bits, rows.fine.is_some(), rows.group == 1) {
            $(($bits, $fine, $shared) => {
                let $coded = Coded::<$bits, $fine, $shared>(rows);
                $body
            })*
            _ => unreachable!("the table's caller checks the format"),
        }
    }};
}

/// One row of [`Coded`] rows, with its own minima and steps.
#[derive(Clone, Copy)]
pub(crate) struct CodeRow<'a, const BITS: u32, const FINE: bool, const SHARED: bool> {
    dim: usize,
    codes: &'a [u8],
    /// Empty without `FINE`.
    fine: &'a [u8],
    /// The group is `2^shift` elements (unless `SHARED`).
    shift: u32,
    min: &'a [f32],
    step: &'a [f32],
}

impl<'a, const BITS: u32, const FINE: bool, const SHARED: bool> RowSource for Coded<'a, BITS, FINE, SHARED> {
    type Row = CodeRow<'a, BITS, FINE, SHARED>;

    fn dim(&self) -> usize {
        self.0.dim
    }

    fn rows(&self) -> usize {
        self.0.codes.len() / self.0.row_bytes()
    }

    #[inline(always)]
    fn row(&self, r: usize) -> Self::Row {
        let CodeRows { dim, codes, fine, group, min, step, .. } = self.0;
        let affine = |x: &'a [f32]| if SHARED { x } else { per_row(x, r, dim.div_ceil(group)) };
        CodeRow {
            dim,
            codes: per_row(codes, r, (dim * BITS as usize).div_ceil(8)),
            fine: if FINE { per_row(fine.unwrap_or_default(), r, dim.div_ceil(2)) } else { &[] },
            shift: group.trailing_zeros(),
            min: affine(min),
            step: affine(step),
        }
    }
}

/// Row `r` of rows of `len` items.
#[inline(always)]
fn per_row<T>(x: &[T], r: usize, len: usize) -> &[T] {
    &x[r * len..][..len]
}

impl<const BITS: u32, const FINE: bool, const SHARED: bool> CodeRow<'_, BITS, FINE, SHARED> {
    /// The levels `min + step · (c · span + (span − 1)/2)` of codes `c` (all 8 bits
    /// with `FINE`) in one multiply-add: the product is exact (an f16 step by at most 9
    /// significant bits), so the sum rounds once, as in `sift`'s scalar reader.
    ///
    /// # Safety
    /// As [`Lanes`].
    #[inline(always)]
    unsafe fn levels<V: Lanes<L>, const L: usize>(c: V, min: V, step: V) -> V {
        // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
        unsafe {
            let offset = if FINE || BITS == 8 {
                c
            } else {
                let span = (1u32 << (8 - BITS)) as f32;
                c.mul_add(V::splat(span), V::splat((span - 1.0) / 2.0))
            };
            step.mul_add(offset, min)
        }
    }
}

impl<const BITS: u32, const FINE: bool, const SHARED: bool> LaneRow for CodeRow<'_, BITS, FINE, SHARED> {
    #[inline(always)]
    unsafe fn lanes<V: Lanes<L>, const L: usize>(self, j: usize) -> V {
        // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
        unsafe {
            let c = if FINE {
                V::load_split_codes(&self.codes[j / 2..], &self.fine[j / 2..])
            } else {
                V::load_codes(&self.codes[j * BITS as usize / 8..], BITS)
            };
            let (min, step) = if SHARED {
                (V::load(whole(&self.min[j..])), V::load(whole(&self.step[j..])))
            } else {
                let g = j >> self.shift;
                (V::splat(self.min[g]), V::splat(self.step[g]))
            };
            Self::levels(c, min, step)
        }
    }

    /// Past the row's end the minima and steps are zeros, and so are the levels.
    #[inline(always)]
    unsafe fn tail<V: Lanes<L>, const L: usize>(self, j: usize) -> V {
        // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
        unsafe {
            let mut c = code_lanes::<V, L>(self.codes, j, BITS);
            if FINE {
                c = c.mul_add(V::splat(16.0), code_lanes::<V, L>(self.fine, j, 4));
            }
            let (min, step) = if SHARED {
                (V::load(&pad(&self.min[j..], 0.0)), V::load(&pad(&self.step[j..], 0.0)))
            } else {
                let (g, n) = (j >> self.shift, self.dim - j);
                (V::load(&pad(&[self.min[g]; L][..n], 0.0)), V::load(&pad(&[self.step[g]; L][..n], 0.0)))
            };
            Self::levels(c, min, step)
        }
    }

    #[inline(always)]
    fn prefetch(self, j: usize, n: usize) {
        prefetch(&self.codes[j * BITS as usize / 8..(j + n) * BITS as usize / 8]);
        if FINE {
            prefetch(&self.fine[j / 2..(j + n) / 2]);
        }
    }
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
/// `queries` holds rows as long as the keys'.
///
/// The queries are taken a group at a time (those of one KV head, in attention), so
/// that each key is loaded and widened once for the whole group.
///
/// # Safety
/// As [`Lanes`]. `queries.len()` is a multiple of `keys.dim() > 0`; `stride ≥
/// keys.rows()` and `out` reaches the last query's last key.
#[inline(always)]
pub(crate) unsafe fn scores<V: Lanes<L>, const L: usize>(
    queries: &[f32],
    keys: impl RowSource,
    out: &mut [f32],
    stride: usize,
) {
    let n = keys.rows();
    if n == 0 {
        return;
    }
    let mut queries = queries.chunks_exact(keys.dim());
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
    keys: impl RowSource,
    outs: &mut impl Iterator<Item = &'a mut [f32]>,
) {
    let (qs, mut outs): ([&[f32]; G], [&mut [f32]; G]) = (next_group(queries), next_group(outs));
    let (n, dim) = (outs[0].len(), keys.dim());
    let mut j = 0;
    while j + R <= n {
        for ahead in j + AHEAD..n.min(j + AHEAD + R) {
            keys.row(ahead).prefetch(0, dim);
        }
        let rows = core::array::from_fn(|r| keys.row(j + r));
        // SAFETY: the caller's ISA guarantee is passed on.
        let sums = unsafe { score_keys::<V, L, G, R>(qs, rows) };
        for (out, sums) in outs.iter_mut().zip(sums) {
            out[j..j + R].copy_from_slice(&sums);
        }
        j += R;
    }
    for j in j..n {
        // SAFETY: as above.
        let sums = unsafe { score_keys::<V, L, G, 1>(qs, [keys.row(j)]) };
        for (out, [s]) in outs.iter_mut().zip(sums) {
            out[j] = s;
        }
    }
}

/// `q · key` for each of `G` queries and `R` keys as long as the queries, in one pass:
/// each (query, key) pair keeps its own accumulator, so the pass runs `G · R`
/// independent multiply-add chains, and every key vector is loaded once.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn score_keys<V: Lanes<L>, const L: usize, const G: usize, const R: usize>(
    queries: [&[f32]; G],
    keys: [impl LaneRow; R],
) -> [[f32; R]; G] {
    let queries = queries.map(|q| q.as_chunks::<L>());
    let (chunks, tail) = (queries[0].0.len(), queries[0].1.len());
    assert!(queries.iter().all(|(body, rest)| body.len() == chunks && rest.len() == tail));
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [[V::splat(0.0); R]; G];
        for c in 0..chunks {
            let mut k = [V::splat(0.0); R];
            for (k, row) in k.iter_mut().zip(keys) {
                *k = row.lanes(c * L);
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
            for (k, row) in k.iter_mut().zip(keys) {
                *k = row.tail(chunks * L);
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
/// `out` holds rows as long as the values'.
///
/// The output rows are taken a group at a time (the query heads of one KV head, in
/// attention), so that each value vector is loaded once for the group. The rows are
/// walked [`VALUE_BLOCK`] at a time, and each block strip by strip: a strip of output
/// vectors stays in registers while the block's rows are added into it. Every output
/// element still sums its rows in order.
///
/// # Safety
/// As [`Lanes`]. `out.len()` is a multiple of `values.dim() > 0`; `stride ≥
/// values.rows()` and `weights` reaches the last row's last weight.
#[inline(always)]
pub(crate) unsafe fn add_weighted<V: Lanes<L>, const L: usize>(
    weights: &[f32],
    stride: usize,
    values: impl RowSource,
    out: &mut [f32],
) {
    let n = values.rows();
    if n == 0 {
        return;
    }
    let mut weights = weights.chunks(stride).map(|w| &w[..n]);
    let mut outs = out.chunks_exact_mut(values.dim());
    in_groups!(outs.len(), add_weighted_group::<V, L>(&mut weights, values, &mut outs));
}

/// The weighted sums of the next `G` output rows, in strips of `C` vectors.
///
/// # Safety
/// As [`Lanes`]; at least `G` weight rows and outputs are left.
#[inline(always)]
unsafe fn add_weighted_group<'a, V: Lanes<L>, const L: usize, const G: usize, const C: usize>(
    weights: &mut impl Iterator<Item = &'a [f32]>,
    values: impl RowSource,
    outs: &mut impl Iterator<Item = &'a mut [f32]>,
) {
    let (weights, mut outs): ([&[f32]; G], [&mut [f32]; G]) = (next_group(weights), next_group(outs));
    let dim = outs[0].len();
    let n = weights[0].len();
    let (strips, narrow) = (dim / L / C, dim / L % C);
    for first in (0..n).step_by(VALUE_BLOCK) {
        let rows = first..n.min(first + VALUE_BLOCK);
        let block_weights = weights.map(|w| &w[rows.clone()]);
        // The next block's rows are asked for while this one is in the caches, a
        // few before each strip.
        let mut next = rows.end..n.min(rows.end + VALUE_BLOCK);
        let per_strip = VALUE_BLOCK.div_ceil(strips.max(1));
        let mut col = 0;
        for _ in 0..strips {
            for r in next.by_ref().take(per_strip) {
                values.row(r).prefetch(0, dim);
            }
            // SAFETY: the caller's ISA guarantee is passed on.
            unsafe { add_weighted_strip::<V, L, G, C>(block_weights, values, first, col, &mut outs) };
            col += C * L;
        }
        for r in next {
            values.row(r).prefetch(0, dim);
        }
        for _ in 0..narrow {
            // SAFETY: as above.
            unsafe { add_weighted_strip::<V, L, G, 1>(block_weights, values, first, col, &mut outs) };
            col += L;
        }
        if col < dim {
            // SAFETY: as above.
            unsafe { add_weighted_tail::<V, L, G>(block_weights, values, first, col, &mut outs) };
        }
    }
}

/// `outs[h][col..col + C·L] += Σⱼ weights[h][j] · values[first + j][col..col + C·L]`.
///
/// # Safety
/// As [`Lanes`].
#[inline(always)]
unsafe fn add_weighted_strip<V: Lanes<L>, const L: usize, const G: usize, const C: usize>(
    weights: [&[f32]; G],
    values: impl RowSource,
    first: usize,
    col: usize,
    outs: &mut [&mut [f32]; G],
) {
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        let mut acc = [[V::splat(0.0); C]; G];
        for (acc, out) in acc.iter_mut().zip(&*outs) {
            let (strip, _) = out[col..][..C * L].as_chunks::<L>();
            for (acc, o) in acc.iter_mut().zip(strip) {
                *acc = V::load(o);
            }
        }
        for j in 0..weights[0].len() {
            let row = values.row(first + j);
            let mut v = [V::splat(0.0); C];
            for (i, v) in v.iter_mut().enumerate() {
                *v = row.lanes(col + i * L);
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
    values: impl RowSource,
    first: usize,
    col: usize,
    outs: &mut [&mut [f32]; G],
) {
    let dim = outs[0].len();
    // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
    unsafe {
        for (out, w) in outs.iter_mut().zip(&weights) {
            let mut padded = pad(&out[col..], 0.0);
            let mut acc = V::load(&padded);
            for (j, &w) in w.iter().enumerate() {
                acc = values.row(first + j).tail::<V, L>(col).mul_add(V::splat(w), acc);
            }
            acc.store(&mut padded);
            out[col..].copy_from_slice(&padded[..dim - col]);
        }
    }
}

/// [`scores`] of the levels of [`CodeRows`] (see [`LaneRow::lanes`] of a [`CodeRow`]).
///
/// # Safety
/// As [`scores`]; `keys` describes whole rows (as `Kernels::scores_coded` checks).
#[inline(always)]
pub(crate) unsafe fn scores_coded<V: Lanes<L>, const L: usize>(
    queries: &[f32],
    keys: &CodeRows,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's guarantees are passed on.
    with_format!(keys, |keys| unsafe { scores::<V, L>(queries, keys, out, stride) })
}

/// [`add_weighted`] of the levels of [`CodeRows`], as [`scores_coded`] reads them.
///
/// # Safety
/// As [`add_weighted`]; `values` describes whole rows (as `Kernels::add_weighted_coded`
/// checks).
#[inline(always)]
pub(crate) unsafe fn add_weighted_coded<V: Lanes<L>, const L: usize>(
    weights: &[f32],
    stride: usize,
    values: &CodeRows,
    out: &mut [f32],
) {
    // SAFETY: the caller's guarantees are passed on.
    with_format!(values, |values| unsafe { add_weighted::<V, L>(weights, stride, values, out) })
}

/// The levels of [`CodeRows`] (see [`LaneRow::lanes`] of a [`CodeRow`]) rounded to
/// f16, row after row.
///
/// # Safety
/// As [`Lanes`]. `rows` describes whole rows (as `Kernels::levels_f16` checks) and `out`
/// holds as many.
#[inline(always)]
pub(crate) unsafe fn levels_f16<V: Lanes<L>, const L: usize>(rows: &CodeRows, out: &mut [f16]) {
    // SAFETY: the caller's guarantees are passed on.
    with_format!(rows, |rows| unsafe { store_levels::<V, L>(rows, out) })
}

/// [`levels_f16`] of one format.
///
/// # Safety
/// As [`levels_f16`].
#[inline(always)]
unsafe fn store_levels<V: Lanes<L>, const L: usize>(rows: impl RowSource, out: &mut [f16]) {
    for (r, out) in out.chunks_exact_mut(rows.dim()).enumerate() {
        let row = rows.row(r);
        for j in (0..out.len()).step_by(L) {
            // SAFETY: the caller's ISA guarantee covers every `Lanes` call below.
            unsafe {
                match out[j..].first_chunk_mut::<L>() {
                    Some(o) => row.lanes::<V, L>(j).store_f16(o),
                    None => {
                        let mut padded = [f16::ZERO; L];
                        row.tail::<V, L>(j).store_f16(&mut padded);
                        let tail = &mut out[j..];
                        tail.copy_from_slice(&padded[..tail.len()]);
                    }
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

/// The portable table's entries.
/// `sum[d] += w · v[d]` in f64, as [`Kernels::add_scaled_f64`](crate::Kernels::add_scaled_f64)
/// says: plain loops, vectorized for whatever features the caller's entry enables,
/// with every operation the same.
#[inline(always)]
pub(crate) fn add_scaled_f64(w: f64, v: &[f32], sum: &mut [f64]) {
    for (s, &x) in sum.iter_mut().zip(v) {
        *s += w * f64::from(x);
    }
}

/// `‖v‖²` in f64, in eight partial sums, as
/// [`Kernels::squared_norm_f64`](crate::Kernels::squared_norm_f64) says.
#[inline(always)]
pub(crate) fn squared_norm_f64(v: &[f32]) -> f64 {
    let mut sums = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (sum, &x) in sums.iter_mut().zip(chunk) {
            *sum += f64::from(x) * f64::from(x);
        }
    }
    for (sum, &x) in sums.iter_mut().zip(rest) {
        *sum += f64::from(x) * f64::from(x);
    }
    sums.iter().sum()
}

pub(crate) mod portable {
    use super::*;

    pub(crate) use super::{add_scaled_f64, squared_norm_f64};

    /// Table entry: [`scores`](super::scores) of f16 keys (lengths checked by the
    /// caller).
    pub(crate) fn scores(dim: usize, queries: &[f32], keys: &[f16], out: &mut [f32], stride: usize) {
        // SAFETY: `Portable` uses no ISA-specific instructions.
        unsafe { super::scores::<Portable, 16>(queries, HalfRows { dim, halves: keys }, out, stride) }
    }

    /// Table entry: [`scores`](super::scores) of coded keys (lengths checked by the
    /// caller).
    pub(crate) fn scores_coded(queries: &[f32], keys: &CodeRows, out: &mut [f32], stride: usize) {
        // SAFETY: as above.
        unsafe { super::scores_coded::<Portable, 16>(queries, keys, out, stride) }
    }

    /// Table entry: [`softmax_exp`](super::softmax_exp).
    pub(crate) fn softmax_exp(x: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { super::softmax_exp::<Portable, 16>(x, max) }
    }

    /// Table entry: [`levels_f16`](super::levels_f16) (lengths checked by the caller).
    pub(crate) fn levels_f16(rows: &CodeRows, out: &mut [f16]) {
        // SAFETY: as above.
        unsafe { super::levels_f16::<Portable, 16>(rows, out) }
    }

    /// Table entry: [`add_weighted`](super::add_weighted) of f16 values (lengths
    /// checked by the caller).
    pub(crate) fn add_weighted(dim: usize, weights: &[f32], stride: usize, values: &[f16], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { super::add_weighted::<Portable, 16>(weights, stride, HalfRows { dim, halves: values }, out) }
    }

    /// Table entry: [`add_weighted`](super::add_weighted) of coded values (lengths
    /// checked by the caller).
    pub(crate) fn add_weighted_coded(weights: &[f32], stride: usize, values: &CodeRows, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { super::add_weighted_coded::<Portable, 16>(weights, stride, values, out) }
    }
}
