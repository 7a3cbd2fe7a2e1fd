//! Chat: templates rendered exactly as the models expect, and `sift chat` driven through a pipe
//! with the default model (Gemma 3 270M, whose file carries no template).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use sift::chat::{encode, BuiltIn, ChatTemplate, Message, Origin};
use sift::model::Arch;
use sift::tokenizer::Tokenizer;

use common::{gemma3_tokenizer as gemma3, tokenizer as load};

/// One of llama.cpp's vocabulary-only files.
fn vocabulary(test: &str, name: &str) -> Option<Tokenizer> {
    let dir = common::shared_dir(test)?.join("data/tokenizer-vectors");
    Some(load(&dir.join(format!("ggml-vocab-{name}.gguf"))))
}

/// A system prompt, a full exchange, and a question waiting for its answer.
fn conversation() -> Vec<Message> {
    vec![
        Message::system("You are terse."),
        Message::user("Hi"),
        Message::assistant("Hello!"),
        Message::user("Name a color."),
    ]
}

fn render(template: &ChatTemplate, messages: &[Message]) -> String {
    template.render(messages, true).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn gemma_built_in_folds_the_system_prompt_into_the_first_turn() {
    let tokenizer = gemma3();
    assert_eq!(tokenizer.chat_template(), None, "the default model is a base model without a template");
    let template = ChatTemplate::for_model(tokenizer, Arch::Gemma3, None).unwrap();
    assert_eq!(template.origin(), &Origin::BuiltIn(BuiltIn::Gemma));
    assert_eq!(
        render(&template, &conversation()),
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n\
         <start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nName a color.<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    // Replies are trimmed, and without the generation prompt the text ends after the last turn.
    let messages = [Message::user("  Hi\n"), Message::assistant("\nHello!\n\n")];
    assert_eq!(
        template.render(&messages, false).unwrap(),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    );
    let error = template.render(&[Message::user("Hi"), Message::user("Hi?")], true).unwrap_err();
    assert!(error.to_string().contains("Conversation roles must alternate"), "{error}");
}

#[test]
fn rendered_special_tokens_are_parsed_and_bos_comes_once() {
    let tokenizer = gemma3();
    let template = ChatTemplate::for_model(tokenizer, Arch::Gemma3, None).unwrap();
    let ids = encode(tokenizer, &render(&template, &[Message::user("Hi")])).unwrap();
    let bos = tokenizer.bos().unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1);
    let start_of_turn: Vec<u32> =
        ids.iter().copied().filter(|&id| tokenizer.token_text(id) == Some("<start_of_turn>")).collect();
    assert_eq!(start_of_turn.len(), 2, "{ids:?}");
    // BOS is added where the template does not write it.
    let without_bos = encode(tokenizer, "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n").unwrap();
    assert_eq!(without_bos, ids);
}

#[test]
fn chatml_built_in() {
    let Some(tokenizer) = vocabulary("chatml_built_in", "qwen2") else { return };
    let template = ChatTemplate::built_in(BuiltIn::ChatMl, &tokenizer);
    assert_eq!(
        render(&template, &conversation()),
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nName a color.<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn llama3_built_in_for_a_vocabulary_with_header_tokens() {
    let Some(tokenizer) = vocabulary("llama3_built_in", "llama-bpe") else { return };
    assert_eq!(BuiltIn::for_model(Arch::Llama, &tokenizer), BuiltIn::Llama3);
    let template = ChatTemplate::for_model(&tokenizer, Arch::Llama, None).unwrap();
    assert_eq!(
        render(&template, &conversation()),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn llama2_built_in_otherwise() {
    let Some(tokenizer) = vocabulary("llama2_built_in", "llama-spm") else { return };
    assert_eq!(BuiltIn::for_model(Arch::Llama, &tokenizer), BuiltIn::Llama2);
    let template = ChatTemplate::for_model(&tokenizer, Arch::Llama, None).unwrap();
    assert_eq!(
        render(&template, &conversation()),
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Name a color. [/INST]"
    );
}

#[test]
fn the_newer_families_fall_back_on_their_formats() {
    let Some(tokenizer) = vocabulary("the_newer_families_fall_back_on_their_formats", "llama-spm") else { return };
    for (arch, built_in) in
        [(Arch::Qwen3, BuiltIn::ChatMl), (Arch::Gemma2, BuiltIn::Gemma), (Arch::Phi3, BuiltIn::Phi3)]
    {
        assert_eq!(BuiltIn::for_model(arch, &tokenizer), built_in, "{arch:?}");
    }
    // Phi-3's turns, as llama.cpp writes them: `<|role|>`, a newline, the text, `<|end|>`.
    let template = ChatTemplate::for_model(&tokenizer, Arch::Phi3, None).unwrap();
    assert_eq!(
        render(&template, &conversation()),
        "<|system|>\nYou are terse.<|end|>\n\
         <|user|>\nHi<|end|>\n\
         <|assistant|>\nHello!<|end|>\n\
         <|user|>\nName a color.<|end|>\n\
         <|assistant|>\n"
    );
}

#[test]
fn the_files_own_template_wins() {
    let Some(tokenizer) = vocabulary("the_files_own_template_wins", "qwen2") else { return };
    let template = ChatTemplate::for_model(&tokenizer, Arch::Qwen2, None).unwrap();
    assert_eq!(template.origin(), &Origin::Model);
    // Qwen's template adds a default system prompt when there is none.
    assert_eq!(
        render(&template, &[Message::user("Hi")]),
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let ids = encode(&tokenizer, &render(&template, &[Message::user("Hi")])).unwrap();
    assert_eq!(ids.iter().filter(|&&id| tokenizer.token_text(id) == Some("<|im_start|>")).count(), 3);
}

#[test]
fn a_large_hugging_face_template_renders_as_jinja2_does() {
    // Gemma 4's template: macros, namespaces, `dictsort`, `str.split`, whitespace control. The
    // expected text is what Python's Jinja2 renders with Hugging Face's settings.
    let Some(tokenizer) = vocabulary("a_large_hugging_face_template", "gemma-4") else { return };
    let template = ChatTemplate::for_model(&tokenizer, Arch::Gemma3, None).unwrap();
    assert_eq!(
        render(&template, &conversation()),
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n\
         <|turn>user\nName a color.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    );
}

#[test]
fn templates_get_hugging_faces_jinja_environment() {
    let tokenizer = gemma3();
    let file = std::env::temp_dir().join(format!("sift-chat-{}.jinja", std::process::id()));
    // trim_blocks and lstrip_blocks, Python's str methods, strftime_now, bos_token and eos_token.
    let source =
        "{% for m in messages %}\n    {% if m.content %}{{ m.content.strip().upper() }}|{% endif %}\n{% endfor %}\n\
                  {{ strftime_now('%Y') | length }} {{ bos_token }}{{ eos_token }}";
    std::fs::write(&file, source).unwrap();
    let template = ChatTemplate::for_model(tokenizer, Arch::Gemma3, Some(&file)).unwrap();
    assert_eq!(template.origin(), &Origin::File(file.clone()));
    assert_eq!(
        template.render(&[Message::user(" hi "), Message::assistant("yo")], false).unwrap(),
        "HI|YO|4 <bos><eos>"
    );
    std::fs::remove_file(file).unwrap();
}

// ---- `sift chat` with the default model, through a pipe ----

/// `sift chat` with short greedy replies, `input` on standard input.
fn chat(args: &[&str], input: &[u8]) -> Output {
    let model = common::default_model();
    let base = ["chat", "-m", model.to_str().unwrap(), "-n", "8", "--temp", "0"];
    common::sift_with_stdin(&[&base[..], args].concat(), input)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What one `/stats` printed.
#[derive(Debug, PartialEq)]
struct Stats {
    per_turn: Vec<usize>,
    re_prefills: usize,
    cache: usize,
}

/// Every `/stats` in the output, in order.
fn stats(stdout: &str) -> Vec<Stats> {
    let number = |s: &str| s.trim().parse::<usize>().unwrap_or_else(|e| panic!("{s:?}: {e}"));
    let lines: Vec<&str> = stdout.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, line)| {
            let rest = line.strip_prefix("prompt tokens prefilled: ")?;
            let list = &rest[rest.find('[').unwrap() + 1..rest.find(']').unwrap()];
            let per_turn = list.split(',').filter(|s| !s.trim().is_empty()).map(number).collect();
            let re_prefills = number(rest.rsplit("re-prefills: ").next().unwrap());
            let cache = lines[i + 1].strip_prefix("cache: ").unwrap().split(" of ").next().map(number).unwrap();
            Some(Stats { per_turn, re_prefills, cache })
        })
        .collect()
}

/// The token count of the Gemma-rendered conversation.
fn prompt_tokens(messages: &[Message], add_generation_prompt: bool) -> usize {
    let template = ChatTemplate::built_in(BuiltIn::Gemma, gemma3());
    encode(gemma3(), &template.render(messages, add_generation_prompt).unwrap()).unwrap().len()
}

#[test]
fn three_turns_reuse_the_cache_and_reset_clears_it() {
    let system = "You answer every question with one short sentence.";
    let question = "What is the capital of France?";
    let input = format!(
        "{question}\n/stats\nAnd of Germany?\n/stats\nAnd of Italy?\n/stats\n/reset\n/stats\n{question}\n/stats\n"
    );
    let o = chat(&["--system", system], input.as_bytes());
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.matches("using the built-in gemma template").count(), 1, "{err}");

    let first = prompt_tokens(&[Message::system(system), Message::user(question)], true);
    let s = stats(&out);
    assert_eq!(s.len(), 5, "{out}");
    assert_eq!(s[0].per_turn, [first]);
    assert!(s[0].cache > first);
    for turn in 1..3 {
        // Only the new turn is prefilled: fewer tokens than the cache held before it.
        assert_eq!(s[turn].per_turn.len(), turn + 1);
        assert_eq!(s[turn].per_turn[..turn], s[turn - 1].per_turn[..]);
        assert!(s[turn].per_turn[turn] < s[turn - 1].cache, "{:?}", s[turn]);
        assert!(s[turn].cache >= s[turn - 1].cache + s[turn].per_turn[turn]);
        assert_eq!(s[turn].re_prefills, 0, "{out}");
    }
    assert_eq!(s[3], Stats { per_turn: vec![], re_prefills: 0, cache: 0 });
    assert_eq!(s[4], s[0], "after /reset the same question is prefilled the same way");
}

#[test]
fn a_loaded_conversation_renders_in_gemmas_format_and_saves_back() {
    let dir = std::env::temp_dir().join(format!("sift-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (loaded, saved) = (dir.join("loaded.json"), dir.join("saved.json"));
    let messages = &conversation()[..3];
    std::fs::write(&loaded, serde_json::json!({ "messages": messages }).to_string()).unwrap();

    let input =
        format!("/load {}\n/prompt\n/stats\nName a color.\n/stats\n/save {}\n", loaded.display(), saved.display());
    let o = chat(&[], input.as_bytes());
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let expected =
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n";
    assert!(out.starts_with(expected), "{out}");
    let s = stats(&out);
    let loaded_tokens = prompt_tokens(messages, false);
    assert_eq!(s[0], Stats { per_turn: vec![loaded_tokens], re_prefills: 0, cache: loaded_tokens });
    let next_turn = prompt_tokens(&conversation(), true) - loaded_tokens;
    assert_eq!((s[1].per_turn.clone(), s[1].re_prefills), (vec![loaded_tokens, next_turn], 0));

    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let saved: Vec<Message> = serde_json::from_value(saved["messages"].clone()).unwrap();
    assert_eq!(saved[..4], conversation()[..]);
    assert_eq!(saved[4].role, "assistant");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_new_system_prompt_prefills_the_conversation_again() {
    let o = chat(&[], b"Hello\n/system Answer in French.\nHello again\n/stats\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let s = stats(&text(&o.stdout));
    // Gemma's template puts the system text in the first user turn: everything after the
    // turn's opening tokens (4 at most) is prefilled again, the cache going back to them rather
    // than starting over. The cache then holds that prompt and a reply of 8 tokens at most.
    assert_eq!(s[0].re_prefills, 0);
    assert!(s[0].per_turn[1] > s[0].per_turn[0], "{:?}", s[0]);
    assert!(s[0].cache - s[0].per_turn[1] <= 4 + 8, "{:?}", s[0]);
}

/// A one-line error on stderr, the documented exit code, and nothing on stdout.
fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "error is not one line: {err}");
    assert!(o.stdout.is_empty(), "stdout should be empty on error: {}", text(&o.stdout));
}

#[test]
fn bad_input_gives_one_line_and_the_documented_exit_code() {
    assert_fails(&chat(&["--quiet"], b"caf\xe9\n"), 2, "not valid UTF-8 (line 1");
    assert_fails(&chat(&["--quiet", "-c", "16"], "word ".repeat(40).as_bytes()), 3, "context");
    assert_fails(&chat(&["--quiet"], b"/frobnicate\n"), 1, "unknown command /frobnicate");
    assert_fails(&chat(&["--quiet"], b"/load /nonexistent/chat.json\n"), 2, "cannot read /nonexistent/chat.json");
    assert_fails(&chat(&["--quiet"], b"/save\n"), 1, "/save needs a file name");
    let template = Path::new("/nonexistent/template.jinja");
    assert_fails(&chat(&["--quiet", "--chat-template", template.to_str().unwrap()], b"Hi\n"), 2, "template");
}

#[test]
fn a_full_context_ends_a_piped_chat_with_exit_3_under_no_forget() {
    let o = chat(&["--quiet", "--no-forget", "-c", "30"], b"Hello there\nAnd again\nOnce more\n");
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert_eq!(err.trim_end().lines().last(), Some("sift: the context of 30 tokens is full"), "{err}");
    assert!(!o.stdout.is_empty(), "the first reply still came");
}

/// Past the context the oldest turns leave the prompt, in one step down to half the context:
/// the reply is then the one a fresh chat gives with only the kept turns loaded, `/prompt`
/// shows what the model reads, and `/save` still writes every message.
#[test]
fn a_conversation_that_outgrows_the_context_leaves_its_oldest_turns_out() {
    let dir = std::env::temp_dir().join(format!("sift-chat-forget-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (saved, kept) = (dir.join("saved.json"), dir.join("kept.json"));
    let questions = [
        "Tell me about the history of Rome in detail please.",
        "And what about Greece and its many city states?",
        "And Egypt with its pharaohs and pyramids?",
        "And Persia?",
    ];
    let input = format!("{}\n/stats\n/prompt\n/save {}\n", questions.join("\n"), saved.display());
    let o = chat(&["-c", "96"], input.as_bytes());
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.matches("its oldest 4 messages are left out").count(), 1, "{err}");
    // The turns left, the cache goes back to the template's opening tokens: no restart.
    assert_eq!(stats(&out)[0].re_prefills, 0, "{out}");
    assert!(out.contains("<bos><start_of_turn>user\nAnd Egypt"), "{out}");
    assert!(!out.contains("<start_of_turn>user\nAnd what about Greece"), "{out}");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let saved: Vec<Message> = serde_json::from_value(saved["messages"].clone()).unwrap();
    assert_eq!(saved.len(), 8);

    std::fs::write(&kept, serde_json::json!({ "messages": saved[4..6] }).to_string()).unwrap();
    let fresh = chat(&["--quiet", "-c", "96"], format!("/load {}\n{}\n", kept.display(), questions[3]).as_bytes());
    assert_eq!(fresh.status.code(), Some(0), "{}", text(&fresh.stderr));
    assert_eq!(text(&fresh.stdout).trim_end(), saved[7].content.trim_end());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unusable_model_files_exit_2() {
    let run = |model: &Path| {
        Command::new(env!("CARGO_BIN_EXE_sift")).args(["chat", "-m"]).arg(model).stdin(Stdio::null()).output().unwrap()
    };
    assert_fails(&run(Path::new("/nonexistent/model.gguf")), 2, "/nonexistent/model.gguf");
    assert_fails(&run(&std::env::temp_dir()), 2, "directory");
    let text_file: PathBuf = std::env::temp_dir().join(format!("sift-chat-{}.gguf", std::process::id()));
    std::fs::write(&text_file, "just some text").unwrap();
    assert_fails(&run(&text_file), 2, "not a GGUF file");
    std::fs::remove_file(text_file).unwrap();
}
