// RouteSparse's shared probe and vertical-slash index builder: the probe
// rows' attention over every key, in four kernels.
//
// tile_stats: a workgroup of 256 per (64-key block, KV head). Four
//   invocations take each (probe row, query head) pair, 64 pairs at a time,
//   each holding a quarter of the pair's query in registers; the block's keys
//   come through workgroup memory 16 at a time, and the pair's quarter dot
//   products, summed by subgroup shuffles, fold into its online softmax
//   statistics over the block (m, l = Σ exp(s − m)). No reduction across
//   invocations, so a pass costs two barriers per 16 keys.
// block_mass: a workgroup per (probe row, KV head) combines a row's block
//   statistics into its whole-row (m, l) per query head, and writes the
//   attention mass of every key block, l_b·exp(m_b − m) / l, averaged over the
//   KV head's query heads (which share one mask): the pooled probe the
//   router estimates each candidate's kept mass from.
// recent_lines: a workgroup of 64 per (64-key block, KV head), an invocation
//   per key, scoring it against the recent rows (16 (row, query head) pairs
//   staged at a time), now with their whole-row statistics: each key's
//   probability summed over the recent rows (vertical-slash's column score),
//   and per key block the same
//   probabilities summed along each of the 127 diagonals that cross the
//   block's 64 × 64 tile of (recent row, key) pairs, into workgroup slots
//   that the invocations add to row by row.
// diagonals: an invocation per diagonal offset o = t − j adds up the (at most
//   three) key blocks' sums for o: vertical-slash's diagonal score.
// column_mass: once the columns are ranked (on the CPU, from the column
//   scores), a workgroup of 64 per (64 ranked columns, KV head), an invocation
//   per column, scores it against every probe row (pairs staged as in
//   recent_lines) and writes each row's probability of it: the exact mass of
//   any prefix of the ranking at every probe row, where the column scores
//   resolve it only at the recent rows.
// Scores are in f32 from f16 operands; probabilities of masked keys (j > t)
// are 0.

// (row, query head) pairs recent_lines scores per pass over a key block.
const PAIRS: u32 = 16u;

// ---- recent_lines' scoring of a key block against probe rows

@group(0) @binding(1) var<storage, read> rows: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> k: array<vec4<f16>>;

// The staged queries, in f32 (converted once, not at every key).
var<workgroup> q_tile: array<vec4<f32>, PAIRS * MAX_QUADS>;
// Position of each staged pair's row (0 for pairs past the end).
var<workgroup> pair_row: array<u32, PAIRS>;
var<workgroup> last_row: u32;

// Stages pairs first .. first + PAIRS of the `pairs` (row r, head g) = pair
// r·heads + g of KV head kv_head, and returns the last position among them.
fn stage(kv_head: u32, first: u32, pairs: u32, lid: u32) -> u32 {
    let heads = group_heads();
    let quads = quads();
    for (var e = lid; e < PAIRS * quads; e += BLOCK) {
        let p = first + e / quads;
        var x = vec4<f32>(0.0);
        if p < pairs {
            let t = rows[p / heads];
            x = vec4<f32>(q[((t - params.pos0) * params.n_head + kv_head * heads + p % heads) * quads + e % quads]);
        }
        q_tile[(e / quads) * MAX_QUADS + e % quads] = x;
    }
    if lid < PAIRS {
        var t = 0u;
        if first + lid < pairs {
            t = rows[(first + lid) / heads];
        }
        pair_row[lid] = t;
    }
    workgroupBarrier();
    if lid == 0u {
        var last = 0u;
        for (var i = 0u; i < PAIRS; i++) {
            last = max(last, pair_row[i]);
        }
        last_row = last;
    }
    return workgroupUniformLoad(&last_row);
}

// The dot products of key j with four staged pairs from p.
fn dots(p: u32, i: u32, key: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(
        dot(q_tile[p * MAX_QUADS + i], key),
        dot(q_tile[(p + 1u) * MAX_QUADS + i], key),
        dot(q_tile[(p + 2u) * MAX_QUADS + i], key),
        dot(q_tile[(p + 3u) * MAX_QUADS + i], key),
    );
}

// The scaled scores of key j against the staged pairs, NEG_BIG where the
// pair's row does not see it (PAIRS = 16, four to a vector).
fn scores(kv_head: u32, j: u32) -> array<f32, PAIRS> {
    var d0 = vec4<f32>(0.0);
    var d1 = vec4<f32>(0.0);
    var d2 = vec4<f32>(0.0);
    var d3 = vec4<f32>(0.0);
    if j < kv_len() {
        let k_at = (j * params.n_kv_head + kv_head) * quads();
        for (var i = 0u; i < quads(); i++) {
            let key = vec4<f32>(k[k_at + i]);
            d0 += dots(0u, i, key);
            d1 += dots(4u, i, key);
            d2 += dots(8u, i, key);
            d3 += dots(12u, i, key);
        }
    }
    var all = array<f32, PAIRS>(
        d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w, d2.x, d2.y, d2.z, d2.w, d3.x, d3.y, d3.z, d3.w,
    );
    var s: array<f32, PAIRS>;
    for (var p = 0u; p < PAIRS; p++) {
        s[p] = select(NEG_BIG, all[p] * params.scale, j <= pair_row[p]);
    }
    return s;
}

// The probability of the key whose scores are `key_scores` for row `row` of the
// pass that starts at pair `first`, averaged over the group's `heads` query
// heads (each divided by its row's sum, after its row's maximum): 0 from the
// pairs past `pairs` and from those the key is masked for.
fn row_probability(key_scores: array<f32, PAIRS>, kv_head: u32, first: u32, pairs: u32, row: u32, heads: u32) -> f32 {
    // A local copy: naga indexes arrays dynamically only in memory.
    var s = key_scores;
    let r = first / heads + row;
    var prob = 0.0;
    for (var g = 0u; g < heads; g++) {
        let p = row * heads + g;
        if first + p < pairs && s[p] > NEG_BIG {
            let st = recent_stats[r * params.n_head + kv_head * heads + g];
            prob += exp(s[p] - st.x) / (st.y * f32(heads));
        }
    }
    return prob;
}

// ---- tile_stats

// [kv_head][row][query head of the group][key block]: (m, l) over the block.
@group(0) @binding(4) var<storage, read_write> block_stats: array<vec2<f32>>;

// The head size, a pipeline constant, so that each invocation's share of a
// query stays in registers.
override HEAD_DIM: u32 = 256u;
// Invocations per (row, query head) pair, pairs a workgroup scores at once,
// and keys staged at once.
const LANES: u32 = 4u;
const TILE_PAIRS: u32 = 64u;
const TILE_KEYS: u32 = 16u;
const MAX_SHARE: u32 = MAX_QUADS / LANES;

// The staged keys, in f32: key i's quad c at i·(HEAD_DIM / 4) + c.
var<workgroup> key_tile: array<vec4<f32>, TILE_KEYS * MAX_QUADS>;

@compute @workgroup_size(256)
fn tile_stats(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kb = group.x;
    let kv_head = group.y;
    let heads = group_heads();
    let pairs = params.rows * heads;
    let quads = HEAD_DIM / 4u;
    let share = quads / LANES;
    let lane = lid % LANES;
    for (var first = 0u; first < pairs; first += TILE_PAIRS) {
        // Invocations past the last pair score its row again and write nothing.
        let p = min(first + lid / LANES, pairs - 1u);
        let t = rows[p / heads];
        // Lane `lane` holds the query's quads lane, lane + LANES, ...: the four
        // lanes of a pair read adjacent quads of a staged key.
        var q_share: array<vec4<f32>, MAX_SHARE>;
        let q_at = ((t - params.pos0) * params.n_head + kv_head * heads + p % heads) * quads + lane;
        for (var i = 0u; i < share; i++) {
            q_share[i] = vec4<f32>(q[q_at + i * LANES]);
        }
        var m = NEG_BIG;
        var l = 0.0;
        for (var j0 = kb * BLOCK; j0 < kb * BLOCK + BLOCK; j0 += TILE_KEYS) {
            workgroupBarrier();
            for (var e = lid; e < TILE_KEYS * quads; e += 256u) {
                let j = j0 + e / quads;
                var x = vec4<f32>(0.0);
                if j < kv_len() {
                    x = vec4<f32>(k[(j * params.n_kv_head + kv_head) * quads + e % quads]);
                }
                key_tile[e] = x;
            }
            workgroupBarrier();
            let sees = j0 <= t;
            for (var jj = 0u; jj < TILE_KEYS; jj++) {
                var part = 0.0;
                if sees {
                    for (var i = 0u; i < share; i++) {
                        part += dot(q_share[i], key_tile[jj * quads + i * LANES + lane]);
                    }
                }
                part += subgroupShuffleXor(part, 1u);
                part += subgroupShuffleXor(part, 2u);
                // Online (m, l) with one exponential a key (t < kv_len, so
                // keys past the end are not seen).
                if j0 + jj <= t {
                    let score = part * params.scale;
                    let top = max(m, score);
                    let e = exp(min(m, score) - top);
                    l = select(l + e, l * e + 1.0, score > m);
                    m = top;
                }
            }
        }
        if first + lid / LANES < pairs && lane == 0u {
            let r = p / heads;
            block_stats[((kv_head * params.rows + r) * heads + p % heads) * key_blocks() + kb] = vec2<f32>(m, l);
        }
    }
}

// ---- block_mass

@group(0) @binding(1) var<storage, read> stats_in: array<vec2<f32>>;
// [row][query head]: (m, l) over every key the row sees.
@group(0) @binding(2) var<storage, read_write> row_stats: array<vec2<f32>>;
// [kv_head][row][key block].
@group(0) @binding(3) var<storage, read_write> block_mass_out: array<f32>;

var<workgroup> part_m: array<f32, BLOCK>;
var<workgroup> part_l: array<f32, BLOCK>;
var<workgroup> head_stats: array<vec2<f32>, 8>;

fn combine(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

@compute @workgroup_size(64)
fn block_mass(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = group.x;
    let kv_head = group.y;
    let heads = group_heads();
    let blocks = key_blocks();
    for (var g = 0u; g < heads; g++) {
        let at = ((kv_head * params.rows + r) * heads + g) * blocks;
        var acc = vec2<f32>(NEG_BIG, 0.0);
        for (var kb = lid; kb < blocks; kb += BLOCK) {
            acc = combine(acc, stats_in[at + kb]);
        }
        part_m[lid] = acc.x;
        part_l[lid] = acc.y;
        workgroupBarrier();
        for (var w = BLOCK / 2u; w > 0u; w /= 2u) {
            if lid < w {
                let c = combine(vec2<f32>(part_m[lid], part_l[lid]), vec2<f32>(part_m[lid + w], part_l[lid + w]));
                part_m[lid] = c.x;
                part_l[lid] = c.y;
            }
            workgroupBarrier();
        }
        if lid == 0u {
            head_stats[g] = vec2<f32>(part_m[0], part_l[0]);
            row_stats[r * params.n_head + kv_head * heads + g] = head_stats[g];
        }
        workgroupBarrier();
    }
    for (var kb = lid; kb < blocks; kb += BLOCK) {
        var mass = 0.0;
        for (var g = 0u; g < heads; g++) {
            let b = stats_in[((kv_head * params.rows + r) * heads + g) * blocks + kb];
            let row = head_stats[g];
            if b.y > 0.0 {
                mass += b.y * exp(b.x - row.x) / row.y;
            }
        }
        block_mass_out[(kv_head * params.rows + r) * blocks + kb] = mass / f32(heads);
    }
}

// ---- recent_lines

// [row][query head]: (m, l), from block_mass.
@group(0) @binding(4) var<storage, read> recent_stats: array<vec2<f32>>;
// [kv_head][key]: Σ over the recent rows of p(t, j).
@group(0) @binding(5) var<storage, read_write> column_out: array<f32>;
// [kv_head][key block][slot]: slot s sums p(t_i, j) over the block's pairs
// with i + (j − first key of the block) = s, that is offset
// t − j = kv_len − 1 − (first key) − s for the recent row i at t = kv_len − 1 − i.
@group(0) @binding(6) var<storage, read_write> diagonal_parts: array<f32>;

var<workgroup> slots: array<f32, 2u * BLOCK>;

@compute @workgroup_size(64)
fn recent_lines(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kb = group.x;
    let kv_head = group.y;
    let j = kb * BLOCK + lid;
    let heads = group_heads();
    let pairs = params.recent * heads;
    slots[lid] = 0.0;
    slots[lid + BLOCK] = 0.0;
    var column = 0.0;
    // A pass holds PAIRS / heads whole rows (heads divides PAIRS).
    for (var first = 0u; first < pairs; first += PAIRS) {
        let last = stage(kv_head, first, pairs, lid);
        if kb * BLOCK <= last {
            let s = scores(kv_head, j);
            for (var row = 0u; row < PAIRS / heads; row++) {
                let r = first / heads + row;
                let prob = row_probability(s, kv_head, first, pairs, row, heads);
                column += prob;
                // Lanes add to distinct slots; rows one after another.
                if r < params.recent {
                    slots[r + lid] += prob;
                }
                workgroupBarrier();
            }
        }
        workgroupBarrier();
    }
    if j < kv_len() {
        column_out[kv_head * kv_len() + j] = column;
    }
    for (var slot = lid; slot < 2u * BLOCK; slot += BLOCK) {
        diagonal_parts[(kv_head * key_blocks() + kb) * 2u * BLOCK + slot] = slots[slot];
    }
}

// ---- diagonals

@group(0) @binding(1) var<storage, read> parts_in: array<f32>;
// [kv_head][offset]: Σ over the recent rows of p(t, t − o).
@group(0) @binding(2) var<storage, read_write> diagonal_out: array<f32>;

@compute @workgroup_size(64)
fn diagonals(@builtin(global_invocation_id) id: vec3<u32>) {
    let o = id.x;
    let kv_head = id.y;
    if o >= kv_len() {
        return;
    }
    // Key block kb holds offset o in slot top − 64·kb, for slots 0 ..= 126.
    let top = kv_len() - 1u - o;
    var kb = 0u;
    if top > 2u * BLOCK - 2u {
        kb = (top - (2u * BLOCK - 2u) + BLOCK - 1u) / BLOCK;
    }
    var sum = 0.0;
    for (; kb <= top / BLOCK; kb++) {
        sum += parts_in[(kv_head * key_blocks() + kb) * 2u * BLOCK + top - kb * BLOCK];
    }
    diagonal_out[kv_head * kv_len() + o] = sum;
}

// ---- column_mass

// Ranked columns per KV head (the CPU's `COLUMNS` mirrors it); entries past a
// head's ranking are u32::MAX, which no row sees.
const COLUMNS: u32 = 1000u;

// [kv_head][rank]: key positions, best first.
@group(0) @binding(5) var<storage, read> ranked_columns: array<u32>;
// [kv_head][row][rank]: p(t, column), averaged over the KV head's query heads.
@group(0) @binding(6) var<storage, read_write> column_mass_out: array<f32>;

@compute @workgroup_size(64)
fn column_mass(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = group.x * BLOCK + lid;
    let kv_head = group.y;
    let heads = group_heads();
    let pairs = params.rows * heads;
    var j = 0xffffffffu;
    if c < COLUMNS {
        j = ranked_columns[kv_head * COLUMNS + c];
    }
    // A pass holds PAIRS / heads whole rows (heads divides PAIRS).
    for (var first = 0u; first < pairs; first += PAIRS) {
        _ = stage(kv_head, first, pairs, lid);
        let s = scores(kv_head, j);
        for (var row = 0u; row < PAIRS / heads; row++) {
            let r = first / heads + row;
            let prob = row_probability(s, kv_head, first, pairs, row, heads);
            if r < params.rows && c < COLUMNS {
                column_mass_out[(kv_head * params.rows + r) * COLUMNS + c] = prob;
            }
        }
        workgroupBarrier();
    }
}
