//! The heavy kernels' pipelines: WGSL behind a header of `const`s, over
//! storage buffers, with the shape as immediate data.
//!
//! They are built apart from [`super::GpuContext::kernel`]'s cache because
//! their shape parameters (the head dimension, heads per workgroup) size
//! private arrays, which WGSL allows only for `const`s, not pipeline
//! overrides; and because their per-call shape travels as immediates rather
//! than in the parameter arena. A [`super::matmul::Matmul`] or
//! [`super::attention::Attention`] is built once per session and dispatched
//! into a [`super::Batch::record`] pass.

/// How a kernel reads one of its storage buffers.
#[derive(Clone, Copy)]
pub(crate) enum Access {
    Read,
    ReadWrite,
}

/// A compiled kernel: its pipeline and the layout of its one bind group.
pub(crate) struct Pipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

impl Pipeline {
    /// Compiles `source` (entry point `main`) behind `header`, a few WGSL
    /// `const` declarations that fix its shape parameters.
    pub fn new(device: &wgpu::Device, label: &str, header: &str, source: &str, buffers: &[Access]) -> Self {
        Self::entry(device, label, header, source, "main", buffers)
    }

    /// [`Self::new`] for the entry point `entry` of a shader that has several.
    pub fn entry(
        device: &wgpu::Device,
        label: &str,
        header: &str,
        source: &str,
        entry: &str,
        buffers: &[Access],
    ) -> Self {
        let entries: Vec<wgpu::BindGroupLayoutEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, access)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: matches!(access, Access::Read) },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout =
            device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: super::KernelPath::IMMEDIATE_BYTES,
        });
        let descriptor = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(with_header(header, source).into()),
        };
        // SAFETY: without runtime checks an out-of-range index is undefined
        // behaviour. The heavy kernels index only in range: the tiled shaders
        // test every global index against the shape before using it, the
        // cooperative ones read and write whole blocks of buffers whose sizes
        // `dispatch` has checked against the (padded) shape, and workgroup and
        // private arrays are indexed by values bounded by constants. The checks
        // cost the cooperative loads from device memory a branch each, which
        // keeps the driver from issuing them together.
        let module = unsafe { device.create_shader_module_trusted(descriptor, wgpu::ShaderRuntimeChecks::unchecked()) };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                // Every kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            },
            cache: None,
        });
        Self { pipeline, layout }
    }

    /// A bind group of `buffers`, in binding order.
    pub fn bind(&self, device: &wgpu::Device, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &self.layout, entries: &entries })
    }

    /// Records one dispatch of `groups` workgroups with `immediates` as the
    /// shader's immediate data.
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass, bind: &wgpu::BindGroup, immediates: &[u32], groups: [u32; 3]) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, bind, &[]);
        pass.set_immediates(0, bytemuck::cast_slice(immediates));
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }
}

/// The WGSL a kernel is compiled from: `enable` directives must come before
/// any declaration, so the header goes after the source's last one.
pub(crate) fn with_header(header: &str, source: &str) -> String {
    let split = source
        .lines()
        .scan(0, |at, line| {
            *at += line.len() + 1;
            Some((*at, line))
        })
        .filter(|(_, line)| line.starts_with("enable "))
        .map(|(at, _)| at)
        .last()
        .unwrap_or(0)
        .min(source.len());
    format!("{}{header}\n{}", &source[..split], &source[split..])
}

#[cfg(test)]
mod tests {
    use super::with_header;

    /// Every shader, with every header its Rust gives it, parses, validates
    /// with all of naga's capabilities and translates to SPIR-V; this covers
    /// the cooperative shaders on machines whose adapter cannot run them.
    #[test]
    fn every_shader_validates_and_translates() {
        let mut modules = vec![
            ("matmul".to_string(), with_header("", include_str!("../../shaders/matmul.wgsl"))),
            ("matmul_coop".to_string(), with_header("", include_str!("../../shaders/matmul_coop.wgsl"))),
        ];
        use crate::gpu::KernelPath;
        for sparse in [false, true] {
            for d in [64, 128, 256] {
                for (path, heads) in [(KernelPath::Tiled, 1), (KernelPath::CooperativeMatrix, 1)]
                    .into_iter()
                    .chain([2, 4].map(|h| (KernelPath::CooperativeMatrix, h)))
                {
                    let (source, header) = crate::gpu::attention::shader(path, d, heads, sparse);
                    let name = format!("attention {} sparse={sparse} D={d} HEADS={heads}", path.name());
                    modules.push((name, with_header(&header, source)));
                }
            }
        }
        modules.extend(crate::gpu::route::probe::shader_sources());
        for (name, source) in modules {
            eprintln!("{name}");
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&source)));
            let info =
                naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
                    .validate(&module)
                    .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&source)));
            // Pipeline constants take their defaults, as wgpu does for those not given.
            let (module, info) =
                naga::back::pipeline_constants::process_overrides(&module, &info, None, &Default::default())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            let options = naga::back::spv::Options { lang_version: (1, 6), ..Default::default() };
            naga::back::spv::write_vec(&module, &info, &options, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn the_header_goes_after_the_directives() {
        let source = "// a comment\nenable f16;\nenable wgpu_cooperative_matrix;\nconst X = D;\n";
        let want = "// a comment\nenable f16;\nenable wgpu_cooperative_matrix;\nconst D = 1;\nconst X = D;\n";
        assert_eq!(with_header("const D = 1;", source), want);
    }
}
