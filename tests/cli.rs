//! The command line as scripts see it: stdout, stderr and exit codes.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn sift(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sift")).args(args).stdin(Stdio::null()).output().unwrap()
}

use common::{assert_fails, sift_with_stdin};

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tiny_llama() -> Option<PathBuf> {
    common::shared_dir("cli tests with tiny-llama").map(|s| s.join("anchors/models/tiny-llama.gguf"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sift-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn help_lists_the_subcommands() {
    let o = sift(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    for sub in ["run", "chat", "perplexity", "tokenize", "inspect", "completions", "Exit codes"] {
        assert!(stdout(&o).contains(sub), "--help lacks {sub}");
    }
}

#[test]
fn usage_errors_exit_1() {
    assert_eq!(sift(&["frobnicate"]).status.code(), Some(1));
    assert_eq!(sift(&["run", "--temp", "warm"]).status.code(), Some(1));
    assert_fails(&sift(&["serve", "--cors-origin", "example.com"]), 1, "not an origin");
    assert_eq!(sift(&["run", "-t", "0", "-p", "hi"]).status.code(), Some(1));
    assert_eq!(sift(&["run", "-l", "15043", "-p", "hi"]).status.code(), Some(1));
}

#[test]
fn sampling_settings_out_of_range_exit_1_with_their_name() {
    let Some(model) = tiny_llama() else { return };
    let model = model.to_str().unwrap();
    let run = |flags: &[&str]| sift(&[&["run", "-m", model, "-p", "hi", "-n", "1"], flags].concat());
    assert_fails(&run(&["--top-p", "2"]), 1, "top_p must be in (0, 1]");
    assert_fails(&run(&["--frequency-penalty", "-3"]), 1, "frequency_penalty");
    assert_fails(&run(&["-l", "99999999+1"]), 1, "token 99999999 is not in the vocabulary");
    assert_eq!(run(&["-l", "1-inf", "--presence-penalty", "-0.5"]).status.code(), Some(0));
}

#[test]
fn unusable_model_files_exit_2() {
    assert_fails(&sift(&["run", "-m", "/nonexistent/model.gguf", "-p", "hi"]), 2, "/nonexistent/model.gguf");
    let dir = std::env::temp_dir();
    assert_fails(&sift(&["run", "-m", dir.to_str().unwrap(), "-p", "hi"]), 2, "directory");
    let text = tmp("not-a-model.gguf");
    std::fs::write(&text, "just some text").unwrap();
    assert_fails(&sift(&["run", "-m", text.to_str().unwrap(), "-p", "hi"]), 2, "not a GGUF file");
}

#[test]
fn unsupported_architecture_exits_2() {
    let Some(model) = tiny_llama() else { return };
    let mut bytes = std::fs::read(model).unwrap();
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // The value follows the key: type 8 (string), length 5, "llama".
    assert_eq!(&bytes[at + 12..at + 17], b"llama");
    bytes[at + 12..at + 17].copy_from_slice(b"mamba");
    let patched = tmp("mamba.gguf");
    std::fs::write(&patched, bytes).unwrap();
    let o = sift(&["run", "-m", patched.to_str().unwrap(), "-p", "hi"]);
    assert_fails(&o, 2, "architecture 'mamba' is not supported (sift runs: llama, qwen2, qwen3, gemma2, gemma3, phi3)");
}

#[test]
fn prompt_longer_than_context_exits_3() {
    let Some(model) = tiny_llama() else { return };
    let o = sift(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-c",
        "8",
        "-p",
        "one two three four five six seven eight nine ten",
    ]);
    assert_fails(&o, 3, "context");
    // The chat template makes the prompt longer still.
    let o = sift(&["run", "-m", model.to_str().unwrap(), "-c", "8", "--chat", "-p", "one two"]);
    assert_fails(&o, 3, "context");
}

#[test]
fn invalid_utf8_on_stdin_exits_2() {
    let Some(model) = tiny_llama() else { return };
    let o = sift_with_stdin(&["run", "-m", model.to_str().unwrap(), "-p", "-"], b"caf\xe9\n");
    assert_fails(&o, 2, "UTF-8");
}

#[test]
fn greedy_run_matches_llama_cpp_and_json_is_complete() {
    let Some(model) = tiny_llama() else { return };
    let reference = common::read_json(&model.parent().unwrap().join("../reference/tiny-llama-greedy.json"));
    let case = &reference["variants"]["flash_attn_off"]["cases"][0];
    let want: Vec<u64> = case["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let o = sift(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "-n",
        "8",
        "--temp",
        "0",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let got: Vec<u64> = json["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want[..8]);
    assert_eq!(json["prompt_tokens"], 6);
    assert_eq!(json["tokens"], 8);
    for key in ["prefill_ms", "decode_ms", "prefill_tok_s", "decode_tok_s"] {
        assert!(json["timings"][key].as_f64().unwrap() >= 0.0, "timings.{key}");
    }
    // Without --json, stdout is exactly the generated text.
    let plain =
        sift(&["run", "-m", model.to_str().unwrap(), "-p", "The capital of France is", "-n", "8", "--temp", "0"]);
    assert_eq!(stdout(&plain), json["text"].as_str().unwrap());
}

#[test]
fn prompt_from_stdin_equals_prompt_from_flag() {
    let Some(model) = tiny_llama() else { return };
    let m = model.to_str().unwrap();
    let from_flag = sift(&["run", "-m", m, "-p", "Once upon a time", "-n", "4", "--temp", "0"]);
    let from_stdin = sift_with_stdin(&["run", "-m", m, "-n", "4", "--temp", "0"], b"Once upon a time");
    assert_eq!(from_flag.status.code(), Some(0), "{}", stderr(&from_flag));
    assert_eq!(stdout(&from_flag), stdout(&from_stdin));
}

#[test]
fn tokenize_prints_llama_cpp_ids() {
    let Some(model) = tiny_llama() else { return };
    let o = sift(&["tokenize", "-m", model.to_str().unwrap(), "-p", "The capital of France is"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let reference = common::read_json(&model.parent().unwrap().join("../reference/tiny-llama-greedy.json"));
    let want: Vec<String> = reference["variants"]["flash_attn_on"]["cases"][0]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert_eq!(stdout(&o).trim(), want.join(" "));
}

#[test]
fn perplexity_reports_text_and_json() {
    let Some(model) = tiny_llama() else { return };
    let text = tmp("book.txt");
    std::fs::write(&text, "It was a bright cold day in April, and the clocks were striking thirteen. ".repeat(12))
        .unwrap();
    let args = ["perplexity", "-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "-c", "64", "--chunks", "2"];
    let o = sift(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("PPL = "), "{}", stdout(&o));
    let o = sift(&[&args[..], &["--json"]].concat());
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["chunks"], 2);
    assert_eq!(json["tokens_scored"], 2 * 31);
    assert!(json["ppl"].as_f64().unwrap() > 1.0 && json["ppl_stderr"].as_f64().unwrap() > 0.0);
    let missing = sift(&["perplexity", "-m", model.to_str().unwrap(), "-f", "/nonexistent.txt"]);
    assert_fails(&missing, 2, "/nonexistent.txt");
    // Among several files, the one too short for the context is named.
    let short = tmp("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let both =
        ["perplexity", "-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "-f", short.to_str().unwrap()];
    let o = sift(&[&both[..], &["-c", "64"]].concat());
    assert_fails(&o, 3, &format!("{}: the text has", short.display()));
}

#[test]
fn inspect_describes_the_model() {
    let Some(model) = tiny_llama() else { return };
    let o = sift(&["inspect", "-m", model.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(json["architecture"], "llama");
    assert_eq!(json["hparams"]["n_head_kv"], 2);
    assert!(json["memory"]["kv_bytes_per_token"].as_u64().unwrap() > 0);
}

/// The greedy continuation of the tiny Llama, as `run` prints it.
fn tiny_greedy(model: &str, extra: &[&str]) -> Output {
    sift(&[&["run", "-m", model, "-p", "The capital of France is", "--temp", "0"], extra].concat())
}

#[test]
fn zero_tokens_reads_the_prompt_and_generates_nothing() {
    let Some(model) = tiny_llama() else { return };
    let o = tiny_greedy(model.to_str().unwrap(), &["-n", "0", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((json["prompt_tokens"].as_u64(), json["tokens"].as_u64()), (Some(6), Some(0)));
    let o = tiny_greedy(model.to_str().unwrap(), &["-n", "0"]);
    assert_eq!((o.status.code(), stdout(&o)), (Some(0), String::new()));
}

#[test]
fn context_beyond_training_is_allowed_with_a_warning() {
    let Some(model) = tiny_llama() else { return };
    let o = tiny_greedy(model.to_str().unwrap(), &["-n", "2", "-c", "4096"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("warning: -c 4096 exceeds the model's training context of 2048"), "{}", stderr(&o));
}

#[test]
fn more_threads_than_cpus_run_with_a_warning() {
    let Some(model) = tiny_llama() else { return };
    let m = model.to_str().unwrap();
    let cpus = std::thread::available_parallelism().unwrap().get();
    let many = (cpus + 1).to_string();
    let o = tiny_greedy(m, &["-n", "2", "-t", &many]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let warning = format!("warning: -t {many} is more threads than the {cpus} CPUs sift may run on");
    assert_eq!(stderr(&o).matches(&warning).count(), 1, "{}", stderr(&o));
    let o = tiny_greedy(m, &["-n", "2", "-t", "1"]);
    assert!(!stderr(&o).contains("more threads than"), "{}", stderr(&o));
}

#[test]
fn stop_strings_end_the_text_and_are_cut() {
    let Some(model) = tiny_llama() else { return };
    let m = model.to_str().unwrap();
    let full = stdout(&tiny_greedy(m, &["-n", "8"]));
    let word = full.split_whitespace().nth(2).expect("three words in eight tokens");
    let want = &full[..full.find(word).unwrap()];
    let o = tiny_greedy(m, &["--max-tokens", "8", "--stop", "no such text", "--stop", word]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), want);
    let o = tiny_greedy(m, &["-n", "8", "--stop", word, "--json"]);
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((json["text"].as_str(), json["stop"].as_str()), (Some(want), Some("stop_string")));
    assert_eq!(tiny_greedy(m, &["--stop", ""]).status.code(), Some(1), "an empty stop string is a usage error");
}

#[test]
fn quiet_leaves_stderr_empty() {
    let Some(model) = tiny_llama() else { return };
    let o = tiny_greedy(model.to_str().unwrap(), &["-n", "4", "--quiet", "--chat"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert!(!o.stdout.is_empty());
}

#[test]
fn chat_flag_wraps_the_prompt_in_the_template() {
    let Some(model) = tiny_llama() else { return };
    let m = model.to_str().unwrap();
    let template = tmp("brackets.jinja");
    std::fs::write(&template, "{{ bos_token }}[[{{ messages[-1].content }}]]").unwrap();
    let args = ["run", "-m", m, "-n", "6", "--temp", "0", "--json"];
    let templated = sift(&[&args[..], &["--chat-template", template.to_str().unwrap(), "-p", "Paris"]].concat());
    let raw = sift(&[&args[..], &["-p", "[[Paris]]"]].concat());
    assert_eq!(templated.status.code(), Some(0), "{}", stderr(&templated));
    assert!(stderr(&templated).contains(&format!("chat template from {}", template.display())));
    let json = |o: &Output| -> serde_json::Value { serde_json::from_str(stdout(o).trim()).unwrap() };
    let (templated, raw) = (json(&templated), json(&raw));
    assert_eq!(templated["prompt_tokens"], raw["prompt_tokens"]);
    assert_eq!(templated["token_ids"], raw["token_ids"]);
    // Without a template in the file, Llama 2's built-in one, system text and all.
    let o = sift(&[&args[..], &["--system", "Be brief.", "-p", "Hi"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("using the built-in llama2 template"), "{}", stderr(&o));
    let tokens = sift(&["tokenize", "-m", m, "-p", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"]);
    let want = stdout(&tokens).split_whitespace().count();
    assert_eq!(json(&o)["prompt_tokens"].as_u64(), Some(want as u64));
}

#[test]
fn bad_chat_templates_exit_2() {
    let Some(model) = tiny_llama() else { return };
    let m = model.to_str().unwrap();
    let o = sift(&["run", "-m", m, "-p", "hi", "--chat-template", "/nonexistent/t.jinja"]);
    assert_fails(&o, 2, "cannot read the chat template /nonexistent/t.jinja");
    let broken = tmp("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}{{ m.content }}").unwrap();
    let o = sift(&["run", "-m", m, "-p", "hi", "--chat-template", broken.to_str().unwrap()]);
    assert_fails(&o, 2, "does not compile");
    let raising = tmp("raising.jinja");
    std::fs::write(&raising, "{{ raise_exception('no system role here') }}").unwrap();
    let o = sift(&["run", "-m", m, "-p", "hi", "--chat-template", raising.to_str().unwrap()]);
    assert_fails(&o, 2, "no system role here");
}

#[test]
fn completions_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let o = sift(&["completions", shell]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert!(stdout(&o).contains("chat") && stdout(&o).contains("max-tokens"), "{shell}: {}", stdout(&o));
    }
    assert_eq!(sift(&["completions", "tcsh"]).status.code(), Some(1));
}

/// `sift embed`: one line a text, each the library's embedding of the text's tokens; `-p` is one
/// text; no text at all is a usage error.
#[test]
fn embed_prints_the_librarys_vectors_one_a_line() {
    use sift::embed::{embed, Pooling};
    let path = common::default_model();
    let file = sift::gguf::GgufFile::open(&path).unwrap();
    let model = sift::model::Model::load(&file).unwrap();
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let texts = ["The cat sat on the mat.", "Stock markets fell sharply today."];
    let model_arg = path.to_str().unwrap();
    let o = sift_with_stdin(&["embed", "-m", model_arg], format!("{}\n\n{}\n", texts[0], texts[1]).as_bytes());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<Vec<f32>> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let want: Vec<Vec<f32>> = texts
        .iter()
        .map(|t| embed(&model, &tokenizer.encode(t, true, false).unwrap(), Pooling::Mean).unwrap())
        .collect();
    assert_eq!(lines, want);
    let o = sift(&["embed", "-m", model_arg, "-p", texts[1]]);
    assert_eq!(stdout(&o).trim(), serde_json::to_string(&want[1]).unwrap());
    assert_fails(&sift_with_stdin(&["embed", "-m", model_arg], b"\n \n"), 1, "no text");
    assert_fails(&sift(&["embed", "-m", model_arg, "-c", "4", "-p", texts[0]]), 3, "text 1: the prompt has");
}
