//! `--audit-out`: the JSON Lines audit of a generation with the default model, and how it fails
//! when it cannot be written (a full device, a file-size limit, a missing directory).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::model::Model;

const PROMPT: &str = "The capital of France is";

fn sift_bin() -> &'static str {
    env!("CARGO_BIN_EXE_sift")
}

/// `sift ARGS` with the default model and no standard input.
fn sift(args: &[&str]) -> Output {
    let model = common::default_model();
    Command::new(sift_bin()).args(args).env("SIFT_MODEL", model).stdin(Stdio::null()).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// An empty directory of the test's own.
fn fresh_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sift-audit-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// Exit code 4 and one line on stderr naming the audit file and the OS error.
fn assert_audit_fails(o: &Output, path: &str, os_error: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(4), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "error is not one line: {err}");
    assert!(err.starts_with(&format!("sift: cannot write audit {path}: {os_error}")), "{err}");
}

fn read_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(text.ends_with('\n'), "the last line is unterminated");
    text.lines().map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))).collect()
}

fn of_type<'a>(lines: &'a [Value], kind: &str) -> Vec<&'a Value> {
    lines.iter().filter(|line| line["type"] == kind).collect()
}

/// The model's log-probabilities after `context`, computed here from one prefill.
fn log_softmax_after(model: &Model, context: &[u32]) -> Vec<f64> {
    let mut session = Session::new(model, 64);
    let logits = session.prefill(context).unwrap();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| l as f64 - log_z).collect()
}

#[test]
fn greedy_run_writes_a_complete_audit() {
    let dir = fresh_dir("greedy");
    let path = dir.join("run.jsonl");
    let o = sift(&["run", "-q", "-p", PROMPT, "-n", "8", "--temp", "0", "--audit-out", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(entries(&dir), ["run.jsonl"], "a .partial file was left behind");
    let lines = read_lines(&path);

    let tokenizer = common::gemma3_tokenizer();
    let prompt_ids = tokenizer.encode(PROMPT, true, false).unwrap();
    let header = &lines[0];
    assert_eq!(header["type"], "header");
    assert_eq!(header["model"], common::default_model().to_str().unwrap());
    assert_eq!(header["architecture"], "gemma3");
    assert_eq!(header["kv_cache"], "f16");
    assert_eq!(header["attention"], "dense");
    assert_eq!(header["n_ctx"], 4096);
    assert_eq!(header["sampling"]["temperature"], 0.0);
    assert_eq!(header["prompt_tokens"], prompt_ids.len());
    assert_eq!(header["sift_version"], env!("CARGO_PKG_VERSION"));

    let summary = lines.last().unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["tokens"], 8);
    assert_eq!(summary["stop"], "token_limit");
    assert!(summary["elapsed_ms"].as_f64().unwrap() > 0.0);

    let tokens = of_type(&lines, "token");
    assert_eq!(tokens.len(), 8);
    assert_eq!(lines.len(), 10, "header, 8 tokens, summary");
    let ids: Vec<u32> = tokens.iter().map(|t| t["token"].as_u64().unwrap() as u32).collect();
    // The tokens spell what was printed, both as the audit gives their text and decoded anew.
    let text: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert_eq!(text, stdout(&o));
    assert_eq!(tokenizer.decode(&ids), stdout(&o));

    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let mut context = prompt_ids.clone();
    let mut max_error = 0.0f64;
    for (step, token) in tokens.iter().enumerate() {
        assert_eq!(token["step"], step);
        assert_eq!(token["position"], prompt_ids.len() + step);
        assert_eq!(token["attention"], serde_json::json!({"kind": "dense", "epsilon": 0.0, "delta": 0.0}));
        let logprob = token["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "step {step}: logprob {logprob}");
        let top = token["top"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], token["token"], "step {step}");
        assert_eq!(top[0]["logprob"], token["logprob"], "step {step}");
        let top_logprobs: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(top_logprobs.windows(2).all(|w| w[0] >= w[1]), "step {step}: not sorted: {top_logprobs:?}");
        let mass: f64 = top_logprobs.iter().map(|l| l.exp()).sum();
        assert!(mass <= 1.0 + 1e-6, "step {step}: the top 5 hold {mass}");
        for alternative in top {
            let id = alternative["token"].as_u64().unwrap() as u32;
            assert_eq!(alternative["text"], String::from_utf8_lossy(&tokenizer.token_bytes(id)).as_ref());
        }

        // The same probabilities from a fresh prefill of everything before the token (sift
        // decoded it one token at a time): the audit reports the model's distribution.
        let reference = log_softmax_after(&model, &context);
        for (id, logprob) in std::iter::once((ids[step], logprob))
            .chain(top.iter().map(|t| (t["token"].as_u64().unwrap() as u32, t["logprob"].as_f64().unwrap())))
        {
            max_error = max_error.max((reference[id as usize] - logprob).abs());
        }
        context.push(ids[step]);
    }
    // Prefill and decode agree to f32 rounding today (1.8e-7); the margin leaves kernels room
    // to order their sums differently.
    eprintln!("max |audit logprob - prefill logprob| = {max_error:.2e}");
    assert!(max_error < 1e-3, "audit logprobs differ from a prefill's by {max_error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_audit_has_a_line_per_reply() {
    let dir = fresh_dir("chat");
    let path = dir.join("chat.jsonl");
    let model = common::default_model();
    let args =
        ["chat", "-m", model.to_str().unwrap(), "-q", "-n", "4", "--temp", "0", "--audit-out", path.to_str().unwrap()];
    let o = common::sift_with_stdin(&args, b"Hello\nName a color.\n");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(entries(&dir), ["chat.jsonl"]);
    let lines = read_lines(&path);
    assert_eq!(lines[0]["type"], "header");
    assert!(lines[0].get("prompt_tokens").is_none(), "a chat gives prompt tokens per reply");
    let replies = of_type(&lines, "reply");
    assert_eq!(replies.len(), 2);
    // Every reply is printed followed by a newline.
    let mut printed = String::new();
    for (turn, reply) in (1..).zip(&replies) {
        assert_eq!(reply["turn"], turn);
        assert!(reply["prompt_tokens"].as_u64().unwrap() > 0);
        let tokens: Vec<&Value> = of_type(&lines, "token").into_iter().filter(|t| t["turn"] == turn).collect();
        let generated = reply["tokens"].as_u64().unwrap() as usize;
        let eog = usize::from(reply["stop"] == "end_of_generation");
        assert_eq!(tokens.len(), generated + eog, "turn {turn}");
        printed.extend(tokens.iter().map(|t| t["text"].as_str().unwrap()));
        printed.push('\n');
    }
    assert_eq!(printed, stdout(&o));
    let summary = lines.last().unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["turns"], 2);
    let total: u64 = replies.iter().map(|r| r["tokens"].as_u64().unwrap()).sum();
    assert_eq!(summary["tokens"], total);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn full_device_fails_with_one_line_and_exit_4() {
    for command in [&["run", "-p", PROMPT, "-n", "8", "--temp", "0"][..], &["chat", "-n", "8"]] {
        let o = sift(&[command, &["--audit-out", "/dev/full"]].concat());
        assert_audit_fails(&o, "/dev/full", "No space left on device");
        // The header is written before anything is generated, so nothing was.
        assert!(o.stdout.is_empty(), "stdout: {}", stdout(&o));
    }
}

#[test]
fn file_size_limit_leaves_no_file_behind() {
    let dir = fresh_dir("fsize");
    let path = dir.join("run.jsonl");
    let full = sift(&["run", "-q", "-p", PROMPT, "-n", "8", "--temp", "0"]);
    assert_eq!(full.status.code(), Some(0), "{}", stderr(&full));
    // RLIMIT_FSIZE of two 512-byte blocks: the header fits, the audit of 8 tokens does not.
    // With SIGXFSZ ignored, the write that crosses it fails with EFBIG instead of killing sift.
    let limited = |path: &Path| {
        let script = "trap '' XFSZ; ulimit -f 2; exec \"$@\"";
        let audit = path.to_str().unwrap();
        let sift_args = ["run", "-q", "-p", PROMPT, "-n", "8", "--temp", "0", "--audit-out", audit];
        Command::new("sh")
            .args(["-c", script, "sh", sift_bin()])
            .args(sift_args)
            .env("SIFT_MODEL", common::default_model())
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let o = limited(&path);
    assert_audit_fails(&o, path.to_str().unwrap(), "File too large");
    assert_eq!(entries(&dir), Vec::<String>::new(), "an incomplete audit was left behind");
    // Generation stopped at the token whose line failed; what was printed came before it.
    let printed = stdout(&o);
    assert!(stdout(&full).starts_with(&printed) && printed.len() < stdout(&full).len(), "{printed:?}");

    // An earlier audit under the name stays as it was.
    std::fs::write(&path, "earlier\n").unwrap();
    let o = limited(&path);
    assert_audit_fails(&o, path.to_str().unwrap(), "File too large");
    assert_eq!(entries(&dir), ["run.jsonl"]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "earlier\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_directory_fails_before_the_model_is_opened() {
    let path = "/nonexistent-sift-dir/audit.jsonl";
    // A model that cannot be opened would exit 2: the audit is checked first.
    let o = Command::new(sift_bin())
        .args(["run", "-m", "/nonexistent/model.gguf", "-p", PROMPT, "--audit-out", path])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_audit_fails(&o, path, "No such file or directory");
    assert!(o.stdout.is_empty());
    // A directory is no audit file either.
    let dir = std::env::temp_dir();
    let o = sift(&["run", "-p", PROMPT, "--audit-out", dir.to_str().unwrap()]);
    assert_audit_fails(&o, dir.to_str().unwrap(), "Is a directory");
}

#[test]
fn a_device_is_written_in_place() {
    // /dev/stdout cannot be renamed onto: the audit goes straight to it, ahead of `--json`'s line.
    let o = sift(&["run", "-q", "-p", PROMPT, "-n", "4", "--temp", "0", "--json", "--audit-out", "/dev/stdout"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<Value> = stdout(&o).lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let (json, audit) = lines.split_last().unwrap();
    assert_eq!(audit[0]["type"], "header");
    assert_eq!(of_type(audit, "token").len(), 4);
    assert_eq!(audit.last().unwrap()["type"], "summary");
    let ids: Vec<&Value> = of_type(audit, "token").iter().map(|t| &t["token"]).collect();
    assert_eq!(json["token_ids"].as_array().unwrap().iter().collect::<Vec<_>>(), ids);
}
