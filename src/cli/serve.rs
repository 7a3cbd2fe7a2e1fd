//! `sift serve`: the model behind an OpenAI-compatible HTTP API (and Anthropic's and Ollama's), with a chat page.

use std::io::Write;
use std::net::{IpAddr, TcpListener};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use sift::chat::ChatTemplate;
use sift::conversation::Conversation;
use sift::embed::Pooling;
use sift::model::Model;
use sift::serve::{Config, ModelFacts, Origins, Params};
use sift::tokenizer::Tokenizer;

use super::{announce_template, context_size, GenerationArgs, ModelArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on; anything but a loopback address lets other machines in
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on; 0 picks a free one (the address is printed on stdout)
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but /health and the chat page
    #[arg(long, env = "SIFT_API_KEY", value_name = "KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests that may wait while one is served; more get 503 with Retry-After
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// A web origin (`http://host:port`) whose pages may call the API from a browser, besides
    /// this machine's own (localhost, 127.0.0.1, [::1]); repeatable; `*` allows any
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// Memory for caches set aside when a request starts something else (a chat app's title
    /// request between two turns), so that a later request going on from one prefills only its
    /// new tokens; in MiB, 0 keeps none
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    cache_ram: usize,
    /// Largest request body accepted, in bytes (larger ones get 413)
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Tokens per reply at most, for a request that gives no max_tokens
    #[arg(short = 'n', long = "n-predict", visible_alias = "max-tokens", default_value_t = 1024)]
    n_predict: usize,
    /// The model's name in responses and listings (`/v1/models`, Ollama's `/api/tags`), for
    /// apps that show it; the file's name without `.gguf` by default
    #[arg(long, value_name = "NAME")]
    alias: Option<String>,
    /// Jinja chat template to use instead of the model's
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// No information lines on stderr (warnings and errors still come)
    #[arg(short, long)]
    quiet: bool,
    /// Sampling flags are the defaults for what a request leaves out
    #[command(flatten)]
    generation: GenerationArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    // The sampling seed draws certified attention's perturbations too.
    let sampling = args.generation.sampling();
    let policy = args.generation.attention.policy(sampling.seed, false)?;
    let rectify = args.generation.attention.rectify(false)?;
    let origins = Origins::parse(&args.cors_origins).map_err(super::Usage)?;
    if let Some(alias) = args.alias.as_ref().filter(|alias| alias.trim().is_empty() || alias.contains('/')) {
        return Err(super::Usage(format!("--alias {alias:?}: a name is needed, without '/'")).into());
    }
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    sampling.check(model.hp.n_vocab).map_err(super::Usage)?;
    // The default format is compiled here, so that a bad one stops the start; the compiler then
    // compiles the requests' own.
    let format = args.generation.format()?;
    let grammars = match &format {
        Some(format) => Some(args.generation.compile(&tokenizer, format)?.0),
        None => None,
    };
    let n_ctx = context_size(args.generation.ctx, model.hp.n_ctx_train)?;
    let template = ChatTemplate::for_model(&tokenizer, model.hp.arch, args.chat_template.as_deref())?;
    let storage = args.generation.cache.storage();
    let mut conversation = Conversation::new(&model, &tokenizer, n_ctx, storage, policy, sampling.clone());
    conversation.set_rectify(rectify)?;
    args.generation.gpu.attach(&model, conversation.session_mut())?;
    let listener = TcpListener::bind((args.host, args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let address = listener.local_addr().context("reading the address listened on")?;
    if !args.quiet {
        eprintln!(
            "sift: {} ({}), context {n_ctx}, {} threads",
            file.path().display(),
            model.hp.arch.gguf_name(),
            rayon::current_num_threads()
        );
        announce_template(&template);
    }
    if !args.host.is_loopback() && args.api_key.is_none() {
        eprintln!("sift: warning: listening on {} without --api-key: anyone who can reach it may use it", args.host);
    }
    let model_id = match args.alias {
        Some(alias) => alias,
        None => file.path().file_stem().map_or("sift".into(), |stem| stem.to_string_lossy().into_owned()),
    };
    let config = Config {
        model_id,
        api_key: args.api_key,
        queue: args.queue,
        max_body: args.max_body,
        origins,
        defaults: Params {
            sampling,
            max_tokens: args.n_predict,
            stop: Vec::new(),
            top_logprobs: None,
            format,
            format_field: "response_format",
        },
        cache_ram: args.cache_ram << 20,
        pooling: Pooling::for_model(&file, model.hp.arch.gguf_name())?,
        facts: ModelFacts::read(&file, &model),
    };
    // The first line on stdout, once connections are taken: scripts read the port from it.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{address}")?;
    stdout.flush()?;
    drop(stdout);
    sift::serve::serve(listener, conversation, template, config, grammars)?;
    if !args.quiet {
        eprintln!("sift: server stopped");
    }
    Ok(())
}
