//! The official Python clients talking to `sift serve`.
//!
//! `openai`, whole and streamed: both give the
//! greedy reply of `sift run --chat`, and a reply held to a JSON Schema through `response_format`
//! (or the client's `parse` with a Pydantic model) gives `sift run --chat --json-schema`'s; a
//! required tool call, whole and streamed, calls the tool with arguments valid under its schema;
//! an embedding comes back the same through the client's default base64 as in floats. Its
//! Responses API, through `/v1/responses`: a reply whole and as raw events, one held to a schema
//! through the client's stream helper, and a required call, as `/v1/chat/completions` gives them.
//!
//! `anthropic`, through `/v1/messages`, whole and streamed: the reply `/v1/chat/completions` gives
//! to the same system prompt and message.
//!
//! `ollama`, through `/api/*`: the model listed and shown as `/props` says, a chat whole and
//! streamed and a generation giving `/v1/chat/completions`' reply, an embedding `/v1/embeddings`'.
//!
//! The interpreter is `$SIFT_TEST_PYTHON` (`.ci/run` makes a virtual environment with the three
//! packages in it), else `python3`; without a package its test says it is skipped, except under
//! CI, where it fails.

mod common;

use std::process::Command;

use common::server::Server;
use serde_json::Value;

/// The interpreter with `package`, or None (outside CI) where it lacks it.
fn python_with(package: &str) -> Option<String> {
    let python = std::env::var("SIFT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let import = format!("import {package}");
    if Command::new(&python).args(["-c", &import]).output().is_ok_and(|o| o.status.success()) {
        return Some(python);
    }
    assert!(std::env::var_os("CI").is_none(), "{python} cannot import {package}; .ci/run installs it");
    eprintln!("SKIPPED the {package} client test: {python} cannot import {package} (pip install {package})");
    None
}

#[test]
fn the_openai_python_client_gets_the_greedy_reply_whole_and_streamed() {
    let Some(python) = python_with("openai") else { return };
    let model = common::default_model();
    let message = "Name three colours.";
    let schema = r#"{"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string",
        "maxLength": 10}, "maxItems": 3}}, "required": ["colours"], "additionalProperties": false}"#;
    let run = |n: &str, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_sift"))
            .args(["run", "--quiet", "--chat", "--temp", "0", "--json", "-n", n, "-p", message, "-m"])
            .arg(&model)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()
    };
    let reference = run("20", &[]);
    let structured = run("60", &["--json-schema", schema]);
    assert_eq!(structured["stop"], "end_of_generation", "{structured}");
    let colours: Value = serde_json::from_str(structured["text"].as_str().unwrap()).unwrap();
    assert!(colours["colours"].is_array(), "{structured}");

    let server = Server::start(&["--api-key", "sesame"]);
    let script = common::repo_root().join("tests/serve_openai.py");
    let o = Command::new(&python).arg(script).args([&server.base, message, "20", schema]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got["models"][0], "gemma-3-270m-Q4_K_M");
    assert_eq!(got["retrieved"], "gemma-3-270m-Q4_K_M");
    assert_eq!(got["whole"], reference["text"]);
    assert_eq!(got["streamed"], reference["text"]);
    assert!(got["streamed_chunks"].as_u64().unwrap() > 2, "{got}");
    assert_eq!(got["completion_tokens"], reference["tokens"]);
    assert_eq!(got["structured"], structured["text"]);
    // Pydantic's schema for the same shape (titles aside) gives the same greedy reply, parsed.
    assert_eq!(got["parsed"], colours["colours"], "{got}");
    assert_eq!(got["call_finish"], "tool_calls", "{got}");
    assert_eq!(got["call"]["name"], "pick_colours", "{got}");
    assert_eq!(got["streamed_call"], got["call"], "{got}");
    let arguments: Value = serde_json::from_str(got["call"]["arguments"].as_str().unwrap()).unwrap();
    let picked = arguments["colours"].as_array().unwrap_or_else(|| panic!("{got}"));
    assert!(picked.len() <= 3 && picked.iter().all(|c| c.as_str().is_some_and(|c| c.len() <= 10)), "{got}");
    // The same f32s, written longer by Python's decoding of base64.
    let as_f32 = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<f32>>();
    let embedding = as_f32(&got["embedding"]);
    assert_eq!(embedding.len(), 640);
    assert!(embedding == as_f32(&got["embedding_floats"]), "base64 and floats differ");
    let norm: f32 = embedding.iter().map(|x| x * x).sum();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    let finish = if reference["stop"] == "token_limit" { "length" } else { "stop" };
    assert_eq!((got["whole_finish"].as_str(), got["streamed_finish"].as_str()), (Some(finish), Some(finish)));
}

#[test]
fn the_anthropic_python_client_gets_chat_completions_reply_whole_and_streamed() {
    let Some(python) = python_with("anthropic") else { return };
    common::default_model();
    let (system, message, max_tokens) = ("Answer in one short sentence.", "Name a large animal.", 20);
    // Greedy by default, as the client sends no temperature.
    let server = Server::start(&["--api-key", "sesame", "--temp", "0"]);
    let chat = serde_json::json!({
        "messages": [{ "role": "system", "content": system }, { "role": "user", "content": message }],
        "max_tokens": max_tokens,
    });
    let (status, text, _) =
        server.post_raw("/v1/chat/completions", chat.to_string().as_bytes(), &[("Authorization", "Bearer sesame")]);
    assert_eq!(status, 200, "{text}");
    let chat: Value = serde_json::from_str(&text).unwrap();
    let want = &chat["choices"][0]["message"]["content"];
    let stop = if chat["choices"][0]["finish_reason"] == "length" { "max_tokens" } else { "end_turn" };

    let script = common::repo_root().join("tests/serve_anthropic.py");
    let o = Command::new(&python)
        .arg(script)
        .args([&server.base, system, message, &max_tokens.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((&got["whole"], &got["streamed"], &got["final"]), (want, want, want), "{got}");
    assert!(got["streamed_pieces"].as_u64().unwrap() > 2, "{got}");
    assert_eq!((got["whole_stop"].as_str(), got["final_stop"].as_str()), (Some(stop), Some(stop)), "{got}");
    assert_eq!(got["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(got["output_tokens"], chat["usage"]["completion_tokens"]);
    assert_eq!(got["final_output_tokens"], chat["usage"]["completion_tokens"]);
}

#[test]
fn the_ollama_python_client_gets_chat_completions_reply_whole_and_streamed() {
    let Some(python) = python_with("ollama") else { return };
    let model = common::default_model();
    let (system, message, num_predict) = ("Answer in one short sentence.", "Name a large animal.", 20);
    let server = Server::start(&["--api-key", "sesame"]);
    let key = [("Authorization", "Bearer sesame")];
    let post = |path: &str, body: Value| {
        let (status, text, _) = server.post_raw(path, body.to_string().as_bytes(), &key);
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let chat = post(
        "/v1/chat/completions",
        serde_json::json!({
            "messages": [{ "role": "system", "content": system }, { "role": "user", "content": message }],
            "max_tokens": num_predict, "temperature": 0, "logprobs": true, "top_logprobs": 2,
        }),
    );
    let want = &chat["choices"][0]["message"]["content"];
    let want_logprobs: Vec<Value> = (chat["choices"][0]["logprobs"]["content"].as_array().unwrap().iter())
        .map(|t| {
            let alternatives: Vec<&Value> = t["top_logprobs"].as_array().unwrap().iter().map(|a| &a["token"]).collect();
            serde_json::json!([t["token"], t["logprob"], alternatives])
        })
        .collect();
    let embedding = post("/v1/embeddings", serde_json::json!({ "input": message }));
    let (_, props) = server.get("/props", &key);
    let props: Value = serde_json::from_str(&props).unwrap();

    let script = common::repo_root().join("tests/serve_ollama.py");
    let o = Command::new(&python)
        .arg(script)
        .args([&server.base, system, message, &num_predict.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got["model"], "gemma-3-270m-Q4_K_M:latest");
    assert_eq!(got["quantization"], "Q4_K_M");
    assert_eq!(got["size"], std::fs::metadata(&model).unwrap().len());
    assert_eq!(got["template"], props["chat_template"]);
    assert_eq!((&got["whole"], &got["streamed"], &got["generated"]), (want, want, want), "{got}");
    assert!(got["streamed_pieces"].as_u64().unwrap() > 2, "{got}");
    assert_eq!(got["whole_done"], chat["choices"][0]["finish_reason"]);
    assert_eq!(got["prompt_eval_count"], chat["usage"]["prompt_tokens"]);
    assert_eq!(got["eval_count"], chat["usage"]["completion_tokens"]);
    // Tokens, log-probabilities (the same f32s) and alternatives.
    let logprobs = got["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), want_logprobs.len(), "{got}");
    for (got, want) in logprobs.iter().zip(&want_logprobs) {
        assert_eq!((&got[0], &got[2]), (&want[0], &want[2]), "{got} against {want}");
        assert_eq!(got[1].as_f64().unwrap() as f32, want[1].as_f64().unwrap() as f32, "{got} against {want}");
    }
    // The same f32s, written longer by Python.
    let as_f32 = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<f32>>();
    assert!(as_f32(&got["embedding"]) == as_f32(&embedding["data"][0]["embedding"]), "the embeddings differ");
}

#[test]
fn the_openai_python_clients_responses_are_chat_completions_replies() {
    let Some(python) = python_with("openai") else { return };
    common::default_model();
    let (system, message, limit) = ("Answer in one short sentence.", "Name three colours.", 20);
    let schema = r#"{"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string",
        "maxLength": 10}, "maxItems": 3}}, "required": ["colours"], "additionalProperties": false}"#;
    let server = Server::start(&["--api-key", "sesame"]);
    let key = [("Authorization", "Bearer sesame")];
    let chat = |body: Value| {
        let (status, text, _) = server.post_raw("/v1/chat/completions", body.to_string().as_bytes(), &key);
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let user = serde_json::json!({ "role": "user", "content": message });
    let plain = chat(serde_json::json!({
        "messages": [{ "role": "system", "content": system }, user], "max_tokens": limit, "temperature": 0,
    }));
    let schema_value: Value = serde_json::from_str(schema).unwrap();
    let structured = chat(serde_json::json!({
        "messages": [user], "max_tokens": 60, "temperature": 0,
        "response_format": { "type": "json_schema", "json_schema": { "name": "colours", "schema": schema_value } },
    }));
    let called = chat(serde_json::json!({
        "messages": [user], "max_tokens": 60, "temperature": 0, "parallel_tool_calls": false,
        "tools": [{ "type": "function", "function": { "name": "pick_colours", "description": "Pick colours", "parameters": schema_value } }],
        "tool_choice": { "type": "function", "function": { "name": "pick_colours" } },
    }));

    let script = common::repo_root().join("tests/serve_openai_responses.py");
    let o = Command::new(&python)
        .arg(script)
        .args([&server.base, system, message, &limit.to_string(), schema])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = &plain["choices"][0]["message"]["content"];
    assert_eq!((&got["whole"], &got["streamed"], &got["last_text"]), (want, want, want), "{got}");
    let (status, last) = match plain["choices"][0]["finish_reason"].as_str() {
        Some("length") => ("incomplete", "response.incomplete"),
        _ => ("completed", "response.completed"),
    };
    assert_eq!((got["whole_status"].as_str(), got["last_event"].as_str()), (Some(status), Some(last)), "{got}");
    assert_eq!(got["input_tokens"], plain["usage"]["prompt_tokens"]);
    assert_eq!(got["output_tokens"], plain["usage"]["completion_tokens"]);
    let want = &structured["choices"][0]["message"]["content"];
    assert_eq!((&got["structured"], &got["structured_pieces"]), (want, want), "{got}");
    assert_eq!(got["structured_status"], "completed", "{got}");
    let call = &called["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(
        got["call"],
        serde_json::json!({ "type": "function_call", "name": "pick_colours", "arguments": call["arguments"] })
    );
}
