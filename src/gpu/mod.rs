//! The GPU: WGSL compute kernels dispatched through wgpu.
//!
//! [`matmul`] and [`attention`] are the heavy kernels of prefill, each in a
//! cooperative-matrix and a plain-tile variant chosen by [`KernelPath`].

pub mod attention;
pub mod matmul;
mod path;
mod pipeline;

pub use path::{KernelError, KernelPath};
