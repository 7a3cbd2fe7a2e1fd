// Y = X·Wᵀ on the tensor cores: 16 × 16 × 16 cooperative-matrix products with
// f16 operands and f32 accumulators.
//
// Same buffers as matmul.wgsl (X f32 [tokens][n_in], W f16 [n_out][n_in],
// Y f32 [tokens][n_out]); n_in must be a multiple of 4, so that X and W are
// read four elements at a time. A workgroup of 8 subgroups of 32 computes one
// 128 × 128 block of Y. Each K step stages a 32-wide slice of X (rounded to
// f16) and of W in workgroup memory, zero-padded past the edges; subgroup s
// owns the 32 × 64 sub-block at rows 32·(s / 2), columns 64·(s % 2): 2 × 4
// accumulators, each fed by one A tile of X and one B tile of Wᵀ per 16 of K.
//
// In WGSL's cooperative-matrix extension, coopLoad reads column-major and
// coopLoadT row-major. The X slice is [m][k] (row-major A); the W slice is
// [n][k], which is Wᵀ = B column-major. Rows are padded by 8 halves so that
// the 16 rows of a tile fall in different banks.

enable f16;
enable wgpu_cooperative_matrix;

const TILE_M: u32 = 128u;
const TILE_N: u32 = 128u;
const TILE_K: u32 = 32u;
const STRIDE: u32 = 40u;

struct Shape {
    tokens: u32,
    n_in: u32,
    n_out: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

var<workgroup> x_slice: array<f16, TILE_M * STRIDE>;
var<workgroup> w_slice: array<f16, TILE_N * STRIDE>;
// Edge blocks go out through here, one 16 × 16 tile per subgroup at a time.
var<workgroup> edge: array<f32, 8u * 256u>;

fn stage_slices(m0: u32, n0: u32, k0: u32, lid: u32) {
    let quads_per_row = TILE_K / 4u;
    for (var i = 0u; i < 4u; i++) {
        let q = lid + i * 256u;
        let row = q / quads_per_row;
        let k = (q % quads_per_row) * 4u;
        var xv = vec4<f32>(0.0);
        if m0 + row < shape.tokens && k0 + k < shape.n_in {
            xv = x[((m0 + row) * shape.n_in + k0 + k) / 4u];
        }
        var wv = vec4<f16>(0.0);
        if n0 + row < shape.n_out && k0 + k < shape.n_in {
            wv = w[((n0 + row) * shape.n_in + k0 + k) / 4u];
        }
        let at = row * STRIDE + k;
        x_slice[at] = f16(xv.x);
        x_slice[at + 1u] = f16(xv.y);
        x_slice[at + 2u] = f16(xv.z);
        x_slice[at + 3u] = f16(xv.w);
        w_slice[at] = wv.x;
        w_slice[at + 1u] = wv.y;
        w_slice[at + 2u] = wv.z;
        w_slice[at + 3u] = wv.w;
    }
}

// Writes one accumulator tile whose top-left output is (t, n), keeping only
// what lies inside Y. Called by every subgroup together (the barriers).
fn store_edge(c: coop_mat16x16<f32, C>, t: u32, n: u32, sg: u32, lane: u32) {
    let at = sg * 256u;
    coopStoreT(c, &edge[at], 16u);
    workgroupBarrier();
    for (var i = 0u; i < 8u; i++) {
        let e = lane * 8u + i;
        let tt = t + e / 16u;
        let nn = n + e % 16u;
        if tt < shape.tokens && nn < shape.n_out {
            y[tt * shape.n_out + nn] = edge[sg * 256u + e];
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let m0 = group.y * TILE_M;
    let n0 = group.x * TILE_N;
    let sm = (sg / 2u) * 32u;
    let sn = (sg % 2u) * 64u;

    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < shape.n_in; k0 += TILE_K) {
        stage_slices(m0, n0, k0, lid);
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&x_slice[sm * STRIDE + kk], STRIDE);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&x_slice[(sm + 16u) * STRIDE + kk], STRIDE);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&w_slice[sn * STRIDE + kk], STRIDE);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&w_slice[(sn + 16u) * STRIDE + kk], STRIDE);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&w_slice[(sn + 32u) * STRIDE + kk], STRIDE);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&w_slice[(sn + 48u) * STRIDE + kk], STRIDE);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
        }
        workgroupBarrier();
    }

    let t = m0 + sm;
    let n = n0 + sn;
    // Whole blocks go straight to Y when its rows are 16-byte aligned.
    if m0 + TILE_M <= shape.tokens && n0 + TILE_N <= shape.n_out && shape.n_out % 4u == 0u {
        // naga 30 translates coopStore only when its index and stride are
        // named values, hence the lets.
        let stride = shape.n_out;
        let row0 = t * stride + n;
        let row0_16 = row0 + 16u;
        let row0_32 = row0 + 32u;
        let row0_48 = row0 + 48u;
        let row1 = row0 + 16u * stride;
        let row1_16 = row1 + 16u;
        let row1_32 = row1 + 32u;
        let row1_48 = row1 + 48u;
        coopStoreT(c00, &y[row0], stride);
        coopStoreT(c01, &y[row0_16], stride);
        coopStoreT(c02, &y[row0_32], stride);
        coopStoreT(c03, &y[row0_48], stride);
        coopStoreT(c10, &y[row1], stride);
        coopStoreT(c11, &y[row1_16], stride);
        coopStoreT(c12, &y[row1_32], stride);
        coopStoreT(c13, &y[row1_48], stride);
    } else {
        store_edge(c00, t, n, sg, lane);
        store_edge(c01, t, n + 16u, sg, lane);
        store_edge(c02, t, n + 32u, sg, lane);
        store_edge(c03, t, n + 48u, sg, lane);
        store_edge(c10, t + 16u, n, sg, lane);
        store_edge(c11, t + 16u, n + 16u, sg, lane);
        store_edge(c12, t + 16u, n + 32u, sg, lane);
        store_edge(c13, t + 16u, n + 48u, sg, lane);
    }
}
