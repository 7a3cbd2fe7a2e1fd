//! One global layer's attention, routed: probe, candidates, router, index,
//! sparse kernel, and what the report says of it.
//!
//! [`RoutedAttention::attend`] replaces the dense attention dispatch of a
//! layer without a window, for a chunk that starts at a multiple of 64
//! positions (prefill makes its chunks so): it runs the probe and the index
//! builders on the chunk's queries and the resident keys, builds every
//! candidate's mask per KV head with its mass estimate, and either routes
//! (`--prefill-attn routed`: [`super::router::route`] under the budget, with
//! the latency profile's times) or applies one fixed pattern at
//! MInference's budget (`ashape`, `vslash`, `blocksparse`: the baselines, no
//! fallback). The KV heads whose choice is dense go through the dense kernel,
//! in one dispatch of those heads, submitted first; each sparse choice of the
//! others goes into an index and a dispatch of the sparse kernel of its own,
//! fewest keys first, made while the GPU computes the heads before it. Its
//! times start once the GPU has finished the work recorded before (the
//! layer's projections, and earlier layers'), so that they count what routing
//! itself costs. With the audit on, dense attention runs beside it into
//! scratch, and the true mass kept is measured on 256 rows spread over the
//! chunk (row statistics over the index's keys against those over all keys).

use std::sync::Mutex;
use std::time::Instant;

use half::f16;
use rayon::prelude::*;
use wgpu::Buffer;

use super::calibration::Residual;
use super::candidates::{estimate, keep_recent, Candidate, Estimate, HeadLines, Pattern};
use super::index::{value_norm_max, Mask, SparseIndex};
use super::probe::{Probe, ProbeKernels, ProbeRows};
use super::profile::LatencyProfile;
use super::router::{route, Choice};
use super::{RecentRows, RouteSettings};
use crate::gpu::attention::{Attention, AttentionShape, KvHeads, BLOCK};
use crate::gpu::report::{CandidateReport, HeadAudit, HeadReport, LayerReport, PrefillReport};
use crate::gpu::{GpuContext, GpuError, KernelPath};

/// Rows of the chunk the audit measures the true mass on.
const AUDIT_ROWS: u32 = 256;

/// The routed attention of a prefill: kernels, profile, settings, and the
/// report of the prompt being prefilled.
pub struct RoutedAttention {
    pub settings: RouteSettings,
    sparse: Attention,
    probe: ProbeKernels,
    profile: Option<LatencyProfile>,
    pub report: Mutex<PrefillReport>,
    /// The residuals per (layer, KV head, sparse candidate), when calibrating.
    pub residuals: Mutex<Vec<Residual>>,
}

fn kernel_error(e: crate::gpu::KernelError) -> GpuError {
    GpuError::Kernel { kernel: "routed attention".into(), reason: e.to_string() }
}

/// One call measured against dense attention: per KV head the relative
/// error, the mean per-row L2 error and the true mass kept; and the dense
/// kernel's GPU time.
struct Audit {
    heads: Vec<(f64, f64, f64)>,
    dense_ms: Option<f64>,
}

/// What one KV head got, before the report.
struct Chosen {
    candidate: Candidate,
    mask: Mask,
    estimate: Estimate,
    lower: f64,
    fallback: bool,
}

impl RoutedAttention {
    /// Kernels for heads of `head_dim` with `group_heads` query heads per KV
    /// head; routing needs `profile`, the fixed patterns do not.
    pub fn new(
        ctx: &GpuContext,
        path: KernelPath,
        (head_dim, group_heads): (u32, u32),
        settings: RouteSettings,
        profile: Option<LatencyProfile>,
    ) -> Result<Self, GpuError> {
        if settings.pattern.is_none() && profile.is_none() {
            return Err(GpuError::Kernel {
                kernel: "routed attention".into(),
                reason: "no latency profile for this adapter and head shape: run `sift gpu-profile`".into(),
            });
        }
        Ok(Self {
            sparse: Attention::sparse(&ctx.device, path, head_dim, group_heads).map_err(kernel_error)?,
            probe: ProbeKernels::new(ctx, head_dim)?,
            profile,
            settings,
            report: Mutex::default(),
            residuals: Mutex::default(),
        })
    }

    /// Whether this call can go sparse, and, when routing, whether it may pay:
    /// a chunk whose dense attention costs less than the probe (a few queries
    /// after a long prefix: a chat's next turn, a teacher-forced batch) runs
    /// dense without one.
    pub fn takes(&self, shape: &AttentionShape) -> bool {
        let blocks = shape.pos0 / BLOCK..shape.kv_len().div_ceil(BLOCK);
        let pays = match (&self.settings.pattern, &self.profile) {
            (None, Some(p)) => {
                let dense = p.mask_time_us(Candidate::DENSE, &Mask::Dense, blocks, shape.kv_len());
                dense.zip(p.probe_us(shape.kv_len())).is_none_or(|(dense, probe)| dense > probe)
            }
            _ => true,
        };
        shape.window.is_none() && shape.pos0.is_multiple_of(BLOCK) && shape.n_kv_head <= KvHeads::MAX && pays
    }

    /// Attention of layer `layer` for `shape` into `out`, from the chunk's f16
    /// queries and the resident keys and values. Everything recorded before
    /// must have been submitted; this submits its own work.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        ctx: &GpuContext,
        layer: usize,
        shape: &AttentionShape,
        [q16, keys, values, out]: [&Buffer; 4],
        dense: &Attention,
        head_dim: usize,
    ) -> Result<(), GpuError> {
        ctx.wait()?;
        let started = Instant::now();
        let hk = shape.n_kv_head as usize;
        let kv_len = shape.kv_len();
        let query_blocks = shape.pos0 / BLOCK..kv_len.div_ceil(BLOCK);
        let rows = ProbeRows::new(shape.pos0, shape.n, 32, 16);
        let mut probe = self.probe.run(ctx, shape, &rows, q16, keys)?;
        let routing_started = Instant::now();
        let lines: Vec<HeadLines> = (0..hk).into_par_iter().map(|h| HeadLines::new(&probe, h)).collect();
        let measuring = Instant::now();
        let ranked: Vec<&[u32]> = lines.iter().map(|l| &l.columns[..]).collect();
        self.probe.column_masses(ctx, shape, &rows, q16, keys, &mut probe, &ranked)?;
        let measuring_ms = measuring.elapsed().as_secs_f64() * 1e3;
        let library: Vec<Candidate> = match self.settings.pattern {
            Some(p) => vec![Candidate::DENSE, fixed_budget(p)],
            None => Candidate::library(),
        };
        // Per KV head, every candidate's mask (a description: nothing is
        // listed yet) and estimate, in parallel over heads and candidates (a
        // layer of few KV heads would leave most cores idle).
        let options: Vec<Vec<(Candidate, Mask, Estimate)>> = lines
            .par_iter()
            .enumerate()
            .map(|(h, lines)| {
                library
                    .par_iter()
                    .map(|&c| {
                        let mask = self.widened(c.mask(&probe, lines, h), &probe, &rows, h, lines);
                        let e = estimate(&mask, &probe, &rows, h, lines);
                        (c, mask, e)
                    })
                    .collect()
            })
            .collect();
        let lower = |pattern: Pattern, e: &Estimate| {
            let kept = match self.settings.recent_rows {
                RecentRows::Bound => e.mass.min(e.worst_recent),
                RecentRows::Mean | RecentRows::Keep => e.mass,
            };
            (kept - self.settings.delta_of(pattern)).max(0.0)
        };
        let time = |c: Candidate, mask: &Mask| {
            self.profile.as_ref().and_then(|p| p.mask_time_us(c, mask, query_blocks.clone(), kv_len)).unwrap_or(0.0)
        };
        let overhead_us = self.profile.as_ref().and_then(|p| p.probe_us(kv_len)).unwrap_or(0.0);
        let heads: Vec<Vec<Choice>> = options
            .par_iter()
            .map(|o| {
                o.par_iter()
                    .map(|(c, mask, e)| Choice {
                        risk: e.risk(self.settings.alpha),
                        lower: lower(c.pattern, e),
                        time_us: time(*c, mask),
                    })
                    .collect()
            })
            .collect();
        let (plan, picks): (Option<_>, Vec<usize>) = match self.settings.pattern {
            // A fixed pattern everywhere, as MInference's baselines.
            Some(_) => (None, vec![1; hk]),
            None => {
                let plan = route(&heads, self.settings.budget, overhead_us, self.settings.tau);
                let picks = plan.choice.clone();
                (Some(plan), picks)
            }
        };
        let weighed: Vec<Vec<CandidateReport>> = options
            .iter()
            .zip(&heads)
            .map(|(o, choices)| {
                o.iter()
                    .zip(choices)
                    .map(|((c, _, e), choice)| CandidateReport {
                        pattern: c.pattern.name().into(),
                        budget: c.pattern.budget_units(c.budget),
                        mass_estimate: e.mass,
                        mass_lower: choice.lower,
                        time_us: choice.time_us,
                    })
                    .collect()
            })
            .collect();
        let mut chosen: Vec<Chosen> = options
            .into_iter()
            .zip(&picks)
            .enumerate()
            .map(|(h, (mut o, &i))| {
                let (candidate, mask, estimate) = o.swap_remove(i);
                let fallback = plan.as_ref().is_some_and(|p| p.fallback[h]);
                Chosen { candidate, lower: lower(candidate.pattern, &estimate), mask, estimate, fallback }
            })
            .collect();
        let routing_ms = routing_started.elapsed().as_secs_f64() * 1e3 - measuring_ms;

        // The dense choices go to the dense kernel in one dispatch, submitted
        // first; then each sparse choice to the sparse kernel in a dispatch of
        // its own, the heads that visit fewest keys first. The block lists of
        // every query block of the choices that read them are copied back
        // before any kernel is submitted (a copy submitted after a kernel would
        // wait for it). Each sparse head's lists are spelt out and uploaded
        // while the GPU computes the heads submitted before it, so that only
        // the first one's lie on the critical path where no head is dense.
        let lists_started = Instant::now();
        let mut readbacks = (0..hk)
            .map(|h| chosen[h].candidate.pattern.reads_lists().then(|| probe.read_head_lists(ctx, h)).transpose())
            .collect::<Result<Vec<_>, GpuError>>()?;
        let is_dense = |c: &Chosen| c.mask == Mask::Dense;
        let dense_heads = KvHeads::of((0..hk as u32).filter(|&h| is_dense(&chosen[h as usize])));
        let mut sparse_heads: Vec<(f64, usize)> = (0..hk)
            .filter(|&h| !is_dense(&chosen[h]))
            .map(|h| (chosen[h].mask.visited_keys(query_blocks.clone()), h))
            .collect();
        sparse_heads.sort_by(|a, b| a.0.total_cmp(&b.0));
        let sizes = [q16.size(), keys.size(), values.size(), out.size()];
        let mut lists_ms = lists_started.elapsed().as_secs_f64() * 1e3;
        let mut batch = ctx.batch();
        batch.mark();
        if let Some(heads) = dense_heads {
            let bind = dense.bind(&ctx.device, q16, keys, values, out);
            batch
                .record("attention", |pass| dense.dispatch_heads(pass, &bind, shape, sizes, heads))
                .map_err(kernel_error)?;
        }
        batch.mark();
        batch.flush();
        let mut indexes: Vec<Option<SparseIndex>> = vec![None; hk];
        let mut gpu_indexes = Vec::new();
        for &(_, h) in &sparse_heads {
            let started = Instant::now();
            if let Some(readback) = readbacks[h].take() {
                let lists = readback.wait(ctx)?;
                let mask = chosen[h].candidate.full_mask(&probe, &lines[h], h, || Ok::<_, GpuError>(lists.into()))?;
                chosen[h].mask = self.widened(mask, &probe, &rows, h, &lines[h]);
            }
            let mut masks = vec![None; hk];
            masks[h] = Some(&chosen[h].mask);
            let index = SparseIndex::new(&masks, kv_len);
            let gpu_index = index.upload(ctx)?;
            indexes[h] = Some(index);
            lists_ms += started.elapsed().as_secs_f64() * 1e3;
            let buffers = gpu_index.buffers();
            let bind = self.sparse.bind_sparse(&ctx.device, [q16, keys, values, out], &buffers);
            batch.mark();
            batch
                .record("sparse attention", |pass| self.sparse.dispatch_sparse(pass, &bind, shape, sizes, &buffers))
                .map_err(kernel_error)?;
            batch.mark();
            batch.flush();
            gpu_indexes.push(gpu_index);
        }
        // Between marks: the dense heads, then for each sparse head the GPU
        // waiting for its lists (if it did) and its kernel.
        let kernel = batch.submit_timed()?.unwrap_or_default();
        let dense_kernel_ms = kernel.first().copied().unwrap_or(0.0);
        let sparse_kernel_ms: f64 = kernel.iter().skip(2).step_by(2).sum();
        let lists_waited_ms: f64 = kernel.iter().skip(1).step_by(2).sum();
        for gpu_index in gpu_indexes {
            gpu_index.recycle(ctx);
        }
        let wall_ms = started.elapsed().as_secs_f64() * 1e3;

        let audit = match self.settings.audit {
            true => {
                let masks: Vec<Option<&Mask>> = chosen.iter().map(|c| (!is_dense(c)).then_some(&c.mask)).collect();
                Some(self.audit(ctx, shape, [q16, keys, values, out], dense, &masks, head_dim)?)
            }
            false => None,
        };
        let dense_ms = audit.as_ref().and_then(|a| a.dense_ms);
        if self.settings.calibrate {
            self.calibrate(ctx, shape, [q16, keys], &probe, &rows, &lines)?;
        }
        probe.release(ctx);
        let v_max = match self.settings.report.is_some() || self.settings.audit {
            true => value_norm_max(&ctx.read::<f16>(values, 0, kv_len as usize * hk * head_dim)?, hk, head_dim),
            false => vec![0.0; hk],
        };

        let mut report = self.report.lock().unwrap_or_else(|p| p.into_inner());
        let heads_report: Vec<HeadReport> = chosen
            .iter()
            .zip(weighed)
            .enumerate()
            .map(|(h, (c, candidates))| {
                let certificate = 2.0 * (1.0 - c.lower) * v_max[h];
                let audit = audit.as_ref().map(|a| {
                    let (relative_error, mean_row_error, true_mass) = a.heads[h];
                    HeadAudit { relative_error, mean_row_error, true_mass, covered: mean_row_error <= certificate }
                });
                HeadReport {
                    kv_head: h,
                    pattern: c.candidate.pattern.name().into(),
                    budget: c.candidate.pattern.budget_units(c.candidate.budget),
                    density: indexes[h].as_ref().map_or(0.0, |i| i.density(h as u32)),
                    mass_estimate: c.estimate.mass,
                    mass_lower: c.lower,
                    disagreement: c.estimate.disagreement,
                    risk: c.estimate.risk(self.settings.alpha),
                    fallback: c.fallback,
                    v_max: v_max[h],
                    certificate,
                    audit,
                    candidates,
                }
            })
            .collect();
        let planned_us = heads.iter().zip(&picks).map(|(o, &i)| o[i].time_us).sum::<f64>() + overhead_us;
        let dense_us: f64 = heads.iter().map(|o| o[0].time_us).sum();
        report.layers.push(LayerReport {
            layer,
            pos0: shape.pos0 as usize,
            queries: shape.n as usize,
            budget_us: plan.as_ref().map(|p| p.budget_us),
            planned_us,
            dense_us,
            wall_ms,
            kernel_ms: dense_kernel_ms + sparse_kernel_ms,
            dense_ms,
            heads: heads_report,
        });
        for (name, ms) in &probe.kernels {
            *report.timing.probe_kernels_ms.entry(name.to_string()).or_default() += ms;
        }
        report.timing.probe_ms += probe.probe_ms;
        report.timing.index_ms += probe.index_ms;
        report.timing.routing_ms += routing_ms;
        report.timing.lists_ms += lists_ms;
        report.timing.lists_waited_ms += lists_waited_ms;
        report.timing.kernel_ms += dense_kernel_ms + sparse_kernel_ms;
        report.timing.dense_kernel_ms += dense_kernel_ms;
        report.timing.sparse_kernel_ms += sparse_kernel_ms;
        report.timing.routed_wall_ms += wall_ms;
        report.timing.dense_estimate_ms += dense_us / 1e3;
        if let Some(ms) = dense_ms {
            *report.timing.dense_measured_ms.get_or_insert(0.0) += ms;
        }
        Ok(())
    }

    /// `mask` of KV head `h` with the recent rows' query blocks widened until
    /// each of those rows keeps τ, when the settings keep them
    /// ([`RecentRows::Keep`]); else `mask`. A mask's recent query blocks list
    /// the same blocks whether it lists only the probe's query blocks or all
    /// of them, so both forms are widened alike.
    fn widened(&self, mask: Mask, probe: &Probe, rows: &ProbeRows, h: usize, lines: &HeadLines) -> Mask {
        match self.settings.recent_rows {
            RecentRows::Keep => keep_recent(mask, probe, rows, h, lines, self.settings.tau),
            RecentRows::Mean | RecentRows::Bound => mask,
        }
    }

    /// Per KV head: the relative error against dense attention over the
    /// chunk, the mean per-row L2 error, and the mean true mass on the audit
    /// rows (1 for the heads without a mask in `masks`, which ran dense); and
    /// the dense kernel's GPU time (`None` without timestamp queries).
    #[allow(clippy::too_many_arguments)]
    fn audit(
        &self,
        ctx: &GpuContext,
        shape: &AttentionShape,
        [q16, keys, values, out]: [&Buffer; 4],
        dense: &Attention,
        masks: &[Option<&Mask>],
        d: usize,
    ) -> Result<Audit, GpuError> {
        let index = match masks.iter().any(Option::is_some) {
            true => Some(SparseIndex::new(masks, shape.kv_len()).upload(ctx)?),
            false => None,
        };
        let (hq, hk) = (shape.n_head as usize, shape.n_kv_head as usize);
        let n = shape.n as usize;
        let scratch = ctx.storage::<f32>("audit dense out", (out.size() / 4) as usize)?;
        let bind = dense.bind(&ctx.device, q16, keys, values, &scratch);
        let sizes = [q16.size(), keys.size(), values.size(), scratch.size()];
        let mut batch = ctx.batch();
        batch.mark();
        batch.record("attention", |pass| dense.dispatch(pass, &bind, shape, sizes)).map_err(kernel_error)?;
        batch.mark();
        let dense_ms = batch.submit_timed()?.and_then(|t| t.first().copied());
        let exact: Vec<f32> = ctx.read(&scratch, 0, n * hq * d)?;
        let sparse: Vec<f32> = ctx.read(out, 0, n * hq * d)?;
        ctx.recycle(scratch);
        let masses = match &index {
            Some(index) => self.true_masses(ctx, shape, [q16, keys], Some(index))?,
            None => vec![1.0; hk],
        };
        let group = hq / hk;
        let heads = (0..hk)
            .map(|h| {
                let mass = match &index {
                    Some(i) if i.heads.contains(h as u32) => masses[h],
                    _ => 1.0,
                };
                let (mut diff, mut norm, mut row_error) = (0.0f64, 0.0f64, 0.0f64);
                for t in 0..n {
                    for g in 0..group {
                        let at = (t * hq + h * group + g) * d;
                        let row_diff: f64 =
                            (0..d).map(|c| (exact[at + c] as f64 - sparse[at + c] as f64).powi(2)).sum();
                        diff += row_diff;
                        norm += (0..d).map(|c| (exact[at + c] as f64).powi(2)).sum::<f64>();
                        row_error += row_diff.sqrt();
                    }
                }
                ((diff / norm.max(1e-300)).sqrt(), row_error / (n * group) as f64, mass)
            })
            .collect();
        if let Some(index) = index {
            index.recycle(ctx);
        }
        Ok(Audit { heads, dense_ms })
    }

    /// Per KV head, the mean over the audit rows (and the head's query heads)
    /// of the attention mass `index` keeps; all kept without one.
    fn true_masses(
        &self,
        ctx: &GpuContext,
        shape: &AttentionShape,
        [q16, keys]: [&Buffer; 2],
        index: Option<&super::GpuIndex>,
    ) -> Result<Vec<f64>, GpuError> {
        let (hq, hk) = (shape.n_head as usize, shape.n_kv_head as usize);
        let count = AUDIT_ROWS.min(shape.n);
        let rows: Vec<u32> = (0..count)
            .map(|i| shape.pos0 + ((2 * i + 1) as u64 * shape.n as u64 / (2 * count as u64)) as u32)
            .collect();
        let rows_buffer = ctx.upload("audit rows", &rows)?;
        let all_buffer = ctx.storage::<[f32; 2]>("audit stats", rows.len() * hq)?;
        let kept_buffer = ctx.storage::<[f32; 2]>("audit sparse stats", rows.len() * hq)?;
        let mut batch = ctx.batch();
        let r = (&rows_buffer, count);
        self.probe.row_stats(&mut batch, ctx, shape, r, q16, keys, &all_buffer, None)?;
        let buffers = index.map(|i| i.buffers());
        self.probe.row_stats(&mut batch, ctx, shape, r, q16, keys, &kept_buffer, buffers.as_ref())?;
        batch.submit();
        let all: Vec<[f32; 2]> = ctx.read(&all_buffer, 0, rows.len() * hq)?;
        let kept_stats: Vec<[f32; 2]> = ctx.read(&kept_buffer, 0, rows.len() * hq)?;
        for b in [rows_buffer, all_buffer, kept_buffer] {
            ctx.recycle(b);
        }
        let group = hq / hk;
        Ok((0..hk)
            .map(|h| {
                let mut sum = 0.0;
                for r in 0..rows.len() {
                    for g in 0..group {
                        let ([m, l], [ms, ls]) = (all[r * hq + h * group + g], kept_stats[r * hq + h * group + g]);
                        sum += (ls as f64 / l as f64) * ((ms - m) as f64).exp();
                    }
                }
                sum / (rows.len() * group) as f64
            })
            .collect())
    }

    /// Records m̂ − m and min(m̂, ŵ) − m for every sparse candidate of the
    /// library and KV head of this call.
    #[allow(clippy::too_many_arguments)]
    fn calibrate(
        &self,
        ctx: &GpuContext,
        shape: &AttentionShape,
        qk: [&Buffer; 2],
        probe: &Probe,
        rows: &ProbeRows,
        lines: &[HeadLines],
    ) -> Result<(), GpuError> {
        let hk = shape.n_kv_head as usize;
        let mut residuals = Vec::new();
        let head_lists = (0..hk).map(|h| probe.head_lists(ctx, h)).collect::<Result<Vec<_>, _>>()?;
        for c in Candidate::library().iter().filter(|c| c.pattern != Pattern::Dense) {
            let masks = (0..hk)
                .map(|h| {
                    let mask = c.full_mask(probe, &lines[h], h, || Ok(head_lists[h].clone()))?;
                    Ok(self.widened(mask, probe, rows, h, &lines[h]))
                })
                .collect::<Result<Vec<Mask>, GpuError>>()?;
            let refs: Vec<Option<&Mask>> = masks.iter().map(Some).collect();
            let index = SparseIndex::new(&refs, shape.kv_len()).upload(ctx)?;
            let truth = self.true_masses(ctx, shape, qk, Some(&index))?;
            index.recycle(ctx);
            for (h, mask) in masks.iter().enumerate() {
                let e = estimate(mask, probe, rows, h, &lines[h]);
                let (mean, recent) = (e.mass - truth[h], e.mass.min(e.worst_recent) - truth[h]);
                residuals.push(Residual { pattern: c.pattern, mean, recent });
            }
        }
        self.residuals.lock().unwrap_or_else(|p| p.into_inner()).extend(residuals);
        Ok(())
    }
}

/// The budget a fixed pattern runs at: MInference's defaults (A-shape 128 +
/// 3968 keys, vertical-slash 1000 columns and 6096 diagonals, block-sparse 100
/// blocks); the union at 100 blocks beyond 1024 diagonals.
pub fn fixed_budget(pattern: Pattern) -> Candidate {
    let budget = match pattern {
        Pattern::Dense => [0, 0],
        Pattern::AShape => [2, 62],
        Pattern::VerticalSlash => [1000, 6096],
        Pattern::BlockSparse => [100, 0],
        Pattern::Union => [100, 1024],
    };
    Candidate { pattern, budget }
}
