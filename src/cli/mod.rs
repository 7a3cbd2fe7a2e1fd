//! Subcommands and what they share: finding and opening the model, threads,
//! exit codes.

mod attn;
mod bench;
mod chat;
mod embed;
mod gpu_bench;
mod gpu_profile;
mod inspect;
mod perplexity;
mod run;
mod serve;
mod tokenize;

use std::io::{IsTerminal, Read};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context};
use clap::builder::TypedValueParser;
use clap::{Args, CommandFactory, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sift::audit::{AuditError, AuditLog};
use sift::chat::{ChatError, ChatTemplate, Origin};
use sift::conversation::ConversationError;
use sift::embed::PoolingError;
use sift::engine::{EngineError, PrefillProgress, Session};
use sift::gguf::{GgufError, GgufFile, Residence};
use sift::gpu::on_demand::{GpuMode, OnDemand, PrefillOptions};
use sift::gpu::route::calibration::CalibrationFile;
use sift::gpu::route::{Pattern, RecentRows, RouteSettings};
use sift::gpu::{GpuError, KernelError};
use sift::kv::{KvMode, Storage};
use sift::model::{Model, ModelError};
use sift::perplexity::PerplexityError;
use sift::sample::{clock_seed, SamplingParams};
use sift::structured::{Format, Grammar, GrammarCompiler, GrammarError};
use sift::tokenizer::{Tokenizer, TokenizerError};

use attn::AttentionArgs;

pub const EXIT_USAGE: u8 = 1;
pub const EXIT_MODEL: u8 = 2;
pub const EXIT_CONTEXT: u8 = 3;
pub const EXIT_OTHER: u8 = 4;

/// The default model, as `models/fetch` assembles it in this checkout.
const DEFAULT_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gemma-3-270m-Q4_K_M.gguf");

#[derive(Parser)]
#[command(
    name = "sift",
    version,
    about = "CPU-first inference for GGUF language models (Gemma 3, Llama, Qwen2, SmolLM)",
    long_about = "CPU-first inference for GGUF language models (Gemma 3, Llama, Qwen2, SmolLM).\n\n\
        Without -m, sift uses the default model, Gemma 3 270M Q4_K_M, which `models/fetch` downloads.\n\n\
        Exit codes: 0 success, 1 usage error, 2 model or input file unusable, 3 prompt longer than the \
        context, 4 any other failure."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt (the chat template only with --chat).
    Run(run::RunArgs),
    /// Talk with the model in turns, with its chat template; piped input is one message a line.
    Chat(chat::ChatArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (and Anthropic's and Ollama's), with a chat page at /.
    Serve(serve::ServeArgs),
    /// Measure perplexity of a text file, as llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
    /// Print the token ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Print texts' embeddings, one JSON array a line (as the server's /v1/embeddings gives them).
    Embed(embed::EmbedArgs),
    /// Describe a model: architecture, hyper-parameters, tensor types, memory needs.
    Inspect(inspect::InspectArgs),
    /// Measure prompt processing and generation speed, as llama-bench does.
    Bench(bench::BenchArgs),
    /// Measure the GPU kernels (matmul, attention) in TFLOP/s on each kernel path.
    GpuBench(gpu_bench::GpuBenchArgs),
    /// Measure the sparse prefill kernels' latency profile for --prefill-attn routed, and
    /// calibrate its mass bound.
    GpuProfile(gpu_profile::GpuProfileArgs),
    /// Print a shell completion script, e.g. `source <(sift completions bash)`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// Options every model-running command takes.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: the fetched Gemma 3 270M]
    #[arg(short, long, env = "SIFT_MODEL")]
    model: Option<PathBuf>,
    /// Worker threads [default: physical cores]
    #[arg(short, long, env = "SIFT_THREADS", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    threads: Option<usize>,
    /// Kernel set: auto picks the best this CPU supports
    #[arg(long, env = "SIFT_ISA", default_value = "auto", value_parser = ["auto", "scalar", "avx2", "avxvnni", "avx512"])]
    isa: String,
    /// Where the weights live: huge-pages reads the file into memory backed by
    /// 2 MiB pages (decoding streams every weight, and runs about 10% faster
    /// so), mmap maps the file (shared with the page cache, nothing read at
    /// start); auto takes huge pages when the kernel offers them and the file
    /// is under half of the available memory (tokenize and inspect, which
    /// read no weights, always map)
    #[arg(long, env = "SIFT_LOAD", default_value = "auto", value_parser = ["auto", "mmap", "huge-pages"])]
    load: String,
}

impl ModelArgs {
    /// The model file, where `--load` says its weights should live.
    pub fn open(&self) -> anyhow::Result<GgufFile> {
        let residence = match self.load.as_str() {
            "mmap" => Residence::Mapped,
            "huge-pages" => Residence::HugePages,
            _ => Residence::Auto,
        };
        self.warn_if_oversubscribed();
        self.open_in(residence)
    }

    /// Warns (once) when `-t` asks for more workers than the CPUs this
    /// process may run on: the extra workers add nothing, and each parallel
    /// loop waits for workers that share a CPU (on 2 CPUs, decoding the
    /// default model ran 12% slower at `-t 16`, 2.3 times at 64, 17 at 256).
    fn warn_if_oversubscribed(&self) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        let (Some(threads), Ok(cpus)) = (self.threads, std::thread::available_parallelism()) else {
            return;
        };
        if threads > cpus.get() {
            ONCE.call_once(|| {
                eprintln!(
                    "sift: warning: -t {threads} is more threads than the {cpus} CPUs sift may run on; \
                     it runs no faster than -t {cpus}, and slower the more threads share a CPU"
                )
            });
        }
    }

    /// The model file for a command that reads its metadata and vocabulary but never its weights
    /// (`tokenize`, `inspect`): mapped whatever `--load` says, so that no weight is read.
    pub fn open_for_metadata(&self) -> anyhow::Result<GgufFile> {
        self.open_in(Residence::Mapped)
    }

    fn open_in(&self, residence: Residence) -> anyhow::Result<GgufFile> {
        if self.isa != "auto" {
            let isa: simd::Isa = self.isa.parse().map_err(|e: simd::ParseIsaError| Usage(e.0))?;
            simd::select_isa(isa).map_err(|e| Usage(e.to_string()))?;
        }
        sift::threads::init(self.threads.unwrap_or_else(sift::threads::default_threads));
        let path = match &self.model {
            Some(path) => path.clone(),
            None => {
                let path = PathBuf::from(DEFAULT_MODEL);
                if !path.exists() {
                    bail!(GgufError::Io {
                        path,
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "the default model is not there; fetch it with `models/fetch`, or pass -m MODEL",
                        ),
                    });
                }
                path
            }
        };
        Ok(GgufFile::open_in(path, residence)?)
    }
}

/// How the KV cache stores keys and values, for every command that runs
/// the model.
#[derive(Args, Clone)]
pub struct CacheArgs {
    /// KV cache: f16 keeps keys and values exact; q8, q4 and q2 quantize all
    /// but the first 4 and the newest 128 tokens (keys per channel over pages
    /// of 64 tokens, values per token in groups of 32)
    #[arg(long = "kv-cache", env = "SIFT_KV_CACHE", default_value = "f16")]
    pub kv_cache: KvMode,
}

/// `--prefill-recent-rows`'s values: the modes' names, listed in `--help`.
fn recent_rows_parser() -> impl TypedValueParser<Value = RecentRows> {
    clap::builder::PossibleValuesParser::new(RecentRows::ALL.map(RecentRows::name)).try_map(|s| s.parse::<RecentRows>())
}

/// Where prompts are prefilled, for every command that runs the model.
#[derive(Args, Clone)]
pub struct GpuArgs {
    /// GPU prefill through Vulkan: auto prefills a prompt (or a chat's next
    /// turn) of at least 2048 tokens on a discrete or integrated GPU when
    /// there is one (the CPU otherwise); on prefills every such prompt on the
    /// GPU, a software renderer such as lavapipe included, and fails (exit 2)
    /// without one; off never opens the GPU. Decoding stays on the CPU
    #[arg(long, env = "SIFT_GPU", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub gpu: String,
    /// Bounds the GPU working memory of one attention call of the prefill
    /// (its Q, K, V, outputs and softmax statistics; not the weights or other
    /// activations) to BYTES: a plain number, or one ending in K, M or G
    /// (KiB, MiB, GiB). A call past it is computed exactly in pieces that fit,
    /// by cyclic quorum sets (Stream-CQSA), and stderr reports the depth and
    /// the time of each stage. Without it every call runs whole (the
    /// prefill's chunks already fit the device's buffer limits)
    #[arg(long, env = "SIFT_GPU_MEM_BUDGET", value_name = "BYTES", value_parser = parse_bytes)]
    pub gpu_mem_budget: Option<u64>,
    /// Attention of GPU prefill on layers without a window: dense (exact); routed picks per
    /// prompt and KV head among A-shape, vertical-slash, block-sparse, their union and dense under
    /// --prefill-budget (needs `sift gpu-profile` once per adapter); ashape, vslash and
    /// blocksparse apply one pattern everywhere at MInference's budgets
    #[arg(long, default_value = "dense", value_parser = ["dense", "routed", "ashape", "vslash", "blocksparse"])]
    pub prefill_attn: String,
    /// Routed: each layer's attention time (probe included) as a fraction of dense, from the
    /// measured latency profile
    #[arg(long, default_value_t = 0.25)]
    pub prefill_budget: f64,
    /// Routed: a KV head whose lower mass bound m̲ = m̂ − δ is under this for every sparse
    /// pattern stays dense
    #[arg(long, default_value_t = 0.95)]
    pub prefill_tau: f64,
    /// Routed: what the probe's recent rows (the prompt's last queries) add to the lower mass
    /// bound. mean: none (m̲ = m̂ − δ); bound (the flag alone): m̲ bounds their least-kept row
    /// too (m̲ = min(m̂, ŵ) − δ), so that a mask dropping a far key they attend to is not
    /// eligible; keep: their query blocks list the key blocks they attend to most until each
    /// keeps τ of its mass, and m̲ bounds the mean
    #[arg(long, value_name = "MODE", num_args = 0..=1, default_value = "mean", default_missing_value = "bound",
          require_equals = true, value_parser = recent_rows_parser())]
    pub prefill_recent_rows: RecentRows,
    /// δ, the calibrated quantile of the probe's mass overestimate, from this file [default:
    /// the one `sift gpu-profile --calibrate` wrote for the model; 0.05 without one]
    #[arg(long, value_name = "FILE")]
    pub prefill_calibration: Option<PathBuf>,
    /// Write what a sparse prefill did to FILE as JSON: per layer and KV head the pattern,
    /// budget, m̂, m̲, fallback and the certificate 2(1 − m̲)·V_max; probe, index, routing
    /// and kernel times
    #[arg(long, value_name = "FILE")]
    pub prefill_report: Option<PathBuf>,
    /// Also run dense attention beside the sparse one and add to the report each head's
    /// true output error and mass kept, and whether the certificate covered it
    #[arg(long, requires = "prefill_report")]
    pub prefill_audit: bool,
}

/// A positive byte count, with an optional K, M or G (powers of 1024).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let (digits, unit) = match s.char_indices().last() {
        Some((at, c @ ('K' | 'M' | 'G' | 'k' | 'm' | 'g'))) => (&s[..at], c.to_ascii_uppercase()),
        _ => (s, ' '),
    };
    let shift = match unit {
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => 0,
    };
    let bytes = digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("'{s}' is not a byte count (a number, optionally ending in K, M or G)"))?;
    match bytes {
        0 => Err("a budget of 0 bytes holds nothing".into()),
        b => Ok(b),
    }
}

impl GpuArgs {
    pub fn mode(&self) -> GpuMode {
        self.gpu.parse().unwrap_or(GpuMode::Auto)
    }

    /// Gives `session` the GPU prefill `--gpu` asks for (opened on first use,
    /// except with `on`, which opens it now).
    pub fn attach<'m>(&self, model: &'m Model<'m>, session: &mut Session<'m>) -> anyhow::Result<()> {
        if let Some(backend) = OnDemand::new(model, self.mode(), self.prefill_options(&model.hp)?)? {
            session.set_prefill_backend(Box::new(backend));
        }
        Ok(())
    }
}

impl GpuArgs {
    /// What the GPU prefill is set up with beyond `--gpu`.
    pub fn prefill_options(&self, hp: &sift::model::hparams::HParams) -> anyhow::Result<PrefillOptions> {
        Ok(PrefillOptions { attention_budget: self.gpu_mem_budget, route: self.route_settings(hp)? })
    }

    /// The sparse prefill asked for; `None` for dense.
    pub fn route_settings(&self, hp: &sift::model::hparams::HParams) -> anyhow::Result<Option<RouteSettings>> {
        if self.prefill_attn == "dense" {
            return Ok(None);
        }
        if !(self.prefill_budget > 0.0 && self.prefill_budget.is_finite()) {
            return Err(Usage(format!("--prefill-budget must be positive, not {}", self.prefill_budget)).into());
        }
        if !(0.0..=1.0).contains(&self.prefill_tau) {
            return Err(Usage(format!("--prefill-tau must be within 0..1, not {}", self.prefill_tau)).into());
        }
        let pattern = match self.prefill_attn.as_str() {
            "routed" => None,
            name => Some(name.parse::<Pattern>().map_err(Usage)?),
        };
        let mut settings = RouteSettings {
            pattern,
            budget: self.prefill_budget,
            tau: self.prefill_tau,
            recent_rows: self.prefill_recent_rows,
            audit: self.prefill_audit,
            report: self.prefill_report.clone(),
            ..RouteSettings::default()
        };
        let (file, given) = match &self.prefill_calibration {
            Some(file) => (file.clone(), true),
            None => (CalibrationFile::file(hp), false),
        };
        match CalibrationFile::load(&file) {
            Ok(c) => {
                settings.delta = c.delta_for(settings.recent_rows);
                settings.pattern_deltas = c.pattern_deltas(settings.recent_rows);
                settings.delta_source = sift::gpu::report::Calibration {
                    delta: settings.delta,
                    quantile: c.quantile,
                    file: Some(file.display().to_string()),
                };
            }
            Err(e) if given => return Err(InputError(format!("--prefill-calibration: {e}")).into()),
            Err(_) => {
                eprintln!(
                    "sift: no mass calibration for this model; delta = {} (run `sift gpu-profile --calibrate`)",
                    settings.delta
                )
            }
        }
        Ok(Some(settings))
    }
}

impl CacheArgs {
    pub fn storage(&self) -> Storage {
        Storage { mode: self.kv_cache, ..Storage::default() }
    }
}

/// Context size, sampling and the cache: how every conversational command generates.
#[derive(Args)]
pub struct GenerationArgs {
    /// Context size in tokens [default: 4096, or the model's if smaller]
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
    /// Sampling temperature; 0 is greedy
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Divide the logits of tokens seen in the last --repeat-last-n by this (1.0: off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtract this from the logits of tokens seen in the last --repeat-last-n, once each
    /// (-2 to 2; 0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this from a token's logit for each time it was seen in the last --repeat-last-n
    /// (-2 to 2; 0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// How many recent tokens (prompt and reply) the penalties look at
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Add BIAS to token ID's logit, e.g. `-l 15043+1`, `-l 15043-inf` to ban it; repeatable (ids
    /// from `sift tokenize`)
    #[arg(short = 'l', long, value_name = "ID(+|-)BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Random seed [default: from the clock]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Hold every reply to this JSON Schema (structured output): the schema's JSON, or @FILE;
    /// '{"type": "object"}' asks for any JSON object. Each token is sampled among those that keep
    /// the reply valid, and the reply ends where the value is complete (a token limit can still
    /// cut it short)
    #[arg(long, value_name = "SCHEMA|@FILE", conflicts_with = "grammar")]
    pub json_schema: Option<String>,
    /// Hold every reply to the grammar in FILE, in llguidance's Lark syntax (`start: ...`, regular
    /// expressions between slashes, `%json {...}` for a JSON Schema inside it)
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub gpu: GpuArgs,
}

/// `--audit-out`, for `run` and `chat`.
#[derive(Args)]
pub struct AuditArgs {
    /// Write an audit of the generation to FILE, as JSON Lines: a header (model, cache,
    /// attention, context, sampling), per token its log-probability, the 5 most likely tokens and
    /// the attention's error bound, and a summary. A regular FILE appears only once complete
    #[arg(long, value_name = "FILE")]
    pub audit_out: Option<PathBuf>,
    /// Compute exact attention beside the policy at every decoding step and add an `attention`
    /// line per layer and query head checked to the audit: keys and bytes read, the error on the
    /// --measure scale, the certificate's bound, whether it was violated
    #[arg(long, requires = "audit_out")]
    pub audit: bool,
}

impl AuditArgs {
    /// Opens the audit file, if one is asked for: first, so that an audit that cannot be
    /// written costs no model load or generation.
    pub fn create(&self) -> Result<Option<AuditLog>, AuditError> {
        self.audit_out.as_deref().map(AuditLog::create).transpose()
    }
}

impl GenerationArgs {
    pub fn sampling(&self) -> SamplingParams {
        let seed = self.seed.unwrap_or_else(clock_seed);
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_last_n: self.repeat_last_n,
            logit_bias: self.logit_bias.clone(),
            seed,
        }
    }

    /// What `--json-schema` or `--grammar` asks every reply to be. An unreadable file exits 2; a
    /// schema that is not JSON, 1.
    pub fn format(&self) -> anyhow::Result<Option<Format>> {
        if let Some(path) = &self.grammar {
            let text = std::fs::read_to_string(path)
                .map_err(|e| InputError(format!("--grammar: cannot read {}: {e}", path.display())))?;
            return Ok(Some(Format::Lark(text)));
        }
        let Some(schema) = &self.json_schema else { return Ok(None) };
        let text = match schema.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| InputError(format!("--json-schema: cannot read {path}: {e}")))?,
            None => schema.clone(),
        };
        let schema = serde_json::from_str(&text).map_err(|e| Usage(format!("--json-schema is not JSON: {e}")))?;
        Ok(Some(Format::JsonSchema(schema)))
    }

    /// The grammar every reply must follow, compiled for `tokenizer`; one llguidance cannot
    /// read exits 1 with its reason.
    pub fn grammar(&self, tokenizer: &Tokenizer) -> anyhow::Result<Option<Grammar>> {
        let Some(format) = self.format()? else { return Ok(None) };
        Ok(Some(self.compile(tokenizer, &format)?.1))
    }

    /// `format` (this command's `--json-schema` or `--grammar`) compiled for `tokenizer`, with the
    /// compiler, which can compile more; one llguidance cannot read exits 1 with its reason.
    pub fn compile(&self, tokenizer: &Tokenizer, format: &Format) -> anyhow::Result<(GrammarCompiler, Grammar)> {
        let flag = if self.grammar.is_some() { "--grammar" } else { "--json-schema" };
        let usage = |e: GrammarError| Usage(format!("{flag}: {e}"));
        let compiler = GrammarCompiler::new(tokenizer).map_err(usage)?;
        let grammar = compiler.compile(format).map_err(usage)?;
        Ok((compiler, grammar))
    }
}

/// `ID+BIAS` or `ID-BIAS`, as llama.cpp writes a logit bias.
fn parse_logit_bias(text: &str) -> Result<(u32, f32), String> {
    let at = text.find(['+', '-']).ok_or("expected ID+BIAS or ID-BIAS, e.g. 15043+1")?;
    let id = text[..at].parse().map_err(|_| format!("{:?} is not a token id", &text[..at]))?;
    let bias: f32 = text[at..].parse().map_err(|_| format!("{:?} is not a number", &text[at..]))?;
    Ok((id, bias))
}

/// Says on stderr which template is in use when it is not the model's own.
pub fn announce_template(template: &ChatTemplate) {
    match template.origin() {
        Origin::Model => {}
        Origin::File(path) => eprintln!("sift: chat template from {}", path.display()),
        Origin::BuiltIn(built_in) => {
            eprintln!("sift: the model file has no chat template; using the built-in {} template", built_in.name())
        }
    }
}

pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Embed(args) => embed::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Bench(args) => bench::run(args),
        Command::GpuBench(args) => gpu_bench::run(args),
        Command::GpuProfile(args) => gpu_profile::run(args),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "sift", &mut std::io::stdout());
            Ok(())
        }
    }
}

/// `-p TEXT`, or standard input for `-p -` (or no `-p` with input piped in).
pub fn read_prompt(prompt: Option<&str>) -> anyhow::Result<String> {
    match prompt {
        Some("-") => read_stdin(),
        Some(text) => Ok(text.to_string()),
        None if !std::io::stdin().is_terminal() => read_stdin(),
        None => Err(anyhow::Error::new(Usage("no prompt: give -p TEXT, or pipe it on standard input".into()))),
    }
}

fn read_stdin() -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes).context("reading standard input")?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::Error::new(InputError(format!(
            "standard input is not valid UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        )))
    })
}

/// A mistake in how sift was called that clap cannot see.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Input data (a prompt, a text file) that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InputError(pub String);

/// Prompts at least this long get a progress bar while the CPU prefills
/// them (a few seconds on a laptop's cores).
const LONG_PROMPT: usize = 2048;

/// Tokens done of `total`, their rate and the time left, drawn only on a
/// terminal.
pub fn token_bar(total: usize) -> ProgressBar {
    let target =
        if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    ProgressBar::with_draw_target(Some(total as u64), target).with_style(
        ProgressStyle::with_template("{msg}{bar:30} {pos}/{len} tokens  {per_sec:0}  eta {eta}")
            .expect("static progress template"),
    )
}

/// A session's prefill progress: where `shown`, a bar for each prompt of at
/// least [`LONG_PROMPT`] tokens, cleared when the prompt is in; the prefill
/// stops at its next batch once `stop` is set (Ctrl-C in `chat`).
pub fn prefill_progress(shown: bool, stop: Option<&'static AtomicBool>) -> PrefillProgress<'static> {
    let mut bar: Option<ProgressBar> = None;
    Box::new(move |done, total| {
        if shown && total >= LONG_PROMPT {
            let drawn = bar.get_or_insert_with(|| token_bar(total).with_message("prefill "));
            drawn.set_position(done as u64);
        }
        let stopped = stop.is_some_and(|flag| flag.load(Ordering::Relaxed));
        if done == total || stopped {
            if let Some(drawn) = bar.take() {
                drawn.finish_and_clear();
            }
        }
        if stopped {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
}

/// The error and its causes on one line, each cause once: an error whose
/// message already quotes its cause (an I/O error after a path) does not
/// say it twice.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain().map(ToString::to_string) {
        if line.contains(&cause) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&cause);
    }
    line
}

pub fn exit_code(e: &anyhow::Error) -> u8 {
    e.chain().find_map(cause_code).unwrap_or(EXIT_OTHER)
}

/// The exit code one cause in an error's chain calls for, if it is one sift knows.
fn cause_code(cause: &(dyn std::error::Error + 'static)) -> Option<u8> {
    if let Some(e) = cause.downcast_ref::<ConversationError>() {
        return match e {
            ConversationError::Template(e) => cause_code(e),
            ConversationError::Tokenizer(e) => cause_code(e),
            ConversationError::Engine(e) => cause_code(e),
        };
    }
    if cause.is::<Usage>() {
        return Some(EXIT_USAGE);
    }
    if cause.is::<GgufError>()
        || cause.is::<ModelError>()
        || cause.is::<TokenizerError>()
        || cause.is::<InputError>()
        || cause.is::<ChatError>()
        || cause.is::<GpuError>()
        || cause.is::<KernelError>()
        || cause.is::<PoolingError>()
    {
        return Some(EXIT_MODEL);
    }
    if let Some(EngineError::PromptTooLong { .. } | EngineError::ContextFull { .. }) = cause.downcast_ref() {
        return Some(EXIT_CONTEXT);
    }
    match cause.downcast_ref() {
        Some(PerplexityError::TooShort { .. }) => Some(EXIT_CONTEXT),
        Some(PerplexityError::Stride { .. }) => Some(EXIT_USAGE),
        Some(PerplexityError::BaseFile { .. } | PerplexityError::BaseMismatch) => Some(EXIT_MODEL),
        _ => None,
    }
}

/// The context size to use: as asked, else 4096 capped by the model's
/// training context. Larger than the training context is allowed (RoPE
/// extrapolates poorly, so say so).
pub fn context_size(requested: Option<usize>, n_ctx_train: usize) -> anyhow::Result<usize> {
    match requested {
        Some(0) => Err(anyhow::Error::new(Usage("-c must be at least 1".into()))),
        Some(c) => {
            if c > n_ctx_train {
                eprintln!(
                    "sift: warning: -c {c} exceeds the model's training context of {n_ctx_train}; quality may drop"
                );
            }
            Ok(c)
        }
        None => Ok(4096.min(n_ctx_train.max(1))),
    }
}
