// What every RouteSparse probe and index-builder kernel is told: the chunk
// of queries (positions pos0 .. pos0 + n, f16 Q [n][n_head][d]), the resident
// keys before its end (f16 K [positions][n_kv_head][d], d at most 256), the
// score scale, and the probe rows (`rows` listed, the first `recent` of them
// the chunk's last queries, newest first). Prepended to route_probe.wgsl and
// route_blocks.wgsl by src/gpu/route/probe.rs, which mirrors `Params`.

enable f16;

struct Params {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
    scale: f32,
    rows: u32,
    recent: u32,
}

@group(0) @binding(0) var<uniform> params: Params;

// Positions per block of the 64 × 64 grid the masks live on.
const BLOCK: u32 = 64u;
const MAX_QUADS: u32 = 64u;
const NEG_BIG: f32 = -3.0e38;

fn group_heads() -> u32 {
    return params.n_head / params.n_kv_head;
}

fn quads() -> u32 {
    return params.d / 4u;
}

// Keys up to the chunk's last query.
fn kv_len() -> u32 {
    return params.pos0 + params.n;
}

fn key_blocks() -> u32 {
    return (kv_len() + BLOCK - 1u) / BLOCK;
}

fn first_query_block() -> u32 {
    return params.pos0 / BLOCK;
}

// Query blocks of the chunk (pos0 is a multiple of BLOCK).
fn query_blocks() -> u32 {
    return key_blocks() - first_query_block();
}
