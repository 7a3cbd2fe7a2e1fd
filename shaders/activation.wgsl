// The gated MLP's middle, element by element: gate = act(gate) * up.
// `gelu_gated` follows ggml's GELU (tanh form): 0 below -10, the identity above
// 10, in between evaluated on the input rounded to f16 with the result rounded
// to f16, as ggml's table holds it.

struct Params {
    len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;

fn index(group: vec3<u32>, groups: vec3<u32>, lane: u32) -> u32 {
    return (group.x + group.y * groups.x) * 256u + lane;
}

fn round_to_f16(v: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
}

@compute @workgroup_size(256)
fn silu_gated(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = index(group, groups, lane);
    if i < p.len {
        let g = gate[i];
        gate[i] = g / (1.0 + exp(-g)) * up[i];
    }
}

@compute @workgroup_size(256)
fn gelu_gated(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let i = index(group, groups, lane);
    if i < p.len {
        let g = gate[i];
        var act = g;
        if g <= -10.0 {
            act = 0.0;
        } else if g < 10.0 {
            let x = round_to_f16(g);
            act = round_to_f16(0.5 * x * (1.0 + tanh(0.7978846 * x * (1.0 + 0.044715 * x * x))));
        }
        gate[i] = act * up[i];
    }
}
