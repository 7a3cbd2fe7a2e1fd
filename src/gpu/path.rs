//! Which variant of the heavy kernels (matmul, attention) an adapter runs.
//!
//! The fast variant multiplies 16 × 16 × 16 tiles of f16 on the tensor cores
//! through WGSL's cooperative matrices (`EXPERIMENTAL_COOPERATIVE_MATRIX`),
//! in subgroups of 32; the fallback uses plain workgroup tiles and f32 FMAs.
//! The choice is made at run time from what the adapter lists.

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
    pub const REQUIRED_FEATURES: wgpu::Features = wgpu::Features::SHADER_F16
        .union(wgpu::Features::SUBGROUP)
        .union(wgpu::Features::IMMEDIATES);

    /// Bytes of immediate data the kernels use at most.
    pub const IMMEDIATE_BYTES: u32 = 32;

    /// Whether the adapter can run the cooperative-matrix path: the feature,
    /// a 16 × 16 × 16 f16 → f32 configuration, and subgroups of exactly 32.
    pub fn cooperative_on(adapter: &wgpu::Adapter) -> bool {
        use wgpu::CooperativeScalarType as T;
        let info = adapter.get_info();
        adapter.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            && info.subgroup_min_size == 32
            && info.subgroup_max_size == 32
            && adapter.cooperative_matrix_properties().iter().any(|p| {
                (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == T::F16 && p.cr_type == T::F32
            })
    }

    /// The fastest path a device opened on `adapter` runs.
    pub fn best(adapter: &wgpu::Adapter, device: &wgpu::Device) -> Self {
        if device.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) && Self::cooperative_on(adapter) {
            Self::CooperativeMatrix
        } else {
            Self::Tiled
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
