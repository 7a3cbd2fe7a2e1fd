// Block-sparse scores: per KV head, query block of the chunk and key block at
// or before it, the pooled query (averaged over the KV head's query heads)
// times the pooled key, scaled (route_pool.wgsl pools them). Params as in
// route_probe.wgsl.

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

@group(0) @binding(1) var<storage, read> pooled_q: array<f32>;
@group(0) @binding(2) var<storage, read> pooled_k: array<f32>;
@group(0) @binding(3) var<storage, read_write> scores: array<f32>;

// Invocation per key block (x), query block of the chunk (y), KV head (z);
// scores [kv_head][query block][key block], −3e38 past the diagonal.
@compute @workgroup_size(64)
fn block_scores(@builtin(global_invocation_id) id: vec3<u32>) {
    let kb = id.x;
    let qb = id.y;
    let kv_head = id.z;
    if kb >= params.keys {
        return;
    }
    let at = (kv_head * params.query_blocks + qb) * params.keys + kb;
    if kb > params.qb0 + qb {
        scores[at] = -3.0e38;
        return;
    }
    let heads = group_heads();
    var s = 0.0;
    for (var g = 0u; g < heads; g++) {
        let q_at = (qb * params.n_head + kv_head * heads + g) * params.d;
        let k_at = (kb * params.n_kv_head + kv_head) * params.d;
        for (var i = 0u; i < params.d; i++) {
            s += pooled_q[q_at + i] * pooled_k[k_at + i];
        }
    }
    scores[at] = s * params.scale / f32(heads);
}
