// Dense causal attention with an online softmax: the fallback for adapters
// without cooperative matrices.
//
// Q is f16 [n][n_head][D] (the n queries of this chunk, at positions
// pos0 .. pos0 + n), K and V are f16 [kv_len][n_kv_head][D] (every position
// up to the chunk's last, kv_len = pos0 + n), O is f32 [n][n_head][D]. Query
// head h reads KV head h / (n_head / n_kv_head) (grouped-query attention).
// Query t sees key j when j <= t and, on a sliding-window layer, t - j < window.
// Which keys a workgroup visits comes from the key-span functions the Rust
// prepends: every key up to the last query (attention_keys_dense.wgsl), or the
// key lists of a sparse pattern (attention_keys_sparse.wgsl).
//
// A workgroup takes 16 queries of one head; 8 invocations share a query, each
// holding D / 8 of its dimensions (of q and of the output accumulator), and
// the 8 partial dot products are summed with subgroup shuffles (subgroups of 8
// or more, aligned to 8, so a query's invocations are in one subgroup). Keys
// and values come through workgroup memory 16 positions at a time; the
// running maximum and sum of the softmax are kept per query in f32, and the
// accumulator is rescaled once per 16 keys.
//
// The Rust prepends `const D: u32 = …;` (the head dimension, a multiple of 32)
// and one of the key-span files.

enable f16;

const QUERIES: u32 = 16u;
const KEYS: u32 = 16u;
const LANES: u32 = 8u;
// Each lane's share of a head, in vec4s.
const SHARE: u32 = D / (4u * LANES);
// A stand-in for minus infinity that stays finite through exp(m - m').
const NEG_BIG: f32 = -3.0e38;

struct Shape {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    window: u32,
    scale: f32,
    // Query blocks per KV head of a sparse index (0 when dense).
    query_blocks: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(1) var<storage, read> k: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read_write> o: array<vec4<f32>>;

var<workgroup> k_tile: array<vec4<f16>, KEYS * D / 4u>;
var<workgroup> v_tile: array<vec4<f16>, KEYS * D / 4u>;
// The positions of the staged keys.
var<workgroup> key_tile: array<u32, KEYS>;

fn visible(t: u32, j: u32) -> bool {
    return j <= t && (shape.window == 0u || t - j < shape.window);
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let head = group.y;
    let kv_head = head / (shape.n_head / shape.n_kv_head);
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

    let row = D / 4u;
    var q_share: array<vec4<f32>, SHARE>;
    var acc: array<vec4<f32>, SHARE>;
    let q_at = (query * shape.n_head + head) * row + lane * SHARE;
    for (var i = 0u; i < SHARE; i++) {
        if live {
            q_share[i] = vec4<f32>(q[q_at + i]) * shape.scale;
        } else {
            q_share[i] = vec4<f32>(0.0);
        }
        acc[i] = vec4<f32>(0.0);
    }
    var m = NEG_BIG;
    var l = 0.0;

    for (var e0 = 0u; e0 < span.len; e0 += KEYS) {
        // Stage 16 keys and values: each invocation moves D / 8 of each.
        if lid < KEYS {
            key_tile[lid] = key_at(span, e0 + lid);
        }
        for (var i = 0u; i < SHARE; i++) {
            let e = lid * SHARE + i;
            let key = key_at(span, e0 + e / row);
            var kv = vec4<f16>(0.0);
            var vv = vec4<f16>(0.0);
            if key < kv_len {
                let at = (key * shape.n_kv_head + kv_head) * row + e % row;
                kv = k[at];
                vv = v[at];
            }
            k_tile[e] = kv;
            v_tile[e] = vv;
        }
        workgroupBarrier();

        var s: array<f32, KEYS>;
        var m_new = m;
        for (var j = 0u; j < KEYS; j++) {
            var score = 0.0;
            for (var i = 0u; i < SHARE; i++) {
                score += dot(q_share[i], vec4<f32>(k_tile[j * row + lane * SHARE + i]));
            }
            score += subgroupShuffleXor(score, 4u);
            score += subgroupShuffleXor(score, 2u);
            score += subgroupShuffleXor(score, 1u);
            if visible(t, key_tile[j]) {
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
                    acc[i] += p * vec4<f32>(v_tile[j * row + lane * SHARE + i]);
                }
            }
        }
        m = m_new;
        workgroupBarrier();
    }

    if live {
        let inv_l = 1.0 / l;
        let o_at = (query * shape.n_head + head) * row + lane * SHARE;
        for (var i = 0u; i < SHARE; i++) {
            o[o_at + i] = acc[i] * inv_l;
        }
    }
}
