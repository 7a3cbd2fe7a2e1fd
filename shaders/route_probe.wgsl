// RouteSparse's probe and index builders, from the f16 queries of a chunk
// (Q [n][n_head][D], row t at t − pos0) and the resident keys (K
// [positions][n_kv_head][D]), after route_row_stats.wgsl has given each probe
// row's softmax statistics (m, l) per query head. Probabilities are averaged
// over the query heads of a KV head, which share one mask.
//
// block_mass: per KV head, probe row and key block of 64, the attention mass
//   of the block, Σ_{j in block, j <= t} p(t, j).
// column_scores / diagonal_scores: over the first `recent` probe rows (the
//   last queries of the prompt), Σ_rows p(t, j) per key j, and Σ_rows
//   p(t, t − o) per diagonal offset o: MInference's vertical-slash estimate.
// The block-sparse index builder is route_pool.wgsl and route_block_scores.wgsl.

enable f16;

struct Params {
    rows: u32,
    recent: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
    scale: f32,
    // Key positions (block_mass: key blocks) the outputs cover.
    keys: u32,
    // pool: rows of the source matrix, and its width in f16s.
    src_rows: u32,
    width: u32,
    // block_scores: the first query block of the chunk, query blocks in it.
    qb0: u32,
    query_blocks: u32,
}

@group(0) @binding(0) var<uniform> params: Params;

fn group_heads() -> u32 {
    return params.n_head / params.n_kv_head;
}

@group(0) @binding(1) var<storage, read> rows: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> k: array<vec4<f16>>;
@group(0) @binding(4) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// Probe row r's probability of key j, averaged over KV head kv_head's query heads.
fn prob(r: u32, kv_head: u32, j: u32) -> f32 {
    let t = rows[r];
    if j > t {
        return 0.0;
    }
    let heads = group_heads();
    let quads = params.d / 4u;
    let k_at = (j * params.n_kv_head + kv_head) * quads;
    var p = 0.0;
    for (var g = 0u; g < heads; g++) {
        let head = kv_head * heads + g;
        let q_at = ((t - params.pos0) * params.n_head + head) * quads;
        var s = 0.0;
        for (var i = 0u; i < quads; i++) {
            s += dot(vec4<f32>(q[q_at + i]), vec4<f32>(k[k_at + i]));
        }
        let st = stats[r * params.n_head + head];
        p += exp(s * params.scale - st.x) / st.y;
    }
    return p / f32(heads);
}

var<workgroup> partial: array<f32, 64>;

// Workgroup (key block, row, KV head); out [kv_head][row][key block].
@compute @workgroup_size(64)
fn block_mass(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kb = group.x;
    let r = group.y;
    let kv_head = group.z;
    partial[lid] = prob(r, kv_head, kb * 64u + lid);
    workgroupBarrier();
    for (var half_width = 32u; half_width > 0u; half_width /= 2u) {
        if lid < half_width {
            partial[lid] += partial[lid + half_width];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        out[(kv_head * params.rows + r) * params.keys + kb] = partial[0];
    }
}

// Invocation per key j (x) and KV head (y); out [kv_head][j].
@compute @workgroup_size(64)
fn column_scores(@builtin(global_invocation_id) id: vec3<u32>) {
    let j = id.x;
    if j >= params.keys {
        return;
    }
    var sum = 0.0;
    for (var r = 0u; r < params.recent; r++) {
        sum += prob(r, id.y, j);
    }
    out[id.y * params.keys + j] = sum;
}

// Invocation per diagonal offset o (x) and KV head (y); out [kv_head][o].
@compute @workgroup_size(64)
fn diagonal_scores(@builtin(global_invocation_id) id: vec3<u32>) {
    let o = id.x;
    if o >= params.keys {
        return;
    }
    var sum = 0.0;
    for (var r = 0u; r < params.recent; r++) {
        let t = rows[r];
        if t >= o {
            sum += prob(r, id.y, t - o);
        }
    }
    out[id.y * params.keys + o] = sum;
}

