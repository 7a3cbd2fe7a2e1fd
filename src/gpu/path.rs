//! Which variant of the heavy kernels (matmul, attention) an adapter runs.
//!
//! The fast variant multiplies 16 × 16 × 16 tiles of f16 on the tensor cores
//! through WGSL's cooperative matrices (`EXPERIMENTAL_COOPERATIVE_MATRIX`),
//! in subgroups of 32; the fallback uses plain workgroup tiles and f32 FMAs.
//! The choice is made at run time from what the adapter lists.

use super::GpuContext;

/// A kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelPath {
    /// Cooperative-matrix tiles (f16 × f16 → f32) on subgroups of 32.
    CooperativeMatrix,
    /// Workgroup-memory tiles and f32 arithmetic.
    Tiled,
}

impl KernelPath {
    /// Features every kernel path needs: f16 storage, subgroup shuffles and
    /// immediates (the kernels' shapes travel as immediate data).
    pub const REQUIRED_FEATURES: wgpu::Features =
        wgpu::Features::SHADER_F16.union(wgpu::Features::SUBGROUP).union(wgpu::Features::IMMEDIATES);

    /// Bytes of immediate data the kernels use at most.
    pub const IMMEDIATE_BYTES: u32 = 36;

    /// Workgroup memory of the largest cooperative kernel: the attention at
    /// head dimension 256 (32 keys and values, 64 × 32 scores and probabilities).
    const COOPERATIVE_WORKGROUP_BYTES: u32 = 48_128;

    /// Whether `ctx` can run this path. Both need f16, subgroups of at least
    /// 8 (the tiled attention sums a query's 8 partial dot products by
    /// shuffles) and the kernels' immediates; the cooperative path also a
    /// 16 × 16 × 16 f16 → f32 configuration, subgroups of exactly 32 and
    /// 47 KiB of workgroup memory.
    pub fn available(self, ctx: &GpuContext) -> Result<(), KernelError> {
        let lacks = |what| Err(KernelError::Device { kernel: self.name(), what });
        if !ctx.has(Self::REQUIRED_FEATURES) {
            return lacks("f16 shaders, subgroups or immediates");
        }
        if ctx.limits.max_immediate_size < Self::IMMEDIATE_BYTES {
            return lacks("36 bytes of immediates");
        }
        if ctx.info.subgroup_min_size < 8 {
            return lacks("subgroups of 8 or more");
        }
        if self == Self::Tiled {
            return Ok(());
        }
        use wgpu::CooperativeScalarType as T;
        if !ctx.has(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            return lacks("cooperative matrices");
        }
        if !ctx
            .cooperative_matrices
            .iter()
            .any(|p| (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == T::F16 && p.cr_type == T::F32)
        {
            return lacks("16 × 16 × 16 f16 → f32 cooperative matrices");
        }
        if (ctx.info.subgroup_min_size, ctx.info.subgroup_max_size) != (32, 32) {
            return lacks("subgroups of exactly 32");
        }
        if ctx.limits.max_compute_workgroup_storage_size < Self::COOPERATIVE_WORKGROUP_BYTES {
            return lacks("47 KiB of workgroup memory");
        }
        Ok(())
    }

    /// The fastest path `ctx` runs, if any.
    pub fn best(ctx: &GpuContext) -> Result<Self, KernelError> {
        match Self::CooperativeMatrix.available(ctx) {
            Ok(()) => Ok(Self::CooperativeMatrix),
            Err(_) => Self::Tiled.available(ctx).map(|()| Self::Tiled),
        }
    }

    /// The name `gpu-bench` and the logs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::CooperativeMatrix => "coop-matrix",
            Self::Tiled => "tiled",
        }
    }
}

/// Why a kernel cannot run a given shape.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("{kernel}: {what}")]
    Shape { kernel: &'static str, what: String },
    #[error("{kernel}: the device lacks {what}")]
    Device { kernel: &'static str, what: &'static str },
}
