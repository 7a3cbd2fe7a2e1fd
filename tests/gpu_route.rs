//! RouteSparse against references: the sparse attention kernel, for every
//! pattern of the library and for KV heads with different patterns in one
//! dispatch, against softmax attention in f64 over exactly the keys the index
//! lists (causal within them); a routed prefill of the default model against
//! the dense one; and (ignored, for a real GPU) a needle in a 30K-token book.
//!
//! On lavapipe (CI) only the tiled path runs; sizes stay far below Debian 12
//! lavapipe's cap of 65,535 loop iterations per invocation.

mod common;

use half::f16;
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::gpu::attention::{Attention, AttentionShape, KvHeads};
use sift::gpu::prefill::GpuPrefill;
use sift::gpu::report::PrefillReport;
use sift::gpu::route::calibration::CalibrationFile;
use sift::gpu::route::candidates::HeadLines;
use sift::gpu::route::index::{BlockSparse, Union, VerticalSlash, Widened};
use sift::gpu::route::probe::{ProbeKernels, ProbeRows, COLUMNS, NO_BLOCK, TOP_BLOCKS};
use sift::gpu::route::profile::{Entry, LatencyProfile, ProbeEntry};
use sift::gpu::route::{Candidate, Mask, RecentRows, RouteSettings, SparseIndex};
use sift::gpu::{GpuContext, KernelPath};
use sift::kv::Storage;
use sift::matmul::set_f32_activations;
use sift::model::Model;

/// The routed prefill test's fallback threshold and budget.
const ROUTED_TAU: f64 = 0.9;
const ROUTED_BUDGET: f64 = 0.85;

struct Noise(common::Rng);

impl Noise {
    fn f16s(&mut self, len: usize, scale: f32) -> Vec<f16> {
        (0..len).map(|_| f16::from_f32(((self.0.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale)).collect()
    }
}

struct Case {
    n: u32,
    pos0: u32,
    n_head: u32,
    n_kv_head: u32,
    d: u32,
}

/// Softmax attention in f64 over the keys `index` lets query t of each head see.
fn masked_reference(q: &[f16], k: &[f16], v: &[f16], c: &Case, index: &SparseIndex, scale: f64) -> Vec<f64> {
    let case = common::AttentionCase {
        n: c.n as usize,
        pos0: c.pos0 as usize,
        n_head: c.n_head as usize,
        n_kv_head: c.n_kv_head as usize,
        d: c.d as usize,
    };
    common::attention_reference(q, k, v, &case, scale, |kvh, t, j| index.sees(kvh as u32, t as u32, j as u32))
}

/// The heads with sparse masks through the sparse kernel and the dense ones
/// through the dense kernel's dispatch of those heads (as routed prefill
/// splits a layer), into one output, against f64 over each head's mask.
fn check(ctx: &GpuContext, path: KernelPath, c: &Case, masks: &[&Mask], noise: &mut Noise) {
    let scale = 1.0 / (c.d as f32).sqrt();
    let shape = AttentionShape { n: c.n, pos0: c.pos0, n_head: c.n_head, n_kv_head: c.n_kv_head, window: None, scale };
    let attention = Attention::sparse(&ctx.device, path, c.d, c.n_head / c.n_kv_head).unwrap();
    let all: Vec<Option<&Mask>> = masks.iter().map(|&m| Some(m)).collect();
    let index = SparseIndex::new(&all, shape.kv_len());
    let sparse_masks: Vec<Option<&Mask>> = masks.iter().map(|&m| (*m != Mask::Dense).then_some(m)).collect();
    let dense_heads = KvHeads::of((0..c.n_kv_head).filter(|&h| *masks[h as usize] == Mask::Dense));
    let d = c.d as usize;
    let q_rows = attention.query_rows(&shape) as usize;
    let k_rows = attention.key_rows(&shape) as usize;
    // Larger scores than unit noise, so that which keys are left out matters.
    let q = noise.f16s(q_rows * c.n_head as usize * d, 3.0);
    let k = noise.f16s(k_rows * c.n_kv_head as usize * d, 3.0);
    let v = noise.f16s(k_rows * c.n_kv_head as usize * d, 1.0);
    let want = masked_reference(&q, &k, &v, c, &index, scale as f64);
    let dense = Attention::new(&ctx.device, path, c.d, c.n_head / c.n_kv_head).unwrap();
    let (qb, kb, vb) = (ctx.upload("q", &q).unwrap(), ctx.upload("k", &k).unwrap(), ctx.upload("v", &v).unwrap());
    let ob = ctx.upload("o", &vec![f32::NAN; q_rows * c.n_head as usize * d]).unwrap();
    let gpu_index = SparseIndex::new(&sparse_masks, shape.kv_len()).upload(ctx).unwrap();
    let buffers = gpu_index.buffers();
    let bind = attention.bind_sparse(&ctx.device, [&qb, &kb, &vb, &ob], &buffers);
    let sizes = [qb.size(), kb.size(), vb.size(), ob.size()];
    let mut batch = ctx.batch();
    batch.record("sparse attention", |pass| attention.dispatch_sparse(pass, &bind, &shape, sizes, &buffers)).unwrap();
    if let Some(heads) = dense_heads {
        let bind = dense.bind(&ctx.device, &qb, &kb, &vb, &ob);
        batch.record("attention", |pass| dense.dispatch_heads(pass, &bind, &shape, sizes, heads)).unwrap();
    }
    batch.submit();
    let got: Vec<f32> = ctx.read(&ob, 0, want.len()).unwrap();
    let err = common::relative_error(&got, &want);
    // And the dense kernel on the same inputs, to show the masks matter.
    let od = ctx.upload("o dense", &vec![f32::NAN; q_rows * c.n_head as usize * d]).unwrap();
    let bind = dense.bind(&ctx.device, &qb, &kb, &vb, &od);
    let mut batch = ctx.batch();
    batch.record("attention", |pass| dense.dispatch(pass, &bind, &shape, sizes)).unwrap();
    batch.submit();
    let dense_out: Vec<f32> = ctx.read(&od, 0, want.len()).unwrap();
    let dense_err = common::relative_error(&dense_out, &want);
    let bound = match path {
        KernelPath::CooperativeMatrix => 3e-3,
        KernelPath::Tiled => 1e-5,
    };
    let names: Vec<&str> = masks.iter().map(|m| m.name()).collect();
    let what =
        format!("{names:?} n={} pos0={} heads {}/{} d={} on {}", c.n, c.pos0, c.n_head, c.n_kv_head, c.d, path.name());
    eprintln!("{what}: relative error {err:.3e}, dense kernel's {dense_err:.3e}");
    assert!(err < bound, "{what}: relative error {err:.3e} (bound {bound:e})");
    let all_dense = masks.iter().all(|m| **m == Mask::Dense);
    assert!(all_dense || dense_err > 10.0 * bound, "{what}: the mask changes nothing ({dense_err:.3e})");
}

#[test]
fn each_pattern_kernel_equals_attention_over_its_mask() {
    let Some(ctx) = common::gpu("each_pattern_kernel_equals_attention_over_its_mask") else { return };
    let mut noise = Noise(common::Rng(0x5eed_0013));
    let ashape = Mask::AShape { sink_blocks: 1, local_blocks: 2 };
    let vslash = Mask::VerticalSlash(VerticalSlash::new(vec![3, 70, 71, 150, 260, 333], vec![0, 200]));
    let blocks = Mask::BlockSparse(BlockSparse::new(&[vec![], vec![], vec![1], vec![1], vec![2], vec![3, 1]]));
    // Query blocks 3 and 5 take blocks 2 and 4 beyond the main diagonal,
    // which hold columns 150 and 260 (no longer single there).
    let union = Mask::Union(Union {
        slash: VerticalSlash::new(vec![3, 70, 71, 150, 260, 333], vec![0]),
        ranked: BlockSparse::new(&[vec![], vec![], vec![1], vec![2, 1], vec![2], vec![4, 1]]),
        extra: 1,
    });
    // Query block 4 widened by key blocks 1 and 2, which hold the single
    // columns 70, 71 and 150 (no longer single there).
    let widened = Mask::Widened(Widened { base: Box::new(vslash.clone()), extra: vec![(4, vec![1, 2])] });
    let cases = [
        Case { n: 300, pos0: 0, n_head: 4, n_kv_head: 2, d: 64 },
        Case { n: 200, pos0: 0, n_head: 4, n_kv_head: 1, d: 256 },
        Case { n: 150, pos0: 192, n_head: 2, n_kv_head: 2, d: 128 },
    ];
    for path in common::kernel_paths(ctx, "each_pattern_kernel_equals_attention_over_its_mask") {
        for c in &cases {
            for mask in [&ashape, &vslash, &blocks, &union, &widened] {
                let masks = vec![mask; c.n_kv_head as usize];
                check(ctx, path, c, &masks, &mut noise);
            }
        }
        // KV heads with different patterns share one dispatch; the dense
        // ones (not adjacent) go to the dense kernel.
        let c = Case { n: 300, pos0: 0, n_head: 10, n_kv_head: 5, d: 64 };
        check(ctx, path, &c, &[&vslash, &Mask::Dense, &union, &Mask::Dense, &blocks], &mut noise);
    }
}

/// The probe's row softmax in f64: per probe row and KV head, p(t, j) over
/// the keys up to t, averaged over the KV head's query heads.
fn probe_reference(q: &[f16], k: &[f16], c: &Case, rows: &ProbeRows, scale: f64) -> Vec<Vec<Vec<f64>>> {
    let (hq, hk, d) = (c.n_head as usize, c.n_kv_head as usize, c.d as usize);
    let group = hq / hk;
    (0..hk)
        .map(|kvh| {
            rows.positions
                .iter()
                .map(|&t| {
                    let t = t as usize;
                    let mut p = vec![0.0; t + 1];
                    for g in 0..group {
                        let qrow = &q[((t - c.pos0 as usize) * hq + kvh * group + g) * d..][..d];
                        let s: Vec<f64> = (0..=t)
                            .map(|j| {
                                let krow = &k[(j * hk + kvh) * d..][..d];
                                scale * qrow.iter().zip(krow).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>()
                            })
                            .collect();
                        let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                        for (p, x) in p.iter_mut().zip(&s) {
                            *p += (x - max).exp() / sum / group as f64;
                        }
                    }
                    p
                })
                .collect()
        })
        .collect()
}

/// Block-sparse's pooled scores in f64: `[kv head][query block of the chunk][key block]`.
fn pooled_scores(q: &[f16], k: &[f16], c: &Case, scale: f64) -> Vec<Vec<Vec<f64>>> {
    let (hq, hk, d) = (c.n_head as usize, c.n_kv_head as usize, c.d as usize);
    let group = hq / hk;
    let kv_len = (c.pos0 + c.n) as usize;
    (0..hk)
        .map(|kvh| {
            (0..(c.n as usize).div_ceil(64))
                .map(|qb| {
                    let rows = qb * 64..(qb * 64 + 64).min(c.n as usize);
                    let pq: Vec<f64> = (0..d)
                        .map(|i| {
                            let sum: f64 = rows
                                .clone()
                                .flat_map(|r| (0..group).map(move |g| (r * hq + kvh * group + g) * d + i))
                                .map(|at| q[at].to_f64())
                                .sum();
                            sum / (rows.len() * group) as f64
                        })
                        .collect();
                    (0..kv_len.div_ceil(64))
                        .map(|kb| {
                            let keys = kb * 64..(kb * 64 + 64).min(kv_len);
                            let pk: Vec<f64> = (0..d)
                                .map(|i| {
                                    keys.clone().map(|j| k[(j * hk + kvh) * d + i].to_f64()).sum::<f64>()
                                        / keys.len() as f64
                                })
                                .collect();
                            scale * pq.iter().zip(&pk).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

#[test]
fn the_probe_equals_f64_softmax_over_its_rows() {
    let Some(ctx) = common::gpu("the_probe_equals_f64_softmax_over_its_rows") else { return };
    let mut noise = Noise(common::Rng(0x5eed_0213));
    let cases = [
        Case { n: 300, pos0: 0, n_head: 4, n_kv_head: 1, d: 256 },
        Case { n: 320, pos0: 128, n_head: 4, n_kv_head: 2, d: 64 },
        // A long context: more than TOP_BLOCKS key blocks to choose from
        // (999 and 1,000 for TOP_BLOCKS = 800).
        Case { n: 128, pos0: 64_000, n_head: 2, n_kv_head: 2, d: 32 },
    ];
    for c in &cases {
        let (hq, hk, d) = (c.n_head as usize, c.n_kv_head as usize, c.d as usize);
        let kv_len = (c.pos0 + c.n) as usize;
        let scale = 1.0 / (c.d as f32).sqrt();
        let shape =
            AttentionShape { n: c.n, pos0: c.pos0, n_head: c.n_head, n_kv_head: c.n_kv_head, window: None, scale };
        let q = noise.f16s(c.n as usize * hq * d, 3.0);
        let k = noise.f16s(kv_len * hk * d, 3.0);
        let rows = ProbeRows::new(c.pos0, c.n, 8, 4);
        let kernels = ProbeKernels::new(ctx, c.d).unwrap();
        let (qb, kb) = (ctx.upload("q", &q).unwrap(), ctx.upload("k", &k).unwrap());
        let mut probe = kernels.run(ctx, &shape, &rows, &qb, &kb).unwrap();
        let lines: Vec<HeadLines> = (0..hk).map(|h| HeadLines::new(&probe, h)).collect();
        let ranked: Vec<&[u32]> = lines.iter().map(|l| &l.columns[..]).collect();
        kernels.column_masses(ctx, &shape, &rows, &qb, &kb, &mut probe, &ranked).unwrap();
        let p = probe_reference(&q, &k, c, &rows, scale as f64);
        let what = format!("n={} pos0={} heads {hq}/{hk} d={d}", c.n, c.pos0);
        let mut worst = [0.0f64; 4];
        for (h, head) in p.iter().enumerate() {
            for (r, row) in head.iter().enumerate() {
                for (b, &got) in probe.mass(h, r).iter().enumerate() {
                    let want: f64 = row.iter().skip(b * 64).take(64).sum();
                    worst[0] = worst[0].max((got as f64 - want).abs());
                }
                // Every probe row's probability of each ranked column (0 past the
                // ranking, and for columns after the row).
                for (rank, &got) in probe.column_mass(h, r).iter().enumerate() {
                    let j = lines[h].columns.get(rank).map(|&j| j as usize);
                    let want = j.and_then(|j| row.get(j).copied()).unwrap_or(0.0);
                    worst[3] = worst[3].max((got as f64 - want).abs());
                }
            }
            assert_eq!(lines[h].columns.len(), COLUMNS.min(kv_len), "{what}");
            for j in 0..kv_len {
                let recent = || head.iter().zip(&rows.positions).take(rows.recent);
                let column: f64 = recent().map(|(row, _)| row.get(j).copied().unwrap_or(0.0)).sum();
                let diagonal: f64 =
                    recent().filter(|(_, t)| **t as usize >= j).map(|(row, &t)| row[t as usize - j]).sum();
                worst[1] = worst[1].max((probe.columns(h)[j] as f64 - column).abs());
                worst[2] = worst[2].max((probe.diagonals(h)[j] as f64 - diagonal).abs());
            }
        }
        eprintln!(
            "{what}: block mass, column and diagonal scores, column masses within {:.2e}, {:.2e}, {:.2e}, {:.2e} of f64",
            worst[0], worst[1], worst[2], worst[3]
        );
        assert!(worst.iter().all(|&w| w < 1e-4), "{what}: {worst:?}");
        // Each query block's best key blocks, best first, against f64 pooled
        // scores: the lists of every query block, and those of the probe
        // rows' query blocks that come back with the probe.
        assert!(rows.positions.iter().all(|t| probe.probe_blocks.binary_search(&(t / 64)).is_ok()), "{what}");
        let scores = pooled_scores(&q, &k, c, scale as f64);
        for (h, head) in scores.iter().enumerate() {
            let every = probe.head_lists(ctx, h).unwrap();
            for (i, row) in head.iter().enumerate() {
                let diagonal = c.pos0 as usize / 64 + i;
                let mut want: Vec<usize> = (1..diagonal).collect();
                want.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                want.truncate(TOP_BLOCKS);
                let mut lists = vec![&every[i * TOP_BLOCKS..][..TOP_BLOCKS]];
                if let Ok(p) = probe.probe_blocks.binary_search(&(diagonal as u32)) {
                    lists.push(&probe.top_blocks[(h * probe.probe_blocks.len() + p) * TOP_BLOCKS..][..TOP_BLOCKS]);
                }
                for (at, &g) in lists.iter().flat_map(|got| got.iter().enumerate()) {
                    match want.get(at) {
                        None => assert_eq!(g, NO_BLOCK, "{what}: head {h} query block {i} entry {at}"),
                        Some(&w) => {
                            assert!(g != NO_BLOCK && (g as usize) < diagonal, "{what}: {h} {i} {at}: {g}");
                            let (sg, sw) = (row[g as usize], row[w]);
                            assert!(
                                (sg - sw).abs() <= 1e-4 * (1.0 + sw.abs()),
                                "{what}: {h} {i} {at}: {g} ({sg}) for {w} ({sw})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A latency profile in which every kernel takes the same time per key it
/// visits, measured at `tokens` positions: dense 1000 µs a KV head, and a
/// sparse mask the same fraction of it as of dense attention's keys.
fn proportional_profile(tokens: u32, n_head: u32, n_kv_head: u32, head_dim: u32) -> LatencyProfile {
    let dense_keys = Mask::Dense.visited_keys(0..tokens.div_ceil(64));
    let entries = Candidate::library()
        .into_iter()
        .map(|c| Entry { pattern: c.pattern, budget: c.budget, tokens, us: 1000.0, keys: dense_keys })
        .collect();
    LatencyProfile {
        adapter: "synthetic".into(),
        driver: String::new(),
        path: String::new(),
        head_dim,
        n_head,
        n_kv_head,
        entries,
        probe: vec![ProbeEntry { tokens, us: 0.0 }],
        listed_dense: vec![],
    }
}

/// A text with structure for attention to find: sentences drawn from a small
/// vocabulary, some of them repeated.
fn text(words: usize) -> String {
    let vocabulary = [
        "the", "river", "ran", "past", "an", "old", "mill", "where", "Anna", "kept", "her", "books", "and", "a",
        "lamp", "that", "burned", "all", "night", "while", "wind", "came", "down", "from", "hills", "of", "grey",
        "stone", "she", "wrote", "letters", "to", "brother", "in", "town",
    ];
    let mut rng = common::Rng(0x5eed_0113);
    let mut sentences: Vec<String> = Vec::new();
    let mut out = String::new();
    while out.split_whitespace().count() < words {
        let sentence = match sentences.len() > 4 && rng.next().is_multiple_of(3) {
            true => sentences[(rng.next() % sentences.len() as u64) as usize].clone(),
            false => {
                let len = 6 + (rng.next() % 10) as usize;
                let words: Vec<&str> =
                    (0..len).map(|_| vocabulary[(rng.next() % vocabulary.len() as u64) as usize]).collect();
                let s = format!("{}.", words.join(" "));
                sentences.push(s.clone());
                s
            }
        };
        out.push_str(&sentence);
        out.push(' ');
    }
    out
}

/// A routed prefill of the default model against the dense one, on a prompt
/// of 8 query blocks with a budget of 0.85 of dense time, under a profile in
/// which time is proportional to the keys visited: a head saves time only
/// with a sparse mask, and takes one only where the probe's lower mass bound
/// clears τ, its last query block widened until each recent row keeps τ
/// (`RecentRows::Keep`, so the widened lists go through the kernel) (on 8 blocks the cheapest masks still visit 0.8 to 0.9 of the
/// keys, so the budget is not always met). Every audited head's certificate
/// must cover its measured error. The bound on the logits is on the expected
/// increase in log-loss of the next token when it follows the dense
/// distribution p, which is KL(p ‖ q): at most 0.05 nats, a perplexity at
/// most 5% above dense at this position, for masks allowed to drop up to
/// 1 − τ = 10% of a head's attention (measured on lavapipe: 0.0133 nats
/// against the CPU's f32 prefill, the three global heads keeping 91–97%, the
/// last query block widened in each; 0.0188 without the widening). A mask that misses where attention
/// goes, or a kernel that reads the wrong keys, is far outside it. The 0.5% criterion
/// of the issue is the perplexity test's, over 2,048 positions of a book.
#[test]
fn routed_prefill_of_a_short_prompt_gives_logits_close_to_dense() {
    let Some(gpu) = common::gpu("routed_prefill_of_a_short_prompt_gives_logits_close_to_dense") else { return };
    let path = common::default_model();
    let file = GgufFile::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let tokenizer = common::gemma3_tokenizer();
    let mut tokens = tokenizer.encode(&text(600), true, false).unwrap();
    tokens.truncate(512);
    let n = tokens.len();
    assert!(n == 512, "{n} tokens");
    let hp = &model.hp;
    // Dense is the CPU's prefill with f32 activations (the GPU's arithmetic
    // but for rounding, in a fraction of a software renderer's time); the
    // routed side's logits leave the GPU as hidden states, and the same f32
    // products make them logits. The switch is the process's: no other test
    // of this binary multiplies on the CPU.
    struct F32Activations;
    impl Drop for F32Activations {
        fn drop(&mut self) {
            set_f32_activations(false);
        }
    }
    set_f32_activations(true);
    let _f32 = F32Activations;
    let session = || Session::with_cache(&model, n + 1, 512, Storage::default());
    let dense = session().prefill(&tokens).unwrap().to_vec();
    let logits = |prefill: &GpuPrefill| {
        let mut session = session();
        session.set_prefill_backend(Box::new(prefill));
        session.prefill(&tokens).unwrap().to_vec()
    };
    let settings = RouteSettings {
        budget: ROUTED_BUDGET,
        tau: ROUTED_TAU,
        recent_rows: RecentRows::Keep,
        delta: 0.0,
        audit: true,
        ..RouteSettings::default()
    };
    let profile = proportional_profile(n as u32, hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim_k as u32);
    let routed_prefill = GpuPrefill::new(gpu, &model).unwrap().with_routing_profile(settings, Some(profile)).unwrap();
    let routed = logits(&routed_prefill);
    let report = routed_prefill.routed().unwrap().report.lock().unwrap().clone();
    let global_layers = (0..hp.n_layer).filter(|&il| hp.window(il).is_none()).count();
    assert_eq!(report.layers.len(), global_layers, "{report:?}");
    let mut sparse = 0;
    for layer in &report.layers {
        for h in &layer.heads {
            eprintln!("layer {} {h}", layer.layer);
            if h.pattern != "dense" {
                sparse += 1;
                assert!(h.density < 1.0 && h.mass_lower >= ROUTED_TAU, "{h:?}");
            }
            assert!(h.audit.as_ref().is_some_and(|a| a.covered), "{h:?}");
        }
    }
    assert!(sparse > 0, "no head went sparse: {report:?}");
    let distribution = |l: &[f32]| {
        let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = l.iter().map(|&x| (x as f64 - max).exp()).sum();
        l.iter().map(|&x| (x as f64 - max).exp() / sum).collect::<Vec<f64>>()
    };
    let (p, q) = (distribution(&dense), distribution(&routed));
    let kl: f64 = p.iter().zip(&q).filter(|(a, _)| **a > 0.0).map(|(a, b)| a * (a / b).ln()).sum();
    let top = |l: &[f64]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    eprintln!("{n} tokens, {sparse} of {global_layers} global heads sparse: KL(dense ‖ routed) {kl:.2e} nats");
    assert_eq!(top(&p), top(&q), "the most likely next token changed");
    assert!(kl <= 0.05, "KL(dense ‖ routed) = {kl}");
}

/// The (τ, budget) settings the GPU quality tests route with: the defaults,
/// or `SIFT_ROUTE_SETTINGS`, comma-separated `τ:budget` pairs (the seed's
/// latency–quality curve varies both), each optionally `:recent` (m̲ bounds
/// the probe's least-kept recent row too, [`RecentRows::Bound`]) or `:keep`
/// (the recent rows' query blocks widened until each keeps τ, [`RecentRows::Keep`]).
fn route_settings(defaults: &RouteSettings) -> Vec<(f64, f64, RecentRows)> {
    let Ok(list) = std::env::var("SIFT_ROUTE_SETTINGS") else {
        return vec![(defaults.tau, defaults.budget, defaults.recent_rows)];
    };
    list.split(',')
        .map(|setting| {
            let mut parts = setting.split(':').map(str::trim);
            let mut number = |what| parts.next().and_then(|p| p.parse().ok()).expect(what);
            let (tau, budget) = (number("SIFT_ROUTE_SETTINGS: τ"), number("SIFT_ROUTE_SETTINGS: budget"));
            let recent_rows = match parts.next() {
                None => RecentRows::Mean,
                Some("recent") => RecentRows::Bound,
                Some("keep") => RecentRows::Keep,
                Some(other) => panic!("SIFT_ROUTE_SETTINGS: '{other}' is neither 'recent' nor 'keep'"),
            };
            (tau, budget, recent_rows)
        })
        .collect()
}

/// A number hidden at 10%, 50% and 90% depth of a 30K-token PG-19 text and
/// asked for at the end: routed prefill answers it whenever dense prefill
/// does, at each of [`route_settings`]. Needs a GPU fast enough for 30K-token
/// prefills (not lavapipe) and `../shared`; profiles the adapter first when
/// it has no profile.
#[test]
#[ignore]
fn routed_prefill_finds_the_needle_whenever_dense_does() {
    let Some(shared) = common::shared_dir("routed_prefill_finds_the_needle_whenever_dense_does") else { return };
    let book = std::fs::read_to_string(shared.join("data/pg19/10762.txt")).unwrap();
    // An existing SIFT_CACHE_DIR is taken to hold this adapter's profile (and
    // the model's calibration); otherwise a fresh one is profiled.
    let given = std::env::var_os("SIFT_CACHE_DIR").map(std::path::PathBuf::from);
    let cache =
        given.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("sift-needle-{}", std::process::id())));
    let sift = |args: &[&str], input: &[u8]| {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let mut child = Command::new(env!("CARGO_BIN_EXE_sift"))
            .args(args)
            .env("SIFT_CACHE_DIR", &cache)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out
    };
    let model = common::default_model();
    let model = model.to_str().unwrap();
    let sweep = route_settings(&RouteSettings::default());
    if given.is_none() {
        sift(&["gpu-profile", "-m", model, "--tokens", "32768", "--runs", "1"], b"");
    }
    let number = "48213";
    let needle = format!(" The secret number of the lighthouse keeper is {number}. ");
    let question = "\n\nQuestion: What is the secret number of the lighthouse keeper?\nAnswer: The secret number of the lighthouse keeper is";
    // About 4.2 characters a token in this book: 30K tokens.
    let body: String = book.chars().take(124_000).collect();
    let mut failures = Vec::new();
    for depth in [0.1, 0.5, 0.9] {
        let at = body
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| i >= (body.len() as f64 * depth) as usize && body[..i].ends_with(". "))
            .unwrap();
        let prompt = format!("{}{needle}{}{question}", &body[..at], &body[at..]);
        let answer = |more: &[&str]| {
            let mut args = vec!["run", "-m", model, "--gpu", "on", "-c", "32768", "-n", "8", "--temp", "0", "--json"];
            args.extend_from_slice(more);
            let out = sift(&args, prompt.as_bytes());
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            (json["text"].as_str().unwrap().to_string(), json["prompt_tokens"].as_u64().unwrap())
        };
        let (dense, tokens) = answer(&["--prefill-attn", "dense"]);
        for &(tau, budget, recent_rows) in &sweep {
            let (tau_arg, budget_arg) = (tau.to_string(), budget.to_string());
            let report = cache.join("needle-report.json");
            let mut args = vec![
                "--prefill-attn",
                "routed",
                "--prefill-tau",
                &tau_arg,
                "--prefill-budget",
                &budget_arg,
                "--prefill-report",
                report.to_str().unwrap(),
            ];
            let recent_arg = format!("--prefill-recent-rows={}", recent_rows.name());
            args.push(&recent_arg);
            let routed = answer(&args).0;
            let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
            let chosen: Vec<String> = report["layers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|l| {
                    l["heads"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(move |h| format!("{} {}{}", l["layer"], h["pattern"], h["budget"]))
                })
                .collect();
            eprintln!(
                "depth {depth}, τ {tau} budget {budget} recent rows {}: {tokens} tokens; dense {dense:?}, routed {routed:?} ({})",
                recent_rows.name(),
                chosen.join(", ")
            );
            if dense.contains(number) && !routed.contains(number) {
                failures.push((depth, tau, budget, recent_rows));
            }
        }
    }
    if given.is_none() {
        let _ = std::fs::remove_dir_all(&cache);
    }
    assert!(
        failures.is_empty(),
        "routed missed the needle that dense found at (depth, τ, budget, recent rows) {failures:?}"
    );
}

/// Teacher-forced perplexity of the 2048 tokens after a 30,720-token prefix
/// prefilled on the GPU, dense against routed (audited), on two PG-19 books
/// (10321 and 10762; calibrate δ on the other two). The prefix goes to the
/// GPU, and so do the scored tokens, in batches of 512 continuing the cache
/// the prefill left (a batch that short attends densely: its dense attention
/// costs less than the probe). Routed must stay within 0.5% of dense, and the
/// certificate must cover at least 95% of the audited heads. Needs a GPU fast
/// enough for 30K-token prefills, this adapter's latency profile (`sift
/// gpu-profile`) and `../shared`. `SIFT_ROUTE_SETTINGS` runs the routed side
/// once per setting against one dense run (see [`route_settings`]).
#[test]
#[ignore]
fn routed_prefix_perplexity_is_within_half_a_percent_of_dense() {
    let Some(shared) = common::shared_dir("routed_prefix_perplexity_is_within_half_a_percent_of_dense") else { return };
    let Some(gpu) = common::gpu("routed_prefix_perplexity_is_within_half_a_percent_of_dense") else { return };
    let path = common::default_model();
    let file = GgufFile::open(&path).unwrap();
    let model = Model::load(&file).unwrap();
    let tokenizer = common::gemma3_tokenizer();
    let (prefix, scored) = (30_720, 2048);
    let dense = GpuPrefill::new(gpu, &model).unwrap();
    let settings = RouteSettings { audit: true, ..RouteSettings::default() };
    let calibration = CalibrationFile::load(&CalibrationFile::file(&model.hp));
    if let Err(e) = &calibration {
        eprintln!("no calibration ({e}): delta {}", settings.delta);
    }
    let sweep = route_settings(&settings);
    let routed: Vec<GpuPrefill> = sweep
        .iter()
        .map(|&(tau, budget, recent_rows)| {
            let delta = calibration.as_ref().map_or(settings.delta, |c| c.delta_for(recent_rows));
            let pattern_deltas = calibration.as_ref().map_or(vec![], |c| c.pattern_deltas(recent_rows));
            let settings = RouteSettings { tau, budget, recent_rows, delta, pattern_deltas, ..settings.clone() };
            GpuPrefill::new(gpu, &model).unwrap().with_routing(settings).unwrap()
        })
        .collect();
    let mut head = sift::matmul::MatmulScratch::default();
    // The mean log-loss of the scored tokens, and the report of the prefix's prefill.
    let mut nll = |prefill: &GpuPrefill, tokens: &[u32]| -> (f64, Option<PrefillReport>) {
        let mut session = Session::with_cache(&model, prefix + scored + 1, 512, Storage::default());
        session.set_prefill_backend(Box::new(prefill));
        session.prefill(&tokens[..prefix]).unwrap();
        let report = prefill.routed().map(|r| r.report.lock().unwrap().clone());
        let n_vocab = model.hp.n_vocab;
        let mut logits = vec![0.0f32; n_vocab];
        let mut sum = 0.0;
        // Position k predicts token k + 1: the scored tokens are prefix + 1 ..= prefix + scored.
        for start in (prefix..prefix + scored).step_by(512) {
            let hidden = session.evaluate_all(&tokens[start..start + 512]).unwrap().to_vec();
            for (i, h) in hidden.chunks_exact(model.hp.n_embd).enumerate() {
                model.logits(h, &mut logits, &mut head);
                let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
                sum += lse - logits[tokens[start + i + 1] as usize] as f64;
            }
        }
        (sum / scored as f64, report)
    };
    let (mut audited, mut covered, mut heads, mut fallbacks) = (0, 0, 0, 0);
    let mut failures = Vec::new();
    let books = std::env::var("SIFT_ROUTE_BOOKS").unwrap_or_else(|_| "10321,10762".into());
    for book in books.split(',').map(str::trim) {
        let text = std::fs::read_to_string(shared.join(format!("data/pg19/{book}.txt"))).unwrap();
        let tokens = tokenizer.encode(&text, true, false).unwrap();
        assert!(tokens.len() > prefix + scored + 1);
        let dense_ppl = nll(&dense, &tokens).0.exp();
        for (routed, (tau, budget, _)) in routed.iter().zip(&sweep) {
            let (routed_nll, report) = nll(routed, &tokens);
            let (routed_ppl, report) = (routed_nll.exp(), report.unwrap());
            for layer in &report.layers {
                for h in &layer.heads {
                    eprintln!("{book} τ {tau} budget {budget} layer {} {h}", layer.layer);
                    let weighed: Vec<String> = h
                        .candidates
                        .iter()
                        .map(|c| format!("{}{:?} m̲ {:.3} {:.0} µs", c.pattern, c.budget, c.mass_lower, c.time_us))
                        .collect();
                    eprintln!("  candidates: {}", weighed.join("; "));
                }
            }
            let s = &report.summary;
            (audited, covered, heads, fallbacks) =
                (audited + s.audited, covered + s.covered, heads + s.heads, fallbacks + s.fallbacks);
            let change = routed_ppl / dense_ppl - 1.0;
            let t = &report.timing;
            eprintln!(
                "{book} τ {tau} budget {budget}: PPL of {scored} tokens after {prefix}: dense {dense_ppl:.4}, routed {routed_ppl:.4} ({:+.3}%); \
                 routed layers {:.1} ms wall (probe {:.1}, index {:.1}, routing {:.1}, lists {:.1}, kernels {:.1} = dense {:.1} + sparse {:.1}) \
                 against {:.1} ms dense (profile)",
                100.0 * change,
                t.routed_wall_ms,
                t.probe_ms,
                t.index_ms,
                t.routing_ms,
                t.lists_ms,
                t.kernel_ms,
                t.dense_kernel_ms,
                t.sparse_kernel_ms,
                t.dense_estimate_ms
            );
            if change.abs() > 0.005 {
                failures
                    .push(format!("{book} τ {tau} budget {budget}: routed PPL {routed_ppl} against dense {dense_ppl}"));
            }
        }
    }
    eprintln!("fallback rate {fallbacks}/{heads}; certificate coverage {covered}/{audited}");
    assert!(failures.is_empty(), "{failures:?}");
    assert!(covered as f64 >= 0.95 * audited as f64, "coverage {covered}/{audited}");
}
