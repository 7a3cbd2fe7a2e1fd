//! The command line as scripts see it: stdout, stderr and exit codes.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn sift(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sift")).args(args).stdin(Stdio::null()).output().unwrap()
}

fn sift_with_stdin(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A one-line error on stderr and the documented exit code.
fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "error is not one line: {err}");
    assert!(o.stdout.is_empty(), "stdout should be empty on error: {}", stdout(o));
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
    for sub in ["run", "perplexity", "tokenize", "inspect", "Exit codes"] {
        assert!(stdout(&o).contains(sub), "--help lacks {sub}");
    }
}

#[test]
fn usage_errors_exit_1() {
    assert_eq!(sift(&["frobnicate"]).status.code(), Some(1));
    assert_eq!(sift(&["run", "--temp", "warm"]).status.code(), Some(1));
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
