//! The `--attn` family of flags: which attention policy a command's
//! sessions decode with, and its settings.

use clap::Args;
use sift::attn::audit::Audited;
use sift::attn::certified::{CertifiedPolicy, Grid, Params, PerturbationSeed};
use sift::attn::dense::Dense;
use sift::attn::resa::{self, Resa};
use sift::attn::topk::Topk;
use sift::attn::{AttentionKind, AttentionPolicy, Measure};
use sift::engine::DEFAULT_BATCH;
use sift::rectify::{Rectify, DEFAULT_EVERY};

use super::Usage;

/// The settings of the sparse policies, shared by every command that takes
/// `--attn`.
#[derive(Args, Clone)]
pub struct PolicyArgs {
    /// Certified attention's error target ε, on the --measure scale
    #[arg(long = "eps", default_value_t = 0.1)]
    pub epsilon: f64,
    /// Certified attention's failure probability δ, per head and decoding step
    #[arg(long, default_value_t = 0.001)]
    pub delta: f64,
    /// The scale errors are certified (and audited) on: value (‖ô−o‖ over the attention-weighted
    /// RMS of the values), output (‖ô−o‖/‖o‖) or denominator (|D̂−D|/D of the softmax)
    #[arg(long, default_value = "value")]
    pub measure: Measure,
    /// Draw certified attention's perturbations once per position and reuse them at every step,
    /// instead of fresh ones per step
    #[arg(long)]
    pub fixed_perturbation: bool,
    /// Pages of 64 keys --attn topk reads beside the 64 newest keys and the first 4
    #[arg(long, default_value_t = 16)]
    pub topk_pages: usize,
}

impl PolicyArgs {
    /// Rejects settings no policy can use.
    pub fn check(&self) -> Result<(), Usage> {
        if !(self.epsilon > 0.0 && self.epsilon.is_finite()) {
            return Err(Usage(format!("--eps must be a positive number, not {}", self.epsilon)));
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return Err(Usage(format!("--delta must lie strictly between 0 and 1, not {}", self.delta)));
        }
        if self.topk_pages == 0 {
            return Err(Usage("--topk-pages must be at least 1".into()));
        }
        Ok(())
    }

    /// The policy `kind` with these settings, its perturbations drawn from
    /// `seed`; audited on `--measure` if `audit`.
    pub fn policy(&self, kind: AttentionKind, seed: u64, audit: bool) -> Result<Box<dyn AttentionPolicy>, Usage> {
        let policy = self.unaudited(kind, seed)?;
        Ok(if audit { Box::new(Audited::new(policy, self.measure)) } else { policy })
    }

    /// The policy `kind` with these settings, its perturbations drawn from
    /// `seed`.
    pub fn unaudited(&self, kind: AttentionKind, seed: u64) -> Result<Box<dyn AttentionPolicy>, Usage> {
        self.check()?;
        Ok(match kind {
            AttentionKind::Dense => Box::new(Dense),
            AttentionKind::Topk => Box::new(Topk::new(self.topk_pages)),
            AttentionKind::Resa => Box::new(Resa::new(resa::Params::default())),
            AttentionKind::Certified => {
                let params =
                    Params { eps: self.epsilon, delta: self.delta, measure: self.measure, grid: Grid::default() };
                Box::new(CertifiedPolicy::new(params, PerturbationSeed { seed, fixed: self.fixed_perturbation }))
            }
        })
    }

    /// How an audit table names the policy `kind` with these settings.
    pub fn describe(&self, kind: AttentionKind) -> String {
        match kind {
            AttentionKind::Certified => format!("certified ε={} {}", self.epsilon, self.measure),
            AttentionKind::Topk => format!("topk {} pages", self.topk_pages),
            AttentionKind::Dense | AttentionKind::Resa => kind.to_string(),
        }
    }
}

/// A policy an audit runs beside the session's (`--shadow`): certified
/// attention at its own ε and measure (the run's δ and perturbations), or
/// top-k at its own page count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ShadowSpec {
    Certified { epsilon: f64, measure: Measure },
    Topk { pages: usize },
}

impl std::str::FromStr for ShadowSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let usage = || format!("'{s}' is not certified:EPS:MEASURE or topk:PAGES");
        let parts: Vec<&str> = s.split(':').collect();
        match parts[..] {
            ["certified", epsilon, measure] => Ok(Self::Certified {
                epsilon: epsilon.parse().map_err(|_| usage())?,
                measure: measure.parse().map_err(|e: sift::attn::UnknownMeasure| e.to_string())?,
            }),
            ["topk", pages] => Ok(Self::Topk { pages: pages.parse().map_err(|_| usage())? }),
            _ => Err(usage()),
        }
    }
}

impl ShadowSpec {
    /// `settings` with this shadow's own ones in place of theirs.
    pub fn settings(self, settings: &PolicyArgs) -> (AttentionKind, PolicyArgs) {
        let mut own = settings.clone();
        match self {
            Self::Certified { epsilon, measure } => {
                (own.epsilon, own.measure) = (epsilon, measure);
                (AttentionKind::Certified, own)
            }
            Self::Topk { pages } => {
                own.topk_pages = pages;
                (AttentionKind::Topk, own)
            }
        }
    }
}

/// `--attn` with its settings, for commands that run one policy.
#[derive(Args, Clone)]
pub struct AttentionArgs {
    /// Attention on decoding steps: dense reads every key; certified estimates attention from a
    /// sample of keys with an error bound (--eps, --delta, --measure); topk reads the --topk-pages
    /// pages of largest score bounds; resa reads the blocks of 16 keys with the largest min/max
    /// bounds for the mean query of each KV head's query heads (10% of the blocks, at least 16,
    /// and the newest). Sparse policies read sparsely only where a step sees 1024 positions or
    /// more (so Gemma 3's sliding layers stay dense)
    #[arg(long = "attn", default_value = "dense")]
    pub kind: AttentionKind,
    /// Every F decoded tokens, run the last F again densely in one batch and overwrite the keys
    /// and values sparse attention wrote for them, so that its errors do not compound (0: never).
    /// Default 32 for a sparse policy, 0 for dense; at most 512
    #[arg(long = "rectify-every", value_name = "F")]
    pub rectify_every: Option<usize>,
    #[command(flatten)]
    pub settings: PolicyArgs,
}

impl AttentionArgs {
    /// The policy asked for, perturbed from `seed`; audited if `audit`.
    pub fn policy(&self, seed: u64, audit: bool) -> Result<Box<dyn AttentionPolicy>, Usage> {
        self.settings.policy(self.kind, seed, audit)
    }

    /// How the policy's sessions rectify; measuring the drift if `audit`.
    pub fn rectify(&self, audit: bool) -> Result<Rectify, Usage> {
        let every = rectify_every(self.rectify_every, self.kind)?;
        Ok(Rectify { every, measure_drift: audit && every > 0 })
    }
}

/// `--rectify-every` for `kind`, given or by default.
pub fn rectify_every(given: Option<usize>, kind: AttentionKind) -> Result<usize, Usage> {
    match given {
        Some(every) if every > DEFAULT_BATCH => {
            Err(Usage(format!("--rectify-every must be at most one batch of {DEFAULT_BATCH} tokens, not {every}")))
        }
        Some(every) => Ok(every),
        None if kind == AttentionKind::Dense => Ok(0),
        None => Ok(DEFAULT_EVERY),
    }
}
