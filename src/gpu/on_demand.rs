//! `--gpu auto|on|off`: which prompts the GPU prefills, and when it is opened.
//!
//! `off` never touches wgpu. `on` opens the adapter and uploads the weights
//! at once (a software renderer counts, and none is an error) and prefills
//! every prompt that starts a cache. `auto` opens a hardware adapter, and
//! uploads, only when the first prompt of at least [`AUTO_MIN_TOKENS`] tokens
//! arrives, and keeps the CPU when there is none.

use std::sync::OnceLock;

use super::context::{AdapterPolicy, GpuContext, GpuError};
use super::prefill::GpuPrefill;
use super::route::RouteSettings;
use crate::engine::{EngineError, PrefillBackend};
use crate::kv::KvCache;
use crate::model::{Model, Outputs};

/// The prompt length from which `auto` prefills on a GPU: below it, opening
/// the device and uploading the weights costs more than the CPU's prefill
/// (measured on the default model: see the README's GPU section).
pub const AUTO_MIN_TOKENS: usize = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMode {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for GpuMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ => Err(format!("--gpu takes auto, on or off, not '{s}'")),
        }
    }
}

impl GpuMode {
    /// The adapters this mode accepts: a software renderer only for `on`.
    fn adapter_policy(self) -> AdapterPolicy {
        match self {
            GpuMode::On => AdapterPolicy::AllowSoftware,
            _ => AdapterPolicy::Hardware,
        }
    }

    /// The shortest prompt this mode prefills on the GPU; `None` for `off`.
    pub fn min_tokens(self) -> Option<usize> {
        match self {
            GpuMode::Off => None,
            GpuMode::On => Some(1),
            GpuMode::Auto => Some(AUTO_MIN_TOKENS),
        }
    }
}

/// How the GPU prefill is set up beyond `--gpu`.
#[derive(Clone, Debug, Default)]
pub struct PrefillOptions {
    /// One attention call's working memory at most, in bytes (`--gpu-mem-budget`).
    pub attention_budget: Option<u64>,
    /// Sparse attention on layers without a window (`--prefill-attn`).
    pub route: Option<RouteSettings>,
}

/// The process's GPU opened for `mode`, and `model`'s weights uploaded to it
/// (logged with their time), taking prompts of `mode`'s length, set up as
/// `options` say.
pub fn upload<'m>(model: &'m Model<'m>, mode: GpuMode, options: &PrefillOptions) -> Result<GpuPrefill<'m>, GpuError> {
    // `off` takes no prompt.
    let min_tokens = mode.min_tokens().unwrap_or(usize::MAX);
    GpuPrefill::supports(&model.hp)?;
    let gpu = shared(mode.adapter_policy())?;
    let started = std::time::Instant::now();
    let mut prefill = GpuPrefill::new(gpu, model)?.with_min_tokens(min_tokens);
    if let Some(bytes) = options.attention_budget {
        prefill = prefill.with_attention_budget(bytes)?;
    }
    if let Some(settings) = &options.route {
        prefill = prefill.with_routing(settings.clone())?;
    }
    eprintln!(
        "gpu: weights uploaded in {:.0} ms; {} kernels; prompts of {min_tokens}+ tokens on the GPU",
        started.elapsed().as_secs_f64() * 1e3,
        prefill.path().name(),
    );
    Ok(prefill)
}

/// The process's GPU, opened at most once.
fn shared(policy: AdapterPolicy) -> Result<&'static GpuContext, GpuError> {
    static GPU: OnceLock<GpuContext> = OnceLock::new();
    if let Some(gpu) = GPU.get() {
        return Ok(gpu);
    }
    let gpu = GpuContext::open(policy)?;
    Ok(GPU.get_or_init(|| gpu))
}

/// A prefill backend that opens the GPU and uploads the weights when it
/// first takes a prompt.
pub struct OnDemand<'m> {
    model: &'m Model<'m>,
    mode: GpuMode,
    min_tokens: usize,
    options: PrefillOptions,
    state: State<'m>,
}

enum State<'m> {
    Closed,
    Ready(Box<GpuPrefill<'m>>),
    /// `auto` found no usable GPU: the CPU prefills from now on.
    Unavailable,
}

impl<'m> OnDemand<'m> {
    /// `None` for `off`. With `on`, the adapter is opened and the weights
    /// uploaded now, so that a missing adapter is reported before any work
    /// and the first prompt's time is the prefill's alone.
    pub fn new(model: &'m Model<'m>, mode: GpuMode, options: PrefillOptions) -> Result<Option<Self>, GpuError> {
        let Some(min_tokens) = mode.min_tokens() else { return Ok(None) };
        let mut backend = Self { model, mode, min_tokens, options, state: State::Closed };
        if mode == GpuMode::On {
            backend.ready()?;
        }
        Ok(Some(backend))
    }

    /// The backend, opened on first use.
    fn ready(&mut self) -> Result<&GpuPrefill<'m>, GpuError> {
        if let State::Closed = self.state {
            self.state = State::Ready(Box::new(upload(self.model, self.mode, &self.options)?));
        }
        match &self.state {
            State::Ready(prefill) => Ok(prefill),
            _ => unreachable!("opened above"),
        }
    }
}

impl PrefillBackend for OnDemand<'_> {
    fn takes(&mut self, _pos0: usize, n: usize) -> bool {
        if n < self.min_tokens || matches!(self.state, State::Unavailable) {
            return false;
        }
        let mode = self.mode;
        match (self.ready(), mode) {
            (Ok(_), _) => true,
            // `on` reports the failure from `prefill`.
            (Err(_), GpuMode::On) => true,
            (Err(e), _) => {
                eprintln!("gpu: {e}; prefill stays on the CPU");
                self.state = State::Unavailable;
                false
            }
        }
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        self.ready()?.prefill_into(tokens, pos0, cache, outputs, hidden)
    }
}
