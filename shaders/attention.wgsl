// Softmax attention with an online softmax on plain workgroup tiles, in two
// entry points that share the inner loop.
//
// `main` is dense causal attention: the fallback for adapters without
// cooperative matrices. Q is f16 [n][n_head][D] (the n queries of this chunk,
// at positions pos0 .. pos0 + n), K and V are f16 [kv_len][n_kv_head][D]
// (every position up to the chunk's last, kv_len = pos0 + n), O is f32
// [n][n_head][D]. Query head h reads KV head h / (n_head / n_kv_head)
// (grouped-query attention). Query t sees key j when j <= t and, on a
// sliding-window layer, t - j < window. Which keys a workgroup visits comes
// from the key-span file the Rust prepends: every key up to its last query
// (attention_keys_dense.wgsl), or the key lists of a sparse pattern
// (attention_keys_sparse.wgsl, RouteSparse).
//
// `partial` is one piece of a decomposed call (src/gpu/cqs): n queries and
// n_keys keys gathered from anywhere in the sequence, Q, K and V in the same
// layouts, with a token table (position and group bits: the queries', then
// the keys') and a summary per 16 tokens of each (first and last position,
// OR and AND of the bits). A query sees a key when their bits are disjoint
// and, if causal, the key's position is at most the query's (and within the
// window). Each tile of 16 queries × 16 keys is first classified from the two
// summaries: fully masked tiles are skipped, clear ones need no per-pair test.
// It writes the unnormalised accumulator to O and (m, l) per query and head
// to `stats`, for the host to merge; a query that sees no key writes l = 0.
//
// A workgroup takes 16 queries of one head; 8 invocations share a query, each
// holding D / 8 of its dimensions (of q and of the output accumulator), and
// the 8 partial dot products are summed with subgroup shuffles (subgroups of 8
// or more, aligned to 8, so a query's invocations are in one subgroup). Keys
// and values come through workgroup memory 16 at a time, with their positions
// and bits; the running maximum and sum of the softmax are kept per query in
// f32, and the accumulator is rescaled once per 16 keys.
//
// The Rust prepends `const D: u32 = …;` (the head dimension, a multiple of 32),
// attention_heads.wgsl and one of the key-span files (which `partial` does not
// use).

enable f16;

const QUERIES: u32 = 16u;
const KEYS: u32 = 16u;
const LANES: u32 = 8u;
// Each lane's share of a head, in vec4s.
const SHARE: u32 = D / (4u * LANES);
const ROW: u32 = D / 4u;
// A stand-in for minus infinity that stays finite through exp(m - m').
const NEG_BIG: f32 = -3.0e38;
// (NO_KEY, the position of a staged key past the end, seen by no query, comes
// with the key-span file.)

struct Shape {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    window: u32,
    scale: f32,
    // `main` only: the KV heads computed (attention_heads.wgsl).
    kv_heads: u32,
    // `partial` only: whether the mask is causal, and the keys of the piece.
    causal: u32,
    n_keys: u32,
}

struct Token {
    position: u32,
    groups: u32,
}

struct Block {
    first: u32,
    last: u32,
    any: u32,
    all: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(1) var<storage, read> k: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read_write> o: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> tokens: array<Token>;
@group(0) @binding(5) var<storage, read> blocks: array<Block>;
@group(0) @binding(6) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> k_tile: array<vec4<f16>, KEYS * D / 4u>;
var<workgroup> v_tile: array<vec4<f16>, KEYS * D / 4u>;
// The staged keys' rows in K and V (NO_KEY: none, staged as zeros).
var<workgroup> key_row: array<u32, KEYS>;
var<workgroup> key_position: array<u32, KEYS>;
var<workgroup> key_groups: array<u32, KEYS>;

// One query's state: its share of q (scaled), of the accumulator, and the
// running maximum and sum.
var<private> q_share: array<vec4<f32>, SHARE>;
var<private> acc: array<vec4<f32>, SHARE>;
var<private> m: f32;
var<private> l: f32;

fn load_query(query: u32, head: u32, lane: u32, live: bool) {
    let at = (query * shape.n_head + head) * ROW + lane * SHARE;
    for (var i = 0u; i < SHARE; i++) {
        if live {
            q_share[i] = vec4<f32>(q[at + i]) * shape.scale;
        } else {
            q_share[i] = vec4<f32>(0.0);
        }
        acc[i] = vec4<f32>(0.0);
    }
    m = NEG_BIG;
    l = 0.0;
}

// Stages the keys and values of the rows in key_row: each invocation moves
// D / 8 of each.
fn stage(kv_head: u32, lid: u32) {
    for (var i = 0u; i < SHARE; i++) {
        let e = lid * SHARE + i;
        let key = key_row[e / ROW];
        var kv = vec4<f16>(0.0);
        var vv = vec4<f16>(0.0);
        if key != NO_KEY {
            let at = (key * shape.n_kv_head + kv_head) * ROW + e % ROW;
            kv = k[at];
            vv = v[at];
        }
        k_tile[e] = kv;
        v_tile[e] = vv;
    }
}

// Whether a query at position t with bits t_groups sees staged key j.
fn sees(t: u32, t_groups: u32, j: u32) -> bool {
    let p = key_position[j];
    let in_window = shape.window == 0u || t - p < shape.window;
    return p != NO_KEY && (t_groups & key_groups[j]) == 0u && (shape.causal == 0u || (p <= t && in_window));
}

// The staged keys' scores for the query at t, folded into its online softmax;
// `clear`: every staged key is seen, no test needed.
fn attend(t: u32, t_groups: u32, lane: u32, clear: bool) {
    var s: array<f32, KEYS>;
    var m_new = m;
    for (var j = 0u; j < KEYS; j++) {
        var score = 0.0;
        for (var i = 0u; i < SHARE; i++) {
            score += dot(q_share[i], vec4<f32>(k_tile[j * ROW + lane * SHARE + i]));
        }
        score += subgroupShuffleXor(score, 4u);
        score += subgroupShuffleXor(score, 2u);
        score += subgroupShuffleXor(score, 1u);
        if clear || sees(t, t_groups, j) {
            s[j] = score;
            m_new = max(m_new, score);
        } else {
            s[j] = NEG_BIG;
        }
    }
    let correction = exp(m - m_new);
    l *= correction;
    for (var i = 0u; i < SHARE; i++) {
        acc[i] *= correction;
    }
    for (var j = 0u; j < KEYS; j++) {
        if s[j] != NEG_BIG {
            let p = exp(s[j] - m_new);
            l += p;
            for (var i = 0u; i < SHARE; i++) {
                acc[i] += p * vec4<f32>(v_tile[j * ROW + lane * SHARE + i]);
            }
        }
    }
    m = m_new;
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group_heads = shape.n_head / shape.n_kv_head;
    let kv_head = selected_kv_head(group.y / group_heads);
    let head = kv_head * group_heads + group.y % group_heads;
    let kv_len = shape.pos0 + shape.n;
    let first_query = group.x * QUERIES;
    let query = first_query + lid / LANES;
    let lane = lid % LANES;
    let t = shape.pos0 + query;
    let live = query < shape.n;

    // The keys any query of this workgroup sees.
    let t_first = shape.pos0 + first_query;
    let t_last = shape.pos0 + min(shape.n, first_query + QUERIES) - 1u;
    let span = key_span(kv_head, t_first, t_last);

    load_query(query, head, lane, live);
    for (var e0 = 0u; e0 < span.len; e0 += KEYS) {
        let tile = tile_at(span, e0);
        if lid < KEYS {
            let j = tile_key(tile, lid);
            let key = select(NO_KEY, j, j < kv_len);
            key_row[lid] = key;
            key_position[lid] = key;
            key_groups[lid] = 0u;
        }
        workgroupBarrier();
        stage(kv_head, lid);
        workgroupBarrier();
        attend(t, 0u, lane, false);
        workgroupBarrier();
    }

    if live {
        let inv_l = 1.0 / l;
        let o_at = (query * shape.n_head + head) * ROW + lane * SHARE;
        for (var i = 0u; i < SHARE; i++) {
            o[o_at + i] = acc[i] * inv_l;
        }
    }
}

const CLEAR: u32 = 0u;
const MASKED: u32 = 1u;
const MIXED: u32 = 2u;

// The verdict on a tile from its query and key block summaries (the rule of
// `Mask::classify` in src/gpu/cqs/plan.rs).
fn classify(qb: Block, kb: Block) -> u32 {
    let causal = shape.causal != 0u;
    let window = shape.window;
    let masked = (qb.all & kb.all) != 0u || (causal && kb.first > qb.last)
        || (window != 0u && qb.first >= kb.last + window);
    if masked {
        return MASKED;
    }
    let clear = (qb.any & kb.any) == 0u && (!causal || kb.last <= qb.first)
        && (window == 0u || qb.last - kb.first < window);
    return select(MIXED, CLEAR, clear);
}

@compute @workgroup_size(128)
fn partial(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let head = group.y;
    let kv_head = head / (shape.n_head / shape.n_kv_head);
    let query = group.x * QUERIES + lid / LANES;
    let lane = lid % LANES;
    let live = query < shape.n;
    let me = tokens[min(query, shape.n - 1u)];

    load_query(query, head, lane, live);
    let query_block = blocks[group.x];
    let key_blocks = (shape.n_keys + KEYS - 1u) / KEYS;
    let first_key_block = (shape.n + QUERIES - 1u) / QUERIES;
    for (var b = 0u; b < key_blocks; b++) {
        let verdict = classify(query_block, blocks[first_key_block + b]);
        if verdict == MASKED {
            continue;
        }
        let j0 = b * KEYS;
        if lid < KEYS {
            var key = Token(NO_KEY, 0u);
            var row = NO_KEY;
            if j0 + lid < shape.n_keys {
                key = tokens[shape.n + j0 + lid];
                row = j0 + lid;
            }
            key_row[lid] = row;
            key_position[lid] = key.position;
            key_groups[lid] = key.groups;
        }
        workgroupBarrier();
        stage(kv_head, lid);
        workgroupBarrier();
        // A last, partial block is never clear: its tail is no key.
        attend(me.position, me.groups, lane, verdict == CLEAR && j0 + KEYS <= shape.n_keys);
        workgroupBarrier();
    }

    if live {
        let o_at = (query * shape.n_head + head) * ROW + lane * SHARE;
        for (var i = 0u; i < SHARE; i++) {
            o[o_at + i] = acc[i];
        }
        if lane == 0u {
            stats[query * shape.n_head + head] = vec2<f32>(m, l);
        }
    }
}
