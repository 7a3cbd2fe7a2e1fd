// Rotary position embedding in place over rows of heads: row r of `x` is head
// r % heads of token r / heads. The angles come in a table of (cos, sin) per
// token and rotated pair, computed on the CPU exactly as the CPU forward pass
// computes them (f32 trigonometry of large angles is not portable on GPUs).
// `neox` pairs dimension i with i + half (GPT-NeoX, Qwen2, Gemma); otherwise
// 2i with 2i + 1 (Llama). Dimensions past 2 * half pass through.

struct Params {
    head_dim: u32,
    heads: u32,
    half_rot: u32,
    rows: u32,
    neox: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> cos_sin: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn rope(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let id = (group.x + group.y * groups.x) * 256u + lane;
    if id >= p.rows * p.half_rot {
        return;
    }
    let row = id / p.half_rot;
    let i = id % p.half_rot;
    let cs = cos_sin[(row / p.heads) * p.half_rot + i];
    let base = row * p.head_dim;
    var a = base + 2u * i;
    var b = a + 1u;
    if p.neox != 0u {
        a = base + i;
        b = a + p.half_rot;
    }
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * cs.x - x1 * cs.y;
    x[b] = x0 * cs.y + x1 * cs.x;
}
