//! Chat templates: a conversation turned into the text a chat model was trained on.
//!
//! A GGUF file usually carries its model's template as Jinja source (`tokenizer.chat_template`,
//! copied from Hugging Face's `tokenizer_config.json`). sift renders it with minijinja, set up the
//! way Hugging Face sets up Jinja2: `trim_blocks` and `lstrip_blocks`, Python's string methods,
//! `raise_exception`, `strftime_now`, `bos_token` and `eos_token`. A file without a template (a
//! base model, such as the default Gemma 3 270M) gets a built-in one chosen by architecture, as
//! llama.cpp does.
//!
//! Templates write special tokens as text (`<start_of_turn>`), so a rendered conversation is
//! tokenized with special tokens parsed: see [`encode`].

use std::fmt;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{context, Environment, Error, ErrorKind};

use crate::model::Arch;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// One turn of a conversation. `role` is `system`, `user` or `assistant`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn system(content: impl Into<String>) -> Self {
        Self { role: "system".into(), content: content.into() }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self { role: "user".into(), content: content.into() }
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self { role: "assistant".into(), content: content.into() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read the chat template {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the {origin} chat template does not compile: {reason}")]
    Compile { origin: Origin, reason: String },
    #[error("the {origin} chat template failed: {reason}")]
    Render { origin: Origin, reason: String },
}

/// Where a template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The model file's `tokenizer.chat_template`.
    Model,
    /// A file the user named.
    File(PathBuf),
    BuiltIn(BuiltIn),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Model => write!(f, "model's"),
            Origin::File(path) => write!(f, "{}", path.display()),
            Origin::BuiltIn(built_in) => write!(f, "built-in {}", built_in.name()),
        }
    }
}

/// The templates sift falls back on when a model file has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltIn {
    /// `<start_of_turn>user … <end_of_turn>`; no system role, so the system text opens the first
    /// user turn.
    Gemma,
    /// `<|im_start|>role … <|im_end|>`, Qwen's format.
    ChatMl,
    /// `<|start_header_id|>role<|end_header_id|> … <|eot_id|>`.
    Llama3,
    /// `[INST] … [/INST]`, with the system text in `<<SYS>>` inside the first instruction.
    Llama2,
    /// `<|user|>\n … <|end|>`, Phi-3's format.
    Phi3,
}

impl BuiltIn {
    /// The format a model of this architecture most likely speaks. Llama files are Llama 3 when
    /// their vocabulary has Llama 3's header tokens, Llama 2 otherwise.
    pub fn for_model(arch: Arch, tokenizer: &Tokenizer) -> Self {
        match arch {
            Arch::Gemma2 | Arch::Gemma3 => BuiltIn::Gemma,
            Arch::Qwen2 | Arch::Qwen3 => BuiltIn::ChatMl,
            Arch::Phi3 => BuiltIn::Phi3,
            Arch::Llama => {
                let has_header = (0..tokenizer.vocab_size() as u32)
                    .any(|id| tokenizer.token_text(id) == Some("<|start_header_id|>"));
                if has_header {
                    BuiltIn::Llama3
                } else {
                    BuiltIn::Llama2
                }
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BuiltIn::Gemma => "gemma",
            BuiltIn::ChatMl => "chatml",
            BuiltIn::Llama3 => "llama3",
            BuiltIn::Llama2 => "llama2",
            BuiltIn::Phi3 => "phi3",
        }
    }

    /// The Jinja source, written after the models' own templates on Hugging Face.
    fn source(self) -> &'static str {
        match self {
            BuiltIn::Gemma => GEMMA,
            BuiltIn::ChatMl => CHATML,
            BuiltIn::Llama3 => LLAMA3,
            BuiltIn::Llama2 => LLAMA2,
            BuiltIn::Phi3 => PHI3,
        }
    }
}

const GEMMA: &str = r#"
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
    {%- set first_user_prefix = messages[0].content + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' -}}
    {{- (first_user_prefix if loop.first else '') + (message.content | trim) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"#;

const CHATML: &str = r#"
{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"#;

const LLAMA3: &str = r#"
{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"#;

const LLAMA2: &str = r#"
{%- if messages and messages[0].role == 'system' -%}
    {%- set system = '<<SYS>>\n' + messages[0].content + '\n<</SYS>>\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- if message.role == 'user' -%}
        {{- bos_token + '[INST] ' + ((system if loop.first else '') + message.content) | trim + ' [/INST]' -}}
    {%- else -%}
        {{- ' ' + (message.content | trim) + ' ' + eos_token -}}
    {%- endif -%}
{%- endfor -%}
"#;

const PHI3: &str = r#"
{%- for message in messages -%}
    {{- '<|' + message.role + '|>\n' + message.content + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"#;

/// A compiled chat template and the token texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The text compiled into `env`.
    source: String,
    origin: Origin,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts the template may write.
    pub fn new(source: String, origin: Origin, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.expect("the default delimiters are valid"));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| strftime(&format, unix_now()));
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ChatError::Compile { origin: origin.clone(), reason: e.to_string() })?;
        Ok(Self { env, source, origin, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// A built-in template, with the tokenizer's BOS and EOS texts.
    pub fn built_in(built_in: BuiltIn, tokenizer: &Tokenizer) -> Self {
        let (bos, eos) = special_texts(tokenizer);
        Self::new(built_in.source().to_string(), Origin::BuiltIn(built_in), bos, eos)
            .expect("the built-in templates compile")
    }

    /// The template to chat with: the file given, else the model's own, else the built-in one for
    /// its architecture.
    pub fn for_model(tokenizer: &Tokenizer, arch: Arch, file: Option<&Path>) -> Result<Self, ChatError> {
        let (bos, eos) = special_texts(tokenizer);
        match (file, tokenizer.chat_template()) {
            (Some(path), _) => {
                let source = std::fs::read_to_string(path)
                    .map_err(|source| ChatError::Read { path: path.to_path_buf(), source })?;
                Self::new(source, Origin::File(path.to_path_buf()), bos, eos)
            }
            (None, Some(source)) => Self::new(source.to_string(), Origin::Model, bos, eos),
            (None, None) => Ok(Self::built_in(BuiltIn::for_model(arch, tokenizer), tokenizer)),
        }
    }

    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The conversation as the model reads it; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, ChatError> {
        let fail = |e: Error| ChatError::Render { origin: self.origin.clone(), reason: e.to_string() };
        let template = self.env.get_template("chat").map_err(fail)?;
        template
            .render(context! {
                messages => Serde(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(fail)
    }
}

/// The ids of a rendered conversation: special-token text parsed into special tokens, and BOS
/// first where the vocabulary asks for it and the template did not write it already.
pub fn encode(tokenizer: &Tokenizer, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = tokenizer.encode(rendered, false, true)?;
    if let Some(bos) = tokenizer.bos().filter(|_| tokenizer.adds_bos()) {
        if ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
    Ok(ids)
}

/// The texts of the tokenizer's BOS and EOS tokens (empty where it has none).
pub(crate) fn special_texts(tokenizer: &Tokenizer) -> (&str, &str) {
    let text = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id)).unwrap_or("");
    (text(tokenizer.bos()), text(tokenizer.eos()))
}

fn unix_now() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| d.as_secs() as i64)
}

/// `unix_seconds` as an RFC 3339 time in UTC, such as `2026-12-05T01:27:00Z`.
pub(crate) fn utc_timestamp(unix_seconds: i64) -> String {
    strftime("%Y-%m-%dT%H:%M:%SZ", unix_seconds).expect("every directive of the format is one strftime writes")
}

/// C's `strftime` for the directives chat templates use (Llama 3.1 writes today's date with
/// `%d %b %Y`), in UTC.
fn strftime(format: &str, unix_seconds: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
    let days = unix_seconds.div_euclid(86_400);
    let seconds = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = DAYS[(days + 4).rem_euclid(7) as usize]; // 1970-01-01 was a Thursday
    let month_name = MONTHS[month as usize - 1];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('B') => out += month_name,
            Some('b') => out += &month_name[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('H') => out += &format!("{:02}", seconds / 3600),
            Some('M') => out += &format!("{:02}", seconds / 60 % 60),
            Some('S') => out += &format!("{:02}", seconds % 60),
            Some('%') => out.push('%'),
            other => {
                let directive = other.map_or(String::new(), String::from);
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: %{directive} is not supported"),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month, day) of a count of days since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153; // March is 0
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 } as u32;
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_dates_as_c_does() {
        // 2024-07-23 14:05:09 UTC, a Tuesday.
        let t = 1_721_743_509;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "23 Jul 2024");
        assert_eq!(strftime("%A %B %d, %y %H:%M:%S %%", t).unwrap(), "Tuesday July 23, 24 14:05:09 %");
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400).unwrap(), "2000-02-29 Tue");
        assert!(strftime("%Q", t).is_err());
        assert_eq!(utc_timestamp(t), "2024-07-23T14:05:09Z");
    }
}
