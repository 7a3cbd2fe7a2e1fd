// The mean of each 64-row block of a [src_rows][width] f16 matrix, in f32:
// the queries of a chunk and the keys before it, pooled for the block-sparse
// index (route_block_scores.wgsl). Params as in route_probe.wgsl.

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

@group(0) @binding(1) var<storage, read> src: array<f16>;
@group(0) @binding(2) var<storage, read_write> pooled: array<f32>;

// Invocation per (block (y), element of the width (x)).
@compute @workgroup_size(64)
fn pool(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x;
    let b = id.y;
    if c >= params.width {
        return;
    }
    let first = b * 64u;
    let last = min(first + 64u, params.src_rows);
    var sum = 0.0;
    for (var i = first; i < last; i++) {
        sum += f32(src[i * params.width + c]);
    }
    pooled[b * params.width + c] = sum / f32(last - first);
}
