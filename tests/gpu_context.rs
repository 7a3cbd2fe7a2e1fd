//! The GPU context on whatever adapter Vulkan lists (lavapipe in CI): a kernel
//! compiles, parameters and buffers bind where the convention says, results
//! come back, pools hand out what was given back, and bad shaders are errors.

mod common;

use sift::gpu::{GpuError, Shader};

const RESIDUAL: Shader = Shader { name: "residual", source: include_str!("../shaders/residual.wgsl") };

#[test]
fn a_dispatch_computes_what_the_cpu_computes() {
    let Some(gpu) = common::gpu("a_dispatch_computes_what_the_cpu_computes") else { return };
    // Not a multiple of the workgroup size, so the bounds check is exercised.
    let len = 1000;
    let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
    let y: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
    let xb = gpu.upload("x", &x).unwrap();
    let yb = gpu.upload("y", &y).unwrap();
    let kernel = gpu.kernel(&RESIDUAL, "add_assign", &[]).unwrap();
    let mut batch = gpu.batch();
    batch.mark();
    // Twice, so the second dispatch reads what the first wrote.
    for _ in 0..2 {
        batch.dispatch(&kernel, &(len as u32), &[xb.as_entire_binding(), yb.as_entire_binding()], gpu.grid(4));
    }
    batch.mark();
    let times = batch.submit_timed().unwrap();
    let got: Vec<f32> = gpu.read(&xb, 0, len).unwrap();
    for i in 0..len {
        assert_eq!(got[i], x[i] + y[i] + y[i], "element {i}");
    }
    if let Some(times) = times {
        assert_eq!(times.len(), 1);
        assert!(times[0] >= 0.0 && times[0].is_finite(), "{times:?}");
    }
}

#[test]
fn many_batches_reuse_the_parameter_arena_in_order() {
    let Some(gpu) = common::gpu("many_batches_reuse_the_parameter_arena_in_order") else { return };
    let kernel = gpu.kernel(&RESIDUAL, "add_assign", &[]).unwrap();
    let ones = gpu.upload("ones", &[1.0f32; 512]).unwrap();
    let acc = gpu.upload("acc", &[0.0f32; 512]).unwrap();
    // Each batch covers a different prefix: a parameter read from the wrong
    // slot or a stale arena shows up as a wrong count somewhere.
    for n in 1..=40u32 {
        let mut batch = gpu.batch();
        batch.dispatch(&kernel, &(n * 12), &[acc.as_entire_binding(), ones.as_entire_binding()], [2, 1, 1]);
        batch.submit();
    }
    let got: Vec<f32> = gpu.read(&acc, 0, 512).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = (1..=40u32).filter(|n| (i as u32) < n * 12).count() as f32;
        assert_eq!(v, want, "element {i}");
    }
}

#[test]
fn pooled_buffers_come_back_and_kernels_are_cached() {
    let Some(gpu) = common::gpu("pooled_buffers_come_back_and_kernels_are_cached") else { return };
    let a = gpu.storage::<f32>("pooled", 777).unwrap();
    gpu.recycle(a.clone());
    assert!(gpu.storage::<f32>("pooled again", 777).unwrap() == a, "the pooled buffer was not handed out again");
    let k1 = gpu.kernel(&RESIDUAL, "add_assign", &[]).unwrap();
    let k2 = gpu.kernel(&RESIDUAL, "add_assign", &[]).unwrap();
    assert_eq!(k1.name(), k2.name());
}

#[test]
fn a_broken_shader_is_an_error_not_a_panic() {
    let Some(gpu) = common::gpu("a_broken_shader_is_an_error_not_a_panic") else { return };
    let broken = Shader { name: "broken", source: "@compute @workgroup_size(1) fn main() { let x: f32 = 1u; }" };
    assert!(matches!(gpu.kernel(&broken, "main", &[]), Err(GpuError::Kernel { .. })));
}

#[test]
fn buffers_over_the_device_limit_are_refused() {
    let Some(gpu) = common::gpu("buffers_over_the_device_limit_are_refused") else { return };
    let too_many = (gpu.limits.max_storage_buffer_binding_size / 4 + 1) as usize;
    assert!(matches!(gpu.storage::<f32>("huge", too_many), Err(GpuError::TooLarge { .. })));
}

#[test]
fn gpu_on_without_an_adapter_is_a_one_line_error_with_exit_2() {
    // No Vulkan driver: the loader finds none (as on a machine without a GPU).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(["run", "--gpu", "on", "-n", "1", "-p", "hi", "-m"])
        .arg(common::default_model())
        .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
        .env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("no GPU adapter")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(out.stdout.is_empty());
}
