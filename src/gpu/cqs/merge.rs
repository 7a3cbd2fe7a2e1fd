//! The host-resident accumulator: pieces' (acc, m, l) recomposed in f32.
//!
//! A piece returns, per query and head, the unnormalised sum
//! `acc = Σ exp(s_j − m) v_j` over the keys it owns, their largest score `m`
//! and `l = Σ exp(s_j − m)`. Two such triples of one row merge with the max
//! shift: `m' = max(m₁, m₂)`, `acc' = acc₁·e^(m₁−m') + acc₂·e^(m₂−m')`, and
//! `l'` alike, so no exponent is positive and nothing overflows; the output is
//! `acc / l` once every piece is in. A piece in which a row sees no key
//! returns `l = 0` and is skipped, never merged as `exp(−∞ − (−∞))`.

use rayon::prelude::*;

/// (acc, m, l) per query and head of one call.
pub struct Accumulator {
    n_head: usize,
    head_dim: usize,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Accumulator {
    pub fn new(queries: usize, n_head: usize, head_dim: usize) -> Self {
        Self {
            n_head,
            head_dim,
            acc: vec![0.0; queries * n_head * head_dim],
            m: vec![f32::NEG_INFINITY; queries * n_head],
            l: vec![0.0; queries * n_head],
        }
    }

    /// Merges a piece whose row `r` is the call's query `rows[r]`: `acc` its
    /// unnormalised outputs `[rows][n_head][D]`, `stats` its (m, l) `[rows][n_head]`.
    pub fn merge(&mut self, rows: &[u32], acc: &[f32], stats: &[[f32; 2]]) {
        let (h, d) = (self.n_head, self.head_dim);
        let mut local = vec![u32::MAX; self.m.len() / h];
        for (r, &row) in rows.iter().enumerate() {
            local[row as usize] = r as u32;
        }
        self.acc.par_chunks_mut(h * d).zip(self.m.par_chunks_mut(h)).zip(self.l.par_chunks_mut(h)).zip(local).for_each(
            |(((acc_row, m_row), l_row), r)| {
                if r == u32::MAX {
                    return;
                }
                let r = r as usize;
                for head in 0..h {
                    let [m_piece, l_piece] = stats[r * h + head];
                    if l_piece == 0.0 {
                        continue;
                    }
                    let piece = &acc[(r * h + head) * d..][..d];
                    let out = &mut acc_row[head * d..][..d];
                    let m_new = m_row[head].max(m_piece);
                    let (old, new) = ((m_row[head] - m_new).exp(), (m_piece - m_new).exp());
                    for (o, p) in out.iter_mut().zip(piece) {
                        *o = *o * old + p * new;
                    }
                    l_row[head] = l_row[head] * old + l_piece * new;
                    m_row[head] = m_new;
                }
            },
        );
    }

    /// The normalised outputs `[queries][n_head][D]` into `out`; a row no
    /// piece gave a key is zero.
    pub fn finish(&self, out: &mut [f32]) {
        let d = self.head_dim;
        out.par_chunks_mut(d).zip(self.acc.par_chunks(d)).zip(&self.l).for_each(|((o, acc), &l)| {
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for (o, a) in o.iter_mut().zip(acc) {
                *o = a * inv;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::Accumulator;

    /// Softmax attention of one row over scores `s` and values `v` (one
    /// dimension), in f64.
    fn exact(s: &[f64], v: &[f64]) -> f64 {
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        w.iter().zip(v).map(|(w, v)| w * v).sum::<f64>() / w.iter().sum::<f64>()
    }

    /// The triple a piece returns for keys `s`, `v` (none: l = 0).
    fn piece(s: &[f64], v: &[f64]) -> ([f32; 2], f32) {
        if s.is_empty() {
            return ([-3.0e38, 0.0], 0.0);
        }
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let acc: f64 = s.iter().zip(v).map(|(s, v)| (s - m).exp() * v).sum();
        let l: f64 = s.iter().map(|s| (s - m).exp()).sum();
        ([m as f32, l as f32], acc as f32)
    }

    /// Pieces with far-apart maxima (scores of ±80, which overflow f32's exp
    /// unshifted) and an empty piece merge to the exact softmax, without NaN.
    #[test]
    fn merging_shifted_pieces_is_exact_and_empty_ones_add_nothing() {
        let s = [80.0, -80.0, 79.0, 3.0, -2.0];
        let v = [1.0, -2.0, 0.5, 4.0, -1.0];
        let parts: [&[usize]; 4] = [&[1], &[], &[0, 3], &[2, 4]];
        let mut acc = Accumulator::new(1, 1, 1);
        for part in parts {
            let (ps, pv): (Vec<f64>, Vec<f64>) = part.iter().map(|&j| (s[j], v[j])).unzip();
            let (stats, a) = piece(&ps, &pv);
            acc.merge(&[0], &[a], &[stats]);
        }
        let mut out = [f32::NAN];
        acc.finish(&mut out);
        let want = exact(&s, &v);
        assert!(((out[0] as f64 - want) / want).abs() < 1e-6, "{} against {want}", out[0]);
    }
}
