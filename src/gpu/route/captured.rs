//! Attention inputs captured from a model's global layers, and their tiling
//! to a larger head shape and a longer prompt.
//!
//! `sift gpu-profile -m MODEL --capture DIR` prefills passages of PG-19
//! books and keeps, for every global layer, the queries and keys after RoPE
//! and the values ([`CapturedPassage`]). `--captured DIR --compare N` then
//! times routed against dense attention on them, tiled by [`tile`] to the
//! shape being compared (the Llama 3.1 8B shape from Gemma 3 270M's heads):
//!
//! - **over the head dimension**: a source head of `s·d` dimensions gives `s`
//!   heads of `d`, the r-th holding the rotary pairs whose index is r modulo
//!   `s` (both dimensions of each pair, and the same dimensions of the
//!   values), so every part is a rotary head whose frequencies span the
//!   source's range. Its queries are scaled by `s·attn_scale·√d`, so that
//!   under the kernel's 1/√d the parts' logits average to the model's own
//!   logit (each part is a sum over a sample of the pairs);
//! - **over heads**: the target's KV heads take the (layer, KV head, part)
//!   sources in turn, parts outermost; a query head takes its source's query
//!   heads in turn within the group. A source used a second time reads the
//!   passages in an order shifted by one, so no two target heads are equal;
//! - **over length**: passage after passage (cycling when they hold fewer
//!   tokens than asked for), each rotated by RoPE to its new position: a
//!   post-RoPE vector at position p rotated by the angles of offset o is the
//!   vector at p + o. Within a passage the relative positions are the
//!   model's; across passages a query meets keys the model computed in
//!   another context, as in a prompt of documents placed one after another.

use std::path::Path;

use half::f16;
use serde::{Deserialize, Serialize};

/// One prefilled passage's attention inputs at the global layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapturedPassage {
    /// What was prefilled (a book and the passage's first token in it).
    pub source: String,
    pub tokens: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// The model's logit scale (applied by the attention to q·k).
    pub attn_scale: f32,
    /// Rotary pairs are (i, i + n_rot/2) (NeoX) rather than (2i, 2i + 1).
    pub neox: bool,
    /// Radians per position of each rotary pair of the global layers.
    pub frequencies: Vec<f64>,
    #[serde(skip)]
    pub layers: Vec<CapturedLayer>,
}

/// Queries (`tokens × n_head × head_dim`), keys and values (`tokens ×
/// n_kv_head × head_dim`) of one layer, position after position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CapturedLayer {
    pub layer: usize,
    pub q: Vec<f16>,
    pub k: Vec<f16>,
    pub v: Vec<f16>,
}

const MANIFEST: &str = "capture.json";

impl CapturedPassage {
    /// `dir/capture.json` and three raw little-endian f16 files per layer.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        #[derive(Serialize)]
        struct Manifest<'a> {
            #[serde(flatten)]
            passage: &'a CapturedPassage,
            layers: Vec<usize>,
        }
        let manifest = Manifest { passage: self, layers: self.layers.iter().map(|l| l.layer).collect() };
        std::fs::write(dir.join(MANIFEST), serde_json::to_string_pretty(&manifest).map_err(std::io::Error::other)?)?;
        for l in &self.layers {
            for (what, values) in [("q", &l.q), ("k", &l.k), ("v", &l.v)] {
                std::fs::write(
                    dir.join(format!("layer{}.{what}.f16", l.layer)),
                    bytemuck::cast_slice::<f16, u8>(values),
                )?;
            }
        }
        Ok(())
    }

    pub fn read(dir: &Path) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct Manifest {
            #[serde(flatten)]
            passage: CapturedPassage,
            layers: Vec<usize>,
        }
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let Manifest { mut passage, layers } =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let (q_len, kv_len) =
            (passage.tokens * passage.n_head * passage.head_dim, passage.tokens * passage.n_kv_head * passage.head_dim);
        for layer in layers {
            let read = |what: &str, len: usize| -> Result<Vec<f16>, String> {
                let path = dir.join(format!("layer{layer}.{what}.f16"));
                let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                match bytes.len() == len * 2 {
                    true => Ok(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect()),
                    false => Err(format!("{}: {} bytes, not {}", path.display(), bytes.len(), len * 2)),
                }
            };
            let (q, k, v) = (read("q", q_len)?, read("k", kv_len)?, read("v", kv_len)?);
            passage.layers.push(CapturedLayer { layer, q, k, v });
        }
        Ok(passage)
    }

    /// Every passage under `dir` (its subdirectories holding a capture), in
    /// name order.
    pub fn read_all(dir: &Path) -> Result<Vec<Self>, String> {
        let mut dirs: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join(MANIFEST).is_file())
            .collect();
        dirs.sort();
        match dirs.is_empty() {
            true => Err(format!("{}: no capture", dir.display())),
            false => dirs.iter().map(|d| Self::read(d)).collect(),
        }
    }

    /// The rotary pairs of a head (dimension indices), pair i at index i.
    fn pairs(&self) -> Vec<(usize, usize)> {
        let half = self.frequencies.len();
        (0..half).map(|i| if self.neox { (i, i + half) } else { (2 * i, 2 * i + 1) }).collect()
    }
}

/// The (sine, cosine) of `offset` positions at each of `frequencies`.
pub fn turn(frequencies: &[f64], offset: usize) -> Vec<(f64, f64)> {
    frequencies.iter().map(|f| (offset as f64 * f).sin_cos()).collect()
}

/// Rotates each rotary pair `(a, b)` of `head` by its angle of `turn` (the
/// direction RoPE turns a later position).
pub fn rotate(head: &mut [f32], pairs: &[(usize, usize)], turn: &[(f64, f64)]) {
    for (&(a, b), &(s, c)) in pairs.iter().zip(turn) {
        let (x0, x1) = (head[a] as f64, head[b] as f64);
        head[a] = (x0 * c - x1 * s) as f32;
        head[b] = (x0 * s + x1 * c) as f32;
    }
}

/// Queries (`rows × n_head × d`), keys and values (`rows × n_kv_head × d`) of
/// `n` positions tiled from `passages` as the module describes, for the
/// shape `(n_head, n_kv_head, d)`; rows past `n` are zero.
pub fn tile(
    passages: &[CapturedPassage],
    (hq, hk, d): (usize, usize, usize),
    n: usize,
    rows: usize,
) -> Result<[Vec<f16>; 3], String> {
    let first = passages.first().ok_or("no passage to tile")?;
    let same = |p: &CapturedPassage| {
        (p.tokens, p.n_head, p.n_kv_head, p.head_dim, p.neox, &p.frequencies, p.layers.len())
            == (
                first.tokens,
                first.n_head,
                first.n_kv_head,
                first.head_dim,
                first.neox,
                &first.frequencies,
                first.layers.len(),
            )
    };
    if !passages.iter().all(same) {
        return Err("the passages differ in shape".into());
    }
    let (src_d, parts) = (first.head_dim, first.head_dim / d.max(1));
    let rotary = 2 * first.frequencies.len();
    if parts == 0 || src_d != parts * d || rotary != src_d {
        return Err(format!("source heads of {src_d} dimensions ({rotary} rotary) do not split into heads of {d}"));
    }
    let (group, src_group) = (hq / hk, first.n_head / first.n_kv_head);
    // (layer, KV head, part), parts outermost.
    let sources: Vec<(usize, usize, usize)> = (0..parts)
        .flat_map(|r| (0..first.layers.len()).flat_map(move |l| (0..first.n_kv_head).map(move |h| (l, h, r))))
        .collect();
    let pairs = first.pairs();
    // The dimensions of part r, pair by pair, and their pairs within the part.
    let part_dims: Vec<Vec<usize>> = (0..parts)
        .map(|r| {
            let chosen: Vec<_> = pairs.iter().skip(r).step_by(parts).collect();
            chosen.iter().map(|p| p.0).chain(chosen.iter().map(|p| p.1)).collect()
        })
        .collect();
    let part_pairs: Vec<(usize, usize)> = (0..d / 2).map(|j| (j, j + d / 2)).collect();
    // Per part and slot of the tiling, the turn to the slot's offset.
    let slots = n.div_ceil(first.tokens);
    let turns: Vec<Vec<Vec<(f64, f64)>>> = (0..parts)
        .map(|r| {
            let frequencies: Vec<f64> = first.frequencies.iter().skip(r).step_by(parts).copied().collect();
            (0..slots).map(|slot| turn(&frequencies, slot * first.tokens)).collect()
        })
        .collect();
    let q_scale = parts as f32 * first.attn_scale * (d as f32).sqrt();
    let (mut q, mut k, mut v) =
        (vec![f16::ZERO; rows * hq * d], vec![f16::ZERO; rows * hk * d], vec![f16::ZERO; rows * hk * d]);
    let mut head = vec![0.0f32; d];
    let mut take = |out: &mut [f16], from: &[f16], dims: &[usize], scale: f32, turn: Option<&[(f64, f64)]>| {
        for (x, &i) in head.iter_mut().zip(dims) {
            *x = from[i].to_f32() * scale;
        }
        if let Some(turn) = turn {
            rotate(&mut head, &part_pairs, turn);
        }
        for (o, &x) in out.iter_mut().zip(head.iter()) {
            *o = f16::from_f32(x);
        }
    };
    let t_len = first.tokens;
    for kv in 0..hk {
        let (l, src_kv, r) = sources[kv % sources.len()];
        let shift = kv / sources.len();
        let dims = &part_dims[r];
        let rotation = |t: usize| Some(turns[r][t / t_len].as_slice());
        for t in 0..n {
            let passage = &passages[(t / t_len + shift) % passages.len()];
            let layer = &passage.layers[l];
            let p = t % t_len;
            let kv_row = (p * first.n_kv_head + src_kv) * src_d;
            let out = (t * hk + kv) * d;
            take(&mut k[out..out + d], &layer.k[kv_row..kv_row + src_d], dims, 1.0, rotation(t));
            take(&mut v[out..out + d], &layer.v[kv_row..kv_row + src_d], dims, 1.0, None);
            for g in 0..group {
                let src_q = src_kv * src_group + g % src_group;
                let q_row = (p * first.n_head + src_q) * src_d;
                let out = (t * hq + kv * group + g) * d;
                take(&mut q[out..out + d], &layer.q[q_row..q_row + src_d], dims, q_scale, rotation(t));
            }
        }
    }
    Ok([q, k, v])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::RopeTable;
    use crate::model::hparams::{Rope, RopeStyle};

    fn rope(n_rot: usize) -> Rope {
        Rope {
            style: RopeStyle::Neox,
            n_rot,
            base: 10000.0,
            base_sliding: 10000.0,
            freq_scale: 1.0,
            freq_factors: None,
            long_factors: None,
            original_context: 0,
            attn_factor: 1.0,
        }
    }

    fn noise(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn rotating_a_rotated_vector_by_an_offset_is_rope_at_the_later_position() {
        let (n_rot, rope) = (16, rope(16));
        let frequencies: Vec<f64> = (0..n_rot / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / n_rot as f64)).collect();
        let pairs: Vec<_> = (0..n_rot / 2).map(|i| (i, i + n_rot / 2)).collect();
        let x = noise(n_rot, 3);
        let mut table = RopeTable::default();
        table.fill(&rope, rope.base, 1.0, 100..101);
        let mut shifted = x.clone();
        table.apply(&mut shifted, n_rot, 0, RopeStyle::Neox);
        rotate(&mut shifted, &pairs, &turn(&frequencies, 1000));
        table.fill(&rope, rope.base, 1.0, 1100..1101);
        let mut direct = x;
        table.apply(&mut direct, n_rot, 0, RopeStyle::Neox);
        for (a, b) in shifted.iter().zip(&direct) {
            assert!((a - b).abs() < 1e-4, "{shifted:?} against {direct:?}");
        }
    }

    /// A passage of `tokens` positions of noise, heads of 8 dimensions.
    fn passage(tokens: usize, seed: u64) -> CapturedPassage {
        let (n_head, n_kv_head, d) = (4, 1, 8);
        let layer = |layer: usize, seed: u64| {
            let f16s = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
            CapturedLayer {
                layer,
                q: f16s(noise(tokens * n_head * d, seed)),
                k: f16s(noise(tokens * n_kv_head * d, seed + 1)),
                v: f16s(noise(tokens * n_kv_head * d, seed + 2)),
            }
        };
        CapturedPassage {
            source: format!("noise {seed}"),
            tokens,
            n_head,
            n_kv_head,
            head_dim: d,
            attn_scale: 0.3,
            neox: true,
            frequencies: vec![1.0, 0.1, 0.01, 0.001],
            layers: vec![layer(5, seed * 10), layer(11, seed * 10 + 5)],
        }
    }

    fn dot(a: &[f16], b: &[f16]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
    }

    #[test]
    fn the_parts_logits_average_to_the_models_and_values_keep_their_dimensions() {
        let passages = [passage(6, 1), passage(6, 2)];
        let (hq, hk, d, n) = (8, 2, 4, 10);
        let [q, k, v] = tile(&passages, (hq, hk, d), n, 12).unwrap();
        assert!(q[n * hq * d..].iter().chain(&k[n * hk * d..]).all(|x| *x == f16::ZERO), "padding rows are zero");
        // Target KV head 0 is layer 5's part 0, KV head 1 layer 11's part 0;
        // the parts of one source sit in heads sources.len() apart, so here
        // compare the tiled logits of part 0 and of part 1 (taken from a tile
        // to 4 KV heads) with the source's logit.
        let [q4, k4, v4] = tile(&passages, (16, 4, d), n, 12).unwrap();
        let src = &passages[1].layers[1];
        // Positions 7 and 8 are passage 1's positions 1 and 2 (the second slot).
        let (tq, tk, pq, pk) = (8, 7, 2, 1);
        for g in 0..4 {
            let logit = |q: &[f16], k: &[f16], hq: usize, hk: usize, kv: usize| {
                let qi = (tq * hq + kv * 4 + g) * d;
                let ki = (tk * hk + kv) * d;
                dot(&q[qi..qi + d], &k[ki..ki + d]) / (d as f64).sqrt()
            };
            let parts_mean = (logit(&q4, &k4, 16, 4, 1) + logit(&q4, &k4, 16, 4, 3)) / 2.0;
            let model = 0.3 * dot(&src.q[(pq * 4 + g) * 8..][..8], &src.k[pk * 8..][..8]);
            assert!((parts_mean - model).abs() < 5e-3 * (1.0 + model.abs()), "head {g}: {parts_mean} against {model}");
            assert_eq!(
                logit(&q, &k, hq, hk, 1),
                logit(&q4, &k4, 16, 4, 1),
                "the tiling does not depend on the heads asked for"
            );
        }
        // Part 1 of layer 11's values: the odd pairs' dimensions (1, 3, 5, 7).
        let value = &v4[(tk * 4 + 3) * d..][..d];
        let source = &src.v[pk * 8..][..8];
        assert_eq!(value, [source[1], source[3], source[5], source[7]]);
        assert_eq!(&v[(tk * hk + 1) * d..][..d], &v4[(tk * 4 + 1) * d..][..d]);
        // A source's second use reads the passages shifted by one: KV head 4
        // of 4 is not there, so tile to 5 and compare its first slot with
        // passage 1's layer 5 part 0.
        let [_, k5, _] = tile(&passages, (20, 5, d), n, 12).unwrap();
        let moved = &k5[4 * d..][..d];
        let expected: Vec<f16> = [0, 2, 4, 6].iter().map(|&i| passages[1].layers[0].k[i]).collect();
        assert_eq!(moved, expected.as_slice());
    }

    #[test]
    fn a_capture_reads_back_what_was_written() {
        let p = passage(5, 4);
        let dir = std::env::temp_dir().join(format!("sift-captured-{}", std::process::id()));
        p.write(&dir.join("a")).unwrap();
        let read = CapturedPassage::read_all(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(read.unwrap(), vec![p]);
    }
}
