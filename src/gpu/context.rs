//! The device, its queue, and the pools a forward pass draws from.
//!
//! A [`GpuContext`] is opened once per process. It picks an adapter and says
//! why on one log line, asks the device for the adapter's own limits (wgpu's
//! defaults would cap a binding at 128 MiB and workgroup memory at 16 KiB),
//! and enables f16 arithmetic, subgroups, cooperative matrices and timestamp
//! queries where the adapter has them.
//!
//! Kernels are compiled once per (shader, entry point, override constants) and
//! kept ([`GpuContext::kernel`]). Buffers are taken from and given back to a
//! pool keyed by size and usage ([`GpuContext::buffer`], [`GpuContext::recycle`]).
//! Work is recorded into a [`Batch`]: each dispatch binds its small parameter
//! struct as a uniform at `@binding(0)`, written into one arena buffer at
//! aligned offsets, and its storage buffers at `@binding(1)..`, in the order given.
//! Queue writes are ordered with submissions, so the arena is rewritten
//! for every batch without waiting for the previous one.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{mpsc, Mutex, MutexGuard};

use bytemuck::Pod;

/// Uniform slots of the parameter arena: the dispatches one batch records
/// before it is submitted and the arena starts again.
const ARENA_SLOTS: u64 = 4096;
/// Largest parameter struct a dispatch binds.
const MAX_PARAMS_BYTES: u64 = 256;
/// Timestamps one batch may record.
const MAX_MARKS: u32 = 256;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter: {0}")]
    NoAdapter(String),
    #[error("the GPU '{adapter}' could not be opened: {reason}")]
    Device { adapter: String, reason: String },
    #[error("a GPU buffer of {bytes} bytes for {what} exceeds the device's limit of {limit}")]
    TooLarge { what: String, bytes: u64, limit: u64 },
    #[error("GPU kernel {kernel}: {reason}")]
    Kernel { kernel: String, reason: String },
    #[error("reading back from the GPU failed: {0}")]
    Readback(String),
}

/// Which adapters may be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterPolicy {
    /// Hardware only: a discrete, integrated or virtual GPU.
    Hardware,
    /// Hardware first, else a software implementation (lavapipe): tests and CI.
    AllowSoftware,
}

/// A WGSL source, named for the pipeline cache and for error messages.
#[derive(Debug, Clone, Copy)]
pub struct Shader {
    pub name: &'static str,
    pub source: &'static str,
}

/// A compiled compute pipeline and its bind-group layout.
#[derive(Clone)]
pub struct Kernel {
    name: String,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }
}

#[derive(Hash, PartialEq, Eq)]
struct KernelKey {
    shader: &'static str,
    entry: String,
    /// Override constants by name, values as f64 bits.
    constants: Vec<(String, u64)>,
}

pub struct GpuContext {
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    /// The limits the device was opened with: the adapter's own.
    pub limits: wgpu::Limits,
    /// The features the device was opened with.
    pub features: wgpu::Features,
    /// The cooperative-matrix shapes the adapter offers (empty without the feature).
    pub cooperative_matrices: Vec<wgpu::CooperativeMatrixProperties>,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    kernels: Mutex<HashMap<KernelKey, Kernel>>,
    buffers: Mutex<HashMap<(u64, wgpu::BufferUsages), Vec<wgpu::Buffer>>>,
    arena: Mutex<wgpu::Buffer>,
    /// Bytes between two parameter slots of the arena.
    slot: u64,
    timestamps: Option<Timestamps>,
}

struct Timestamps {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    /// Nanoseconds per timestamp tick.
    period: f64,
}

/// The features a kernel can use, enabled whenever the adapter has them.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::TIMESTAMP_QUERY)
    .union(wgpu::Features::IMMEDIATES)
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);

impl GpuContext {
    /// Opens the best adapter `policy` allows and logs which one and why.
    pub fn open(policy: AdapterPolicy) -> Result<Self, GpuError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
        let (adapter, why) = choose(adapters, policy)?;
        let info = adapter.get_info();
        eprintln!(
            "gpu: {} ({:?}, {:?}, driver {} {}): {why}",
            info.name, info.device_type, info.backend, info.driver, info.driver_info
        );
        Self::from_adapter(adapter, info)
    }

    fn from_adapter(adapter: wgpu::Adapter, info: wgpu::AdapterInfo) -> Result<Self, GpuError> {
        let features = adapter.features() & WANTED_FEATURES;
        let limits = adapter.limits();
        let experimental = match features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            // SAFETY: the experimental feature (cooperative matrices) is only
            // used by kernels that check `cooperative_matrices` for the exact
            // shape and types they declare; wgpu's caveat is that a misuse of
            // such a feature may be undefined behaviour rather than an error.
            true => unsafe { wgpu::ExperimentalFeatures::enabled() },
            false => wgpu::ExperimentalFeatures::disabled(),
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("sift"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| GpuError::Device { adapter: info.name.clone(), reason: e.to_string() })?;
        let cooperative_matrices = match features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            true => adapter.cooperative_matrix_properties(),
            false => Vec::new(),
        };
        let slot = u64::from(limits.min_uniform_buffer_offset_alignment).max(MAX_PARAMS_BYTES);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kernel parameters"),
            size: slot * ARENA_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let timestamps = features.contains(wgpu::Features::TIMESTAMP_QUERY).then(|| Timestamps {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("marks"),
                ty: wgpu::QueryType::Timestamp,
                count: MAX_MARKS,
            }),
            resolved: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("resolved marks"),
                size: u64::from(MAX_MARKS) * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            period: f64::from(queue.get_timestamp_period()),
        });
        Ok(Self {
            adapter,
            device,
            queue,
            info,
            limits,
            features,
            cooperative_matrices,
            modules: Mutex::default(),
            kernels: Mutex::default(),
            buffers: Mutex::default(),
            arena: Mutex::new(arena),
            slot,
            timestamps,
        })
    }

    pub fn has(&self, feature: wgpu::Features) -> bool {
        self.features.contains(feature)
    }

    /// Whether the adapter is a software implementation (lavapipe).
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The smallest subgroup the adapter may run a kernel with.
    pub fn subgroup_min_size(&self) -> u32 {
        self.info.subgroup_min_size
    }

    /// The pipeline for `entry` of `shader` with override `constants`,
    /// compiled on first use and kept. Compilation errors come back as
    /// [`GpuError::Kernel`] rather than wgpu's panic.
    pub fn kernel(&self, shader: &Shader, entry: &str, constants: &[(&str, f64)]) -> Result<Kernel, GpuError> {
        let key = KernelKey {
            shader: shader.name,
            entry: entry.to_string(),
            constants: constants.iter().map(|&(n, v)| (n.to_string(), v.to_bits())).collect(),
        };
        let mut kernels = lock(&self.kernels);
        if let Some(kernel) = kernels.get(&key) {
            return Ok(kernel.clone());
        }
        let name = format!("{}::{entry}", shader.name);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = lock(&self.modules)
            .entry(shader.name)
            .or_insert_with(|| {
                self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(shader.name),
                    source: wgpu::ShaderSource::Wgsl(shader.source.into()),
                })
            })
            .clone();
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&name),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Some(error) = pollster::block_on(scope.pop()) {
            lock(&self.modules).remove(shader.name);
            return Err(GpuError::Kernel { kernel: name, reason: error.to_string() });
        }
        let layout = pipeline.get_bind_group_layout(0);
        let kernel = Kernel { name, pipeline, layout };
        kernels.insert(key, kernel.clone());
        Ok(kernel)
    }

    /// A buffer of exactly `bytes` bytes (its contents undefined), from the
    /// pool when one of that size and usage was given back.
    pub fn buffer(&self, what: &str, bytes: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, GpuError> {
        self.check_size(what, bytes, usage)?;
        if let Some(buffer) = lock(&self.buffers).get_mut(&(bytes, usage)).and_then(Vec::pop) {
            return Ok(buffer);
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer of `len` elements of `T` that can be copied to and from.
    pub fn storage<T>(&self, what: &str, len: usize) -> Result<wgpu::Buffer, GpuError> {
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        self.buffer(what, padded_bytes(len * size_of::<T>()), usage)
    }

    /// Gives a buffer back to the pool. The GPU may still be using it: a
    /// buffer taken again is only used by work submitted later, in order.
    pub fn recycle(&self, buffer: wgpu::Buffer) {
        lock(&self.buffers).entry((buffer.size(), buffer.usage())).or_default().push(buffer);
    }

    /// A new storage buffer holding `data` (weights: uploaded once, kept).
    pub fn upload<T: Pod>(&self, what: &str, data: &[T]) -> Result<wgpu::Buffer, GpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buffer = self.storage::<u8>(what, bytes.len())?;
        self.queue.write_buffer(&buffer, 0, bytes);
        Ok(buffer)
    }

    /// Writes `data` into `buffer` at byte `offset`, ordered before the next submission.
    pub fn write<T: Pod>(&self, buffer: &wgpu::Buffer, offset: u64, data: &[T]) {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len().is_multiple_of(4) {
            self.queue.write_buffer(buffer, offset, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(padded_bytes(bytes.len()) as usize, 0);
            self.queue.write_buffer(buffer, offset, &padded);
        }
    }

    /// Reads `len` elements of `T` from `buffer` at byte `offset`, waiting for
    /// all submitted work first.
    pub fn read<T: Pod>(&self, buffer: &wgpu::Buffer, offset: u64, len: usize) -> Result<Vec<T>, GpuError> {
        self.read_later(buffer, offset, len)?.wait(self)
    }

    /// Starts reading `len` elements of `T` from `buffer` at byte `offset`:
    /// the copy is submitted now, after all submitted work and before any
    /// submitted later, which [`Readback::wait`] does not wait for.
    pub fn read_later<T: Pod>(&self, buffer: &wgpu::Buffer, offset: u64, len: usize) -> Result<Readback<T>, GpuError> {
        let bytes = padded_bytes(len * size_of::<T>());
        let staging = self.buffer("readback", bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, bytes);
        let submission = self.queue.submit([encoder.finish()]);
        let (sender, mapped) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |result| {
            let _ = sender.send(result);
        });
        Ok(Readback { staging, submission, mapped, len, element: PhantomData })
    }

    /// [`Self::read`] through a staging buffer freed after, for sizes that
    /// do not recur (a pool would only hoard them).
    pub fn read_once<T: Pod>(&self, buffer: &wgpu::Buffer, offset: u64, len: usize) -> Result<Vec<T>, GpuError> {
        let bytes = padded_bytes(len * size_of::<T>());
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        self.check_size("readback", bytes, usage)?;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, bytes);
        self.queue.submit([encoder.finish()]);
        self.map_and_copy(&staging, len)
    }

    fn map_and_copy<T: Pod>(&self, staging: &wgpu::Buffer, len: usize) -> Result<Vec<T>, GpuError> {
        let (sender, receiver) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |result| {
            let _ = sender.send(result);
        });
        self.wait()?;
        receiver
            .recv()
            .map_err(|e| GpuError::Readback(e.to_string()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = {
            let view = staging.get_mapped_range(..).map_err(|e| GpuError::Readback(e.to_string()))?;
            let elements: &[T] = bytemuck::cast_slice(&view[..len * size_of::<T>()]);
            elements.to_vec()
        };
        staging.unmap();
        Ok(out)
    }

    /// Blocks until the submission `submission` (and all before it) is done.
    fn wait_for(&self, submission: wgpu::SubmissionIndex) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::Wait { submission_index: Some(submission), timeout: None })
            .map(drop)
            .map_err(|e| GpuError::Readback(e.to_string()))
    }

    /// Blocks until all submitted work is done.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map(drop)
            .map_err(|e| GpuError::Readback(e.to_string()))
    }

    /// Workgroup counts for `groups` workgroups, folded into two dimensions when
    /// one exceeds the device's per-dimension limit (kernels take their linear
    /// index as `id.x + id.y * num_workgroups.x`).
    pub fn grid(&self, groups: u32) -> [u32; 3] {
        let max = self.limits.max_compute_workgroups_per_dimension;
        match groups <= max {
            true => [groups, 1, 1],
            false => [max, groups.div_ceil(max), 1],
        }
    }

    /// Starts recording work.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            ctx: self,
            encoder: self.device.create_command_encoder(&Default::default()),
            arena: lock(&self.arena),
            params: Vec::new(),
            marks: 0,
        }
    }

    fn check_size(&self, what: &str, bytes: u64, usage: wgpu::BufferUsages) -> Result<(), GpuError> {
        let limit = match usage.contains(wgpu::BufferUsages::STORAGE) {
            true => self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size),
            false => self.limits.max_buffer_size,
        };
        match bytes <= limit {
            true => Ok(()),
            false => Err(GpuError::TooLarge { what: what.to_string(), bytes, limit }),
        }
    }
}

/// A read from the GPU under way: [`GpuContext::read_later`].
pub struct Readback<T> {
    staging: wgpu::Buffer,
    submission: wgpu::SubmissionIndex,
    mapped: mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
    len: usize,
    element: PhantomData<T>,
}

impl<T: Pod> Readback<T> {
    /// The elements read, once the copy's submission is done (not the work
    /// submitted after it); the staging buffer goes back to `ctx`'s pool.
    pub fn wait(self, ctx: &GpuContext) -> Result<Vec<T>, GpuError> {
        ctx.wait_for(self.submission)?;
        self.mapped
            .recv()
            .map_err(|e| GpuError::Readback(e.to_string()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = {
            let view = self.staging.get_mapped_range(..).map_err(|e| GpuError::Readback(e.to_string()))?;
            bytemuck::cast_slice::<u8, T>(&view[..self.len * size_of::<T>()]).to_vec()
        };
        self.staging.unmap();
        ctx.recycle(self.staging);
        Ok(out)
    }
}

/// Picks the adapter: discrete before integrated before virtual; software only
/// when `policy` allows it and nothing else exists.
fn choose(adapters: Vec<wgpu::Adapter>, policy: AdapterPolicy) -> Result<(wgpu::Adapter, String), GpuError> {
    use wgpu::DeviceType as T;
    let rank = |t: T| match t {
        T::DiscreteGpu => Some(0),
        T::IntegratedGpu => Some(1),
        T::VirtualGpu | T::Other => Some(2),
        T::Cpu => (policy == AdapterPolicy::AllowSoftware).then_some(3),
    };
    let found: Vec<String> =
        adapters.iter().map(|a| format!("{} ({:?})", a.get_info().name, a.get_info().device_type)).collect();
    let total = adapters.len();
    let best =
        adapters.into_iter().filter_map(|a| rank(a.get_info().device_type).map(|r| (r, a))).min_by_key(|(r, _)| *r);
    match best {
        Some((r, adapter)) => {
            let kind = ["a discrete GPU", "an integrated GPU", "a virtual GPU", "a software renderer, no GPU found"][r];
            Ok((adapter, format!("{kind}, chosen of {total} Vulkan adapter(s)")))
        }
        None if found.is_empty() => Err(GpuError::NoAdapter("Vulkan lists none (no driver or no loader)".into())),
        None => Err(GpuError::NoAdapter(format!("Vulkan lists only software renderers: {}", found.join(", ")))),
    }
}

/// `bytes` rounded up to wgpu's copy alignment (4 bytes), and at least one word.
fn padded_bytes(bytes: usize) -> u64 {
    (bytes.max(1) as u64).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Work being recorded: dispatches and copies, submitted together.
pub struct Batch<'c> {
    ctx: &'c GpuContext,
    encoder: wgpu::CommandEncoder,
    arena: MutexGuard<'c, wgpu::Buffer>,
    /// Parameter bytes of the dispatches recorded since the last submission.
    params: Vec<u8>,
    marks: u32,
}

impl Batch<'_> {
    /// Records `kernel` over `groups` workgroups with `params` at `@binding(0)`
    /// and `buffers` at `@binding(1)..`.
    pub fn dispatch<P: Pod>(
        &mut self,
        kernel: &Kernel,
        params: &P,
        buffers: &[wgpu::BindingResource<'_>],
        groups: [u32; 3],
    ) {
        let size = size_of::<P>() as u64;
        assert!(size <= MAX_PARAMS_BYTES, "{}: parameters of {size} bytes exceed a slot", kernel.name);
        if self.params.len() as u64 == self.ctx.slot * ARENA_SLOTS {
            self.flush();
        }
        let offset = self.params.len() as u64;
        self.params.extend_from_slice(bytemuck::bytes_of(params));
        self.params.resize((offset + self.ctx.slot) as usize, 0);
        let arena = wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.arena,
            offset,
            size: wgpu::BufferSize::new(size.next_multiple_of(16)),
        });
        let entries: Vec<wgpu::BindGroupEntry> = std::iter::once(arena)
            .chain(buffers.iter().cloned())
            .enumerate()
            .map(|(i, resource)| wgpu::BindGroupEntry { binding: i as u32, resource })
            .collect();
        let bind_group = self.ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(&kernel.name),
            layout: &kernel.layout,
            entries: &entries,
        });
        let mut pass = self
            .encoder
            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(&kernel.name), timestamp_writes: None });
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }

    /// [`GpuContext::grid`] of the context recorded into.
    pub fn grid(&self, groups: u32) -> [u32; 3] {
        self.ctx.grid(groups)
    }

    /// Records a kernel that binds its own groups (the heavy kernels) into a
    /// compute pass of its own.
    pub fn record<R>(&mut self, label: &str, f: impl FnOnce(&mut wgpu::ComputePass<'_>) -> R) -> R {
        let mut pass = self
            .encoder
            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(label), timestamp_writes: None });
        f(&mut pass)
    }

    /// Records zeroing all of `buffer`.
    pub fn clear(&mut self, buffer: &wgpu::Buffer) {
        self.encoder.clear_buffer(buffer, 0, None);
    }

    /// Records a copy of `bytes` bytes between buffers.
    pub fn copy(&mut self, from: &wgpu::Buffer, from_offset: u64, to: &wgpu::Buffer, to_offset: u64, bytes: u64) {
        self.encoder.copy_buffer_to_buffer(from, from_offset, to, to_offset, bytes);
    }

    /// Records a GPU timestamp here (nothing without timestamp queries);
    /// [`Self::submit_timed`] returns the times between marks.
    pub fn mark(&mut self) {
        let Some(t) = &self.ctx.timestamps else { return };
        if self.marks == MAX_MARKS {
            return;
        }
        self.encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("mark"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: &t.queries,
                beginning_of_pass_write_index: Some(self.marks),
                end_of_pass_write_index: None,
            }),
        });
        self.marks += 1;
    }

    /// Submits what was recorded since the last submission and starts a new
    /// encoder, without waiting: the GPU starts on it while more is recorded.
    /// The arena starts again (queue writes are ordered with submissions), and
    /// the marks go on counting, so [`Self::submit_timed`] times across it.
    pub fn flush(&mut self) {
        let encoder = std::mem::replace(&mut self.encoder, self.ctx.device.create_command_encoder(&Default::default()));
        self.ctx.queue.write_buffer(&self.arena, 0, &self.params);
        self.params.clear();
        self.ctx.queue.submit([encoder.finish()]);
    }

    /// Submits the work without waiting for it.
    pub fn submit(mut self) {
        self.flush();
    }

    /// Submits the work, waits for it, and returns the milliseconds between
    /// consecutive [`Self::mark`]s (`None` without timestamp queries).
    pub fn submit_timed(mut self) -> Result<Option<Vec<f64>>, GpuError> {
        let ctx = self.ctx;
        let (Some(t), marks) = (&ctx.timestamps, self.marks) else {
            self.flush();
            return ctx.wait().map(|()| None);
        };
        if marks > 0 {
            self.encoder.resolve_query_set(&t.queries, 0..marks, &t.resolved, 0);
        }
        self.flush();
        if marks == 0 {
            return ctx.wait().map(|()| Some(Vec::new()));
        }
        let ticks: Vec<u64> = ctx.read(&t.resolved, 0, marks as usize)?;
        Ok(Some(ticks.windows(2).map(|w| w[1].wrapping_sub(w[0]) as f64 * t.period / 1e6).collect()))
    }
}
