//! The whole prompt's forward pass on the GPU.
//!
//! [`GpuPrefill::new`] uploads the layers' weights once: matrices dequantized
//! from their GGUF blocks to f16 (the matmul kernel's storage), norms and
//! biases in f32. The token embedding and the output head stay on the CPU:
//! embedding a prompt is a row lookup, and only the rows the caller wants
//! logits for leave the GPU, as final hidden states.
//!
//! [`GpuPrefill::prefill_into`] runs positions `0..n` in chunks as large as the
//! device's binding limit allows (on an H200 a 32K prompt is one chunk). Each
//! layer's keys and values stay resident on the GPU, in f16, for the whole
//! prompt, so a later chunk attends to every earlier position without reading
//! anything back. When the prompt is done they are read back once and stored
//! into the CPU cache position by position through [`PagedLayer::store`],
//! which builds the sketches and codes of the quantized modes exactly as the
//! CPU prefill does.
//!
//! A prompt may continue a cache that already holds positions (a chat's next
//! turn): before the first chunk, the positions the new rows can see are
//! uploaded from the cache as attention reads them there ([`PagedLayer::key`]
//! and [`PagedLayer::value`]: coded pages dequantized), so the GPU attends to
//! the same keys and values a CPU prefill of the continuation would.
//!
//! The stages are those of [`Model::forward`], under the same names; with a
//! [`Trace`], each stage's output is read back and handed to it.
//!
//! With [`GpuPrefill::with_routing`], the attention of layers without a
//! window goes through [`RoutedAttention`] (RouteSparse: sparse patterns
//! chosen per prompt), chunks are whole multiples of 64 tokens, and each
//! prompt that routes a layer leaves a [`PrefillReport`] (a shorter one, such
//! as a decoding step, leaves the last).
//!
//! With an attention budget ([`GpuPrefill::with_attention_budget`]), a layer
//! whose attention call would need more working memory than the budget
//! reads its Q, K and V back and computes the call decomposed ([`Cqs`]),
//! exactly, writing the output where the whole call would have.
//!
//! [`PagedLayer::store`]: crate::kv::PagedLayer::store
//! [`PagedLayer::key`]: crate::kv::PagedLayer::key
//! [`PagedLayer::value`]: crate::kv::PagedLayer::value

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use wgpu::Buffer;

use super::attention::{Attention, AttentionShape};
use super::context::{Batch, GpuContext, GpuError};
use super::cqs::plan::Mask;
use super::cqs::{AttentionCall, Cqs, CqsReport};
use super::layers::LayerKernels;
use super::matmul::{Matmul, MatmulShape};
use super::report::PrefillReport;
use super::route::profile::LatencyProfile;
use super::route::{RouteSettings, RoutedAttention};
use super::KernelPath;
use crate::engine::{EngineError, PrefillBackend};
use crate::kv::KvCache;
use crate::matmul::Matrix;
use crate::model::blocks::{self, RopeTable};
use crate::model::hparams::HParams;
use crate::model::{Model, Outputs, Trace};

/// A weight matrix in f16, `rows` outputs of `cols` inputs.
struct GpuMatrix {
    data: Buffer,
    rows: usize,
    cols: usize,
}

struct GpuLayer {
    attn_norm: Buffer,
    wq: GpuMatrix,
    wk: GpuMatrix,
    wv: GpuMatrix,
    bq: Option<Buffer>,
    bk: Option<Buffer>,
    bv: Option<Buffer>,
    q_norm: Option<Buffer>,
    k_norm: Option<Buffer>,
    wo: GpuMatrix,
    post_attn_norm: Option<Buffer>,
    ffn_norm: Buffer,
    w_gate: GpuMatrix,
    w_up: GpuMatrix,
    w_down: GpuMatrix,
    post_ffn_norm: Option<Buffer>,
}

/// A model's layers on one GPU, ready to prefill prompts.
pub struct GpuPrefill<'m> {
    ctx: &'m GpuContext,
    model: &'m Model<'m>,
    layers: Vec<GpuLayer>,
    kernels: LayerKernels,
    matmul: Matmul,
    attention: Attention,
    min_tokens: usize,
    /// A cap on [`Self::chunk_tokens`] below the device's.
    max_chunk: usize,
    routed: Option<RoutedAttention>,
    /// Decomposed attention for calls past the budget.
    cqs: Option<Cqs>,
    /// What it did in the last prompt.
    cqs_report: std::sync::Mutex<CqsReport>,
}

/// The activations of one chunk of `tokens` rows.
struct Workspace {
    x: Buffer,
    normed: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    q16: Buffer,
    attn: Buffer,
    proj: Buffer,
    gate: Buffer,
    up: Buffer,
    rope_global: Buffer,
    rope_sliding: Buffer,
}

impl<'m> GpuPrefill<'m> {
    /// Whether the GPU's kernels compute every step of `hp`'s layers, else
    /// the step they lack (attention-logit soft-capping, Gemma 2's). Checked
    /// before any device is opened, so that `--gpu auto` keeps such a model
    /// on the CPU and `--gpu on` says why it cannot.
    pub fn supports(hp: &HParams) -> Result<(), GpuError> {
        match hp.attn_softcap {
            Some(cap) => Err(GpuError::Kernel {
                kernel: "attention".into(),
                reason: format!(
                    "{} soft-caps attention scores (at {cap}), which the GPU does not",
                    hp.arch.gguf_name()
                ),
            }),
            None => Ok(()),
        }
    }

    /// Uploads `model`'s layers to `ctx`'s device and builds the kernels.
    pub fn new(ctx: &'m GpuContext, model: &'m Model<'m>) -> Result<Self, GpuError> {
        let hp = &model.hp;
        Self::supports(hp)?;
        let path = KernelPath::best(ctx).map_err(kernel_error)?;
        // The best path that takes the model's head size: the cooperative
        // attention takes 64, 128 and 256, the tiled one any.
        let (head_dim, group) = (hp.head_dim_k as u32, hp.n_gqa() as u32);
        let attention = Attention::new(&ctx.device, path, head_dim, group)
            .or_else(|_| Attention::new(&ctx.device, KernelPath::Tiled, head_dim, group))
            .map_err(kernel_error)?;
        if hp.head_dim_k != hp.head_dim_v {
            return Err(GpuError::Kernel {
                kernel: "attention".into(),
                reason: format!("key size {} differs from value size {}", hp.head_dim_k, hp.head_dim_v),
            });
        }
        let vector = |what: &str, v: &[f32]| ctx.upload(what, v);
        let optional = |what: &str, v: &Option<Vec<f32>>| v.as_ref().map(|v| ctx.upload(what, v)).transpose();
        let layers = model
            .weights()
            .layers
            .iter()
            .map(|l| {
                Ok(GpuLayer {
                    attn_norm: vector("attn_norm", &l.attn_norm)?,
                    wq: upload_matrix(ctx, "wq", &l.wq)?,
                    wk: upload_matrix(ctx, "wk", &l.wk)?,
                    wv: upload_matrix(ctx, "wv", &l.wv)?,
                    bq: optional("bq", &l.bq)?,
                    bk: optional("bk", &l.bk)?,
                    bv: optional("bv", &l.bv)?,
                    q_norm: optional("q_norm", &l.q_norm)?,
                    k_norm: optional("k_norm", &l.k_norm)?,
                    wo: upload_matrix(ctx, "wo", &l.wo)?,
                    post_attn_norm: optional("post_attn_norm", &l.post_attn_norm)?,
                    ffn_norm: vector("ffn_norm", &l.ffn_norm)?,
                    w_gate: upload_matrix(ctx, "w_gate", &l.w_gate)?,
                    w_up: upload_matrix(ctx, "w_up", &l.w_up)?,
                    w_down: upload_matrix(ctx, "w_down", &l.w_down)?,
                    post_ffn_norm: optional("post_ffn_norm", &l.post_ffn_norm)?,
                })
            })
            .collect::<Result<_, GpuError>>()?;
        Ok(Self {
            ctx,
            model,
            layers,
            kernels: LayerKernels::new(ctx)?,
            matmul: Matmul::new(ctx, path),
            attention,
            min_tokens: 1,
            max_chunk: usize::MAX,
            routed: None,
            cqs: None,
            cqs_report: Default::default(),
        })
    }

    /// Bounds one attention call's working memory to `bytes` (see
    /// [`super::cqs::working_bytes`]): calls past it are decomposed.
    pub fn with_attention_budget(mut self, bytes: u64) -> Result<Self, GpuError> {
        let hp = &self.model.hp;
        self.cqs = Some(Cqs::new(self.ctx, hp.head_dim_k, hp.n_gqa(), Some(bytes))?);
        Ok(self)
    }

    /// What decomposed attention did in the last prompt (zero calls when
    /// every call fit).
    pub fn attention_report(&self) -> CqsReport {
        self.cqs_report.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Routes the attention of layers without a window (or applies one fixed
    /// sparse pattern) as `settings` say. Routing reads this adapter's latency
    /// profile, which `sift gpu-profile` writes.
    pub fn with_routing(self, settings: RouteSettings) -> Result<Self, GpuError> {
        let hp = &self.model.hp;
        let (d, hq, hk) = (hp.head_dim_k as u32, hp.n_head as u32, hp.n_head_kv as u32);
        let profile = match settings.pattern {
            Some(_) => None,
            None => {
                let file = LatencyProfile::file(self.ctx, self.path(), d, hq, hk);
                Some(LatencyProfile::load(&file).map_err(|reason| GpuError::Kernel {
                    kernel: "routed attention".into(),
                    reason: format!("no latency profile ({reason}): run `sift gpu-profile` on this adapter"),
                })?)
            }
        };
        self.with_routing_profile(settings, profile)
    }

    /// [`Self::with_routing`] with the latency profile given.
    pub fn with_routing_profile(
        mut self,
        settings: RouteSettings,
        profile: Option<LatencyProfile>,
    ) -> Result<Self, GpuError> {
        let hp = &self.model.hp;
        let (d, group) = (hp.head_dim_k as u32, hp.n_gqa() as u32);
        self.routed = Some(RoutedAttention::new(self.ctx, self.path(), (d, group), settings, profile)?);
        Ok(self)
    }

    /// The routed attention, when [`Self::with_routing`] set it up.
    pub fn routed(&self) -> Option<&RoutedAttention> {
        self.routed.as_ref()
    }

    /// The kernel variant attention runs (the matmuls run the best one).
    pub fn path(&self) -> KernelPath {
        self.attention.path()
    }

    /// The most tokens one chunk holds: every activation buffer within one
    /// binding, and the matmul's f32 inputs too.
    pub fn chunk_tokens(&self) -> usize {
        let hp = &self.model.hp;
        let widest = [hp.n_embd, hp.n_head * hp.head_dim_k, hp.n_head * hp.head_dim_v, hp.n_ff].into_iter().max();
        let row_bytes = widest.unwrap_or(1) as u64 * 4;
        let limit = self.ctx.limits.max_storage_buffer_binding_size.min(self.ctx.limits.max_buffer_size);
        // Room for the attention kernel's padding of the last block.
        let tokens = ((limit / row_bytes) as usize).saturating_sub(64).clamp(1, self.max_chunk);
        match self.routed {
            // Sparse chunks start at multiples of the index's blocks.
            Some(_) if tokens >= 64 => tokens / 64 * 64,
            _ => tokens,
        }
    }

    /// Prompts shorter than `min_tokens` are left to the CPU (`--gpu auto`'s
    /// threshold; 1 takes every prompt).
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens.max(1);
        self
    }

    /// Chunks of at most `tokens` tokens, fewer than the device allows (to
    /// bound the GPU's memory, or to exercise chunking on a small prompt).
    pub fn with_max_chunk(mut self, tokens: usize) -> Self {
        self.max_chunk = tokens.max(1);
        self
    }

    /// Whether a fresh prompt of `n` tokens is long enough for this backend.
    pub fn takes_prompt(&self, n: usize) -> bool {
        n >= self.min_tokens
    }

    /// [`Self::run`] for the engine's seam.
    pub fn prefill_into(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        *hidden = self.run(tokens, pos0, cache, outputs, None)?;
        Ok(())
    }

    /// Runs `tokens` at positions `start..` through every layer (`cache`
    /// holds positions `..start`), stores each layer's keys and values in
    /// `cache`, and returns the final-normed hidden states of the `outputs`
    /// rows.
    pub fn run(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        trace: Option<Trace>,
    ) -> Result<Vec<f32>, GpuError> {
        let hp = &self.model.hp;
        let (n, end) = (tokens.len(), start + tokens.len());
        let started = std::time::Instant::now();
        // The report is of the last prompt that routed any layer: a later
        // prompt too short to route (a decoding step) leaves it as it is.
        let previous =
            self.routed.as_ref().map(|r| std::mem::take(&mut *r.report.lock().unwrap_or_else(|p| p.into_inner())));
        let chunk = self.chunk_tokens().min(n);
        let ws = self.workspace(chunk)?;
        let kv_dim = hp.n_head_kv * hp.head_dim_k;
        // Resident keys and values: every position, padded to the attention
        // kernel's blocks with zeros (finite).
        let rows = end.next_multiple_of(64);
        let resident: Vec<(Buffer, Buffer)> = (0..hp.n_layer)
            .map(|_| -> Result<_, GpuError> {
                let k = self.ctx.storage::<f16>("resident keys", rows * kv_dim)?;
                let v = self.ctx.storage::<f16>("resident values", rows * kv_dim)?;
                Ok((k, v))
            })
            .collect::<Result<_, _>>()?;
        let mut zero = self.ctx.batch();
        for (k, v) in &resident {
            zero.clear(k);
            zero.clear(v);
        }
        zero.clear(&ws.q16);
        zero.submit();
        self.upload_cached_keys_and_values(&resident, start, cache)?;
        let mut hidden = Vec::new();
        let mut embedded = Vec::new();
        let mut rope = RopeTable::default();
        let mut stages = Stages { ctx: self.ctx, batch: None, trace };
        *self.cqs_report.lock().unwrap_or_else(|p| p.into_inner()) = CqsReport::default();
        for pos0 in (start..end).step_by(chunk) {
            let chunk_tokens = &tokens[pos0 - start..(pos0 - start + chunk).min(n)];
            self.embed(chunk_tokens, &mut embedded);
            self.ctx.write(&ws.x, 0, &embedded);
            let positions = pos0..pos0 + chunk_tokens.len();
            for (table, base, scale) in
                [(&ws.rope_global, hp.rope.base, hp.rope.freq_scale), (&ws.rope_sliding, hp.rope.base_sliding, 1.0)]
            {
                rope.fill(&hp.rope.at_context(cache.n_ctx()), base, scale, positions.clone());
                let pairs: Vec<[f32; 2]> = rope.cos_sin().iter().map(|&(c, s)| [c, s]).collect();
                self.ctx.write(table, 0, &pairs);
            }
            for (il, l) in self.layers.iter().enumerate() {
                self.layer(&mut stages, il, l, &ws, &resident[il], pos0, chunk_tokens.len())?;
            }
            stages.submit();
            let wanted = match outputs {
                Outputs::All => 0..chunk_tokens.len(),
                Outputs::Last if pos0 + chunk_tokens.len() == end => chunk_tokens.len() - 1..chunk_tokens.len(),
                Outputs::Last | Outputs::CacheOnly => 0..0,
            };
            if !wanted.is_empty() {
                let x: Vec<f32> =
                    self.ctx.read(&ws.x, (wanted.start * hp.n_embd * 4) as u64, wanted.len() * hp.n_embd)?;
                let at = hidden.len();
                hidden.resize(at + x.len(), 0.0);
                blocks::rms_norm(&x, &self.model.weights().output_norm, hp.rms_eps, &mut hidden[at..]);
            }
        }
        self.store_keys_and_values(&resident, start..end, cache)?;
        if let (Some(r), Some(previous)) = (&self.routed, previous) {
            let mut report = r.report.lock().unwrap_or_else(|p| p.into_inner());
            match report.layers.is_empty() {
                true => *report = previous,
                false => self.finish_report(&mut report, &r.settings, n, started.elapsed().as_secs_f64() * 1e3)?,
            }
        }
        let report = self.attention_report();
        if report.calls > 0 {
            eprintln!(
                "gpu: attention past the budget of {} bytes: {report}",
                self.cqs.as_ref().and_then(Cqs::budget).unwrap_or(0)
            );
        }
        for buffer in ws.into_buffers() {
            self.ctx.recycle(buffer);
        }
        for (k, v) in resident {
            self.ctx.recycle(k);
            self.ctx.recycle(v);
        }
        Ok(hidden)
    }

    /// One layer for a chunk of `n` tokens at `pos0..`.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        s: &mut Stages,
        il: usize,
        l: &GpuLayer,
        ws: &Workspace,
        (keys, values): &(Buffer, Buffer),
        pos0: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let hp = &self.model.hp;
        let k = &self.kernels;
        let (q_dim, kv_dim) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
        let eps = hp.rms_eps;

        k.rms_norm(s.batch(), &ws.x, &l.attn_norm, &ws.normed, n, eps);
        s.stage("attn_norm", il, &ws.normed, n * hp.n_embd)?;
        for (w, out, bias, name) in [(&l.wq, &ws.q, &l.bq, "q"), (&l.wk, &ws.k, &l.bk, "k"), (&l.wv, &ws.v, &l.bv, "v")]
        {
            self.matmul(s.batch(), &ws.normed, w, out, n)?;
            if let Some(bias) = bias {
                k.add_bias(s.batch(), out, bias, n * w.rows, w.rows);
            }
            s.stage(name, il, out, n * w.rows)?;
        }
        if let Some(w) = &l.q_norm {
            k.rms_norm_in_place(s.batch(), &ws.q, w, n * hp.n_head, eps);
            s.stage("q_norm", il, &ws.q, n * q_dim)?;
        }
        if let Some(w) = &l.k_norm {
            k.rms_norm_in_place(s.batch(), &ws.k, w, n * hp.n_head_kv, eps);
            s.stage("k_norm", il, &ws.k, n * kv_dim)?;
        }
        let table = if hp.is_sliding(il) { &ws.rope_sliding } else { &ws.rope_global };
        k.rope(s.batch(), &ws.q, table, n, hp.n_head, hp.head_dim_k, hp.rope.n_rot, hp.rope.style);
        k.rope(s.batch(), &ws.k, table, n, hp.n_head_kv, hp.head_dim_k, hp.rope.n_rot, hp.rope.style);
        s.stage("q_rope", il, &ws.q, n * q_dim)?;
        s.stage("k_rope", il, &ws.k, n * kv_dim)?;
        k.to_f16(s.batch(), &ws.q, &ws.q16, n * q_dim, 0);
        k.to_f16(s.batch(), &ws.k, keys, n * kv_dim, pos0 * kv_dim);
        k.to_f16(s.batch(), &ws.v, values, n * kv_dim, pos0 * kv_dim);

        let shape = AttentionShape {
            n: n as u32,
            pos0: pos0 as u32,
            n_head: hp.n_head as u32,
            n_kv_head: hp.n_head_kv as u32,
            window: hp.window(il).map(|w| w as u32),
            scale: hp.attn_scale,
        };
        match (&self.routed, &self.cqs) {
            (_, Some(cqs)) if !cqs.fits(n, pos0 + n, hp.n_head, hp.n_head_kv, hp.head_dim_k) => {
                self.decomposed_attention(s, cqs, ws, keys, values, &shape)?
            }
            (Some(routed), _) if routed.takes(&shape) => {
                s.submit();
                let buffers = [&ws.q16, keys, values, &ws.attn];
                routed.attend(self.ctx, il, &shape, buffers, &self.attention, hp.head_dim_k)?;
            }
            _ => {
                let bind = self.attention.bind(&self.ctx.device, &ws.q16, keys, values, &ws.attn);
                let sizes = [ws.q16.size(), keys.size(), values.size(), ws.attn.size()];
                s.batch()
                    .record("attention", |pass| self.attention.dispatch(pass, &bind, &shape, sizes))
                    .map_err(kernel_error)?;
            }
        }
        s.stage("attn_out", il, &ws.attn, n * hp.n_head * hp.head_dim_v)?;
        self.matmul(s.batch(), &ws.attn, &l.wo, &ws.proj, n)?;
        s.stage("attn_proj", il, &ws.proj, n * hp.n_embd)?;
        if let Some(w) = &l.post_attn_norm {
            k.rms_norm_in_place(s.batch(), &ws.proj, w, n, eps);
            s.stage("attn_post_norm", il, &ws.proj, n * hp.n_embd)?;
        }
        k.add_assign(s.batch(), &ws.x, &ws.proj, n * hp.n_embd);
        s.stage("ffn_inp", il, &ws.x, n * hp.n_embd)?;

        k.rms_norm(s.batch(), &ws.x, &l.ffn_norm, &ws.normed, n, eps);
        s.stage("ffn_norm", il, &ws.normed, n * hp.n_embd)?;
        self.matmul(s.batch(), &ws.normed, &l.w_gate, &ws.gate, n)?;
        self.matmul(s.batch(), &ws.normed, &l.w_up, &ws.up, n)?;
        k.gated_activation(s.batch(), &ws.gate, &ws.up, n * hp.n_ff, hp.ffn_activation);
        s.stage("ffn_act", il, &ws.gate, n * hp.n_ff)?;
        self.matmul(s.batch(), &ws.gate, &l.w_down, &ws.proj, n)?;
        s.stage("ffn_out", il, &ws.proj, n * hp.n_embd)?;
        if let Some(w) = &l.post_ffn_norm {
            k.rms_norm_in_place(s.batch(), &ws.proj, w, n, eps);
            s.stage("ffn_post_norm", il, &ws.proj, n * hp.n_embd)?;
        }
        k.add_assign(s.batch(), &ws.x, &ws.proj, n * hp.n_embd);
        s.stage("l_out", il, &ws.x, n * hp.n_embd)
    }

    /// Completes the routed prompt's report and writes it where asked.
    fn finish_report(
        &self,
        report: &mut PrefillReport,
        settings: &RouteSettings,
        tokens: usize,
        prefill_ms: f64,
    ) -> Result<(), GpuError> {
        report.method = settings.pattern.map_or("routed", |p| p.name()).into();
        report.adapter = self.ctx.info.name.clone();
        report.tokens = tokens;
        report.budget = settings.pattern.is_none().then_some(settings.budget);
        report.tau = settings.pattern.is_none().then_some(settings.tau);
        report.delta = Some(settings.delta_source.clone());
        report.timing.prefill_ms = prefill_ms;
        let decomposed = self.attention_report();
        report.decomposed = (decomposed.calls > 0).then_some(decomposed);
        report.summarize();
        if let Some(path) = &settings.report {
            report.write(path).map_err(|e| GpuError::Kernel {
                kernel: "prefill report".into(),
                reason: format!("cannot write {}: {e}", path.display()),
            })?;
        }
        Ok(())
    }

    /// The attention of `shape` through [`Cqs`]: Q, K and V read back, the
    /// output written into the workspace's.
    fn decomposed_attention(
        &self,
        s: &mut Stages,
        cqs: &Cqs,
        ws: &Workspace,
        keys: &Buffer,
        values: &Buffer,
        shape: &AttentionShape,
    ) -> Result<(), GpuError> {
        let hp = &self.model.hp;
        let (n, kv_len) = (shape.n as usize, shape.kv_len() as usize);
        let (q_dim, kv_dim) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
        s.submit();
        let q: Vec<f16> = self.ctx.read(&ws.q16, 0, n * q_dim)?;
        let k: Vec<f16> = self.ctx.read(keys, 0, kv_len * kv_dim)?;
        let v: Vec<f16> = self.ctx.read(values, 0, kv_len * kv_dim)?;
        let call = AttentionCall {
            q: &q,
            k: &k,
            v: &v,
            queries: n,
            keys: kv_len,
            n_head: hp.n_head,
            n_kv_head: hp.n_head_kv,
            head_dim: hp.head_dim_k,
            mask: Mask { causal: true, window: shape.window },
            scale: shape.scale,
        };
        let mut out = vec![0.0f32; n * q_dim];
        let report = cqs.attend(self.ctx, &call, &mut out)?;
        self.ctx.write(&ws.attn, 0, &out);
        self.cqs_report.lock().unwrap_or_else(|p| p.into_inner()).absorb(&report);
        Ok(())
    }

    /// `y = x · wᵀ` for `n` rows of `x`.
    fn matmul(&self, b: &mut Batch, x: &Buffer, w: &GpuMatrix, y: &Buffer, n: usize) -> Result<(), GpuError> {
        let shape = MatmulShape { tokens: n as u32, n_in: w.cols as u32, n_out: w.rows as u32 };
        let bind = self.matmul.bind(&self.ctx.device, x, &w.data, y);
        let sizes = [x.size(), w.data.size(), y.size()];
        b.record("matmul", |pass| self.matmul.dispatch(pass, &bind, shape, sizes)).map_err(kernel_error)
    }

    /// The token embeddings of `tokens`, scaled as the model asks.
    fn embed(&self, tokens: &[u32], out: &mut Vec<f32>) {
        let hp = &self.model.hp;
        let embedding = &self.model.weights().token_embd;
        out.resize(tokens.len() * hp.n_embd, 0.0);
        out.par_chunks_mut(hp.n_embd).zip(tokens).for_each(|(row, &token)| {
            embedding.dequantize_row(token as usize, row);
            if let Some(scale) = hp.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        });
    }

    fn workspace(&self, tokens: usize) -> Result<Workspace, GpuError> {
        let hp: &HParams = &self.model.hp;
        let padded = tokens.next_multiple_of(64);
        let f32s = |what: &str, len: usize| self.ctx.storage::<f32>(what, len);
        let (q_dim, kv_dim, o_dim) =
            (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k, hp.n_head * hp.head_dim_v);
        Ok(Workspace {
            x: f32s("x", tokens * hp.n_embd)?,
            normed: f32s("normed", tokens * hp.n_embd)?,
            q: f32s("q", tokens * q_dim)?,
            k: f32s("k", tokens * kv_dim)?,
            v: f32s("v", tokens * kv_dim)?,
            q16: self.ctx.storage::<f16>("q f16", padded * q_dim)?,
            attn: f32s("attention out", padded * o_dim)?,
            proj: f32s("projection", tokens * hp.n_embd)?,
            gate: f32s("gate", tokens * hp.n_ff)?,
            up: f32s("up", tokens * hp.n_ff)?,
            rope_global: f32s("rope global", tokens * hp.rope.n_rot)?,
            rope_sliding: f32s("rope sliding", tokens * hp.rope.n_rot)?,
        })
    }

    /// Uploads the cached keys and values that rows from `start` on can see
    /// (every earlier position on a global layer, the window on a sliding
    /// one) into each layer's resident buffers.
    fn upload_cached_keys_and_values(
        &self,
        resident: &[(Buffer, Buffer)],
        start: usize,
        cache: &KvCache,
    ) -> Result<(), GpuError> {
        if start == 0 {
            return Ok(());
        }
        let hp = &self.model.hp;
        let (n_kv, dk, dv) = (hp.n_head_kv, hp.head_dim_k, hp.head_dim_v);
        for (il, (keys, values)) in resident.iter().enumerate() {
            let layer = cache.layer(il);
            let seen = layer.visible(start).start..start;
            let (mut k16, mut v16) = (vec![f16::ZERO; seen.len() * n_kv * dk], vec![f16::ZERO; seen.len() * n_kv * dv]);
            let (mut k32, mut v32) = (vec![0.0; dk], vec![0.0; dv]);
            for (i, pos) in seen.clone().enumerate() {
                for h in 0..n_kv {
                    layer.key(h, pos, &mut k32);
                    layer.value(h, pos, &mut v32);
                    k16[(i * n_kv + h) * dk..][..dk].convert_from_f32_slice(&k32);
                    v16[(i * n_kv + h) * dv..][..dv].convert_from_f32_slice(&v32);
                }
            }
            self.ctx.write(keys, (seen.start * n_kv * dk * 2) as u64, &k16);
            self.ctx.write(values, (seen.start * n_kv * dv * 2) as u64, &v16);
        }
        Ok(())
    }

    /// Reads every layer's resident keys and values at `positions` back and
    /// stores them in `cache`, position by position, layers in parallel.
    fn store_keys_and_values(
        &self,
        resident: &[(Buffer, Buffer)],
        positions: Range<usize>,
        cache: &mut KvCache,
    ) -> Result<(), GpuError> {
        let kv_dim = self.model.hp.n_head_kv * self.model.hp.head_dim_k;
        let (offset, len) = ((positions.start * kv_dim * 2) as u64, positions.len() * kv_dim);
        let read: Vec<(Vec<f16>, Vec<f16>)> = resident
            .iter()
            .map(|(k, v)| Ok((self.ctx.read(k, offset, len)?, self.ctx.read(v, offset, len)?)))
            .collect::<Result<_, GpuError>>()?;
        cache.layers_mut().par_iter_mut().zip(&read).for_each(|(layer, (keys, values))| {
            let (mut k32, mut v32) = (vec![0.0; kv_dim], vec![0.0; kv_dim]);
            for (i, pos) in positions.clone().enumerate() {
                for (dst, src) in [(&mut k32, keys), (&mut v32, values)] {
                    for (d, s) in dst.iter_mut().zip(&src[i * kv_dim..(i + 1) * kv_dim]) {
                        *d = s.to_f32();
                    }
                }
                layer.store(pos, &k32, &v32);
            }
        });
        Ok(())
    }
}

impl Workspace {
    fn into_buffers(self) -> [Buffer; 12] {
        let Self { x, normed, q, k, v, q16, attn, proj, gate, up, rope_global, rope_sliding } = self;
        [x, normed, q, k, v, q16, attn, proj, gate, up, rope_global, rope_sliding]
    }
}

/// The batch being recorded, and the trace that stages report to: with a
/// trace, each stage submits what was recorded and reads its output back.
struct Stages<'c, 't> {
    ctx: &'c GpuContext,
    batch: Option<Batch<'c>>,
    trace: Option<Trace<'t>>,
}

impl<'c> Stages<'c, '_> {
    fn batch(&mut self) -> &mut Batch<'c> {
        self.batch.get_or_insert_with(|| self.ctx.batch())
    }

    fn stage(&mut self, name: &str, layer: usize, buffer: &Buffer, len: usize) -> Result<(), GpuError> {
        let Some(trace) = self.trace.as_mut() else { return Ok(()) };
        if let Some(batch) = self.batch.take() {
            batch.submit();
        }
        let rows: Vec<f32> = self.ctx.read(buffer, 0, len)?;
        trace(name, layer, &rows);
        Ok(())
    }

    fn submit(&mut self) {
        if let Some(batch) = self.batch.take() {
            batch.submit();
        }
    }
}

/// Dequantizes `m` to f16, rows in parallel, and uploads it.
fn upload_matrix(ctx: &GpuContext, what: &str, m: &Matrix) -> Result<GpuMatrix, GpuError> {
    let mut data = vec![f16::ZERO; m.rows * m.cols];
    data.par_chunks_mut(m.cols).enumerate().for_each_init(
        || vec![0.0f32; m.cols],
        |row, (r, out)| {
            m.dequantize_row(r, row);
            for (o, &v) in out.iter_mut().zip(row.iter()) {
                *o = f16::from_f32(v);
            }
        },
    );
    Ok(GpuMatrix { data: ctx.upload(what, &data)?, rows: m.rows, cols: m.cols })
}

fn kernel_error(e: super::KernelError) -> GpuError {
    GpuError::Kernel { kernel: "prefill".into(), reason: e.to_string() }
}

/// One upload serving many sessions (`sift bench`).
impl PrefillBackend for &GpuPrefill<'_> {
    fn takes(&mut self, _pos0: usize, n: usize) -> bool {
        self.takes_prompt(n)
    }

    fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        outputs: Outputs,
        hidden: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        self.prefill_into(tokens, pos0, cache, outputs, hidden)
    }
}
