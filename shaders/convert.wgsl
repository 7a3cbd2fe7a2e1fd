// f32 rows to f16 (the attention kernel's Q, K and V), two values to a 32-bit
// word, written at a word offset of the destination (a chunk's keys land at
// their positions in the prompt's resident K/V).

struct Params {
    pairs: u32,
    dst_word: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn to_f16(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = (group.x + group.y * groups.x) * 256u + lane;
    if i < p.pairs {
        dst[p.dst_word + i] = pack2x16float(src[i]);
    }
}
