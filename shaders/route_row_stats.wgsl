// The softmax statistics of a few query rows (the probe's and the audit's):
// for each row t (an absolute position, listed in `rows`) and each query head,
// the maximum m of its scaled scores over the keys it sees and the sum
// l = Σ exp(s − m). With the dense key-span file the keys are every position
// up to t; with the sparse one, those a sparse index lists, so that
// exp(lse_sparse − lse_dense) is the attention mass the index keeps.
//
// Q is the chunk's f16 [n][n_head][D] (row t at t − pos0), K f16
// [positions][n_kv_head][D]. A workgroup of 64 takes one row and one KV head
// with its query heads (at most MAX_GROUP), the row's queries staged in
// workgroup memory; each invocation takes every 64th key of the span.
//
// The Rust prepends `const D: u32 = …;` and one of the key-span files.

enable f16;

const KEYS: u32 = 64u;
const MAX_GROUP: u32 = 8u;
const NEG_BIG: f32 = -3.0e38;

struct Shape {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    window: u32,
    scale: f32,
    // Rows listed in `rows`.
    rows: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> rows: array<u32>;
@group(0) @binding(1) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<f16>>;
// [row][head]: (m, l).
@group(0) @binding(3) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> q_tile: array<vec4<f32>, MAX_GROUP * D / 4u>;
var<workgroup> m_part: array<f32, KEYS * MAX_GROUP>;
var<workgroup> l_part: array<f32, KEYS * MAX_GROUP>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = group.x;
    let kv_head = group.y;
    let t = rows[r];
    let heads = shape.n_head / shape.n_kv_head;
    let quads = D / 4u;
    for (var e = lid; e < heads * quads; e += KEYS) {
        let g = e / quads;
        let at = ((t - shape.pos0) * shape.n_head + kv_head * heads + g) * quads + e % quads;
        q_tile[e] = vec4<f32>(q[at]) * shape.scale;
    }
    workgroupBarrier();

    var m: array<f32, MAX_GROUP>;
    var l: array<f32, MAX_GROUP>;
    for (var g = 0u; g < MAX_GROUP; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.0;
    }
    let span = key_span(kv_head, t, t);
    for (var e0 = 0u; e0 < span.len; e0 += KEYS) {
        let j = tile_key(tile_at(span, e0), lid);
        if j > t {
            continue;
        }
        let k_at = (j * shape.n_kv_head + kv_head) * quads;
        for (var g = 0u; g < heads; g++) {
            var s = 0.0;
            for (var i = 0u; i < quads; i++) {
                s += dot(q_tile[g * quads + i], vec4<f32>(k[k_at + i]));
            }
            let m_new = max(m[g], s);
            l[g] = l[g] * exp(m[g] - m_new) + exp(s - m_new);
            m[g] = m_new;
        }
    }
    for (var g = 0u; g < heads; g++) {
        m_part[g * KEYS + lid] = m[g];
        l_part[g * KEYS + lid] = l[g];
    }
    workgroupBarrier();
    if lid < heads {
        var m_all = NEG_BIG;
        for (var i = 0u; i < KEYS; i++) {
            m_all = max(m_all, m_part[lid * KEYS + i]);
        }
        var l_all = 0.0;
        for (var i = 0u; i < KEYS; i++) {
            l_all += l_part[lid * KEYS + i] * exp(m_part[lid * KEYS + i] - m_all);
        }
        stats[r * shape.n_head + kv_head * heads + lid] = vec2<f32>(m_all, l_all);
    }
}
