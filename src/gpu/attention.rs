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
//!
//! Both shaders take the keys a workgroup visits from a small WGSL file put in
//! front of them: every key up to its last query (`attention_keys_dense.wgsl`),
//! or, for [`Attention::sparse`], the key lists of a [`SparseIndex`]
//! (`attention_keys_sparse.wgsl`): per KV head and 64-position query block, a
//! list of 64-position key blocks and a list of single positions. The tile loop
//! and the masks are the same; a sparse pattern only changes the sequence of
//! positions, so its kernel does the work of the keys it lists and no other.
//!
//! A dispatch may compute only some of the KV heads ([`KvHeads`],
//! `attention_heads.wgsl`): RouteSparse sends a layer's dense choices through
//! the dense kernel and the rest through the sparse one, into the same O.
//!
//! [`SparseIndex`]: super::route::SparseIndex

use super::pipeline::{Access, Pipeline};
use super::{KernelError, KernelPath};

/// The tiled shader, whose `partial` entry computes the pieces of a
/// decomposed call ([`super::cqs`]).
pub(crate) const TILED: &str = include_str!("../../shaders/attention.wgsl");
const COOPERATIVE: &str = include_str!("../../shaders/attention_coop.wgsl");
const HEADS: &str = include_str!("../../shaders/attention_heads.wgsl");
const DENSE_KEYS: &str = include_str!("../../shaders/attention_keys_dense.wgsl");
const SPARSE_KEYS: &str = include_str!("../../shaders/attention_keys_sparse.wgsl");

/// The header the tiled shader is compiled behind for its dense entries (and
/// for `partial`, which reads no key span but shares the module).
pub(crate) fn tiled_header(head_dim: u32) -> String {
    shader(KernelPath::Tiled, head_dim, 1, false).1
}

/// The shader an [`Attention`] of `path` compiles and the header put in
/// front of it: the head size, the cooperative shader's query heads per
/// workgroup, the head selection and the key-span file (sparse or dense).
pub(crate) fn shader(path: KernelPath, head_dim: u32, heads_per_block: u32, sparse: bool) -> (&'static str, String) {
    let keys = if sparse { SPARSE_KEYS } else { DENSE_KEYS };
    match path {
        KernelPath::CooperativeMatrix => (
            COOPERATIVE,
            format!("const D: u32 = {head_dim}u;\nconst HEADS: u32 = {heads_per_block}u;\n{HEADS}\n{keys}"),
        ),
        KernelPath::Tiled => (TILED, format!("const D: u32 = {head_dim}u;\n{HEADS}\n{keys}")),
    }
}

/// Rows of the cooperative shader's blocks, in tokens and in positions; also
/// the query and key blocks of a sparse index.
pub const BLOCK: u32 = 64;

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

/// A set of KV heads for one dispatch: bit h for KV head h, at most
/// [`KvHeads::MAX`] of them; every head by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvHeads(u32);

impl KvHeads {
    /// Every KV head of the shape, however many.
    pub const ALL: Self = Self(0);
    /// The most KV heads a subset can name.
    pub const MAX: u32 = 32;

    /// The heads `heads`; `None` when there are none or one is not below
    /// [`Self::MAX`].
    pub fn of(heads: impl IntoIterator<Item = u32>) -> Option<Self> {
        let bits = heads.into_iter().try_fold(0u32, |bits, h| (h < Self::MAX).then(|| bits | 1 << h))?;
        (bits != 0).then_some(Self(bits))
    }

    /// How many of a shape's `n_kv_head` heads the set holds.
    pub fn count(self, n_kv_head: u32) -> u32 {
        match self.0 {
            0 => n_kv_head,
            bits => bits.count_ones(),
        }
    }

    /// Whether KV head `h` is in the set.
    pub fn contains(self, h: u32) -> bool {
        self.0 == 0 || (h < Self::MAX && self.0 >> h & 1 == 1)
    }

    /// Whether the set holds a head at or past `n_kv_head`.
    fn exceeds(self, n_kv_head: u32) -> bool {
        n_kv_head < Self::MAX && self.0 >> n_kv_head != 0
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
    sparse: bool,
}

/// The four buffers of a sparse index, as `attention_keys_sparse.wgsl` reads
/// them, and the query blocks per KV head they describe.
pub struct IndexBuffers<'b> {
    pub block_offsets: &'b wgpu::Buffer,
    pub blocks: &'b wgpu::Buffer,
    pub column_offsets: &'b wgpu::Buffer,
    pub columns: &'b wgpu::Buffer,
    pub query_blocks: u32,
    /// The KV heads the index lists keys for: the heads its dispatch computes.
    pub kv_heads: KvHeads,
}

impl Attention {
    /// `group_heads` is the number of query heads per KV head; `head_dim` must
    /// be a multiple of 32 (the cooperative shader: 64, 128 or 256).
    pub fn new(device: &wgpu::Device, path: KernelPath, head_dim: u32, group_heads: u32) -> Result<Self, KernelError> {
        Self::build(device, path, head_dim, group_heads, false)
    }

    /// The same kernel reading the keys from a sparse index, bound with
    /// [`Self::bind_sparse`]; it runs only on chunks starting at a multiple of
    /// [`BLOCK`] positions, without a window.
    pub fn sparse(
        device: &wgpu::Device,
        path: KernelPath,
        head_dim: u32,
        group_heads: u32,
    ) -> Result<Self, KernelError> {
        Self::build(device, path, head_dim, group_heads, true)
    }

    fn build(
        device: &wgpu::Device,
        path: KernelPath,
        head_dim: u32,
        group_heads: u32,
        sparse: bool,
    ) -> Result<Self, KernelError> {
        let bad = |what: String| Err(KernelError::Shape { kernel: "attention", what });
        if head_dim == 0 || !head_dim.is_multiple_of(32) {
            return bad(format!("head dimension {head_dim} is not a multiple of 32"));
        }
        if group_heads == 0 {
            return bad("no query heads per KV head".into());
        }
        let heads_per_block = [4, 2, 1].into_iter().find(|h| group_heads.is_multiple_of(*h)).unwrap_or(1);
        if path == KernelPath::CooperativeMatrix && ![64, 128, 256].contains(&head_dim) {
            return bad(format!("head dimension {head_dim}: the cooperative shader takes 64, 128 or 256"));
        }
        let (source, header) = shader(path, head_dim, heads_per_block, sparse);
        let (label, buffers): (_, &[Access]) = match sparse {
            false => ("attention", &[Access::Read, Access::Read, Access::Read, Access::ReadWrite]),
            true => (
                "sparse attention",
                &[
                    Access::Read,
                    Access::Read,
                    Access::Read,
                    Access::ReadWrite,
                    Access::Read,
                    Access::Read,
                    Access::Read,
                    Access::Read,
                ],
            ),
        };
        let kernel = Pipeline::new(device, label, &header, source, buffers);
        Ok(Self { kernel, path, head_dim, group_heads, heads_per_block, sparse })
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

    /// Binds Q, K, V and O (see the module's layout) for a dense kernel.
    pub fn bind(
        &self,
        device: &wgpu::Device,
        q: &wgpu::Buffer,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        o: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        assert!(!self.sparse, "a sparse kernel binds its index too");
        self.kernel.bind(device, &[q, k, v, o])
    }

    /// Binds Q, K, V, O and the index for a sparse kernel.
    pub fn bind_sparse(
        &self,
        device: &wgpu::Device,
        [q, k, v, o]: [&wgpu::Buffer; 4],
        index: &IndexBuffers,
    ) -> wgpu::BindGroup {
        assert!(self.sparse, "a dense kernel has no index");
        self.kernel.bind(device, &[q, k, v, o, index.block_offsets, index.blocks, index.column_offsets, index.columns])
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
        self.dispatch_heads(pass, bind, shape, sizes, KvHeads::ALL)
    }

    /// [`Self::dispatch`] for the KV heads `heads` only; the other heads' rows
    /// of O are left as they are.
    pub fn dispatch_heads(
        &self,
        pass: &mut wgpu::ComputePass,
        bind: &wgpu::BindGroup,
        shape: &AttentionShape,
        sizes: [u64; 4],
        heads: KvHeads,
    ) -> Result<(), KernelError> {
        if self.sparse {
            return Err(KernelError::Shape { kernel: "sparse attention", what: "dispatched without an index".into() });
        }
        self.dispatch_with(pass, bind, shape, sizes, heads)
    }

    /// [`Self::dispatch`] for a sparse kernel bound with `index`, which must
    /// cover every query of `shape` (the shader finds the query blocks per KV
    /// head from the length of its offsets), for the KV heads the index lists.
    pub fn dispatch_sparse(
        &self,
        pass: &mut wgpu::ComputePass,
        bind: &wgpu::BindGroup,
        shape: &AttentionShape,
        sizes: [u64; 4],
        index: &IndexBuffers,
    ) -> Result<(), KernelError> {
        let query_blocks = index.query_blocks;
        let bad = |what: String| Err(KernelError::Shape { kernel: "sparse attention", what });
        if !self.sparse {
            return bad("a dense kernel dispatched with an index".into());
        }
        if !shape.pos0.is_multiple_of(BLOCK) || shape.window.is_some() {
            return bad(format!(
                "a chunk at {} with window {:?}: sparse chunks start at multiples of {BLOCK}, without windows",
                shape.pos0, shape.window
            ));
        }
        if query_blocks < shape.kv_len().div_ceil(BLOCK) {
            return bad(format!("an index of {query_blocks} query blocks for {} positions", shape.kv_len()));
        }
        let offsets = (shape.n_kv_head as u64 * query_blocks as u64 + 1) * 4;
        if index.block_offsets.size() != offsets || index.column_offsets.size() != offsets {
            return bad(format!("index offsets of {} bytes for {offsets}", index.block_offsets.size()));
        }
        self.dispatch_with(pass, bind, shape, sizes, index.kv_heads)
    }

    fn dispatch_with(
        &self,
        pass: &mut wgpu::ComputePass,
        bind: &wgpu::BindGroup,
        shape: &AttentionShape,
        sizes: [u64; 4],
        heads: KvHeads,
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
        if heads.exceeds(shape.n_kv_head) {
            return bad(format!("{heads:?} names a head past the shape's {}", shape.n_kv_head));
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
                heads.count(shape.n_kv_head) * (self.group_heads / self.heads_per_block),
                1,
            ],
            KernelPath::Tiled => [shape.n.div_ceil(16), heads.count(shape.n_kv_head) * self.group_heads, 1],
        };
        if groups[0] > 65535 || groups[1] > 65535 {
            return bad(format!("{} queries need more than 65535 workgroups", shape.n));
        }
        // The tiled shader's shape goes on with `partial`'s fields: causal,
        // and the keys (the cooperative shader reads the first seven only).
        let immediates = [
            shape.n,
            shape.pos0,
            shape.n_head,
            shape.n_kv_head,
            shape.window.unwrap_or(0),
            shape.scale.to_bits(),
            heads.0,
            1,
            shape.kv_len(),
        ];
        self.kernel.dispatch(pass, bind, &immediates, groups);
        Ok(())
    }
}
