// Y = X·Wᵀ on plain workgroup tiles: the fallback for adapters without
// cooperative matrices.
//
// X is f32 [tokens][n_in], W is f16 [n_out][n_in] (a weight matrix as GGUF
// stores it, one output row after another), Y is f32 [tokens][n_out]. A
// workgroup computes one TILE_M × TILE_N block of Y. Each step of the K loop
// brings a TILE_K-wide slice of X and W into workgroup memory (as f32,
// zero-padded past the edges, so tails of any size are exact), and each of the
// 256 invocations accumulates a 4 × 4 block of outputs from it in f32.

enable f16;

const TILE_M: u32 = 64u;
const TILE_N: u32 = 64u;
const TILE_K: u32 = 16u;

struct Shape {
    tokens: u32,
    n_in: u32,
    n_out: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f16>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// Both slices are stored k-major, so that an invocation reads its four rows
// (or columns) at one k as four neighbours.
var<workgroup> x_slice: array<f32, TILE_K * TILE_M>;
var<workgroup> w_slice: array<f32, TILE_K * TILE_N>;

fn x_at(t: u32, k: u32) -> f32 {
    if t < shape.tokens && k < shape.n_in {
        return x[t * shape.n_in + k];
    }
    return 0.0;
}

fn w_at(n: u32, k: u32) -> f32 {
    if n < shape.n_out && k < shape.n_in {
        return f32(w[n * shape.n_in + k]);
    }
    return 0.0;
}

fn x_four(k: u32, m: u32) -> vec4<f32> {
    let i = k * TILE_M + m;
    return vec4<f32>(x_slice[i], x_slice[i + 1u], x_slice[i + 2u], x_slice[i + 3u]);
}

fn w_four(k: u32, n: u32) -> vec4<f32> {
    let i = k * TILE_N + n;
    return vec4<f32>(w_slice[i], w_slice[i + 1u], w_slice[i + 2u], w_slice[i + 3u]);
}

fn store_row(t: u32, n: u32, v: vec4<f32>) {
    if t >= shape.tokens {
        return;
    }
    let base = t * shape.n_out + n;
    if n < shape.n_out { y[base] = v.x; }
    if n + 1u < shape.n_out { y[base + 1u] = v.y; }
    if n + 2u < shape.n_out { y[base + 2u] = v.z; }
    if n + 3u < shape.n_out { y[base + 3u] = v.w; }
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = group.y * TILE_M;
    let n0 = group.x * TILE_N;
    // This invocation's 4 × 4 block of the tile.
    let m = (lid / 16u) * 4u;
    let n = (lid % 16u) * 4u;
    // What it loads: four neighbouring k of one row of X and one row of W.
    let load_row = lid / 4u;
    let load_k = (lid % 4u) * 4u;

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < shape.n_in; k0 += TILE_K) {
        let k = k0 + load_k;
        x_slice[load_k * TILE_M + load_row] = x_at(m0 + load_row, k);
        x_slice[(load_k + 1u) * TILE_M + load_row] = x_at(m0 + load_row, k + 1u);
        x_slice[(load_k + 2u) * TILE_M + load_row] = x_at(m0 + load_row, k + 2u);
        x_slice[(load_k + 3u) * TILE_M + load_row] = x_at(m0 + load_row, k + 3u);
        w_slice[load_k * TILE_N + load_row] = w_at(n0 + load_row, k);
        w_slice[(load_k + 1u) * TILE_N + load_row] = w_at(n0 + load_row, k + 1u);
        w_slice[(load_k + 2u) * TILE_N + load_row] = w_at(n0 + load_row, k + 2u);
        w_slice[(load_k + 3u) * TILE_N + load_row] = w_at(n0 + load_row, k + 3u);
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk++) {
            let xv = x_four(kk, m);
            let wv = w_four(kk, n);
            acc0 += xv.x * wv;
            acc1 += xv.y * wv;
            acc2 += xv.z * wv;
            acc3 += xv.w * wv;
        }
        workgroupBarrier();
    }
    store_row(m0 + m, n0 + n, acc0);
    store_row(m0 + m + 1u, n0 + n, acc1);
    store_row(m0 + m + 2u, n0 + n, acc2);
    store_row(m0 + m + 3u, n0 + n, acc3);
}
