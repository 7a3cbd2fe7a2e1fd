//! The GPU forward pass against the CPU's, stage by stage through the trace
//! hook, on the default model and the tiny Llama and Qwen2. The CPU runs with
//! f32 activations against dequantized weights (`set_f32_activations`), so the
//! two compute the same function and differ only by rounding: the GPU's
//! weights in f16, its attention inputs in f16, its sums in another order.
//! Every stage of every layer must agree within a tolerance that such rounding
//! stays under and a wrong index, a wrong constant or a missing stage does not.
//! Against that CPU, the greedy continuations of the golden prompts after a GPU
//! prefill are the CPU prefill's, every step.

mod common;

use std::path::Path;

use sift::attn::dense::Dense;
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::gpu::prefill::GpuPrefill;
use sift::kv::{KvCache, KvMode, Storage, PAGE};
use sift::model::{Attention, Model, Outputs, Scratch};
use sift::sample::argmax;

type Stages = Vec<(String, usize, Vec<f32>)>;

/// Largest |a - b| relative to |b| plus the root mean square of `b` (so an
/// element near zero is not judged against itself, nor an outlier against the
/// typical size).
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let rms = (b.iter().map(|v| v * v).sum::<f32>() / b.len() as f32).sqrt().max(1e-6);
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / (y.abs() + rms)).fold(0.0, f32::max)
}

fn compare_stages(test: &str, model_path: &Path, tokens: &[u32], tolerance: f32) {
    let Some(gpu) = common::gpu(test) else { return };
    sift::matmul::set_f32_activations(true);
    let file = GgufFile::open(model_path).unwrap();
    let model = Model::load(&file).unwrap();

    let mut cpu_stages: Stages = Vec::new();
    let mut cpu_cache = KvCache::new(&model.cache_shape(), Storage::default(), 256, 256);
    let (mut policy, mut records, mut scratch) = (Dense, Vec::new(), Scratch::default());
    let mut attention = Attention { policy: &mut policy, step: 0, records: &mut records };
    let mut record_cpu = |name: &str, layer: usize, rows: &[f32]| cpu_stages.push((name.into(), layer, rows.to_vec()));
    sift::threads::on_pool(|| {
        model.forward(tokens, 0, &mut cpu_cache, &mut scratch, Outputs::All, &mut attention, Some(&mut record_cpu))
    });
    let cpu_hidden = scratch.hidden.clone();

    let mut gpu_stages: Stages = Vec::new();
    let mut gpu_cache = KvCache::new(&model.cache_shape(), Storage::default(), 256, 256);
    let prefill = GpuPrefill::new(gpu, &model).unwrap();
    let mut record_gpu = |name: &str, layer: usize, rows: &[f32]| gpu_stages.push((name.into(), layer, rows.to_vec()));
    let gpu_hidden = prefill.run(tokens, 0, &mut gpu_cache, Outputs::All, Some(&mut record_gpu)).unwrap();

    let names = |s: &Stages| s.iter().map(|(n, l, _)| format!("{n}.{l}")).collect::<Vec<_>>();
    assert_eq!(names(&gpu_stages), names(&cpu_stages), "the GPU reports other stages than the CPU");
    let mut worst = (0.0f32, String::new());
    for ((name, layer, g), (_, _, c)) in gpu_stages.iter().zip(&cpu_stages) {
        assert_eq!(g.len(), c.len(), "{name}.{layer}: lengths");
        let err = relative_error(g, c);
        assert!(err < tolerance, "{name}.{layer}: GPU differs from CPU by {err} (tolerance {tolerance})");
        if err > worst.0 {
            worst = (err, format!("{name}.{layer}"));
        }
    }
    let err = relative_error(&gpu_hidden, &cpu_hidden);
    assert!(err < tolerance, "final hidden states differ by {err}");
    // The keys in the cache are what the GPU computed, stored as the CPU stores them.
    let kv_dim = model.hp.n_head_kv * model.hp.head_dim_k;
    let (mut kg, mut kc) = (vec![0.0; model.hp.head_dim_k], vec![0.0; model.hp.head_dim_k]);
    for il in 0..model.hp.n_layer {
        for pos in 0..tokens.len() {
            for h in 0..model.hp.n_head_kv {
                gpu_cache.layer(il).key(h, pos, &mut kg);
                cpu_cache.layer(il).key(h, pos, &mut kc);
                let err = relative_error(&kg, &kc);
                assert!(err < tolerance, "layer {il} position {pos} head {h} of {kv_dim}: cached keys differ by {err}");
            }
        }
    }
    eprintln!("{test}: {} stages, worst {} at {}, final {err}", gpu_stages.len(), worst.0, worst.1);
}

fn prompt(n: usize, n_vocab: u32) -> Vec<u32> {
    // BOS-free ids spread over the vocabulary, deterministic.
    (0..n as u32).map(|i| 2 + (i * 7919 + 13) % (n_vocab - 2)).collect()
}

#[test]
fn default_model_stages_match_the_cpu() {
    let path = common::default_model();
    // Eighteen layers with Gemma's post-norms: the rounding grows smoothly
    // from 0.006 after the first layer to about 0.05 at the last; a bug jumps.
    compare_stages("default_model_stages_match_the_cpu", &path, &prompt(40, 200_000), 0.1);
}

#[test]
fn tiny_llama_stages_match_the_cpu() {
    let Some(shared) = common::shared_dir("tiny_llama_stages_match_the_cpu") else { return };
    compare_stages(
        "tiny_llama_stages_match_the_cpu",
        &shared.join("anchors/models/tiny-llama.gguf"),
        &prompt(37, 30_000),
        0.05,
    );
}

#[test]
fn tiny_qwen2_stages_match_the_cpu() {
    let Some(shared) = common::shared_dir("tiny_qwen2_stages_match_the_cpu") else { return };
    compare_stages(
        "tiny_qwen2_stages_match_the_cpu",
        &shared.join("anchors/models/tiny-qwen2.gguf"),
        &prompt(37, 30_000),
        0.05,
    );
}

#[test]
fn default_model_greedy_after_gpu_prefill_equals_the_f32_cpu() {
    let test = "default_model_greedy_after_gpu_prefill_equals_the_f32_cpu";
    let Some(gpu) = common::gpu(test) else { return };
    let Some(shared) = common::shared_dir(test) else { return };
    sift::matmul::set_f32_activations(true);
    let json = common::read_json(&shared.join("anchors/reference/gemma3-270m-greedy.json"));
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let prefill = GpuPrefill::new(gpu, &model).unwrap();
    let cases = json["variants"].as_object().unwrap().values().next().unwrap()["cases"].as_array().unwrap().clone();
    for (c, case) in cases.iter().enumerate() {
        let prompt: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let greedy = |session: &mut Session| {
            let mut tokens = vec![argmax(session.prefill(&prompt).unwrap()) as u32];
            while tokens.len() < 16 {
                tokens.push(argmax(session.decode(*tokens.last().unwrap()).unwrap()) as u32);
            }
            tokens
        };
        let mut cpu = Session::new(&model, 512);
        let mut on_gpu = Session::new(&model, 512);
        on_gpu.set_prefill_backend(Box::new(&prefill));
        assert_eq!(greedy(&mut on_gpu), greedy(&mut cpu), "case {c}");
    }
}

#[test]
fn chunked_gpu_prefill_matches_one_chunk() {
    let test = "chunked_gpu_prefill_matches_one_chunk";
    let Some(gpu) = common::gpu(test) else { return };
    let Some(shared) = common::shared_dir(test) else { return };
    let file = GgufFile::open(shared.join("anchors/models/tiny-qwen2.gguf")).unwrap();
    let model = Model::load(&file).unwrap();
    let tokens = prompt(45, 30_000);
    let run = |max_chunk: usize| {
        let mut cache = KvCache::new(&model.cache_shape(), Storage::default(), 256, 256);
        let prefill = GpuPrefill::new(gpu, &model).unwrap().with_max_chunk(max_chunk);
        let hidden = prefill.run(&tokens, 0, &mut cache, Outputs::All, None).unwrap();
        (hidden, cache)
    };
    let (whole, whole_cache) = run(usize::MAX);
    // Chunks of 16, 16 and 13: later chunks attend to the resident keys of earlier ones.
    let (chunked, chunked_cache) = run(16);
    let err = relative_error(&chunked, &whole);
    assert!(err < 1e-4, "hidden states of a chunked prefill differ by {err}");
    let mut a = vec![0.0; model.hp.head_dim_v];
    let mut b = vec![0.0; model.hp.head_dim_v];
    for il in 0..model.hp.n_layer {
        for pos in 0..tokens.len() {
            chunked_cache.layer(il).value(0, pos, &mut a);
            whole_cache.layer(il).value(0, pos, &mut b);
            assert!(relative_error(&a, &b) < 1e-3, "layer {il} position {pos}: cached values differ");
        }
    }
}

/// A prompt that continues a cache (a chat's next turn) goes to the GPU too,
/// which attends to the cached positions as the CPU reads them. In f16 the
/// continuation gives the hidden states of one GPU prefill of the whole
/// prompt (the same keys and values, read back and uploaded again). In q8,
/// with the first part's pages already coded, its logits are those of a CPU
/// prefill split at the same point, which reads those pages coded too, and
/// not those of a CPU prefill of the whole prompt in one batch, which reads
/// its own keys exact.
#[test]
fn gpu_prefill_continues_a_cache() {
    let test = "gpu_prefill_continues_a_cache";
    let Some(gpu) = common::gpu(test) else { return };
    let Some(shared) = common::shared_dir(test) else { return };
    sift::matmul::set_f32_activations(true);
    let file = GgufFile::open(shared.join("anchors/models/tiny-qwen2.gguf")).unwrap();
    let model = Model::load(&file).unwrap();
    let prefill = GpuPrefill::new(gpu, &model).unwrap();
    let tokens = prompt(3 * PAGE + 20, 30_000);
    let (first, rest) = tokens.split_at(2 * PAGE + 10);

    let mut whole_cache = KvCache::new(&model.cache_shape(), Storage::default(), 512, 512);
    let whole = prefill.run(&tokens, 0, &mut whole_cache, Outputs::All, None).unwrap();
    let mut cache = KvCache::new(&model.cache_shape(), Storage::default(), 512, 512);
    prefill.run(first, 0, &mut cache, Outputs::All, None).unwrap();
    let continued = prefill.run(rest, first.len(), &mut cache, Outputs::All, None).unwrap();
    let err = relative_error(&continued, &whole[first.len() * model.hp.n_embd..]);
    assert!(err < 1e-4, "a continued GPU prefill differs from one prefill of the whole prompt by {err}");

    let storage = Storage { mode: KvMode::Q8, residual: PAGE, ..Storage::default() };
    let cpu_logits = |split: bool| {
        let mut cpu = Session::with_cache(&model, 512, 512, storage);
        if split {
            cpu.prefill(first).unwrap();
            cpu.prefill(rest).unwrap().to_vec()
        } else {
            cpu.prefill(&tokens).unwrap().to_vec()
        }
    };
    let mut on_gpu = Session::with_cache(&model, 512, 512, storage);
    on_gpu.prefill(first).unwrap();
    on_gpu.set_prefill_backend(Box::new(&prefill));
    let gpu_logits = on_gpu.prefill(rest).unwrap().to_vec();
    let (split, whole) = (cpu_logits(true), cpu_logits(false));
    let (err_split, err_whole) = (relative_error(&gpu_logits, &split), relative_error(&gpu_logits, &whole));
    eprintln!("{test}: q8 logits against the split CPU prefill {err_split}, against one batch {err_whole}");
    assert!(err_split < 0.05, "q8: logits of a GPU continuation differ from the CPU's by {err_split}");
    assert!(err_split < 0.5 * err_whole, "q8: the GPU continuation did not read the coded pages as the CPU does");
    assert_eq!(argmax(&gpu_logits), argmax(&split), "q8: the continuations rank another token first");
}
