//! Attention over the KV cache, behind one seam: an [`AttentionPolicy`].
//!
//! The forward pass hands every layer's batch and cache to the session's
//! policy ([`LayerCall`]); the policy writes the attention output and says,
//! per query head, what it did ([`HeadRecord`]): which method ran, what its
//! result is certified to be within ([`Certificate`]), how many keys and
//! bytes it read. [`dense::Dense`] reads every visible key exactly, as ggml
//! does, and is the default; sparse policies read fewer keys on decoding
//! steps whose pool is large enough to pay ([`worth_sparse`]) and are dense
//! everywhere else.

pub mod audit;
pub mod capture;
pub mod certified;
pub mod dense;
pub mod read;
pub mod resa;
pub mod topk;

use std::ops::Range;

use serde::Serialize;

use crate::kv::PagedLayer;

/// What one layer's attention needs to know about the batch.
pub struct AttentionBatch<'a> {
    /// Queries after RoPE: `n_tokens` rows of `n_head * head_dim_k`.
    pub queries: &'a [f32],
    /// The batch's keys (after RoPE) and values, as stored in the cache:
    /// `n_tokens` rows of `n_kv_head * head_dim_k` and `n_kv_head * head_dim_v`.
    pub keys: &'a [f32],
    pub values: &'a [f32],
    /// Position of the batch's first token.
    pub pos0: usize,
    pub n_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Query heads per KV head.
    pub n_gqa: usize,
    /// How a query–key dot product becomes the score the softmax takes.
    pub scorer: Scorer,
}

/// How a query–key dot product `q·k` becomes an attention score: scaled,
/// `s = scale · q·k`, then, for a model that soft-caps its attention logits
/// (Gemma 2), `cap · tanh(s / cap)`. Every policy scores through this, on
/// exact dot products and on bounds alike.
///
/// The cap is increasing and 1-Lipschitz, which is all a sparse policy's
/// reasoning needs from it: bounds `l ≤ q·k ≤ u` become bounds on the
/// capped score by capping them ([`Self::bounds`]), a key's softmax weight
/// is still `exp(score)`, and what the certificate proves about weights and
/// values holds for any scores. Capping also never widens the spread of the
/// scores, so the softmax only gets flatter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scorer {
    pub scale: f32,
    pub softcap: Option<f32>,
}

/// Relative slack on capped bounds: more than `tanh`'s rounding in f32 (a
/// few units in the last place, 2^-24 each) and in f64.
const CAP_SLACK: f64 = 1e-6;

/// Scores as dot products themselves (a scale of 1, no cap).
impl Default for Scorer {
    fn default() -> Self {
        Self::scaled(1.0)
    }
}

impl Scorer {
    /// Scaling alone, no cap.
    pub fn scaled(scale: f32) -> Self {
        Self { scale, softcap: None }
    }

    /// The score of a dot product, in f32, as every policy computes it.
    pub fn score(self, dot: f32) -> f32 {
        let s = self.scale * dot;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }

    /// [`Self::score`] of every element, in place.
    pub fn score_all(self, dots: &mut [f32]) {
        dots.iter_mut().for_each(|x| *x = self.score(*x));
    }

    /// The score of a dot product in f64, for references.
    pub fn score_f64(self, dot: f64) -> f64 {
        let s = f64::from(self.scale) * dot;
        match self.softcap {
            Some(cap) => f64::from(cap) * (s / f64::from(cap)).tanh(),
            None => s,
        }
    }

    /// An f32 bound at or above [`Self::score`] of every dot product up to
    /// `dot`: the scaled dot itself without a cap (rounding is monotone),
    /// the capped one moved up past `tanh`'s rounding with one.
    pub fn upper(self, dot: f32) -> f32 {
        let s = self.score(dot);
        match self.softcap {
            None => s,
            Some(_) => s + s.abs() * CAP_SLACK as f32 + f32::MIN_POSITIVE,
        }
    }

    /// Bounds `(l, u)` on the score, in f32 as [`Self::score`] computes it
    /// and in f64, of any dot product within `[lower, upper]`: the scaled
    /// ends stepped outward past f32's rounding, then capped (the cap is
    /// increasing) with a margin for `tanh`'s rounding.
    pub fn bounds(self, lower: f32, upper: f32) -> (f64, f64) {
        let (lo, hi) = (f64::from((self.scale * lower).next_down()), f64::from((self.scale * upper).next_up()));
        match self.softcap {
            None => (lo, hi),
            Some(cap) => {
                let cap = |s: f64| f64::from(cap) * (s / f64::from(cap)).tanh();
                let slack = |s: f64| s.abs() * CAP_SLACK + f64::from(f32::MIN_POSITIVE);
                let (lo, hi) = (cap(lo), cap(hi));
                (lo - slack(lo), hi + slack(hi))
            }
        }
    }
}

impl AttentionBatch<'_> {
    pub fn n_tokens(&self) -> usize {
        self.queries.len() / (self.n_head * self.head_dim_k)
    }

    pub fn n_kv_head(&self) -> usize {
        self.n_head / self.n_gqa
    }
}

/// One layer's attention call, as the forward pass makes it. The batch's
/// keys and values are already in `cache`.
pub struct LayerCall<'a> {
    pub layer: usize,
    /// The session's decoding steps before this call: 0 for a prefill and
    /// the first step after it, then one more per step. Together with the
    /// positions it tells calls apart (fresh perturbations per step).
    pub step: u64,
    pub batch: &'a AttentionBatch<'a>,
    pub cache: &'a PagedLayer,
}

impl LayerCall<'_> {
    /// Whether this is a decoding step: one token, the only calls a sparse
    /// policy reads sparsely.
    pub fn is_decoding_step(&self) -> bool {
        self.batch.n_tokens() == 1
    }

    /// The positions the batch's token `t` sees.
    pub fn visible(&self, t: usize) -> Range<usize> {
        self.cache.visible(self.batch.pos0 + t)
    }
}

/// How a layer's attention is computed, for every call of a session.
pub trait AttentionPolicy: Send {
    /// The method this policy stands for (a sparse policy's dense calls
    /// still record [`AttentionKind::Dense`]).
    fn kind(&self) -> AttentionKind;

    /// Whether the policy reads the key sketch: the f16 cache builds sketches
    /// only for sessions whose policy does.
    fn reads_sketch(&self) -> bool;

    /// `out` gets `n_tokens` rows of `n_head * head_dim_v`: every token's
    /// attention over the positions the cache shows it. Appends one
    /// [`HeadRecord`] per query head to `records`.
    fn attend(&mut self, call: &LayerCall, out: &mut [f32], records: &mut Vec<HeadRecord>);

    /// The cache forgets its positions from `pos` on, to store them anew (a
    /// reset, a rectification): a policy that keeps summaries of the keys it
    /// has seen drops those of these positions.
    fn forget_from(&mut self, _pos: usize) {}
}

/// The visible positions from which a sparse policy reads a decoding step
/// sparsely; below it, the call is dense. Candidate generation, the levels'
/// bookkeeping and the exact window of 64 and 4 sinks cost about as much as
/// reading a few hundred keys, so a pool must be well above that to pay;
/// 1024 keeps Gemma 3's sliding layers (which see at most 512 positions)
/// dense, and sparse reading starts on its global layers from 1024 tokens of
/// context.
pub const SPARSE_MIN_VISIBLE: usize = 1024;

/// Whether a sparse policy should read `call` sparsely: a decoding step
/// that sees at least [`SPARSE_MIN_VISIBLE`] positions.
pub fn worth_sparse(call: &LayerCall) -> bool {
    call.is_decoding_step() && call.visible(0).len() >= SPARSE_MIN_VISIBLE
}

/// The newest positions a sparse policy always reads exactly.
pub const WINDOW: usize = 64;

/// The first positions a sparse policy always reads exactly (when visible):
/// attention sinks draw much of every head's attention.
pub const SINKS: usize = 4;

/// A step's visible positions as a sparse policy splits them: the exact
/// sinks and window, and the pool between them, from which it chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub sinks: Range<usize>,
    pub pool: Range<usize>,
    pub window: Range<usize>,
}

impl Split {
    pub fn of(visible: Range<usize>) -> Self {
        let sinks = visible.start..SINKS.clamp(visible.start, visible.end);
        let window = visible.end.saturating_sub(WINDOW).max(sinks.end)..visible.end;
        Self { pool: sinks.end..window.start, sinks, window }
    }
}

/// Which method computed a head's attention, and so what its certificate
/// promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Every key read exactly: the certificate is zero.
    Dense,
    /// A Horvitz–Thompson estimate from perturbed threshold sampling,
    /// certified within ε except with probability δ.
    Certified,
    /// The pages with the largest score bounds read exactly, the rest
    /// dropped: no bound at all.
    Topk,
    /// The blocks of 16 keys with the largest min/max score bounds for the
    /// mean query of a KV head's query heads read exactly (ReSA's sparse
    /// phase), the rest dropped: no bound at all.
    Resa,
}

impl AttentionKind {
    pub const ALL: [AttentionKind; 4] =
        [AttentionKind::Dense, AttentionKind::Certified, AttentionKind::Topk, AttentionKind::Resa];
}

impl std::fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            AttentionKind::Dense => "dense",
            AttentionKind::Certified => "certified",
            AttentionKind::Topk => "topk",
            AttentionKind::Resa => "resa",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown attention '{0}' (expected dense, certified, topk or resa)")]
pub struct UnknownAttention(String);

impl std::str::FromStr for AttentionKind {
    type Err = UnknownAttention;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AttentionKind::ALL.into_iter().find(|k| k.to_string() == s).ok_or_else(|| UnknownAttention(s.to_string()))
    }
}

/// The scale an attention error is measured on, writing `o` for exact
/// attention's output, `ô` for the policy's, `D = Σ exp(s_i)` for the
/// softmax denominator and `M² = Σ a_i ‖v_i‖²` for the attention-weighted
/// mean square of the values (`M ≥ ‖o‖`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Measure {
    /// `‖ô − o‖ / M`.
    Value,
    /// `‖ô − o‖ / ‖o‖`.
    Output,
    /// `|D̂ − D| / D`.
    Denominator,
}

impl Measure {
    pub const ALL: [Measure; 3] = [Measure::Value, Measure::Output, Measure::Denominator];
}

impl std::fmt::Display for Measure {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Measure::Value => "value",
            Measure::Output => "output",
            Measure::Denominator => "denominator",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown measure '{0}' (expected value, output or denominator)")]
pub struct UnknownMeasure(String);

impl std::str::FromStr for Measure {
    type Err = UnknownMeasure;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Measure::ALL.into_iter().find(|m| m.to_string() == s).ok_or_else(|| UnknownMeasure(s.to_string()))
    }
}

/// How far an attention output may be from exact attention's: within
/// `epsilon` on `measure`'s scale except with probability at most `delta`.
/// Exact attention's is [`Certificate::DENSE`]; a method without a bound has
/// an infinite `epsilon` (`null` in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Certificate {
    pub kind: AttentionKind,
    pub epsilon: f64,
    pub delta: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measure: Option<Measure>,
}

impl Certificate {
    pub const DENSE: Self = Self { kind: AttentionKind::Dense, epsilon: 0.0, delta: 0.0, measure: None };

    /// What a whole forward call's attention promises: the weakest of its
    /// heads' certificates (the largest ε, then the largest δ); dense when
    /// there are none.
    pub fn weakest(records: &[HeadRecord]) -> Self {
        records.iter().map(|r| r.certificate).fold(Self::DENSE, |weakest, c| {
            let weaker = (c.epsilon, c.delta) > (weakest.epsilon, weakest.delta);
            if weaker {
                c
            } else {
                weakest
            }
        })
    }
}

/// What a policy did for one query head in one layer call. Counts add over
/// the call's tokens; a prefill batch's head is one record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeadRecord {
    pub layer: usize,
    /// The query head.
    pub head: usize,
    pub certificate: Certificate,
    /// The level whose certificate held (certified attention only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub level: Option<u32>,
    /// No level certified and the head was computed exactly: the
    /// certificate is then [`Certificate::DENSE`]'s.
    pub fallback: bool,
    /// Positions visible to the head: the keys dense attention reads.
    pub visible: usize,
    /// Keys whose exact score the head used.
    pub keys_read: usize,
    /// Bytes of the cache read for the head: sketches, codes, exact rows.
    /// Reads shared by the query heads of one KV head are split evenly among
    /// them, so that a call's records add up to what it read.
    pub bytes_read: f64,
    /// What the estimate itself says, for an audit to measure its error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Estimate>,
    /// The audit's comparison with exact attention, where one ran
    /// ([`audit::Audited`]); policies leave it `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit: Option<Checked>,
}

/// How far a head's output was from exact attention's, as the audit
/// measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Checked {
    /// The scale the error is on: the certificate's, else the audit's.
    pub measure: Measure,
    /// The error on that scale.
    pub error: f64,
    /// The bytes dense attention reads for the head over the same cache.
    pub dense_bytes: f64,
    /// Certified, and the error above the certificate's ε.
    pub violated: bool,
}

/// A sparse estimate's own numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// `ln D̂`, the estimated log of the softmax denominator `Σ exp(s_i)`
    /// (the shift the policy used added back).
    pub log_denominator: f64,
    /// The error bound the certificate proved, on its measure's scale (at
    /// most ε where the head is certified).
    pub bound: f64,
}
