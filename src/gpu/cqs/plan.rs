//! The decomposition: which tokens a piece gathers, which of their pairs it
//! owns, and the per-block summaries that classify its score tiles.
//!
//! A piece of `L` tokens is cut into [`CHUNKS`] contiguous chunks of near-equal
//! size (the last `L mod 7` one token longer). Sub-piece `i` gathers chunks
//! `i, i + 1, i + 3 (mod 7)` in ascending order, so its local order is the
//! global one and a causal mask on positions holds inside it. The differences
//! of `{0, 1, 3}` modulo 7 are every non-zero residue once, so each pair of
//! distinct chunks meets in exactly one sub-piece; each chunk's own diagonal
//! block appears in three, and only sub-piece `i` keeps chunk `i`'s. That is
//! the group rule: at depth `d` the tokens of chunk `i + 1` carry bit `2d`, those
//! of chunk `i + 3` bit `2d + 1`, and a pair is kept when its two tokens share no
//! bit. Bits are inherited, so a deeper piece keeps a pair only when every
//! coarser piece did, and every query–key pair of the whole call is kept by
//! exactly one leaf piece, whatever depths the leaves reached.
//!
//! A [`Block`] summarises 16 consecutive tokens of a piece: their first and last
//! positions and the OR and AND of their group bits. Two blocks' summaries
//! decide a tile ([`Verdict`]) without looking at its pairs: fully masked when a
//! bit is common to every token of both or causality (or the window) excludes
//! every pair; clear when no bit of one block appears in the other and every
//! pair is causal (and in the window); mixed otherwise. The verdict errs only
//! towards mixed, which the kernel resolves pair by pair.

/// Chunks a piece is cut into.
pub const CHUNKS: usize = 7;
/// The difference set: sub-piece `i` gathers chunks `i + x (mod 7)` for `x` in it.
pub const QUORUM: [usize; 3] = [0, 1, 3];
/// Tokens one block summary covers: the kernel's query and key tile.
pub const BLOCK: usize = 16;
/// Two group bits per depth in a `u32`.
pub const MAX_DEPTH: u32 = 16;

/// The tokens one piece gathers, by position ascending, with their group bits.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    pub positions: Vec<u32>,
    pub groups: Vec<u32>,
    /// Splits from the whole call: 0 for the call itself.
    pub depth: u32,
}

impl Piece {
    /// The whole call: positions `0..n`, every pair kept.
    pub fn whole(n: usize) -> Self {
        Self { positions: (0..n as u32).collect(), groups: vec![0; n], depth: 0 }
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The seven pieces one level deeper, empty ones left out (a piece of
    /// fewer than seven tokens has empty chunks); `None` past [`MAX_DEPTH`].
    pub fn split(&self) -> Option<Vec<Piece>> {
        if self.depth >= MAX_DEPTH {
            return None;
        }
        let bounds = chunk_bounds(self.len());
        let (own_bit, other_bit) = (1u32 << (2 * self.depth), 1u32 << (2 * self.depth + 1));
        let pieces = (0..CHUNKS)
            .map(|i| {
                let mut chunks = QUORUM.map(|x| (i + x) % CHUNKS);
                chunks.sort_unstable();
                let mut piece = Piece { positions: Vec::new(), groups: Vec::new(), depth: self.depth + 1 };
                for c in chunks {
                    let bit = match (c + CHUNKS - i) % CHUNKS {
                        1 => own_bit,
                        3 => other_bit,
                        _ => 0,
                    };
                    piece.positions.extend_from_slice(&self.positions[bounds[c]..bounds[c + 1]]);
                    piece.groups.extend(self.groups[bounds[c]..bounds[c + 1]].iter().map(|g| g | bit));
                }
                piece
            })
            .filter(|p| !p.is_empty())
            .collect();
        Some(pieces)
    }

    /// Index of the first token at or after `pos0`: the piece's queries are
    /// its tokens from there on (positions ascend).
    pub fn first_query(&self, pos0: u32) -> usize {
        self.positions.partition_point(|&p| p < pos0)
    }

    /// Summaries of the blocks of `rows` (a range of this piece's tokens), one
    /// per [`BLOCK`] tokens, the last possibly shorter.
    pub fn blocks(&self, rows: std::ops::Range<usize>) -> Vec<Block> {
        let (positions, groups) = (&self.positions[rows.clone()], &self.groups[rows]);
        positions
            .chunks(BLOCK)
            .zip(groups.chunks(BLOCK))
            .map(|(p, g)| Block {
                first: p[0],
                last: p[p.len() - 1],
                any: g.iter().fold(0, |a, b| a | b),
                all: g.iter().fold(u32::MAX, |a, b| a & b),
            })
            .collect()
    }
}

/// Where each of the seven chunks of `len` tokens begins (and, last, `len`):
/// near-equal, the last `len mod 7` chunks one token longer.
pub fn chunk_bounds(len: usize) -> [usize; CHUNKS + 1] {
    let (size, longer) = (len / CHUNKS, len % CHUNKS);
    let mut bounds = [0; CHUNKS + 1];
    for c in 0..CHUNKS {
        bounds[c + 1] = bounds[c] + size + usize::from(c >= CHUNKS - longer);
    }
    bounds
}

/// The summary of a run of consecutive tokens of a piece (the layout of the
/// kernel's `Block`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Block {
    /// Position of the first token and of the last.
    pub first: u32,
    pub last: u32,
    /// OR of the tokens' group bits, and AND.
    pub any: u32,
    pub all: u32,
}

/// How the pairs of a query block and a key block are masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every pair is kept: no per-pair test.
    Clear,
    /// No pair is kept: the tile is skipped.
    Masked,
    /// Some may be: tested pair by pair.
    Mixed,
}

/// Which pairs a call keeps besides the group rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask {
    /// A query sees keys at its position or before.
    pub causal: bool,
    /// A causal query sees only keys fewer than this many positions back.
    pub window: Option<u32>,
}

impl Mask {
    /// Whether a query at `t` with groups `tg` sees a key at `p` with groups `pg`.
    pub fn keeps(&self, t: u32, tg: u32, p: u32, pg: u32) -> bool {
        tg & pg == 0 && (!self.causal || p <= t) && self.window.is_none_or(|w| t - p < w)
    }

    /// The verdict on the tile of queries `q` against keys `k` (the rule the
    /// kernel's `classify` applies).
    pub fn classify(&self, q: &Block, k: &Block) -> Verdict {
        let window = self.window.unwrap_or(0);
        let masked = q.all & k.all != 0
            || (self.causal && k.first > q.last)
            || (window != 0 && q.first >= k.last.saturating_add(window));
        let clear =
            q.any & k.any == 0 && (!self.causal || k.last <= q.first) && (window == 0 || q.last - k.first < window);
        match (masked, clear) {
            (true, _) => Verdict::Masked,
            (false, true) => Verdict::Clear,
            (false, false) => Verdict::Mixed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leaves of `depth` levels below the whole call of `n` tokens.
    fn leaves(n: usize, depth: u32) -> Vec<Piece> {
        let mut pieces = vec![Piece::whole(n)];
        for _ in 0..depth {
            pieces = pieces.iter().flat_map(|p| p.split().unwrap()).collect();
        }
        pieces
    }

    /// Every (query, key) pair of the call is kept by exactly one leaf, with
    /// positions ascending inside each, at depths 1 to 3 and lengths that are
    /// and are not multiples of 7 (some below 7, so chunks are empty).
    #[test]
    fn every_pair_is_kept_exactly_once() {
        for n in [1, 5, 7, 13, 49, 50, 101] {
            for depth in 1..=3 {
                let mut kept = vec![0u32; n * n];
                for piece in leaves(n, depth) {
                    assert!(piece.positions.windows(2).all(|w| w[0] < w[1]), "n {n} depth {depth}: not ascending");
                    for (&t, &tg) in piece.positions.iter().zip(&piece.groups) {
                        for (&p, &pg) in piece.positions.iter().zip(&piece.groups) {
                            if tg & pg == 0 {
                                kept[t as usize * n + p as usize] += 1;
                            }
                        }
                    }
                }
                assert!(kept.iter().all(|&c| c == 1), "n {n} depth {depth}: a pair is kept {:?} times", {
                    let bad = kept.iter().position(|&c| c != 1).unwrap();
                    (bad / n, bad % n, kept[bad])
                });
            }
        }
    }

    #[test]
    fn chunks_are_near_equal_with_the_longer_ones_last() {
        assert_eq!(chunk_bounds(7), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(chunk_bounds(10), [0, 1, 2, 3, 4, 6, 8, 10]);
        assert_eq!(chunk_bounds(3), [0, 0, 0, 0, 0, 1, 2, 3]);
    }

    #[test]
    fn a_piece_gathers_three_sevenths() {
        let pieces = Piece::whole(700).split().unwrap();
        assert_eq!(pieces.len(), 7);
        assert!(pieces.iter().all(|p| p.len() == 300 && p.depth == 1));
    }

    /// A masked tile keeps no pair and a clear one every pair, checked pair by
    /// pair on every tile of every leaf, causal with and without a window and
    /// not causal; and each verdict occurs.
    #[test]
    fn verdicts_agree_with_the_pairs() {
        let masks = [
            Mask { causal: true, window: None },
            Mask { causal: true, window: Some(40) },
            Mask { causal: false, window: None },
        ];
        for mask in masks {
            let mut seen = [0usize; 3];
            for piece in leaves(300, 2) {
                let blocks = piece.blocks(0..piece.len());
                for (qb, qs) in blocks.iter().zip((0..piece.len()).step_by(BLOCK)) {
                    for (kb, ks) in blocks.iter().zip((0..piece.len()).step_by(BLOCK)) {
                        let verdict = mask.classify(qb, kb);
                        let rows = |s: usize| s..(s + BLOCK).min(piece.len());
                        let pairs: Vec<bool> = rows(qs)
                            .flat_map(|i| rows(ks).map(move |j| (i, j)))
                            .map(|(i, j)| {
                                mask.keeps(piece.positions[i], piece.groups[i], piece.positions[j], piece.groups[j])
                            })
                            .collect();
                        match verdict {
                            Verdict::Masked => {
                                assert!(pairs.iter().all(|&k| !k), "{mask:?}: a masked tile keeps a pair")
                            }
                            Verdict::Clear => assert!(pairs.iter().all(|&k| k), "{mask:?}: a clear tile drops a pair"),
                            Verdict::Mixed => {}
                        }
                        seen[verdict as usize] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s > 0), "{mask:?}: verdicts seen {seen:?}");
        }
    }
}
