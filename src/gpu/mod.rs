//! GPU prefill through wgpu: the device, its pools, and the kernels.
//!
//! The CPU decodes; the GPU only runs whole prompts. [`GpuContext`] opens one
//! adapter (Vulkan: a discrete GPU before an integrated one, a software
//! rasterizer such as lavapipe only when asked for), requests the adapter's own
//! limits and the features that speed kernels up (f16 arithmetic, subgroups,
//! cooperative matrices, timestamp queries), and keeps pipelines and buffers in
//! pools so that a forward pass creates neither. Kernels are WGSL files in the
//! top-level `shaders/` folder, compiled into the binary with `include_str!`.
//!
//! The heavy kernels of prefill, [`matmul`] and [`attention`], come in a
//! cooperative-matrix (tensor-core) and a plain-tile variant, chosen at run
//! time by [`KernelPath`].
//!
//! The Vulkan loader is opened at run time: on a machine without one, opening a
//! context fails with [`GpuError::NoAdapter`] and nothing else changes.

mod context;
pub mod layers;
pub mod on_demand;
pub mod prefill;
pub mod report;
pub mod route;

pub use context::{AdapterPolicy, Batch, GpuContext, GpuError, Kernel, Readback, Shader};

pub mod attention;
pub mod cqs;
pub mod matmul;
mod path;
mod pipeline;

pub use path::{KernelError, KernelPath};
