//! The pipeline of one piece: the `partial` entry of the tiled attention
//! shader, which writes unnormalised outputs and (m, l) per query and head.

use super::super::attention::{tiled_header, TILED};
use super::super::pipeline::{Access, Pipeline};
use super::super::KernelError;
use super::plan::BLOCK;

/// The sizes of one piece's dispatch.
#[derive(Clone, Copy, Debug)]
pub struct PieceShape {
    pub queries: u32,
    pub keys: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub causal: bool,
    /// 0: no window.
    pub window: u32,
    pub scale: f32,
}

pub(crate) struct PieceKernel {
    kernel: Pipeline,
    group_heads: u32,
}

impl PieceKernel {
    /// `head_dim` a multiple of 32; `group_heads` query heads per KV head.
    pub fn new(device: &wgpu::Device, head_dim: u32, group_heads: u32) -> Result<Self, KernelError> {
        let bad = |what: String| Err(KernelError::Shape { kernel: "attention partial", what });
        if head_dim == 0 || !head_dim.is_multiple_of(32) {
            return bad(format!("head dimension {head_dim} is not a multiple of 32"));
        }
        if group_heads == 0 {
            return bad("no query heads per KV head".into());
        }
        // Q, K, V, O, tokens, blocks, statistics.
        let buffers = [
            Access::Read,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
        ];
        let header = tiled_header(head_dim);
        let kernel = Pipeline::entry(device, "attention partial", &header, TILED, "partial", &buffers);
        Ok(Self { kernel, group_heads })
    }

    /// Binds the piece's buffers in the kernel's order: Q, K, V, O, tokens,
    /// blocks, statistics.
    pub fn bind(&self, device: &wgpu::Device, buffers: &[&wgpu::Buffer; 7]) -> wgpu::BindGroup {
        self.kernel.bind(device, buffers)
    }

    /// Workgroups of the dispatch: 16 queries of one head each.
    pub fn groups(&self, shape: &PieceShape) -> Result<[u32; 3], KernelError> {
        let groups = [shape.queries.div_ceil(BLOCK as u32), shape.n_head, 1];
        if groups[0] > 65535 || groups[1] > 65535 {
            return Err(KernelError::Shape {
                kernel: "attention partial",
                what: format!("{} queries need more than 65535 workgroups", shape.queries),
            });
        }
        if shape.n_kv_head == 0 || shape.n_head != shape.n_kv_head * self.group_heads {
            return Err(KernelError::Shape {
                kernel: "attention partial",
                what: format!("{} query heads over {} KV heads", shape.n_head, shape.n_kv_head),
            });
        }
        Ok(groups)
    }

    pub fn dispatch(&self, pass: &mut wgpu::ComputePass, bind: &wgpu::BindGroup, shape: &PieceShape, groups: [u32; 3]) {
        let immediates = [
            shape.queries,
            0,
            shape.n_head,
            shape.n_kv_head,
            shape.window,
            shape.scale.to_bits(),
            0,
            u32::from(shape.causal),
            shape.keys,
        ];
        self.kernel.dispatch(pass, bind, &immediates, groups);
    }
}
