// Element-wise adds over a batch of rows: the residual connection x += y, and
// biases x[r][c] += b[c] (Qwen2's Q/K/V biases).

struct Params {
    len: u32,
    // Length of the repeated vector `y` for `add_bias`.
    width: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

fn index(group: vec3<u32>, groups: vec3<u32>, lane: u32) -> u32 {
    return (group.x + group.y * groups.x) * 256u + lane;
}

@compute @workgroup_size(256)
fn add_assign(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = index(group, groups, lane);
    if i < p.len {
        x[i] += y[i];
    }
}

@compute @workgroup_size(256)
fn add_bias(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = index(group, groups, lane);
    if i < p.len {
        x[i] += y[i % p.width];
    }
}
