//! `sift chat`: a conversation with the model.
//!
//! Every turn renders the whole conversation with the chat template, and the library's
//! [`Conversation`] prefills only the tokens that the KV cache does not hold yet: the cache keeps
//! the earlier turns. When the rendered history no longer tokenizes as it went into the cache
//! (the template trims a reply, `/system` changed the first turn), the conversation is prefilled
//! anew and `/stats` counts it.
//!
//! On a terminal, lines are edited with history, and Ctrl-C stops a reply but not the session.
//! With standard input piped, every line is a message (or a command) and every reply is printed
//! followed by a newline.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::Args;
use rustyline::error::ReadlineError;
use sift::audit::{audit_token, AuditError, AuditHeader, AuditLog, AuditSummary, ReplySummary};
use sift::chat::{ChatTemplate, Message};
use sift::conversation::{chat_prompt, fitted_prompt, kept_messages, Conversation, ConversationError, Stats};
use sift::engine::EngineError;
use sift::generate::{Generated, Limits, Sampled, StopReason};
use sift::model::Model;
use sift::rectify::RectifyReport;
use sift::structured::Grammar;
use sift::tokenizer::Tokenizer;

use super::{announce_template, context_size, AuditArgs, GenerationArgs, InputError, ModelArgs, Usage};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt (Gemma, which has no system role, reads it at the start of the first message)
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// Tokens per reply at most
    #[arg(short = 'n', long = "n-predict", visible_alias = "max-tokens", default_value_t = 1024)]
    n_predict: usize,
    /// Jinja chat template to use instead of the model's
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// No information lines on stderr (warnings and errors still come)
    #[arg(short, long)]
    quiet: bool,
    /// When the conversation outgrows the context, stop with exit 3 instead of leaving its
    /// oldest turns out of the prompt
    #[arg(long)]
    no_forget: bool,
    #[command(flatten)]
    generation: GenerationArgs,
    #[command(flatten)]
    audit: AuditArgs,
}

const HELP: &str = "\
/help          this list
/reset         forget the conversation (the system prompt stays)
/system TEXT   set the system prompt; /system alone removes it
/save FILE     write the conversation as JSON
/load FILE     read a conversation saved with /save and prefill it
/stats         prompt tokens prefilled (in all and per turn), cache fill, speeds, rectifications
/prompt        the conversation as the chat template renders it for the model (without the
               turns left out once it outgrew the context)
/exit          leave (Ctrl-D too)
";

/// Set by Ctrl-C while a reply is streaming.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    // The sampling seed draws certified attention's perturbations too.
    let sampling = args.generation.sampling();
    let policy = args.generation.attention.policy(sampling.seed, args.audit.audit)?;
    let rectify = args.generation.attention.rectify(args.audit.audit)?;
    let mut audit = args.audit.create()?;
    let file = args.model.open()?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = Model::load(&file)?;
    sampling.check(model.hp.n_vocab).map_err(super::Usage)?;
    let grammar = args.generation.grammar(&tokenizer)?;
    let n_ctx = context_size(args.generation.ctx, model.hp.n_ctx_train)?;
    let template = ChatTemplate::for_model(&tokenizer, model.hp.arch, args.chat_template.as_deref())?;
    if let Some(audit) = &mut audit {
        let kv_cache = args.generation.cache.kv_cache;
        audit.header(&AuditHeader::new(
            file.path(),
            model.hp.arch.gguf_name(),
            kv_cache,
            args.generation.attention.kind,
            n_ctx,
            Some(&sampling),
            None,
        ))?;
    }
    if !args.quiet {
        eprintln!(
            "sift: {} ({}), context {n_ctx}, {} threads",
            file.path().display(),
            model.hp.arch.gguf_name(),
            rayon::current_num_threads()
        );
        announce_template(&template);
    }
    let storage = args.generation.cache.storage();
    let mut conversation = Conversation::new(&model, &tokenizer, n_ctx, storage, policy, sampling);
    conversation.set_rectify(rectify)?;
    let mut chat = Chat {
        conversation,
        template,
        messages: Vec::new(),
        max_tokens: args.n_predict,
        grammar,
        forget: !args.no_forget,
        forgotten: 0,
        quiet: args.quiet,
        audit,
        turns: 0,
        tokens: 0,
    };
    args.generation.gpu.attach(&model, chat.conversation.session_mut())?;
    // Ctrl-C stops a long prompt's prefill as it stops a reply.
    let progress = super::prefill_progress(!args.quiet, Some(&INTERRUPTED));
    chat.conversation.session_mut().set_prefill_progress(Some(progress));
    chat.set_system(args.system);
    if std::io::stdin().is_terminal() {
        chat.interactive()?;
    } else {
        chat.piped()?;
    }
    if let Some(audit) = chat.audit.take() {
        let session = chat.conversation.session();
        let rectify = session.rectify_settings();
        let rectify = (rectify.every > 0).then(|| RectifyReport::of(rectify, session.rectify_stats()));
        audit.finish(&AuditSummary { tokens: chat.tokens, stop: None, turns: Some(chat.turns), rectify })?;
    }
    Ok(())
}

/// The conversation, and how it talks to the user.
struct Chat<'a> {
    conversation: Conversation<'a>,
    template: ChatTemplate,
    messages: Vec<Message>,
    max_tokens: usize,
    /// What every reply must be (`--json-schema`, `--grammar`).
    grammar: Option<Grammar>,
    /// Whether the oldest turns leave the prompt when the context is full.
    forget: bool,
    /// Turns after the system message that the prompt leaves out.
    forgotten: usize,
    quiet: bool,
    audit: Option<AuditLog>,
    /// Replies generated, and their tokens, for the audit.
    turns: usize,
    tokens: usize,
}

enum Flow {
    Continue,
    Exit,
}

impl Chat<'_> {
    /// Adds the user's message and generates the reply, streaming it to `on_text` and showing
    /// every token sampled to `on_token`.
    fn reply(
        &mut self,
        text: &str,
        limits: Limits,
        on_text: impl FnMut(&str),
        on_token: impl FnMut(&Sampled) -> ControlFlow<()>,
    ) -> anyhow::Result<Generated> {
        self.messages.push(Message::user(text));
        let generated =
            self.prompt().and_then(|ids| Ok(self.conversation.generate(&ids, limits, on_text, on_token)?));
        match generated {
            Ok(generated) => {
                self.messages.push(Message::assistant(&generated.text));
                Ok(generated)
            }
            Err(e) => {
                self.messages.pop();
                Err(e.into())
            }
        }
    }

    /// The prompt of the conversation so far, its oldest turns left out if it has outgrown the
    /// context (and `forget` allows it), with room for a reply of `max_tokens` (or a quarter of
    /// the context, if less).
    fn prompt(&mut self) -> Result<Vec<u32>, ConversationError> {
        let tokenizer = self.conversation.tokenizer();
        if !self.forget {
            return chat_prompt(tokenizer, &self.template, &self.messages, true);
        }
        let n_ctx = self.conversation.session().n_ctx();
        let room = self.max_tokens.min(n_ctx / 4);
        let (ids, forgotten) = fitted_prompt(tokenizer, &self.template, &self.messages, self.forgotten, n_ctx, room)?;
        if forgotten > self.forgotten {
            self.info(&format!(
                "the conversation outgrew the context of {n_ctx} tokens: its oldest {forgotten} messages are left out \
                 of the prompt from now on (/save still writes them)"
            ));
            self.forgotten = forgotten;
        }
        Ok(ids)
    }

    /// Replaces the system prompt, or removes it. The cache notices at the next turn.
    fn set_system(&mut self, text: Option<String>) {
        if self.messages.first().is_some_and(|m| m.role == "system") {
            self.messages.remove(0);
        }
        if let Some(text) = text {
            self.messages.insert(0, Message::system(text));
        }
    }

    /// Forgets everything but the system prompt.
    fn reset(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.forgotten = 0;
        self.conversation.reset();
    }

    /// Replaces the conversation with `messages` and prefills it.
    /// Replaces the conversation with `messages` and prefills it; one longer than the context
    /// is left for the next message to fit, when `forget` allows it.
    fn load(&mut self, messages: Vec<Message>) -> anyhow::Result<()> {
        let ids = chat_prompt(self.conversation.tokenizer(), &self.template, &messages, false)?;
        let n_ctx = self.conversation.session().n_ctx();
        if self.forget && ids.len() > n_ctx {
            self.info(&format!(
                "the conversation's {} tokens outgrow the context of {n_ctx}: the next message leaves out its oldest turns",
                ids.len()
            ));
            self.conversation.reset();
        } else {
            self.conversation.prefill(&ids)?;
        }
        self.messages = messages;
        self.forgotten = 0;
        Ok(())
    }

    fn stats(&self) -> String {
        let Stats { prefilled, re_prefills, last_reply } = self.conversation.stats();
        let session = self.conversation.session();
        let (n_past, n_ctx) = (session.n_past(), session.n_ctx());
        let mut text = format!(
            "prompt tokens prefilled: {} in all; per turn: {prefilled:?}; re-prefills: {re_prefills}\n\
             cache: {n_past} of {n_ctx} tokens ({:.1}%)\n",
            prefilled.iter().sum::<usize>(),
            100.0 * n_past as f64 / n_ctx as f64,
        );
        if let Some(last) = last_reply {
            text += &format!(
                "last reply: prefill {} tokens at {:.1} tok/s, decode {} tokens at {:.1} tok/s\n",
                last.prompt_tokens,
                last.prefill_tok_s(),
                last.decode_steps,
                last.decode_tok_s(),
            );
        }
        let every = session.rectify_settings().every;
        if every > 0 {
            let rectified = session.rectify_stats();
            text += &format!(
                "rectification every {every} tokens: {} passes, {} tokens rewritten in all",
                rectified.passes, rectified.tokens
            );
            if let Some(last) = last_reply {
                text += &format!(
                    "; last reply: {} passes, {:.1}% of decode time",
                    last.rectifications,
                    100.0 * last.rectify_share()
                );
            }
            text.push('\n');
        }
        text
    }

    fn interactive(&mut self) -> anyhow::Result<()> {
        ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::Relaxed)).context("installing the Ctrl-C handler")?;
        let mut editor = rustyline::DefaultEditor::new().context("starting the line editor")?;
        self.info("type a message, or /help; /exit or Ctrl-D leaves");
        loop {
            let line = match editor.readline("> ") {
                Ok(line) => line,
                Err(ReadlineError::Interrupted) => {
                    self.info("(/exit or Ctrl-D leaves)");
                    continue;
                }
                Err(ReadlineError::Eof) => return Ok(()),
                Err(e) => return Err(e).context("reading the terminal"),
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            // The history is a convenience: a line it cannot keep is still sent.
            let _ = editor.add_history_entry(line);
            match self.handle(line) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Exit) => return Ok(()),
                // The session cannot go on with a gap in its audit.
                Err(e) if e.is::<AuditError>() => return Err(e),
                Err(e) => eprintln!("sift: {}", super::one_line(&e)),
            }
        }
    }

    /// One message or command per line; the first error ends the chat.
    fn piped(&mut self) -> anyhow::Result<()> {
        for (number, line) in std::io::stdin().lock().split(b'\n').enumerate() {
            let line = line.context("reading standard input")?;
            let line = String::from_utf8(line).map_err(|e| {
                InputError(format!(
                    "standard input is not valid UTF-8 (line {}, byte {})",
                    number + 1,
                    e.utf8_error().valid_up_to()
                ))
            })?;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Flow::Exit = self.handle(line)? {
                break;
            }
        }
        Ok(())
    }

    fn handle(&mut self, line: &str) -> anyhow::Result<Flow> {
        let Some(command) = line.strip_prefix('/') else {
            self.say(line)?;
            return Ok(Flow::Continue);
        };
        let (name, argument) = command.split_once(char::is_whitespace).unwrap_or((command, ""));
        let argument = argument.trim();
        let file = || match argument {
            "" => Err(Usage(format!("/{name} needs a file name"))),
            path => Ok(Path::new(path)),
        };
        match name {
            "help" => print!("{HELP}"),
            "reset" => {
                self.reset();
                self.info("conversation cleared");
            }
            "system" => {
                let text = Some(argument.to_string()).filter(|text| !text.is_empty());
                self.info(if text.is_some() { "system prompt set" } else { "system prompt removed" });
                self.set_system(text);
            }
            "save" => {
                let path = file()?;
                let saved = serde_json::to_string_pretty(&Saved { messages: self.messages.clone() })?;
                std::fs::write(path, saved + "\n").with_context(|| format!("cannot write {}", path.display()))?;
                self.info(&format!("saved {} messages to {}", self.messages.len(), path.display()));
            }
            "load" => {
                let path = file()?;
                self.load(read_conversation(path)?)?;
                self.info(&format!("loaded {} messages from {}", self.messages.len(), path.display()));
            }
            "stats" => print!("{}", self.stats()),
            "prompt" => {
                let text = self.template.render(&kept_messages(&self.messages, self.forgotten), false)?;
                print!("{text}");
                if !text.ends_with('\n') {
                    println!();
                }
            }
            "exit" | "quit" => return Ok(Flow::Exit),
            _ => return Err(Usage(format!("unknown command /{name}; /help lists them")).into()),
        }
        std::io::stdout().flush()?;
        Ok(Flow::Continue)
    }

    /// Streams the reply to `text` to stdout, and a newline after it.
    fn say(&mut self, text: &str) -> anyhow::Result<()> {
        INTERRUPTED.store(false, Ordering::Relaxed);
        let grammar = self.grammar.take();
        let limits =
            Limits { max_tokens: self.max_tokens, stop: &[], interrupt: Some(&INTERRUPTED), grammar: grammar.as_ref() };
        let mut stdout = std::io::stdout().lock();
        // A closed pipe (`| head`) is not an error worth reporting.
        let on_text = |piece: &str| {
            let _ = stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush());
        };
        let turn = self.turns + 1;
        let mut audit_failure = None;
        let tokenizer = self.conversation.tokenizer();
        let mut audit = self.audit.take();
        let on_token =
            |sampled: &Sampled| audit_token(audit.as_mut(), &mut audit_failure, sampled, tokenizer, Some(turn));
        let generated = self.reply(text, limits, on_text, on_token);
        self.audit = audit;
        self.grammar = grammar;
        if let Err(e) = &generated {
            if matches!(
                e.downcast_ref::<ConversationError>(),
                Some(ConversationError::Engine(EngineError::Interrupted { .. }))
            ) {
                // Ctrl-C during the prompt's prefill: the turn is dropped, the conversation goes on.
                eprintln!("sift: reply interrupted");
                return Ok(());
            }
        }
        let generated = generated?;
        if let Some(e) = audit_failure {
            return Err(e.into());
        }
        self.turns = turn;
        self.tokens += generated.tokens.len();
        if let Some(audit) = &mut self.audit {
            let stop = generated.stop;
            audit.reply(&ReplySummary {
                turn,
                prompt_tokens: generated.prompt_tokens,
                tokens: generated.tokens.len(),
                stop,
            })?;
        }
        let _ = writeln!(stdout).and_then(|_| stdout.flush());
        match generated.stop {
            StopReason::Interrupted => eprintln!("sift: reply interrupted"),
            StopReason::ContextFull => {
                let n_ctx = self.conversation.session().n_ctx();
                match self.forget {
                    true => eprintln!(
                        "sift: the context of {n_ctx} tokens is full; the next message leaves out the oldest turns"
                    ),
                    false => eprintln!(
                        "sift: the context of {n_ctx} tokens is full; /reset starts over (a larger -c holds more)"
                    ),
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn info(&self, message: &str) {
        if !self.quiet {
            eprintln!("sift: {message}");
        }
    }
}

/// A conversation as `/save` writes it: `{"messages": [{"role": …, "content": …}, …]}`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    messages: Vec<Message>,
}

fn read_conversation(path: &Path) -> anyhow::Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).map_err(|e| InputError(format!("cannot read {}: {e}", path.display())))?;
    let saved: Saved = serde_json::from_str(&text)
        .map_err(|e| InputError(format!("{} is not a saved conversation: {e}", path.display())))?;
    Ok(saved.messages)
}
