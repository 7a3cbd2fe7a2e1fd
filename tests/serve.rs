//! `sift serve` through a real HTTP client: greedy replies equal `sift run --chat` and `sift chat`,
//! stop strings, a client that leaves mid-stream, the bounded queue, OpenAI's errors, the model
//! retrieved by name, which browser pages may call (CORS), embeddings and a graceful stop. Every server
//! listens on 127.0.0.1 and is killed at the end of its test.

mod common;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use common::server::{streamed_text, Server};
use serde_json::{json, Value};

const QUESTION: &str = "What is the capital of France?";

/// `sift run --chat` on the default model, greedy: the reference reply.
fn run_chat(message: &str, n: usize) -> String {
    let model = common::default_model();
    let o = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(["run", "--quiet", "--chat", "--temp", "0", "--json", "-n", &n.to_string(), "-p", message, "-m"])
        .arg(model)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json: Value = serde_json::from_slice(&o.stdout).unwrap();
    json["text"].as_str().unwrap().to_string()
}

fn greedy(messages: Value, n: usize) -> Value {
    json!({ "model": "any", "messages": messages, "temperature": 0, "max_tokens": n })
}

fn content(response: &Value) -> &str {
    response["choices"][0]["message"]["content"].as_str().unwrap()
}

#[test]
fn greedy_chat_completions_equal_sift_run_streamed_or_not() {
    common::default_model();
    let server = Server::start(&[]);
    let want = run_chat(QUESTION, 24);
    assert!(!want.is_empty());

    let (status, whole) =
        server.post("/v1/chat/completions", &greedy(json!([{"role": "user", "content": QUESTION}]), 24));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(content(&whole), want);
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    assert_eq!(whole["choices"][0]["x_sift"]["attention"]["kind"], "dense");
    assert_eq!(whole["choices"][0]["x_sift"]["attention"]["epsilon"], 0.0);

    let mut request = greedy(json!([{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]), 24);
    request["stream"] = json!(true);
    request["stream_options"] = json!({ "include_usage": true });
    let chunks = server.stream("/v1/chat/completions", &request).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.len() > 3, "streamed in pieces: {chunks:?}");
    assert_eq!(streamed_text(&chunks), want);
    let last = &chunks[chunks.len() - 2];
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(
        (usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()),
        (whole["usage"]["prompt_tokens"].as_u64(), Some(24))
    );

    let (status, models) = server.get("/v1/models", &[]);
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "gemma-3-270m-Q4_K_M");
}

/// The second turn of a conversation reuses the cache and replies as `sift chat` does.
#[test]
fn the_next_turn_reuses_the_cache_and_replies_as_sift_chat() {
    let model = common::default_model();
    let second = "And of Germany?";
    let saved = std::env::temp_dir().join(format!("sift-serve-chat-{}.json", std::process::id()));
    let input = format!("{QUESTION}\n{second}\n/save {}\n", saved.display());
    let o = common::sift_with_stdin(
        &["chat", "--quiet", "--temp", "0", "-n", "12", "-m", model.to_str().unwrap()],
        input.as_bytes(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let chat: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    std::fs::remove_file(&saved).unwrap();
    let replies: Vec<&str> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .step_by(2)
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(replies.len(), 2, "{chat}");

    let server = Server::start(&[]);
    let first = json!([{"role": "user", "content": QUESTION}]);
    let (_, one) = server.post("/v1/chat/completions", &greedy(first, 12));
    assert_eq!(content(&one), replies[0]);
    assert_eq!(one["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let history = json!([
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": content(&one)},
        {"role": "user", "content": second},
    ]);
    let (_, two) = server.post("/v1/chat/completions", &greedy(history, 12));
    assert_eq!(content(&two), replies[1]);
    let cached = two["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let first_prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > first_prompt, "the first turn stays in the cache: {cached} of {}", two["usage"]);
}

/// A request for something else between two turns (a chat app's title) parks the conversation's
/// cache; the next turn takes it up and prefills only what is new, and replies as a server that
/// saw only the conversation does. With `--cache-ram 0` nothing is parked: the next turn goes on
/// from the title request's first tokens only.
#[test]
fn a_request_between_two_turns_leaves_the_conversations_cache_for_the_next() {
    common::default_model();
    let second = "And of Germany?";
    let one_turn = json!([{"role": "user", "content": QUESTION}]);
    let title = json!([{"role": "user", "content": "Write a title of three words for a chat about capitals."}]);
    let next_turn = |reply: &str| {
        json!([
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": second},
        ])
    };
    let plain = Server::start(&[]);
    let (_, one) = plain.post("/v1/chat/completions", &greedy(one_turn.clone(), 12));
    let (_, want) = plain.post("/v1/chat/completions", &greedy(next_turn(content(&one)), 12));

    for (flags, kept) in [(&[][..], true), (&["--cache-ram", "0"][..], false)] {
        let server = Server::start(flags);
        let (_, one) = server.post("/v1/chat/completions", &greedy(one_turn.clone(), 12));
        let (status, _) = server.post("/v1/chat/completions", &greedy(title.clone(), 8));
        assert_eq!(status, 200);
        let (_, two) = server.post("/v1/chat/completions", &greedy(next_turn(content(&one)), 12));
        assert_eq!(content(&two), content(&want), "{flags:?}");
        let cached = two["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let first_prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
        match kept {
            true => assert!(cached > first_prompt, "the first turn was parked: {cached} of {}", two["usage"]),
            // Only the chat template's opening tokens, which the title request shared.
            false => assert!(cached <= 4, "{}", two["usage"]),
        }
    }
}

/// A reply asked for again (a chat app's "regenerate") prefills only the prompt's last token,
/// and is the same reply, greedy.
#[test]
fn a_regenerated_reply_prefills_one_token() {
    common::default_model();
    let server = Server::start(&[]);
    let request = greedy(json!([{"role": "user", "content": QUESTION}]), 12);
    let (_, one) = server.post("/v1/chat/completions", &request);
    let (_, two) = server.post("/v1/chat/completions", &request);
    assert_eq!(content(&two), content(&one));
    let prompt = two["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(two["usage"]["prompt_tokens_details"]["cached_tokens"], prompt - 1, "{}", two["usage"]);
}

#[test]
fn stop_strings_end_the_reply_before_them() {
    common::default_model();
    let server = Server::start(&[]);
    let prompt = json!({ "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12 });
    let (status, free) = server.post("/v1/completions", &prompt);
    assert_eq!(status, 200, "{free}");
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    // A word from the middle of the greedy text: the reply must end just before it.
    let word = text.split_whitespace().nth(2).unwrap_or_else(|| panic!("too short: {text:?}"));
    let cut = &text[..text.find(word).unwrap()];
    for stop in [json!(word), json!(["\u{1F600}", word])] {
        let mut request = prompt.clone();
        request["stop"] = stop;
        let (_, stopped) = server.post("/v1/completions", &request);
        assert_eq!(stopped["choices"][0]["text"], cut, "stop {word:?} in {text:?}");
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        request["stream"] = json!(true);
        let chunks = server.stream("/v1/completions", &request).collect();
        assert_eq!(streamed_text(&chunks), cut);
    }
}

#[test]
fn a_client_that_leaves_mid_stream_frees_the_server() {
    common::default_model();
    let server = Server::start(&[]);
    let short = json!({ "prompt": "Hello", "max_tokens": 1, "temperature": 0 });
    let (_, alone) = server.post("/v1/completions", &short);
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 4000, "stream": true, "seed": 1 });
    let mut events = server.stream("/v1/completions", &long);
    for _ in 0..3 {
        assert!(events.next_data().is_some());
    }
    let started = Instant::now();
    drop(events);
    let (status, after) = server.post("/v1/completions", &short);
    let waited = started.elapsed();
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], alone["choices"][0]["text"]);
    // A token costs well under a second here; the abandoned reply had thousands to go.
    assert!(waited < Duration::from_secs(20), "the next request waited {waited:?}");

    // The same for a client that waits for a whole reply and gives up.
    let body = json!({ "prompt": "Once upon a time", "max_tokens": 4000 }).to_string();
    let mut client = std::net::TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
    client.write_all(head.as_bytes()).and_then(|_| client.write_all(body.as_bytes())).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    drop(client);
    let (status, after) = server.post("/v1/completions", &short);
    assert_eq!(status, 200, "{after}");
    assert!(started.elapsed() < Duration::from_secs(20), "the next request waited {:?}", started.elapsed());
}

/// A client that leaves during a long prompt's prefill stops it at the next batch; the batches
/// done stay in the cache, so the same prompt sent again goes on from them.
#[test]
fn a_client_that_leaves_during_the_prefill_stops_it_and_its_batches_are_kept() {
    common::default_model();
    // On the CPU, which prefills in batches (a GPU takes a prompt whole).
    let server = Server::start(&["-c", "8192", "--gpu", "off"]);
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(600);
    let long = json!({ "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": true });
    let events = server.stream("/v1/completions", &long);
    std::thread::sleep(Duration::from_secs(1));
    drop(events);
    let again = json!({ "prompt": prompt, "max_tokens": 1, "temperature": 0 });
    let (status, reply) = server.post("/v1/completions", &again);
    assert_eq!(status, 200, "{reply}");
    let usage = &reply["usage"];
    let (prompt_tokens, cached) =
        (usage["prompt_tokens"].as_u64().unwrap(), usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap());
    // Had the first prefill run to its end, its reply would have left nothing to reuse.
    assert!(cached > 0 && cached < prompt_tokens && cached % 512 == 0, "{usage}");
}

#[test]
fn past_the_queue_requests_get_503_with_retry_after() {
    common::default_model();
    let server = Server::start(&["--queue", "1"]);
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 4000, "stream": true });
    let mut events = server.stream("/v1/completions", &long);
    assert!(events.next_data().is_some(), "the long reply is being served");
    // One of two more requests waits in the queue of one; the other is refused at once.
    let body = json!({ "prompt": "Hello", "max_tokens": 2 }).to_string();
    let results = std::thread::scope(|scope| {
        let waiting: Vec<_> =
            (0..2).map(|_| scope.spawn(|| server.post_raw("/v1/completions", body.as_bytes(), &[]))).collect();
        std::thread::sleep(Duration::from_secs(3));
        drop(events);
        waiting.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
    });
    let mut statuses: Vec<u16> = results.iter().map(|r| r.0).collect();
    statuses.sort();
    assert_eq!(statuses, [200, 503], "{results:?}");
    let refused = results.iter().find(|r| r.0 == 503).unwrap();
    assert_eq!(refused.2.as_deref(), Some("1"));
    let error: Value = serde_json::from_str(&refused.1).unwrap();
    assert_eq!(error["error"]["code"], "queue_full");
}

/// A request's logit bias and penalties reach the sampler: a greedy completion that bans the
/// token dense greedy decoding starts with, and penalises repeats, equals `sift run` with the
/// same flags, and differs from the plain greedy one.
#[test]
fn logit_bias_and_penalties_shape_the_reply_as_sift_runs_flags_do() {
    let model = common::default_model();
    let prompt = "The capital of France is";
    let run = |flags: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_sift"))
            .args(["run", "--quiet", "--temp", "0", "--json", "-n", "16", "-p", prompt, "-m"])
            .arg(&model)
            .args(flags)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let json: Value = serde_json::from_slice(&o.stdout).unwrap();
        json["text"].as_str().unwrap().to_string()
    };
    // " the", the first token of the plain greedy reply.
    let the = 506;
    let plain = run(&[]);
    assert!(plain.starts_with(" the"), "{plain:?}");
    let banned = format!("{the}-100");
    let shaped = run(&["-l", &banned, "--frequency-penalty", "1.5", "--presence-penalty", "0.5"]);
    assert!(!shaped.starts_with(" the") && shaped != plain, "{shaped:?}");

    let server = Server::start(&[]);
    let request = json!({
        "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "logit_bias": { the.to_string(): -100 }, "frequency_penalty": 1.5, "presence_penalty": 0.5,
    });
    let (status, reply) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["text"], shaped.as_str());
}

/// `{"error": {"message", "type", ...}}` with the status expected.
fn assert_error(got: (u16, String, Option<String>), status: u16, needle: &str) {
    assert_eq!(got.0, status, "{}", got.1);
    let body: Value = serde_json::from_str(&got.1).unwrap_or_else(|e| panic!("{e}: {}", got.1));
    let message = body["error"]["message"].as_str().unwrap_or_else(|| panic!("no error.message: {body}"));
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

#[test]
fn bad_requests_get_openais_errors_with_the_right_status() {
    common::default_model();
    let server = Server::start(&["--api-key", "sesame", "--max-body", "2048", "-c", "64"]);
    let key = [("Authorization", "Bearer sesame")];
    let chat = |body: &str, headers: &[(&str, &str)]| server.post_raw("/v1/chat/completions", body.as_bytes(), headers);
    let hello = r#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}"#;

    assert_error(chat(hello, &[]), 401, "API key");
    assert_error(chat(hello, &[("Authorization", "Bearer sesamE")]), 401, "API key");
    assert_error(server.get("/v1/models", &[]).into_error(), 401, "API key");
    assert_eq!(server.get("/health", &[]).0, 200, "/health needs no key");
    assert_eq!(chat(hello, &key).0, 200);

    assert_error(chat("{\"messages\": [", &key), 400, "not a valid request");
    assert_error(chat(r#"{"messages": "Hi"}"#, &key), 400, "not a valid request");
    assert_error(chat(r#"{"messages": [], "temperature": "hot"}"#, &key), 400, "not a valid request");
    assert_error(
        chat(r#"{"messages": [{"role": "user", "content": "Hi"}], "temperature": 7}"#, &key),
        400,
        "temperature",
    );
    assert_error(chat(r#"{"messages": [{"role": "robot", "content": "Hi"}]}"#, &key), 400, "role");
    let hi = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "Hi"}}], {extra}}}"#);
    assert_error(chat(&hi(r#""n": 2"#), &key), 400, "n: only one choice");
    assert_error(chat(&hi(r#""presence_penalty": 2.5"#), &key), 400, "presence_penalty");
    assert_error(chat(&hi(r#""logit_bias": {"abc": 1}"#), &key), 400, "\"abc\" is not a token id");
    assert_error(chat(&hi(r#""logit_bias": {"999999999": 1}"#), &key), 400, "not in the vocabulary");
    assert_error(chat(&hi(r#""logit_bias": {"5": 300}"#), &key), 400, "between -100 and 100");
    assert_error(chat(r#"{"messages": []}"#, &key), 400, "at least one message");
    let long = format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#, "word ".repeat(200));
    assert_error(chat(&long, &key), 400, "but the context holds 64");
    let oversized = format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#, "x".repeat(4000));
    assert_error(chat(&oversized, &key), 413, "larger than the limit");
    assert_error(server.get("/v2/nothing", &key).into_error(), 404, "/v2/nothing");
    assert_eq!(chat(hello, &key).0, 200, "still serving after the errors");
}

trait IntoError {
    fn into_error(self) -> (u16, String, Option<String>);
}

impl IntoError for (u16, String) {
    fn into_error(self) -> (u16, String, Option<String>) {
        (self.0, self.1, None)
    }
}

#[test]
fn sigterm_lets_the_reply_in_flight_finish() {
    common::default_model();
    let mut server = Server::start(&[]);
    let request = json!({ "prompt": "Once upon a time", "max_tokens": 16, "stream": true, "temperature": 0 });
    let mut events = server.stream("/v1/completions", &request);
    assert!(events.next_data().is_some());
    server.terminate();
    let mut rest = Vec::new();
    while let Some(data) = events.next_data() {
        rest.push(data);
    }
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "the reply ended whole: {rest:?}");
    assert_eq!(server.wait(Duration::from_secs(30)), Some(0));
}

#[test]
fn the_chat_page_is_served_whole() {
    common::default_model();
    let server = Server::start(&["--api-key", "sesame"]);
    let (status, page) = server.get("/", &[]);
    assert_eq!(status, 200);
    assert!(page.starts_with("<!doctype html>") && page.contains("/v1/chat/completions"), "{page}");
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"), "nothing from elsewhere");
}

/// Greedy decoding picks the most likely token, so each position's own log-probability must be
/// the first of its alternatives, and the tokens' bytes must spell the reply.
#[test]
fn logprobs_describe_the_tokens_of_the_reply_whole_and_streamed() {
    common::default_model();
    let server = Server::start(&[]);
    let mut request = greedy(json!([{"role": "user", "content": QUESTION}]), 12);
    request["logprobs"] = json!(true);
    request["top_logprobs"] = json!(3);
    let (status, whole) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{whole}");
    let positions = whole["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(positions.len() as u64, whole["usage"]["completion_tokens"].as_u64().unwrap());
    let mut bytes = Vec::new();
    for position in &positions {
        let top = position["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{position}");
        let logprob = position["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0 && logprob == top[0]["logprob"].as_f64().unwrap(), "{position}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{position}");
        bytes.extend(position["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), content(&whole));

    // OpenAI's range reaches 20 alternatives: distinct tokens, the 3 above first, the
    // probabilities summing to at most 1.
    request["top_logprobs"] = json!(20);
    let (status, twenty) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{twenty}");
    let wide = twenty["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(wide.len(), positions.len());
    for (wide, narrow) in wide.iter().zip(&positions) {
        let top = wide["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 20, "{wide}");
        assert_eq!(top[..3], narrow["top_logprobs"].as_array().unwrap()[..], "{wide}");
        let tokens: std::collections::HashSet<_> = top.iter().map(|t| t["bytes"].to_string()).collect();
        assert_eq!(tokens.len(), 20, "{wide}");
        let mass: f64 = top.iter().map(|t| t["logprob"].as_f64().unwrap().exp()).sum();
        assert!(mass <= 1.0 + 1e-5, "{mass}: {wide}");
    }
    request["top_logprobs"] = json!(21);
    let (status, error) = server.post("/v1/chat/completions", &request);
    assert_eq!((status, error["error"]["message"].as_str()), (400, Some("top_logprobs must be between 0 and 20")));
    request["top_logprobs"] = json!(3);

    // Legacy completions list up to 5 (their own range), named by `logprobs`.
    let text = |n: usize| json!({ "prompt": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": n });
    let (status, five) = server.post("/v1/completions", &text(5));
    assert_eq!(status, 200, "{five}");
    let listed = five["choices"][0]["logprobs"]["top_logprobs"].as_array().unwrap();
    assert!(!listed.is_empty() && listed.iter().all(|t| t.as_object().unwrap().len() <= 5), "{five}");
    let (status, error) = server.post("/v1/completions", &text(6));
    assert_eq!((status, error["error"]["message"].as_str()), (400, Some("logprobs must be between 0 and 5")));

    request["stream"] = json!(true);
    let chunks = server.stream("/v1/chat/completions", &request).collect();
    let streamed: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array()).flatten().collect();
    assert_eq!(streamed.len(), positions.len());
    for (streamed, whole) in streamed.iter().zip(&positions) {
        assert_eq!((&streamed["token"], &streamed["logprob"]), (&whole["token"], &whole["logprob"]));
    }
}

/// With a sparse policy, each choice carries that policy's certificate, not dense attention's.
#[test]
fn x_sift_carries_the_policys_certificate() {
    common::default_model();
    let server = Server::start(&["--attn", "topk", "--topk-pages", "1"]);
    // Past sift::attn::SPARSE_MIN_VISIBLE positions, so that decoding steps go sparse.
    let prompt = "The history of the city begins long ago. ".repeat(130);
    let (status, reply) =
        server.post("/v1/completions", &json!({ "prompt": prompt, "max_tokens": 3, "temperature": 0 }));
    assert!(reply["usage"]["prompt_tokens"].as_u64().unwrap() > sift::attn::SPARSE_MIN_VISIBLE as u64, "{reply}");
    assert_eq!(status, 200, "{reply}");
    let attention = &reply["choices"][0]["x_sift"]["attention"];
    assert_eq!(attention["kind"], "topk", "{reply}");
    assert_ne!(attention["epsilon"], 0.0, "top-k promises no exactness: {attention}");
}

/// `/v1/models/{id}` retrieves the one model, and no other.
#[test]
fn the_model_is_retrieved_by_its_name() {
    common::default_model();
    let server = Server::start(&[]);
    let (status, card) = server.get("/v1/models/gemma-3-270m-Q4_K_M", &[]);
    assert_eq!(status, 200, "{card}");
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_eq!((card["id"].as_str(), card["object"].as_str()), (Some("gemma-3-270m-Q4_K_M"), Some("model")));
    let (status, error) = server.get("/v1/models/gpt-4o", &[]);
    assert_eq!(status, 404, "{error}");
    let error: Value = serde_json::from_str(&error).unwrap();
    assert_eq!(error["error"]["code"], "model_not_found", "{error}");

    // --alias names the model everywhere a name is shown.
    let server = Server::start(&["--alias", "gemma3:270m"]);
    let (_, models) = server.get("/v1/models", &[]);
    assert_eq!(serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"], "gemma3:270m");
    let (_, props) = server.get("/props", &[]);
    assert_eq!(serde_json::from_str::<Value>(&props).unwrap()["model_alias"], "gemma3:270m");
    let (_, tags) = server.get("/api/tags", &[]);
    assert_eq!(serde_json::from_str::<Value>(&tags).unwrap()["models"][0]["name"], "gemma3:270m", "a tag is kept");
    let (status, reply) = server.post("/v1/chat/completions", &greedy(json!([{"role": "user", "content": "Hi"}]), 2));
    assert_eq!((status, reply["model"].as_str()), (200, Some("gemma3:270m")), "{reply}");
    for bad in ["", "org/model"] {
        let o =
            Command::new(env!("CARGO_BIN_EXE_sift")).args(["serve", "--port", "0", "--alias", bad]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "--alias {bad:?}: a usage error");
        assert!(String::from_utf8_lossy(&o.stderr).contains("--alias"), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// Tools through `/v1/messages` are `/v1/chat/completions`' tool calls: the same greedy call as a
/// `tool_use` block (one, with parallel use turned off), whole and streamed (its input in one
/// `input_json_delta`), and a turn that brings a `tool_result` gets the reply the same history
/// gets there.
#[test]
fn anthropic_tool_use_is_chat_completions_tool_calls() {
    common::default_model();
    let server = Server::start(&["--temp", "0"]);
    let weather = json!({ "type": "object", "properties": { "city": { "enum": ["Oslo", "Rome"] } }, "required": ["city"], "additionalProperties": false });
    let description = "Today's weather in a city";
    let question = "What is the weather in Oslo today?";
    let openai_tools = json!([{ "type": "function", "function": { "name": "weather", "description": description, "parameters": weather } }]);
    let tools = json!([{ "name": "weather", "description": description, "input_schema": weather }]);

    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({
            "messages": [{ "role": "user", "content": question }], "max_tokens": 60,
            "tools": openai_tools, "tool_choice": { "type": "function", "function": { "name": "weather" } },
            "parallel_tool_calls": false,
        }),
    );
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls", "{chat}");
    let call = &chat["choices"][0]["message"]["tool_calls"][0]["function"];
    let input: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();

    let request = json!({
        "max_tokens": 60, "messages": [{ "role": "user", "content": question }],
        "tools": tools, "tool_choice": { "type": "tool", "name": "weather", "disable_parallel_tool_use": true },
    });
    let (status, message) = server.post("/v1/messages", &request);
    assert_eq!(status, 200, "{message}");
    assert_eq!(message["stop_reason"], "tool_use", "{message}");
    let block = &message["content"][0];
    assert_eq!((block["type"].as_str(), block["name"].as_str()), (Some("tool_use"), Some("weather")), "{message}");
    assert_eq!(block["input"], input, "{message}");
    assert_eq!(message["content"].as_array().unwrap().len(), 1, "{message}");

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.named_events("/v1/messages", &streamed, &[]);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    let order = [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ];
    assert_eq!(names, order);
    let (start, delta, end) = (&events[1].1, &events[2].1, &events[4].1);
    assert_eq!(start["content_block"]["type"], "tool_use");
    assert_eq!(start["content_block"]["name"], "weather");
    assert_eq!(
        start["content_block"]["id"],
        block["id"].as_str().unwrap().replace(
            message["id"].as_str().unwrap().trim_start_matches("msg-"),
            events[0].1["message"]["id"].as_str().unwrap().trim_start_matches("msg-")
        )
    );
    assert_eq!(delta["delta"]["type"], "input_json_delta");
    assert_eq!(serde_json::from_str::<Value>(delta["delta"]["partial_json"].as_str().unwrap()).unwrap(), input);
    assert_eq!(end["delta"]["stop_reason"], "tool_use");

    // The tool's result, then the model's reply: the same history on both routes.
    let arguments = json!({ "city": "Oslo" });
    let result = "Sunny, 21 degrees.";
    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({
            "max_tokens": 40, "tools": openai_tools,
            "messages": [
                { "role": "user", "content": question },
                { "role": "assistant", "content": null, "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "weather", "arguments": arguments.to_string() } }] },
                { "role": "tool", "tool_call_id": "c1", "content": result },
            ],
        }),
    );
    assert_eq!(status, 200, "{chat}");
    let (status, message) = server.post(
        "/v1/messages",
        &json!({
            "max_tokens": 40, "tools": tools,
            "messages": [
                { "role": "user", "content": question },
                { "role": "assistant", "content": [{ "type": "tool_use", "id": "c1", "name": "weather", "input": arguments }] },
                { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "c1", "content": [{ "type": "text", "text": result }] }] },
            ],
        }),
    );
    assert_eq!(status, 200, "{message}");
    let choice = &chat["choices"][0];
    if choice["finish_reason"] == "tool_calls" {
        assert_eq!(message["stop_reason"], "tool_use", "{chat} {message}");
        let arguments = choice["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
        assert_eq!(message["content"][0]["input"], serde_json::from_str::<Value>(arguments).unwrap());
    } else {
        assert_eq!(message["content"], json!([{ "type": "text", "text": choice["message"]["content"] }]), "{chat}");
    }
    assert_eq!(message["usage"]["input_tokens"], chat["usage"]["prompt_tokens"], "the same prompt on both routes");
}

/// `/props` says what the server was started with: the context, the chat template and
/// special tokens, the sampling a request gets by default.
#[test]
fn props_say_what_the_server_was_started_with() {
    let file = sift::gguf::GgufFile::open(common::default_model()).unwrap();
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let server = Server::start(&["-c", "384", "--temp", "0.25", "--top-k", "7", "--repeat-last-n", "33", "-n", "99"]);
    let (status, props) = server.get("/props", &[]);
    assert_eq!(status, 200, "{props}");
    let props: Value = serde_json::from_str(&props).unwrap();
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["n_ctx"], 384, "{props}");
    let params = &settings["params"];
    assert_eq!((params["temperature"].as_f64(), params["top_k"].as_u64()), (Some(0.25), Some(7)), "{props}");
    assert_eq!((params["repeat_last_n"].as_u64(), params["n_predict"].as_u64()), (Some(33), Some(99)), "{props}");
    // The file has no template of its own: the one sift chats with is its built-in Gemma one.
    assert_eq!(tokenizer.chat_template(), None);
    let model = sift::model::Model::load(&file).unwrap();
    let template = sift::chat::ChatTemplate::for_model(&tokenizer, model.hp.arch, None).unwrap();
    assert_eq!(props["chat_template"], template.source());
    assert!(template.source().contains("<start_of_turn>"), "{}", template.source());
    let text = |id: Option<u32>| tokenizer.token_text(id.unwrap()).unwrap();
    assert_eq!(
        (props["bos_token"].as_str(), props["eos_token"].as_str()),
        (Some(text(tokenizer.bos())), Some(text(tokenizer.eos())))
    );
    assert_eq!(props["bos_token"], "<bos>");
    assert_eq!(props["model_alias"], "gemma-3-270m-Q4_K_M");
    assert_eq!(props["total_slots"], 1);
}

/// `/v1/messages` (Anthropic's API) replies as `/v1/chat/completions` does to the same turns,
/// whole and streamed, stops at a stop sequence and names it, takes the key as `x-api-key`, and
/// answers errors in Anthropic's shape.
#[test]
fn anthropic_messages_reply_as_chat_completions_do() {
    common::default_model();
    let server = Server::start(&["--api-key", "k"]);
    let post = |path: &str, body: &Value, headers: &[(&str, &str)]| {
        let (status, text, _) = server.post_raw(path, body.to_string().as_bytes(), headers);
        (status, serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    };
    let (system, user) = ("Answer in one short sentence.", "What is the capital of France?");
    let chat = json!({
        "messages": [{ "role": "system", "content": system }, { "role": "user", "content": user }],
        "temperature": 0, "max_tokens": 24,
    });
    let (status, chat) = post("/v1/chat/completions", &chat, &[("Authorization", "Bearer k")]);
    assert_eq!(status, 200, "{chat}");
    let want = content(&chat).to_string();
    assert!(!want.is_empty());
    let request = json!({
        "model": "claude-anything", "max_tokens": 24, "temperature": 0,
        "system": [{ "type": "text", "text": system }],
        "messages": [{ "role": "user", "content": [{ "type": "text", "text": user }] }],
    });
    let key = [("x-api-key", "k"), ("anthropic-version", "2023-06-01")];
    let (status, message) = post("/v1/messages", &request, &key);
    assert_eq!(status, 200, "{message}");
    assert_eq!((message["type"].as_str(), message["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(message["content"], json!([{ "type": "text", "text": want }]), "{message}");
    let stop = match chat["choices"][0]["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        Some("stop") => "end_turn",
        other => panic!("finish reason {other:?}"),
    };
    assert_eq!(message["stop_reason"], stop, "{message}");
    assert_eq!(message["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(message["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);

    // Streamed: the named events in Anthropic's order, their deltas the whole reply.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.named_events("/v1/messages", &streamed, &key);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    let deltas = names.iter().filter(|&&n| n == "content_block_delta").count();
    assert!(deltas > 0, "{names:?}");
    let mut order = vec!["message_start", "content_block_start"];
    order.extend(std::iter::repeat_n("content_block_delta", deltas));
    order.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, order);
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "{data}");
    }
    let text: String = events.iter().filter_map(|(_, data)| data["delta"]["text"].as_str()).collect();
    assert_eq!(text, want);
    let (_, end) = &events[events.len() - 2];
    assert_eq!(
        (end["delta"]["stop_reason"].as_str(), end["usage"]["output_tokens"].as_u64()),
        (Some(stop), chat["usage"]["completion_tokens"].as_u64())
    );

    // A stop sequence from within the reply ends it there, and is named.
    let word = want.split_whitespace().nth(2).expect("a reply of three words or more");
    let mut stopped = request.clone();
    stopped["stop_sequences"] = json!(["never in the reply", word]);
    let (status, message) = post("/v1/messages", &stopped, &key);
    assert_eq!(status, 200, "{message}");
    assert_eq!(
        (message["stop_reason"].as_str(), message["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some(word))
    );
    assert_eq!(message["content"][0]["text"].as_str(), Some(&want[..want.find(word).unwrap()]));

    // Errors, in Anthropic's shape.
    let error = |status: u16, body: &Value, kind: &str, needle: &str| {
        assert_eq!((body["type"].as_str(), body["error"]["type"].as_str()), (Some("error"), Some(kind)), "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(needle), "{status}: {body}");
    };
    let (status, body) = post("/v1/messages", &request, &[("x-api-key", "wrong")]);
    assert_eq!(status, 401);
    error(status, &body, "authentication_error", "API key");
    for (change, needle) in [
        (json!({ "max_tokens": null }), "not a valid request"),
        (json!({ "messages": [{ "role": "user", "content": [{ "type": "image", "source": {} }] }] }), "\"image\""),
        (json!({ "messages": [{ "role": "system", "content": "x" }] }), "\"system\""),
        (json!({ "tools": [{ "type": "web_search_20250305", "name": "web_search" }] }), "server tools"),
        (json!({ "tool_choice": { "type": "tool" } }), "name"),
        (json!({ "temperature": 1.5 }), "temperature"),
    ] {
        let mut bad = request.clone();
        for (field, value) in change.as_object().unwrap() {
            bad[field] = value.clone();
        }
        if bad["max_tokens"].is_null() {
            bad.as_object_mut().unwrap().remove("max_tokens");
        }
        let (status, body) = post("/v1/messages", &bad, &key);
        assert_eq!(status, 400, "{bad}: {body}");
        error(status, &body, "invalid_request_error", needle);
    }
}

/// A browser page served from this machine may call the API, a web site only when named by
/// `--cors-origin`; the key is asked of both.
#[test]
fn browser_pages_of_this_machine_may_call_the_api_and_other_sites_only_when_named() {
    common::default_model();
    let key = [("Authorization", "Bearer sesame")];
    let server = Server::start(&["--api-key", "sesame", "--cors-origin", "https://chat.example.com/"]);
    let allows = |headers: &[(String, String)], origin: &str| {
        headers.iter().any(|(name, value)| name == "access-control-allow-origin" && value == origin)
    };
    for origin in ["http://localhost:3000", "http://127.0.0.1:5173", "https://chat.example.com"] {
        for (path, method) in [("/v1/chat/completions", "POST"), ("/v1/responses/resp_1", "DELETE")] {
            let (status, headers) = server.preflight(path, origin, method);
            assert_eq!(status, 200, "preflight from {origin}: {headers:?}");
            assert!(allows(&headers, origin), "preflight from {origin}: {headers:?}");
            let value = |field: &str| {
                let header = headers.iter().find(|(name, _)| name == field);
                header.map(|(_, v)| v.to_ascii_lowercase()).unwrap_or_default()
            };
            let allowed = value("access-control-allow-headers");
            assert!(Server::CLIENT_HEADERS.split(',').all(|h| allowed.contains(h)), "{headers:?}");
            assert!(value("access-control-allow-methods").contains(&method.to_ascii_lowercase()), "{headers:?}");
        }
        let (status, headers) = server.get_from("/v1/models", origin, &key);
        assert_eq!(status, 200);
        assert!(allows(&headers, origin), "GET from {origin}: {headers:?}");
        assert_eq!(server.get_from("/v1/models", origin, &[]).0, 401, "the key is still needed");
    }
    for origin in ["https://example.com", "http://localhost.example.com"] {
        let (_, headers) = server.preflight("/v1/chat/completions", origin, "POST");
        assert!(headers.iter().all(|(name, _)| name != "access-control-allow-origin"), "{origin}: {headers:?}");
        let (_, headers) = server.get_from("/v1/models", origin, &key);
        assert!(headers.iter().all(|(name, _)| name != "access-control-allow-origin"), "{origin}: {headers:?}");
    }
}

/// `/v1/embeddings`: each text's vector is the library's embedding of its tokens (unit length,
/// the model's mean-pooled final-normed states), the same given as text or as tokens, as floats
/// or as base64; the conversation's cache is left as it was; bad inputs are 400s.
#[test]
fn embeddings_are_the_librarys_for_each_input() {
    use base64::Engine;
    use sift::embed::{embed, Pooling};
    let file = sift::gguf::GgufFile::open(common::default_model()).unwrap();
    let model = sift::model::Model::load(&file).unwrap();
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let server = Server::start(&["-c", "256"]);
    let texts = ["The cat sat on the mat.", "Stock markets fell sharply today."];

    let (status, first) =
        server.post("/v1/chat/completions", &greedy(json!([{"role": "user", "content": QUESTION}]), 4));
    assert_eq!(status, 200, "{first}");
    let (status, body) = server.post("/v1/embeddings", &json!({ "model": "any", "input": texts }));
    assert_eq!(status, 200, "{body}");
    let mut n_tokens = 0;
    for (i, text) in texts.iter().enumerate() {
        let ids = tokenizer.encode(text, true, false).unwrap();
        n_tokens += ids.len();
        let want = embed(&model, &ids, Pooling::Mean).unwrap();
        let got: Vec<f32> =
            body["data"][i]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        assert_eq!(got, want, "{text}");
        assert!((want.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5);
        assert_eq!(body["data"][i]["index"], i);

        let tokens = json!({ "input": ids, "encoding_format": "base64" });
        let (status, coded) = server.post("/v1/embeddings", &tokens);
        assert_eq!(status, 200, "{coded}");
        let bytes = base64::engine::general_purpose::STANDARD.decode(coded["data"][0]["embedding"].as_str().unwrap());
        let floats: Vec<f32> =
            bytes.unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(floats, want);
    }
    assert_eq!(body["usage"]["prompt_tokens"], n_tokens);
    assert_eq!(body["object"], "list");

    // The next turn still goes on from the conversation's cache.
    let reply = content(&first).to_string();
    let next = json!([
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}
    ]);
    let (status, body) = server.post("/v1/chat/completions", &greedy(next, 4));
    assert_eq!(status, 200, "{body}");
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 10, "{body}");

    for (input, needle) in [
        (json!({ "input": [] }), "at least one"),
        (json!({ "input": "x", "dimensions": 3 }), "have 640"),
        (json!({ "input": "x", "encoding_format": "hex" }), "\"hex\""),
        (json!({ "input": [[2, 999999999]] }), "token 999999999"),
        (json!({ "input": "word ".repeat(400) }), "context holds 256"),
        (json!({ "input": 7 }), "not a valid request"),
    ] {
        let (status, body) = server.post("/v1/embeddings", &input);
        assert_eq!(status, 400, "{input}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(needle), "{input}: {body}");
    }
}

#[test]
fn tokenize_and_detokenize_are_the_librarys() {
    let file = sift::gguf::GgufFile::open(common::default_model()).unwrap();
    let tokenizer = sift::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let server = Server::start(&["-c", "256"]);
    // A control token's text, and a character outside the vocabulary, which falls back to bytes.
    let text = "Hello world<start_of_turn> \u{10FFFD}!";
    let ids = |body: &Value| -> Vec<u32> {
        body["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };

    let (status, body) = server.post("/tokenize", &json!({ "content": text }));
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body), tokenizer.encode(text, false, true).unwrap());
    let request = json!({ "content": text, "add_special": true, "parse_special": false });
    let (status, body) = server.post("/tokenize", &request);
    assert_eq!(status, 200, "{body}");
    let plain = tokenizer.encode(text, true, false).unwrap();
    assert_eq!(ids(&body), plain);
    assert_ne!(plain, tokenizer.encode(text, false, true).unwrap());

    let (status, body) = server.post("/tokenize", &json!({ "content": text, "with_pieces": true }));
    assert_eq!(status, 200, "{body}");
    let pieces = body["tokens"].as_array().unwrap();
    let want = tokenizer.encode(text, false, true).unwrap();
    assert_eq!(pieces.len(), want.len());
    let mut bytes_pieces = 0;
    for (piece, &id) in pieces.iter().zip(&want) {
        assert_eq!(piece["id"], id);
        let bytes = tokenizer.token_bytes(id);
        match String::from_utf8(bytes.clone()) {
            Ok(text) => assert_eq!(piece["piece"], text, "token {id}"),
            Err(_) => {
                assert_eq!(piece["piece"], json!(bytes), "token {id}");
                bytes_pieces += 1;
            }
        }
    }
    assert!(bytes_pieces > 0, "the text has no token that is part of a character: {body}");

    let (status, body) = server.post("/detokenize", &json!({ "tokens": want }));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["content"], tokenizer.decode(&want));
    assert_eq!(body["content"], text);

    for (route, input, needle) in [
        ("/detokenize", json!({ "tokens": [2, 999999999] }), "token 999999999"),
        ("/detokenize", json!({ "tokens": "abc" }), "not a valid request"),
        ("/tokenize", json!({ "content": 5 }), "not a valid request"),
    ] {
        let (status, body) = server.post(route, &input);
        assert_eq!(status, 400, "{route} {input}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(needle), "{route} {input}: {body}");
    }
}

/// llama.cpp's `/completion` continues a prompt as `/v1/completions` does (greedy: the same text,
/// counts and stop, whole and as `data:` pieces then the account), names the stop string that
/// ended a reply, gives `n_probs` as `/v1/completions`' logprobs, and refuses what it cannot do.
#[test]
fn llama_cpp_completion_continues_as_v1_completions_does() {
    common::default_model();
    let server = Server::start(&[]);
    let prompt = "The capital of France is";
    let (status, want) =
        server.post("/v1/completions", &json!({ "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2 }));
    assert_eq!(status, 200, "{want}");
    let text = want["choices"][0]["text"].as_str().unwrap();
    let request = json!({ "prompt": prompt, "n_predict": 12, "temperature": 0, "n_probs": 2 });
    let (status, got) = server.post("/completion", &request);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["content"], text, "{got}");
    assert_eq!((got["stop"].as_bool(), got["stop_type"].as_str()), (Some(true), Some("limit")), "{got}");
    assert_eq!(got["tokens_predicted"], want["usage"]["completion_tokens"]);
    assert_eq!(got["tokens_evaluated"], want["usage"]["prompt_tokens"]);
    assert_eq!(got["timings"]["predicted_n"], want["usage"]["completion_tokens"]);
    let probabilities = got["completion_probabilities"].as_array().unwrap();
    let want_logprobs = want["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(
        probabilities.iter().map(|t| &t["logprob"]).collect::<Vec<_>>(),
        want_logprobs.iter().collect::<Vec<_>>()
    );
    assert!(probabilities.iter().all(|t| t["top_logprobs"].as_array().unwrap().len() == 2), "{got}");

    // Streamed: the pieces spell the text, and the last event is the account.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let mut events = server.stream("/completion", &streamed);
    let mut pieces = Vec::new();
    while let Some(data) = events.next_data() {
        pieces.push(serde_json::from_str::<Value>(&data).unwrap());
    }
    let (last, pieces) = pieces.split_last().unwrap();
    assert!(pieces.len() > 2 && pieces.iter().all(|p| p["stop"] == false), "{pieces:?}");
    assert_eq!(pieces.iter().map(|p| p["content"].as_str().unwrap()).collect::<String>(), text);
    assert_eq!((last["stop"].as_bool(), last["tokens_predicted"].as_u64()), (Some(true), Some(12)), "{last}");

    // A stop string from within the reply ends it before it, and is named.
    let word = text.split_whitespace().nth(2).expect("three words in twelve tokens");
    let (_, stopped) =
        server.post("/completion", &json!({ "prompt": prompt, "n_predict": 12, "temperature": 0, "stop": [word] }));
    assert_eq!(stopped["content"].as_str(), Some(&text[..text.find(word).unwrap()]), "{stopped}");
    assert_eq!((stopped["stop_type"].as_str(), stopped["stopping_word"].as_str()), (Some("word"), Some(word)));

    for (bad, says) in [
        (json!({ "prompt": [1, 2, 3] }), "prompts of token ids are not supported"),
        (json!({ "prompt": prompt, "grammar": "root ::= \"a\"" }), "GBNF grammars are not supported"),
        (json!({ "prompt": prompt, "n_predict": 0 }), "n_predict: at least 1"),
        (json!({ "prompt": prompt, "n_probs": 21 }), "between 0 and 20"),
    ] {
        let (status, error) = server.post("/completion", &bad);
        assert_eq!(status, 400, "{bad}: {error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(says), "{error}");
    }
}
