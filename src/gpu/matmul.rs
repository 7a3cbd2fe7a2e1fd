//! Y = X·Wᵀ on the GPU, for prefill: every token's activations times a weight
//! matrix at once.
//!
//! X is f32 `[tokens][n_in]`, W is f16 `[n_out][n_in]` (GGUF's row order, one
//! output after another), Y is f32 `[tokens][n_out]`; products accumulate in
//! f32. Two shaders compute it: `shaders/matmul_coop.wgsl` on the tensor cores
//! (128 × 128 output blocks of 16 × 16 × 16 cooperative-matrix products; X is
//! rounded to f16 on its way into workgroup memory) and `shaders/matmul.wgsl`
//! on plain 64 × 64 workgroup tiles in f32, through one of its two entry
//! points: 4 × 4 outputs per invocation on GPUs, 8 × 8 on software renderers
//! (the shader says why). All handle any `tokens` and `n_out`; the
//! cooperative one needs `n_in` to be a multiple of 4.

use super::pipeline::{Access, Pipeline};
use super::{GpuContext, KernelError, KernelPath};

const TILED: &str = include_str!("../../shaders/matmul.wgsl");
const COOPERATIVE: &str = include_str!("../../shaders/matmul_coop.wgsl");

/// The sizes of one product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub tokens: u32,
    pub n_in: u32,
    pub n_out: u32,
}

impl MatmulShape {
    /// Multiply-adds count twice.
    pub fn flops(&self) -> f64 {
        2.0 * self.tokens as f64 * self.n_in as f64 * self.n_out as f64
    }
}

/// The matmul pipeline of one path.
pub struct Matmul {
    kernel: Pipeline,
    path: KernelPath,
}

impl Matmul {
    pub fn new(ctx: &GpuContext, path: KernelPath) -> Self {
        let (source, entry) = match path {
            KernelPath::CooperativeMatrix => (COOPERATIVE, "main"),
            KernelPath::Tiled if ctx.is_software() => (TILED, "main_software"),
            KernelPath::Tiled => (TILED, "main"),
        };
        let buffers = [Access::Read, Access::Read, Access::ReadWrite];
        let kernel = Pipeline::entry(&ctx.device, "matmul", "", source, entry, &buffers);
        Self { kernel, path }
    }

    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// The output block one workgroup computes, as (tokens, outputs).
    fn block(&self) -> (u32, u32) {
        match self.path {
            KernelPath::CooperativeMatrix => (128, 128),
            KernelPath::Tiled => (64, 64),
        }
    }

    /// Binds X, W and Y (see the module's layout).
    pub fn bind(&self, device: &wgpu::Device, x: &wgpu::Buffer, w: &wgpu::Buffer, y: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind(device, &[x, w, y])
    }

    /// Records Y = X·Wᵀ for `shape` into `pass`, after checking that the
    /// buffers bound in `bind` (of sizes `sizes`: X, W, Y in bytes) hold it.
    pub fn dispatch(
        &self,
        pass: &mut wgpu::ComputePass,
        bind: &wgpu::BindGroup,
        shape: MatmulShape,
        sizes: [u64; 3],
    ) -> Result<(), KernelError> {
        let bad = |what: String| Err(KernelError::Shape { kernel: "matmul", what });
        let MatmulShape { tokens, n_in, n_out } = shape;
        if tokens == 0 || n_in == 0 || n_out == 0 {
            return bad(format!("empty product {tokens} × {n_in} → {n_out}"));
        }
        if self.path == KernelPath::CooperativeMatrix && !n_in.is_multiple_of(4) {
            return bad(format!("n_in = {n_in} is not a multiple of 4"));
        }
        let need = [tokens as u64 * n_in as u64 * 4, n_out as u64 * n_in as u64 * 2, tokens as u64 * n_out as u64 * 4];
        for ((name, need), have) in ["X", "W", "Y"].iter().zip(need).zip(sizes) {
            if have < need {
                return bad(format!("{name} holds {have} bytes, the shape needs {need}"));
            }
        }
        let (bm, bn) = self.block();
        let groups = [n_out.div_ceil(bn), tokens.div_ceil(bm), 1];
        if groups[0] > 65535 || groups[1] > 65535 {
            return bad(format!("{tokens} × {n_out} needs more than 65535 workgroups a side"));
        }
        self.kernel.dispatch(pass, bind, &[tokens, n_in, n_out, 0], groups);
        Ok(())
    }
}
