// Dense causal attention on the tensor cores, in two passes over the keys.
//
// Buffers and masking as in attention.wgsl: Q f16 [n][n_head][D] for the
// queries at positions pos0 .. pos0 + n, K and V f16 [kv_len][n_kv_head][D],
// O f32 [n][n_head][D]; query t sees key j when j <= t and, on a sliding
// window layer, t - j < window; the keys visited come from the key-span file
// the Rust prepends, as in attention.wgsl. Unlike the fallback, this kernel reads and
// writes whole 16-row tiles: Q and O must have room for n rounded up to 64
// tokens, K and V for kv_len rounded up to 64 positions, and the padding must
// hold finite numbers (zero-initialised buffers do).
//
// A workgroup of 8 subgroups of 32 takes 64 rows of queries: HEADS query heads
// of one KV head (grouped-query attention: they share every key and value it
// loads) times 64 / HEADS tokens, as 4 blocks of 16 rows of one head. Subgroup
// s works on row block s / 2 and keeps its D / 16 tiles of Q in registers for
// the whole call. Keys and values come 32 positions at a time, copied into
// workgroup memory by all 256 invocations; each tile is loaded into
// registers while the one before it is computed (`fetch`, then `stage`).
// For each such block the 64 × 32 scores S = Q·Kᵀ are computed as 16 × 16 × 16 products with f16 operands and
// f32 accumulators (subgroup s: keys 16·(s % 2)) and written to workgroup
// memory, where the softmax reads them element by element.
//
// Cooperative matrices cannot be rescaled row by row, which an online softmax
// needs whenever a row's maximum grows. So the first pass computes only each
// row's maximum m and sum l = Σ exp(s − m); the second computes S again and
// P = exp(S − m) / l, exact, in f16, and accumulates O += P·V in f32 tiles
// that no later step rescales (subgroup s: rows 16·(s / 2), D / 2 columns).
// The price is computing Q·Kᵀ twice: 3/2 of the products of one pass.
//
// The Rust prepends `const D: u32 = …;` (64, 128 or 256) and
// `const HEADS: u32 = …;` (1, 2 or 4, dividing n_head / n_kv_head),
// attention_heads.wgsl and one of the key-span files.

enable f16;
enable wgpu_cooperative_matrix;

const ROWS: u32 = 64u;
const KEYS: u32 = 32u;
const KV_STRIDE: u32 = D + 8u;
const TOKENS: u32 = ROWS / HEADS;
const S_STRIDE: u32 = KEYS + 4u;
const P_STRIDE: u32 = KEYS + 8u;
// Output column tiles per subgroup.
const COLUMNS: u32 = D / 32u;
const NEG_BIG: f32 = -3.0e38;

struct Shape {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    window: u32,
    scale: f32,
    // The KV heads computed (attention_heads.wgsl).
    kv_heads: u32,
}

var<immediate> shape: Shape;

@group(0) @binding(0) var<storage, read> q: array<f16>;
@group(0) @binding(1) var<storage, read> k: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read_write> o: array<f32>;

var<workgroup> s_tile: array<f32, ROWS * S_STRIDE>;
var<workgroup> p_tile: array<f16, ROWS * P_STRIDE>;
var<workgroup> k_tile: array<f16, KEYS * KV_STRIDE>;
var<workgroup> v_tile: array<f16, KEYS * KV_STRIDE>;
// The positions of the staged keys.
var<workgroup> key_tile: array<u32, KEYS>;

struct Block {
    // First token of the workgroup, within the chunk.
    token0: u32,
    kv_head: u32,
    // First query head of the workgroup.
    head0: u32,
}

// Token (within the chunk) and head of the first row of row block b.
fn block_token(blk: Block, b: u32) -> u32 {
    return blk.token0 + (b / HEADS) * 16u;
}

fn block_head(blk: Block, b: u32) -> u32 {
    return blk.head0 + b % HEADS;
}

fn visible(t: u32, j: u32) -> bool {
    return j < shape.pos0 + shape.n && j <= t && (shape.window == 0u || t - j < shape.window);
}

// This invocation's share of the next tile: D / 32 quads of keys (and of
// values) and, for the first KEYS invocations, one position. The loop loads
// tile i + 1 into these registers before it computes tile i, so that the
// loads' latency, larger where workgroups read different key blocks (a
// sparse index) than where they all walk the same keys (dense), is hidden
// behind the products; then it copies them into workgroup memory.
var<private> k_next: array<vec4<f16>, 8>;
var<private> v_next: array<vec4<f16>, 8>;
var<private> key_next: u32;

// Span entries e0 .. e0 + 32 (and, with `values`, their values) into this
// invocation's registers. Each of a subgroup's 32 lanes (lane = lid % 32,
// one per entry of the tile) finds its entry's position once, and every
// invocation takes the positions of the entries it loads from those lanes.
// Finding a position per quad loaded instead (tile_key, with its branch
// between a listed block and single columns, D / 32 times) cost the sparse
// kernel twice the dense kernel's time for the same keys at D = 256 on an
// H200, where the dense key file's tile_key, a select, cost nothing.
fn fetch(blk: Block, span: Span, e0: u32, lid: u32, values: bool) {
    let quads = D / 4u;
    let tile = tile_at(span, e0);
    let lane_key = tile_key(tile, lid % KEYS);
    key_next = lane_key;
    for (var i = 0u; i < D / 32u; i++) {
        let e = lid + i * 256u;
        // An entry past the span reads position 0, and the mask drops it.
        let j = subgroupShuffle(lane_key, e / quads);
        let at = (select(j, 0u, j == NO_KEY) * shape.n_kv_head + blk.kv_head) * quads + e % quads;
        k_next[i] = k[at];
        if values {
            v_next[i] = v[at];
        }
    }
}

// The fetched tile into workgroup memory, with its positions.
fn stage(lid: u32, values: bool) {
    let quads = D / 4u;
    if lid < KEYS {
        key_tile[lid] = key_next;
    }
    for (var i = 0u; i < D / 32u; i++) {
        let e = lid + i * 256u;
        let to = (e / quads) * KV_STRIDE + (e % quads) * 4u;
        let kx = k_next[i];
        k_tile[to] = kx.x;
        k_tile[to + 1u] = kx.y;
        k_tile[to + 2u] = kx.z;
        k_tile[to + 3u] = kx.w;
        if values {
            let vx = v_next[i];
            v_tile[to] = vx.x;
            v_tile[to + 1u] = vx.y;
            v_tile[to + 2u] = vx.z;
            v_tile[to + 3u] = vx.w;
        }
    }
}

// This subgroup's 16 query rows, as D / 16 A tiles, loaded once.
var<private> q_tiles: array<coop_mat16x16<f16, A>, 16>;

fn load_queries(blk: Block, sg: u32) {
    let b = sg / 2u;
    let q_stride = shape.n_head * D;
    let at = (block_token(blk, b) * shape.n_head + block_head(blk, b)) * D;
    q_tiles[0] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 0u], q_stride);
    q_tiles[1] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 16u], q_stride);
    q_tiles[2] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 32u], q_stride);
    q_tiles[3] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 48u], q_stride);
    if D >= 128u {
        q_tiles[4] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 64u], q_stride);
        q_tiles[5] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 80u], q_stride);
        q_tiles[6] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 96u], q_stride);
        q_tiles[7] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 112u], q_stride);
    }
    if D == 256u {
        q_tiles[8] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 128u], q_stride);
        q_tiles[9] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 144u], q_stride);
        q_tiles[10] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 160u], q_stride);
        q_tiles[11] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 176u], q_stride);
        q_tiles[12] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 192u], q_stride);
        q_tiles[13] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 208u], q_stride);
        q_tiles[14] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 224u], q_stride);
        q_tiles[15] = coopLoadT<coop_mat16x16<f16, A>>(&q[at + 240u], q_stride);
    }
}

// S for the 32 keys staged in k_tile into s_tile. The products
// are written out so that q_tiles is only indexed by constants.
fn scores(sg: u32) {
    let b = sg / 2u;
    let kt = sg % 2u;
    let at = kt * 16u * KV_STRIDE;
    var s = coop_mat16x16<f32, C>();
    s = coopMultiplyAdd(q_tiles[0], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 0u], KV_STRIDE), s);
    s = coopMultiplyAdd(q_tiles[1], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 16u], KV_STRIDE), s);
    s = coopMultiplyAdd(q_tiles[2], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 32u], KV_STRIDE), s);
    s = coopMultiplyAdd(q_tiles[3], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 48u], KV_STRIDE), s);
    if D >= 128u {
        s = coopMultiplyAdd(q_tiles[4], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 64u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[5], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 80u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[6], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 96u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[7], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 112u], KV_STRIDE), s);
    }
    if D == 256u {
        s = coopMultiplyAdd(q_tiles[8], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 128u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[9], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 144u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[10], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 160u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[11], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 176u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[12], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 192u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[13], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 208u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[14], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 224u], KV_STRIDE), s);
        s = coopMultiplyAdd(q_tiles[15], coopLoad<coop_mat16x16<f16, B>>(&k_tile[at + 240u], KV_STRIDE), s);
    }
    let s_at = b * 16u * S_STRIDE + kt * 16u;
    coopStoreT(s, &s_tile[s_at], S_STRIDE);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
) {
    let group_heads = shape.n_head / shape.n_kv_head;
    let head_blocks = group_heads / HEADS;
    var blk: Block;
    // The longest rows (the last tokens) first, so that short ones fill in.
    blk.token0 = (groups.x - 1u - group.x) * TOKENS;
    blk.kv_head = selected_kv_head(group.y / head_blocks);
    blk.head0 = blk.kv_head * group_heads + (group.y % head_blocks) * HEADS;

    let t_first = shape.pos0 + blk.token0;
    let t_last = shape.pos0 + min(shape.n, blk.token0 + TOKENS) - 1u;
    let span = key_span(blk.kv_head, t_first, t_last);

    // This invocation's share of the softmax: 16 keys of one row.
    let row = lid / 4u;
    let quarter = lid % 4u;
    let t = shape.pos0 + block_token(blk, row / 16u) + row % 16u;

    load_queries(blk, sg);

    // Pass 1: each row's maximum and sum of exponentials.
    var m = NEG_BIG;
    var l = 0.0;
    fetch(blk, span, 0u, lid, false);
    for (var e0 = 0u; e0 < span.len; e0 += KEYS) {
        stage(lid, false);
        workgroupBarrier();
        if e0 + KEYS < span.len {
            fetch(blk, span, e0 + KEYS, lid, false);
        }
        scores(sg);
        workgroupBarrier();
        var m_new = m;
        for (var i = 0u; i < KEYS / 4u; i++) {
            let kl = quarter * (KEYS / 4u) + i;
            if visible(t, key_tile[kl]) {
                m_new = max(m_new, s_tile[row * S_STRIDE + kl] * shape.scale);
            }
        }
        l *= exp(m - m_new);
        for (var i = 0u; i < KEYS / 4u; i++) {
            let kl = quarter * (KEYS / 4u) + i;
            if visible(t, key_tile[kl]) {
                l += exp(s_tile[row * S_STRIDE + kl] * shape.scale - m_new);
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    s_tile[lid * 2u] = m;
    s_tile[lid * 2u + 1u] = l;
    workgroupBarrier();
    var m_row = NEG_BIG;
    for (var i = 0u; i < 4u; i++) {
        m_row = max(m_row, s_tile[(row * 4u + i) * 2u]);
    }
    var l_row = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let at = (row * 4u + i) * 2u;
        l_row += s_tile[at + 1u] * exp(s_tile[at] - m_row);
    }
    workgroupBarrier();
    let inv_l = select(0.0, 1.0 / l_row, l_row > 0.0);

    // Pass 2: O = Σ P·V with the final statistics.
    let b = sg / 2u;
    let column0 = (sg % 2u) * COLUMNS * 16u;
    // The accumulators are named, not an array, so that they stay in
    // registers; o2, o3 exist for D >= 128 only, o4 .. o7 for D = 256.
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    fetch(blk, span, 0u, lid, true);
    for (var e0 = 0u; e0 < span.len; e0 += KEYS) {
        stage(lid, true);
        workgroupBarrier();
        if e0 + KEYS < span.len {
            fetch(blk, span, e0 + KEYS, lid, true);
        }
        scores(sg);
        workgroupBarrier();
        for (var i = 0u; i < KEYS / 4u; i++) {
            let kl = quarter * (KEYS / 4u) + i;
            var p = 0.0;
            if visible(t, key_tile[kl]) {
                p = exp(s_tile[row * S_STRIDE + kl] * shape.scale - m_row) * inv_l;
            }
            p_tile[row * P_STRIDE + kl] = f16(p);
        }
        workgroupBarrier();
        for (var kt = 0u; kt < KEYS / 16u; kt++) {
            let pa = coopLoadT<coop_mat16x16<f16, A>>(&p_tile[b * 16u * P_STRIDE + kt * 16u], P_STRIDE);
            let v_at = kt * 16u * KV_STRIDE + column0;
            o0 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at], KV_STRIDE), o0);
            o1 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 16u], KV_STRIDE), o1);
            if COLUMNS >= 4u {
                o2 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 32u], KV_STRIDE), o2);
                o3 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 48u], KV_STRIDE), o3);
            }
            if COLUMNS == 8u {
                o4 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 64u], KV_STRIDE), o4);
                o5 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 80u], KV_STRIDE), o5);
                o6 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 96u], KV_STRIDE), o6);
                o7 = coopMultiplyAdd(pa, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[v_at + 112u], KV_STRIDE), o7);
            }
        }
        workgroupBarrier();
    }
    // naga 30 translates coopStore only when its index and stride are named
    // values, hence the lets.
    let o_stride = shape.n_head * D;
    let at0 = (block_token(blk, b) * shape.n_head + block_head(blk, b)) * D + column0;
    let at1 = at0 + 16u;
    coopStoreT(o0, &o[at0], o_stride);
    coopStoreT(o1, &o[at1], o_stride);
    if COLUMNS >= 4u {
        let at2 = at0 + 32u;
        let at3 = at0 + 48u;
        coopStoreT(o2, &o[at2], o_stride);
        coopStoreT(o3, &o[at3], o_stride);
    }
    if COLUMNS == 8u {
        let at4 = at0 + 64u;
        let at5 = at0 + 80u;
        let at6 = at0 + 96u;
        let at7 = at0 + 112u;
        coopStoreT(o4, &o[at4], o_stride);
        coopStoreT(o5, &o[at5], o_stride);
        coopStoreT(o6, &o[at6], o_stride);
        coopStoreT(o7, &o[at7], o_stride);
    }
}
