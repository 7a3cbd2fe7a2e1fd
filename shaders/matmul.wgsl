// Y = X·Wᵀ on plain workgroup tiles: the fallback for adapters without
// cooperative matrices.
//
// X is f32 [tokens][n_in], W is f16 [n_out][n_in] (a weight matrix as GGUF
// stores it, one output row after another), Y is f32 [tokens][n_out]. A
// workgroup computes one TILE_M × TILE_N block of Y. Each step of the K loop
// brings a TILE_K-wide slice of X and W into workgroup memory (as f32,
// zero-padded past the edges, so tails of any size are exact), and each of the
// 64 invocations accumulates an 8 × 8 block of outputs from it in f32, k in
// order. With eight by eight outputs in registers and the slices read four
// neighbours a load, each k takes four loads from workgroup memory for 64
// multiply-adds.

enable f16;

const TILE_M: u32 = 64u;
const TILE_N: u32 = 64u;
const TILE_K: u32 = 32u;

struct Shape {
    tokens: u32,
    n_in: u32,
    n_out: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f16>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// Both slices are stored k-major in fours: element [k * 16 + i] holds rows
// (or columns) 4i to 4i + 3 at k, so that an invocation reads the four it
// multiplies at one k in one load.
var<workgroup> x_slice: array<vec4<f32>, TILE_K * TILE_M / 4u>;
var<workgroup> w_slice: array<vec4<f32>, TILE_K * TILE_N / 4u>;

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = group.y * TILE_M;
    let n0 = group.x * TILE_N;
    // This invocation's 8 × 8 block of the tile: rows 8·(lid / 8) onwards,
    // columns 8·(lid % 8) onwards, as indices of fours.
    let m4 = (lid / 8u) * 2u;
    let n4 = (lid % 8u) * 2u;

    // Row r of the block times its columns 0–3 and 4–7: a[r] and b[r].
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var b0 = vec4<f32>(0.0);
    var b1 = vec4<f32>(0.0);
    var b2 = vec4<f32>(0.0);
    var b3 = vec4<f32>(0.0);
    var b4 = vec4<f32>(0.0);
    var b5 = vec4<f32>(0.0);
    var b6 = vec4<f32>(0.0);
    var b7 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < shape.n_in; k0 += TILE_K) {
        // Each slice holds 16 fours at TILE_K k: eight of the 512 per
        // invocation, neighbouring invocations on neighbouring k.
        for (var slot = lid; slot < TILE_K * 16u; slot += 64u) {
            let four = slot / TILE_K;
            let kk = slot % TILE_K;
            let k = k0 + kk;
            let t = m0 + four * 4u;
            let n = n0 + four * 4u;
            x_slice[kk * 16u + four] = vec4<f32>(x_at(t, k), x_at(t + 1u, k), x_at(t + 2u, k), x_at(t + 3u, k));
            w_slice[kk * 16u + four] = vec4<f32>(w_at(n, k), w_at(n + 1u, k), w_at(n + 2u, k), w_at(n + 3u, k));
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk++) {
            let xa = x_slice[kk * 16u + m4];
            let xb = x_slice[kk * 16u + m4 + 1u];
            let wl = w_slice[kk * 16u + n4];
            let wh = w_slice[kk * 16u + n4 + 1u];
            a0 += xa.x * wl;
            b0 += xa.x * wh;
            a1 += xa.y * wl;
            b1 += xa.y * wh;
            a2 += xa.z * wl;
            b2 += xa.z * wh;
            a3 += xa.w * wl;
            b3 += xa.w * wh;
            a4 += xb.x * wl;
            b4 += xb.x * wh;
            a5 += xb.y * wl;
            b5 += xb.y * wh;
            a6 += xb.z * wl;
            b6 += xb.z * wh;
            a7 += xb.w * wl;
            b7 += xb.w * wh;
        }
        workgroupBarrier();
    }
    let m = m0 + m4 * 4u;
    let n = n0 + n4 * 4u;
    store_row(m + 0u, n, a0);
    store_row(m + 0u, n + 4u, b0);
    store_row(m + 1u, n, a1);
    store_row(m + 1u, n + 4u, b1);
    store_row(m + 2u, n, a2);
    store_row(m + 2u, n + 4u, b2);
    store_row(m + 3u, n, a3);
    store_row(m + 3u, n + 4u, b3);
    store_row(m + 4u, n, a4);
    store_row(m + 4u, n + 4u, b4);
    store_row(m + 5u, n, a5);
    store_row(m + 5u, n + 4u, b5);
    store_row(m + 6u, n, a6);
    store_row(m + 6u, n + 4u, b6);
    store_row(m + 7u, n, a7);
    store_row(m + 7u, n + 4u, b7);
}
