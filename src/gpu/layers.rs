//! The small kernels of a transformer layer on the GPU, each the twin of a CPU
//! function in [`crate::model::blocks`]: RMS norm (beside its input or in
//! place), RoPE from a CPU-built angle table, the gated MLP activation,
//! residual and bias adds, and the f32 → f16 conversion that feeds attention.
//! Shapes travel as `[u32; N]` parameter words (f32 values as their bits).

use wgpu::Buffer;

use super::context::{Batch, GpuContext, GpuError, Kernel, Shader};
use crate::model::hparams::{FfnActivation, RopeStyle};

const NORM: Shader = Shader { name: "norm", source: include_str!("../../shaders/norm.wgsl") };
const ROPE: Shader = Shader { name: "rope", source: include_str!("../../shaders/rope.wgsl") };
const ACTIVATION: Shader = Shader { name: "activation", source: include_str!("../../shaders/activation.wgsl") };
const RESIDUAL: Shader = Shader { name: "residual", source: include_str!("../../shaders/residual.wgsl") };
const CONVERT: Shader = Shader { name: "convert", source: include_str!("../../shaders/convert.wgsl") };

/// Invocations per workgroup of the element-wise kernels.
const LANES: u32 = 256;

pub struct LayerKernels {
    norm: Kernel,
    norm_in_place: Kernel,
    rope: Kernel,
    silu_gated: Kernel,
    gelu_gated: Kernel,
    add_assign: Kernel,
    add_bias: Kernel,
    to_f16: Kernel,
}

impl LayerKernels {
    pub fn new(ctx: &GpuContext) -> Result<Self, GpuError> {
        Ok(Self {
            norm: ctx.kernel(&NORM, "norm", &[])?,
            norm_in_place: ctx.kernel(&NORM, "norm_in_place", &[])?,
            rope: ctx.kernel(&ROPE, "rope", &[])?,
            silu_gated: ctx.kernel(&ACTIVATION, "silu_gated", &[])?,
            gelu_gated: ctx.kernel(&ACTIVATION, "gelu_gated", &[])?,
            add_assign: ctx.kernel(&RESIDUAL, "add_assign", &[])?,
            add_bias: ctx.kernel(&RESIDUAL, "add_bias", &[])?,
            to_f16: ctx.kernel(&CONVERT, "to_f16", &[])?,
        })
    }

    /// `out = x / rms(x) * weight` for `rows` rows as wide as `weight` (f32).
    pub fn rms_norm(&self, b: &mut Batch, x: &Buffer, weight: &Buffer, out: &Buffer, rows: usize, eps: f32) {
        let width = weight.size() / 4;
        let params = [width as u32, rows as u32, eps.to_bits(), 0];
        let groups = b.grid(rows as u32);
        b.dispatch(
            &self.norm,
            &params,
            &[weight.as_entire_binding(), x.as_entire_binding(), out.as_entire_binding()],
            groups,
        );
    }

    /// [`Self::rms_norm`] in place.
    pub fn rms_norm_in_place(&self, b: &mut Batch, x: &Buffer, weight: &Buffer, rows: usize, eps: f32) {
        let width = weight.size() / 4;
        let params = [width as u32, rows as u32, eps.to_bits(), 0];
        let groups = b.grid(rows as u32);
        b.dispatch(&self.norm_in_place, &params, &[weight.as_entire_binding(), x.as_entire_binding()], groups);
    }

    /// Rotates every head of `tokens` rows of `heads * head_dim` values in
    /// `x` by the angles of `cos_sin` (`tokens * n_rot / 2` pairs).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        b: &mut Batch,
        x: &Buffer,
        cos_sin: &Buffer,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        n_rot: usize,
        style: RopeStyle,
    ) {
        let rows = tokens * heads;
        let half = n_rot / 2;
        let params =
            [head_dim as u32, heads as u32, half as u32, rows as u32, u32::from(style == RopeStyle::Neox), 0, 0, 0];
        let groups = b.grid(((rows * half) as u32).div_ceil(LANES));
        b.dispatch(&self.rope, &params, &[cos_sin.as_entire_binding(), x.as_entire_binding()], groups);
    }

    /// `gate = act(gate) * up` over `len` values.
    pub fn gated_activation(&self, b: &mut Batch, gate: &Buffer, up: &Buffer, len: usize, act: FfnActivation) {
        let kernel = match act {
            FfnActivation::Silu => &self.silu_gated,
            FfnActivation::GeluTanh => &self.gelu_gated,
        };
        let groups = b.grid((len as u32).div_ceil(LANES));
        b.dispatch(kernel, &[len as u32, 0, 0, 0], &[gate.as_entire_binding(), up.as_entire_binding()], groups);
    }

    /// `x += y` over `len` values.
    pub fn add_assign(&self, b: &mut Batch, x: &Buffer, y: &Buffer, len: usize) {
        let groups = b.grid((len as u32).div_ceil(LANES));
        b.dispatch(&self.add_assign, &[len as u32, 0, 0, 0], &[x.as_entire_binding(), y.as_entire_binding()], groups);
    }

    /// Adds `bias` (`width` values) to each of the `len / width` rows of `x`.
    pub fn add_bias(&self, b: &mut Batch, x: &Buffer, bias: &Buffer, len: usize, width: usize) {
        let groups = b.grid((len as u32).div_ceil(LANES));
        let params = [len as u32, width as u32, 0, 0];
        b.dispatch(&self.add_bias, &params, &[x.as_entire_binding(), bias.as_entire_binding()], groups);
    }

    /// Writes `len` (even) f32 values of `src` as f16 into `dst`, starting at
    /// its element `dst_offset` (even).
    pub fn to_f16(&self, b: &mut Batch, src: &Buffer, dst: &Buffer, len: usize, dst_offset: usize) {
        debug_assert!(len.is_multiple_of(2) && dst_offset.is_multiple_of(2));
        let pairs = (len / 2) as u32;
        let groups = b.grid(pairs.div_ceil(LANES));
        let params = [pairs, (dst_offset / 2) as u32, 0, 0];
        b.dispatch(&self.to_f16, &params, &[src.as_entire_binding(), dst.as_entire_binding()], groups);
    }
}
