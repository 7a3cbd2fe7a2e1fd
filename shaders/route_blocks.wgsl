// RouteSparse's block-sparse index builder, MInference's: the chunk's queries
// and the keys pooled into 64-position blocks (queries averaged over the
// query heads of a KV head too, which share one mask), the pooled scores of
// every query block against the key blocks before its diagonal, and per query
// block the TOP best of those key blocks, best first.
//
// pool_queries / pool_keys: an invocation per (quad of d, block, KV head).
// block_scores: a workgroup per (64 key blocks, QUERY_TILE query blocks, KV
//   head), the query blocks' pooled queries staged in workgroup memory, an
//   invocation per key block. Only key blocks 1 .. diagonal − 1 are written:
//   the sink block and the diagonal are in every mask anyway.
// top_blocks: a workgroup per (query block, KV head) selects the TOP largest
//   scores by a radix select on their order-preserving bit patterns (four
//   passes of 8 bits), gathers them, and sorts them by a bitonic network
//   (score descending, block ascending on ties; each invocation takes
//   SORTED / 128 of its compare-exchanges per step), so that the first b
//   entries are the top b for every budget b ≤ TOP. Lists shorter than TOP
//   end in NO_BLOCK. If more than SORTED − TOP scores tie exactly at the
//   threshold, which ones are kept among the tied is the order they arrive in.

const TOP: u32 = 800u;
const SORTED: u32 = 1024u;
const QUERY_TILE: u32 = 8u;
const NO_BLOCK: u32 = 0xffffffffu;

// ---- pool_queries

@group(0) @binding(1) var<storage, read> q: array<vec4<f16>>;
// [query block of the chunk][kv_head][quad].
@group(0) @binding(2) var<storage, read_write> pooled_q_out: array<vec4<f32>>;

@compute @workgroup_size(64)
fn pool_queries(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x;
    let qb = id.y;
    let kv_head = id.z;
    if c >= quads() {
        return;
    }
    let heads = group_heads();
    let first = qb * BLOCK;
    let last = min(first + BLOCK, params.n);
    var sum = vec4<f32>(0.0);
    for (var i = first; i < last; i++) {
        for (var g = 0u; g < heads; g++) {
            sum += vec4<f32>(q[(i * params.n_head + kv_head * heads + g) * quads() + c]);
        }
    }
    pooled_q_out[(qb * params.n_kv_head + kv_head) * quads() + c] = sum / f32((last - first) * heads);
}

// ---- pool_keys

@group(0) @binding(1) var<storage, read> k: array<vec4<f16>>;
// [key block][kv_head][quad].
@group(0) @binding(2) var<storage, read_write> pooled_k_out: array<vec4<f32>>;

@compute @workgroup_size(64)
fn pool_keys(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x;
    let kb = id.y;
    let kv_head = id.z;
    if c >= quads() {
        return;
    }
    let first = kb * BLOCK;
    let last = min(first + BLOCK, kv_len());
    var sum = vec4<f32>(0.0);
    for (var j = first; j < last; j++) {
        sum += vec4<f32>(k[(j * params.n_kv_head + kv_head) * quads() + c]);
    }
    pooled_k_out[(kb * params.n_kv_head + kv_head) * quads() + c] = sum / f32(last - first);
}

// ---- block_scores

@group(0) @binding(1) var<storage, read> pooled_q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> pooled_k: array<vec4<f32>>;
// [kv_head][query block of the chunk][key block].
@group(0) @binding(3) var<storage, read_write> scores_out: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, QUERY_TILE * MAX_QUADS>;

@compute @workgroup_size(64)
fn block_scores(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kb = group.x * BLOCK + lid;
    let qb_first = group.y * QUERY_TILE;
    let kv_head = group.z;
    let quads = quads();
    for (var e = lid; e < QUERY_TILE * quads; e += BLOCK) {
        let qb = qb_first + e / quads;
        var x = vec4<f32>(0.0);
        if qb < query_blocks() {
            x = pooled_q[(qb * params.n_kv_head + kv_head) * quads + e % quads];
        }
        q_tile[(e / quads) * MAX_QUADS + e % quads] = x;
    }
    workgroupBarrier();
    if kb == 0u || kb >= key_blocks() {
        return;
    }
    var s: array<f32, QUERY_TILE>;
    let k_at = (kb * params.n_kv_head + kv_head) * quads;
    for (var i = 0u; i < quads; i++) {
        let key = pooled_k[k_at + i];
        for (var t = 0u; t < QUERY_TILE; t++) {
            s[t] += dot(q_tile[t * MAX_QUADS + i], key);
        }
    }
    for (var t = 0u; t < QUERY_TILE; t++) {
        let qb = qb_first + t;
        if qb < query_blocks() && kb < first_query_block() + qb {
            scores_out[(kv_head * query_blocks() + qb) * key_blocks() + kb] = s[t] * params.scale;
        }
    }
}

// ---- top_blocks

@group(0) @binding(1) var<storage, read> scores_in: array<f32>;
// [kv_head][query block of the chunk][TOP]: key blocks, best first.
@group(0) @binding(2) var<storage, read_write> top_out: array<u32>;

var<workgroup> histogram: array<atomic<u32>, 256>;
var<workgroup> threshold: vec2<u32>;
var<workgroup> taken: atomic<u32>;
var<workgroup> sorted_key: array<u32, SORTED>;
var<workgroup> sorted_block: array<u32, SORTED>;

// A float's bits, mapped so that unsigned order is the floats' order.
fn order_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// Whether entry a of the sort goes before entry b.
fn before(a: u32, b: u32) -> bool {
    return sorted_key[a] > sorted_key[b] || (sorted_key[a] == sorted_key[b] && sorted_block[a] < sorted_block[b]);
}

@compute @workgroup_size(64)
fn top_blocks(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let qb = group.x;
    let kv_head = group.y;
    let diagonal = first_query_block() + qb;
    let row = (kv_head * query_blocks() + qb) * key_blocks();
    // Candidates: key blocks 1 .. diagonal − 1.
    let count = max(diagonal, 1u) - 1u;
    // The threshold's key and how many scores equal to it are kept; every
    // score above it is. With TOP or fewer candidates, all are kept.
    var prefix = 0u;
    var need = 0u;
    if count > TOP {
        var mask = 0u;
        need = TOP;
        for (var shift = 24; shift >= 0; shift -= 8) {
            for (var b = lid; b < 256u; b += BLOCK) {
                atomicStore(&histogram[b], 0u);
            }
            workgroupBarrier();
            for (var kb = 1u + lid; kb < diagonal; kb += BLOCK) {
                let key = order_key(scores_in[row + kb]);
                if (key & mask) == prefix {
                    atomicAdd(&histogram[(key >> u32(shift)) & 255u], 1u);
                }
            }
            workgroupBarrier();
            if lid == 0u {
                var above = 0u;
                var digit = 0u;
                for (var b = 255; b >= 0; b--) {
                    let c = atomicLoad(&histogram[b]);
                    if above + c >= need {
                        digit = u32(b);
                        break;
                    }
                    above += c;
                }
                threshold = vec2<u32>(prefix | (digit << u32(shift)), need - above);
            }
            let t = workgroupUniformLoad(&threshold);
            prefix = t.x;
            need = t.y;
            mask |= 255u << u32(shift);
        }
    }
    for (var e = lid; e < SORTED; e += BLOCK) {
        sorted_key[e] = 0u;
        sorted_block[e] = NO_BLOCK;
    }
    if lid == 0u {
        atomicStore(&taken, 0u);
    }
    workgroupBarrier();
    // Above the threshold: at most TOP − need entries; at it: the rest of the room.
    for (var kb = 1u + lid; kb < diagonal; kb += BLOCK) {
        let key = order_key(scores_in[row + kb]);
        if key > prefix || (key == prefix && need > 0u) {
            let at = atomicAdd(&taken, 1u);
            if at < SORTED {
                sorted_key[at] = key;
                sorted_block[at] = kb;
            }
        }
    }
    workgroupBarrier();
    for (var size = 2u; size <= SORTED; size *= 2u) {
        for (var stride = size / 2u; stride > 0u; stride /= 2u) {
            for (var pair = lid; pair < SORTED / 2u; pair += BLOCK) {
                let a = (pair / stride) * 2u * stride + pair % stride;
                let b = a + stride;
                let ahead = (a & size) == 0u;
                if before(b, a) == ahead {
                    let key = sorted_key[a];
                    let block = sorted_block[a];
                    sorted_key[a] = sorted_key[b];
                    sorted_block[a] = sorted_block[b];
                    sorted_key[b] = key;
                    sorted_block[b] = block;
                }
            }
            workgroupBarrier();
        }
    }
    for (var e = lid; e < TOP; e += BLOCK) {
        top_out[(kv_head * query_blocks() + qb) * TOP + e] = sorted_block[e];
    }
}
