//! Load on one `sift serve`: 100 requests one after another, then 16 at once. Every reply must
//! equal `sift run --chat`'s greedy reply to its prompt, and the server's resident memory must
//! stay within 5% of what it was after warm-up. Expensive: run it with
//! `cargo test --release --test serve_load -- --ignored --nocapture`, which prints the figures.

mod common;

use std::process::Command;
use std::time::Instant;

use common::server::{streamed_text, Server};
use serde_json::{json, Value};

const PROMPTS: [&str; 4] =
    ["What is the capital of France?", "Name three colours.", "Tell me a joke.", "How many legs has a spider?"];
const TOKENS: usize = 16;

fn reference(model: &std::path::Path, message: &str) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(["run", "--quiet", "--chat", "--temp", "0", "--json", "-n", &TOKENS.to_string(), "-p", message, "-m"])
        .arg(model)
        .output()
        .unwrap();
    assert!(o.status.success());
    let json: Value = serde_json::from_slice(&o.stdout).unwrap();
    json["text"].as_str().unwrap().to_string()
}

/// The server's resident set, in KiB, from /proc.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// One request for prompt `i`, streamed every third time; its reply's text.
fn ask(server: &Server, i: usize) -> String {
    let request = json!({
        "messages": [{"role": "user", "content": PROMPTS[i % PROMPTS.len()]}],
        "temperature": 0,
        "max_tokens": TOKENS,
    });
    if i.is_multiple_of(3) {
        let mut request = request;
        request["stream"] = json!(true);
        streamed_text(&server.stream("/v1/chat/completions", &request).collect())
    } else {
        let (status, body) = server.post("/v1/chat/completions", &request);
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    }
}

#[test]
#[ignore = "load test: 116 requests, a few minutes"]
fn a_hundred_sequential_and_sixteen_concurrent_requests_stay_correct_and_flat() {
    let model = common::default_model();
    let want: Vec<String> = PROMPTS.iter().map(|p| reference(&model, p)).collect();
    let server = Server::start(&["--queue", "16"]);
    let pid = server.pid();

    let started = Instant::now();
    let mut warm = 0;
    for i in 0..100 {
        assert_eq!(ask(&server, i), want[i % PROMPTS.len()], "request {i}");
        if i == 9 {
            warm = rss_kib(pid);
        }
    }
    let sequential = started.elapsed();
    let after_sequential = rss_kib(pid);

    let started = Instant::now();
    let replies: Vec<(usize, String)> = std::thread::scope(|scope| {
        let server = &server;
        let threads: Vec<_> = (0..16).map(|i| scope.spawn(move || (i, ask(server, i)))).collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let concurrent = started.elapsed();
    for (i, reply) in &replies {
        assert_eq!(reply, &want[i % PROMPTS.len()], "concurrent request {i}");
    }
    let after_concurrent = rss_kib(pid);

    let growth = |rss: u64| (rss as f64 / warm as f64 - 1.0) * 100.0;
    eprintln!(
        "100 sequential in {:.1} s ({:.2} s each), 16 concurrent in {:.1} s; RSS after 10 requests {} MiB, \
         after 100 {} MiB ({:+.2}%), after 16 more {} MiB ({:+.2}%)",
        sequential.as_secs_f64(),
        sequential.as_secs_f64() / 100.0,
        concurrent.as_secs_f64(),
        warm / 1024,
        after_sequential / 1024,
        growth(after_sequential),
        after_concurrent / 1024,
        growth(after_concurrent),
    );
    assert!(growth(after_sequential).abs() <= 5.0 && growth(after_concurrent).abs() <= 5.0, "RSS not flat");
}
