//! Dense causal attention on the GPU, for prefill: a chunk of queries against
//! every key up to its last.
//!
//! Q is f16 `[n][n_head][D]` (queries at positions `pos0 .. pos0 + n`), K and
//! V are f16 `[kv_len][n_kv_head][D]` with `kv_len = pos0 + n`, O is f32
//! `[n][n_head][D]`. Query head h reads KV head `h / (n_head / n_kv_head)`;
//! query t sees key j when `j <= t` and, on a sliding-window layer,
//! `t - j < window`. Two shaders compute it: `shaders/attention_coop.wgsl` on
//! the tensor cores (two passes, see there) and `shaders/attention.wgsl`, an
//! online softmax in f32 on plain workgroup tiles. The cooperative shader
//! reads and writes whole 64-row blocks: its Q and O buffers need room for
//! [`AttentionShape::padded_tokens`] tokens, K and V for
//! [`AttentionShape::padded_positions`] positions, the padding finite.

use super::pipeline::{Access, Pipeline};
use super::{KernelError, KernelPath};

/// The tiled shader, whose `partial` entry computes the pieces of a
/// decomposed call ([`super::cqs`]).
pub(crate) const TILED: &str = include_str!("../../shaders/attention.wgsl");
const COOPERATIVE: &str = include_str!("../../shaders/attention_coop.wgsl");

/// Rows of the cooperative shader's blocks, in tokens and in positions.
const BLOCK: u32 = 64;

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Queries in this chunk.
    pub n: u32,
    /// Position of the chunk's first query.
    pub pos0: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    /// `None` on global layers.
    pub window: Option<u32>,
    /// The factor scores are multiplied by before the softmax.
    pub scale: f32,
}

impl AttentionShape {
    /// Keys the chunk attends to: every position up to its last query.
    pub fn kv_len(&self) -> u32 {
        self.pos0 + self.n
    }

    /// Tokens the Q and O buffers must hold for the cooperative shader.
    pub fn padded_tokens(&self) -> u32 {
        self.n.next_multiple_of(BLOCK)
    }

    /// Positions the K and V buffers must hold for the cooperative shader.
    pub fn padded_positions(&self) -> u32 {
        self.kv_len().next_multiple_of(BLOCK)
    }

    /// The FLOPs of the attention a query does, counted the usual way: two
    /// products (Q·Kᵀ and P·V) of 2·D per visible key.
    pub fn flops(&self, head_dim: u32) -> f64 {
        let visible: f64 = match self.window {
            None => (0..self.n as u64).map(|i| (self.pos0 as u64 + i + 1) as f64).sum(),
            Some(w) => (0..self.n as u64).map(|i| (self.pos0 as u64 + i + 1).min(w as u64) as f64).sum(),
        };
        4.0 * head_dim as f64 * self.n_head as f64 * visible
    }
}

/// The attention pipeline of one path, head dimension and head grouping.
pub struct Attention {
    kernel: Pipeline,
    path: KernelPath,
    head_dim: u32,
    group_heads: u32,
    /// Query heads one cooperative workgroup takes.
    heads_per_block: u32,
}

impl Attention {
    /// `group_heads` is the number of query heads per KV head; `head_dim` must
    /// be a multiple of 32 (the cooperative shader: 64, 128 or 256).
    pub fn new(device: &wgpu::Device, path: KernelPath, head_dim: u32, group_heads: u32) -> Result<Self, KernelError> {
        let bad = |what: String| Err(KernelError::Shape { kernel: "attention", what });
        if head_dim == 0 || !head_dim.is_multiple_of(32) {
            return bad(format!("head dimension {head_dim} is not a multiple of 32"));
        }
        if group_heads == 0 {
            return bad("no query heads per KV head".into());
        }
        let heads_per_block = [4, 2, 1].into_iter().find(|h| group_heads.is_multiple_of(*h)).unwrap_or(1);
        let (source, header) = match path {
            KernelPath::CooperativeMatrix => {
                if ![64, 128, 256].contains(&head_dim) {
                    return bad(format!("head dimension {head_dim}: the cooperative shader takes 64, 128 or 256"));
                }
                (COOPERATIVE, format!("const D: u32 = {head_dim}u;\nconst HEADS: u32 = {heads_per_block}u;"))
            }
            KernelPath::Tiled => (TILED, format!("const D: u32 = {head_dim}u;")),
        };
        let buffers = [Access::Read, Access::Read, Access::Read, Access::ReadWrite];
        let kernel = Pipeline::new(device, "attention", &header, source, &buffers);
        Ok(Self { kernel, path, head_dim, group_heads, heads_per_block })
    }

    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// Tokens the Q and O buffers must hold for `shape` on this path.
    pub fn query_rows(&self, shape: &AttentionShape) -> u32 {
        match self.path {
            KernelPath::CooperativeMatrix => shape.padded_tokens(),
            KernelPath::Tiled => shape.n,
        }
    }

    /// Positions the K and V buffers must hold for `shape` on this path.
    pub fn key_rows(&self, shape: &AttentionShape) -> u32 {
        match self.path {
            KernelPath::CooperativeMatrix => shape.padded_positions(),
            KernelPath::Tiled => shape.kv_len(),
        }
    }

    /// Binds Q, K, V and O (see the module's layout).
    pub fn bind(
        &self,
        device: &wgpu::Device,
        q: &wgpu::Buffer,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        o: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        self.kernel.bind(device, &[q, k, v, o])
    }

    /// Records attention for `shape` into `pass`, after checking that the
    /// buffers bound in `bind` (of sizes `sizes`: Q, K, V, O in bytes) hold it.
    pub fn dispatch(
        &self,
        pass: &mut wgpu::ComputePass,
        bind: &wgpu::BindGroup,
        shape: &AttentionShape,
        sizes: [u64; 4],
    ) -> Result<(), KernelError> {
        let bad = |what: String| Err(KernelError::Shape { kernel: "attention", what });
        if shape.n == 0 {
            return bad("no queries".into());
        }
        if shape.n_kv_head == 0 || shape.n_head != shape.n_kv_head * self.group_heads {
            return bad(format!(
                "{} query heads over {} KV heads; this pipeline takes {} per KV head",
                shape.n_head, shape.n_kv_head, self.group_heads
            ));
        }
        if shape.window == Some(0) {
            return bad("a window of 0 positions".into());
        }
        let d = self.head_dim as u64;
        let q_rows = self.query_rows(shape) as u64;
        let k_rows = self.key_rows(shape) as u64;
        let need = [
            q_rows * shape.n_head as u64 * d * 2,
            k_rows * shape.n_kv_head as u64 * d * 2,
            k_rows * shape.n_kv_head as u64 * d * 2,
            q_rows * shape.n_head as u64 * d * 4,
        ];
        for ((name, need), have) in ["Q", "K", "V", "O"].iter().zip(need).zip(sizes) {
            if have < need {
                return bad(format!("{name} holds {have} bytes, the shape needs {need}"));
            }
        }
        let groups = match self.path {
            KernelPath::CooperativeMatrix => [
                shape.n.div_ceil(BLOCK / self.heads_per_block),
                shape.n_kv_head * (self.group_heads / self.heads_per_block),
                1,
            ],
            KernelPath::Tiled => [shape.n.div_ceil(16), shape.n_head, 1],
        };
        if groups[0] > 65535 || groups[1] > 65535 {
            return bad(format!("{} queries need more than 65535 workgroups", shape.n));
        }
        // The tiled shader's shape goes on with `partial`'s fields: causal,
        // and the keys (the cooperative shader reads the first six only).
        let immediates = [
            shape.n,
            shape.pos0,
            shape.n_head,
            shape.n_kv_head,
            shape.window.unwrap_or(0),
            shape.scale.to_bits(),
            1,
            shape.kv_len(),
        ];
        self.kernel.dispatch(pass, bind, &immediates, groups);
        Ok(())
    }
}
