// RMS norm over rows: y = x / sqrt(mean(x²) + eps) * weight, one workgroup per
// row. `norm` writes y beside x (the attention and MLP input norms); `norm_in_place`
// overwrites x (Gemma 3's per-head QK-norms and its post-norms). Each lane sums a
// strided slice of the row, then the workgroup adds the partial sums as a tree.

struct Params {
    width: u32,
    rows: u32,
    eps: f32,
}

const LANES: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x_in_place: array<f32>;

var<workgroup> partial: array<f32, LANES>;

/// 1 / rms of the row that starts at `base`, given this lane's sum of squares.
fn inverse_rms(lane: u32, sum_sq: f32) -> f32 {
    partial[lane] = sum_sq;
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride /= 2u) {
        if lane < stride {
            partial[lane] += partial[lane + stride];
        }
        workgroupBarrier();
    }
    return inverseSqrt(partial[0] / f32(p.width) + p.eps);
}

fn row_index(group: vec3<u32>, groups: vec3<u32>) -> u32 {
    return group.x + group.y * groups.x;
}

@compute @workgroup_size(LANES)
fn norm(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let row = row_index(group, groups);
    // Rows beyond the last still take part in the barriers.
    let live = row < p.rows;
    let base = min(row, p.rows - 1u) * p.width;
    var sum_sq = 0.0;
    for (var i = lane; i < p.width; i += LANES) {
        let v = x[base + i];
        sum_sq += v * v;
    }
    let scale = inverse_rms(lane, sum_sq);
    if live {
        for (var i = lane; i < p.width; i += LANES) {
            y[base + i] = x[base + i] * scale * weight[i];
        }
    }
}

@compute @workgroup_size(LANES)
fn norm_in_place(
    @builtin(workgroup_id) group: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let row = row_index(group, groups);
    let live = row < p.rows;
    let base = min(row, p.rows - 1u) * p.width;
    var sum_sq = 0.0;
    for (var i = lane; i < p.width; i += LANES) {
        let v = x_in_place[base + i];
        sum_sq += v * v;
    }
    let scale = inverse_rms(lane, sum_sq);
    if live {
        for (var i = lane; i < p.width; i += LANES) {
            x_in_place[base + i] *= scale * weight[i];
        }
    }
}
