// Residual connection: x += y, element by element, over a batch of rows.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

@compute @workgroup_size(256)
fn add_assign(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = (group.x + group.y * groups.x) * 256u + lane;
    if i < p.len {
        x[i] += y[i];
    }
}
