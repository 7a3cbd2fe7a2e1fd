//! `sift serve`'s Ollama routes through a real HTTP client: `/api/chat` and `/api/generate` reply
//! as `/v1/chat/completions` and `/v1/completions` do (greedy, the same text, stop reason and
//! counts, whole or as lines), tool calls as the OpenAI route's, embeddings as `/v1/embeddings`'
//! vectors, and the listings say what `sift inspect` and `/props` say of the model.

mod common;

use std::process::Command;

use common::server::{spelled, Server};
use serde_json::{json, Value};

const SYSTEM: &str = "Answer in one short sentence.";
const QUESTION: &str = "What is the capital of France?";

/// POSTs `body`: the status, and the body's JSON objects, one a line (one for a whole reply).
fn lines(server: &Server, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Vec<Value>) {
    let (status, text, _) = server.post_raw(path, body.to_string().as_bytes(), headers);
    let lines = text.lines().map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")));
    (status, lines.collect())
}

/// The one object of a whole reply.
fn whole(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (status, mut objects) = lines(server, path, body, &[]);
    assert_eq!(objects.len(), 1, "{objects:?}");
    (status, objects.remove(0))
}

/// A streamed reply's lines: every one but the last not done, their pieces the whole text; the
/// text and the last line.
fn streamed(objects: &[Value], piece: &str) -> (String, Value) {
    let (last, pieces) = objects.split_last().expect("a line at least");
    assert!(pieces.iter().all(|line| line["done"] == false), "{objects:?}");
    assert_eq!(last["done"], true, "{last}");
    (pieces.iter().map(|line| line.pointer(piece).and_then(Value::as_str).unwrap()).collect(), last.clone())
}

/// OpenAI's finish reason as Ollama's `done_reason`: the same words.
fn done_reason(choice: &Value) -> &str {
    choice["finish_reason"].as_str().unwrap()
}

#[test]
fn chat_and_generate_reply_as_the_openai_routes_do() {
    common::default_model();
    let server = Server::start(&["--api-key", "k"]);
    let key = [("Authorization", "Bearer k")];
    let messages = json!([{ "role": "system", "content": SYSTEM }, { "role": "user", "content": QUESTION }]);
    let (status, text, _) = server.post_raw(
        "/v1/chat/completions",
        json!({ "messages": messages, "temperature": 0, "max_tokens": 24 }).to_string().as_bytes(),
        &key,
    );
    assert_eq!(status, 200, "{text}");
    let chat: Value = serde_json::from_str(&text).unwrap();
    let (want, choice) = (chat["choices"][0]["message"]["content"].as_str().unwrap(), &chat["choices"][0]);
    assert!(!want.is_empty());
    let options = json!({ "temperature": 0, "num_predict": 24 });

    // Whole, then as lines (the default).
    let request = json!({ "model": "gemma3:270m", "messages": messages, "options": options, "stream": false });
    let (status, reply) = lines(&server, "/api/chat", &request, &key);
    assert_eq!(status, 200, "{reply:?}");
    let reply = &reply[0];
    assert_eq!(reply["message"], json!({ "role": "assistant", "content": want }), "{reply}");
    assert_eq!((reply["done"].as_bool(), reply["done_reason"].as_str()), (Some(true), Some(done_reason(choice))));
    assert_eq!(reply["model"], "gemma3:270m", "the model asked for is echoed");
    assert_eq!(reply["prompt_eval_count"], chat["usage"]["prompt_tokens"]);
    assert_eq!(reply["eval_count"], chat["usage"]["completion_tokens"]);
    for duration in ["total_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(reply[duration].as_u64().unwrap() > 0, "{duration}: {reply}");
    }
    let mut request = request;
    request.as_object_mut().unwrap().remove("stream");
    let (status, objects) = lines(&server, "/api/chat", &request, &key);
    assert_eq!(status, 200);
    assert!(objects.len() > 2, "a line per piece: {objects:?}");
    let (text, last) = streamed(&objects, "/message/content");
    assert_eq!(text, want);
    assert_eq!(last["done_reason"], done_reason(choice));
    assert_eq!(last["eval_count"], chat["usage"]["completion_tokens"]);

    // /api/generate: the prompt as one user turn after the system prompt, the same reply.
    let generate = json!({ "prompt": QUESTION, "system": SYSTEM, "options": options, "stream": false });
    let (status, reply) = lines(&server, "/api/generate", &generate, &key);
    assert_eq!(status, 200, "{reply:?}");
    assert_eq!(reply[0]["response"], want, "{reply:?}");
    // Raw: the prompt as it is, as /v1/completions takes it.
    let raw = "The capital of France is";
    let (status, text, _) = server.post_raw(
        "/v1/completions",
        json!({ "prompt": raw, "temperature": 0, "max_tokens": 12 }).to_string().as_bytes(),
        &key,
    );
    assert_eq!(status, 200, "{text}");
    let completion: Value = serde_json::from_str(&text).unwrap();
    let raw_request = json!({ "prompt": raw, "raw": true, "options": { "temperature": 0, "num_predict": 12 } });
    let (status, objects) = lines(&server, "/api/generate", &raw_request, &key);
    assert_eq!(status, 200);
    let (text, last) = streamed(&objects, "/response");
    assert_eq!(text, completion["choices"][0]["text"].as_str().unwrap());
    assert_eq!(last["done_reason"], done_reason(&completion["choices"][0]));

    // A stop string from within the reply ends it before it.
    let word = want.split_whitespace().nth(2).expect("a reply of three words or more");
    let stopped = json!({ "messages": messages, "options": { "temperature": 0, "num_predict": 24, "stop": [word] }, "stream": false });
    let (_, reply) = lines(&server, "/api/chat", &stopped, &key);
    assert_eq!(reply[0]["message"]["content"].as_str(), Some(&want[..want.find(word).unwrap()]));
    assert_eq!(reply[0]["done_reason"], "stop");

    // `format` holds the reply to JSON, as `response_format` does.
    let (_, text, _) = server.post_raw(
        "/v1/chat/completions",
        json!({ "messages": messages, "temperature": 0, "max_tokens": 40, "response_format": { "type": "json_object" } })
            .to_string()
            .as_bytes(),
        &key,
    );
    let json_chat: Value = serde_json::from_str(&text).unwrap();
    let formatted = json!({ "messages": messages, "format": "json", "options": { "temperature": 0, "num_predict": 40 }, "stream": false });
    let (_, reply) = lines(&server, "/api/chat", &formatted, &key);
    assert_eq!(reply[0]["message"]["content"], json_chat["choices"][0]["message"]["content"], "{reply:?}");

    // No messages, or no prompt: the model is loaded.
    for (path, body) in
        [("/api/chat", json!({ "model": "m" })), ("/api/generate", json!({ "model": "m", "prompt": "" }))]
    {
        let (status, reply) = lines(&server, path, &body, &key);
        assert_eq!(status, 200);
        assert_eq!((reply[0]["done"].as_bool(), reply[0]["done_reason"].as_str()), (Some(true), Some("load")));
    }

    // Errors, in Ollama's shape.
    let (status, reply) = lines(&server, "/api/chat", &request, &[("Authorization", "Bearer wrong")]);
    assert_eq!(status, 401);
    assert!(reply[0]["error"].as_str().unwrap().contains("API key"), "{reply:?}");
    let user = json!([{ "role": "user", "content": "hi" }]);
    for (path, body, needle) in [
        ("/api/chat", json!({ "messages": user, "think": true }), "think"),
        ("/api/chat", json!({ "messages": [{ "role": "user", "content": "hi", "images": ["AAAA"] }] }), "images"),
        ("/api/chat", json!({ "messages": [{ "role": "robot", "content": "hi" }] }), "\"robot\""),
        ("/api/chat", json!({ "messages": user, "options": { "num_predict": 0 } }), "num_predict"),
        ("/api/chat", json!({ "messages": user, "format": 3 }), "format"),
        ("/api/chat", json!({ "messages": user, "options": { "temperature": 9 } }), "temperature"),
        ("/api/generate", json!({ "prompt": "hi", "template": "{{ .Prompt }}" }), "template"),
        ("/api/generate", json!({ "prompt": "hi", "context": [1, 2, 3] }), "context"),
        ("/api/generate", json!({ "prompt": "hi", "suffix": "end" }), "suffix"),
        ("/api/generate", json!({ "prompt": 5 }), "not a valid request"),
    ] {
        let (status, reply) = lines(&server, path, &body, &key);
        assert_eq!(status, 400, "{body}: {reply:?}");
        assert!(reply[0]["error"].as_str().unwrap().contains(needle), "{body}: {reply:?}");
    }
}

#[test]
fn tool_calls_are_the_openai_routes_calls() {
    common::default_model();
    let server = Server::start(&["--temp", "0"]);
    let weather = json!({ "type": "object", "properties": { "city": { "enum": ["Oslo", "Rome"] } }, "required": ["city"], "additionalProperties": false });
    let tools = json!([{ "type": "function", "function": { "name": "weather", "description": "Today's weather in a city", "parameters": weather } }]);
    // One exchange before the question, on each route's terms, shows the model a call.
    let openai_history = json!([
        { "role": "user", "content": "What is the weather in Rome?" },
        { "role": "assistant", "content": null, "tool_calls": [{ "id": "c0", "type": "function", "function": { "name": "weather", "arguments": "{\"city\":\"Rome\"}" } }] },
        { "role": "tool", "tool_call_id": "c0", "content": "Rain, 12 degrees." },
        { "role": "assistant", "content": "It rains in Rome: 12 degrees." },
    ]);
    let history = json!([
        { "role": "user", "content": "What is the weather in Rome?" },
        { "role": "assistant", "content": "", "tool_calls": [{ "function": { "name": "weather", "arguments": { "city": "Rome" } } }] },
        { "role": "tool", "tool_name": "weather", "content": "Rain, 12 degrees." },
        { "role": "assistant", "content": "It rains in Rome: 12 degrees." },
    ]);
    let question = json!({ "role": "user", "content": "What is the weather in Oslo?" });
    let with = |history: &Value, more: &[Value]| {
        let mut messages = history.as_array().unwrap().clone();
        messages.extend_from_slice(more);
        Value::Array(messages)
    };

    // With tools and no tool_choice, the model may call or answer: here it calls, on both routes.
    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({ "messages": with(&openai_history, std::slice::from_ref(&question)), "max_tokens": 60, "tools": tools }),
    );
    assert_eq!(status, 200, "{chat}");
    let choice = &chat["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{chat}");
    let request = json!({ "messages": with(&history, std::slice::from_ref(&question)), "tools": tools, "options": { "num_predict": 60 } });
    let mut whole_request = request.clone();
    whole_request["stream"] = json!(false);
    let (status, reply) = whole(&server, "/api/chat", &whole_request);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["prompt_eval_count"], chat["usage"]["prompt_tokens"], "the same prompt on both routes");
    let call = &choice["message"]["tool_calls"][0]["function"];
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    let want = json!([{ "function": { "name": call["name"], "arguments": arguments } }]);
    assert_eq!(reply["message"]["tool_calls"], want, "{reply}");
    assert_eq!((reply["message"]["content"].as_str(), reply["done_reason"].as_str()), (Some(""), Some("stop")));
    // Streamed, the call comes whole on one line, then the last line.
    let (status, objects) = lines(&server, "/api/chat", &request, &[]);
    assert_eq!(status, 200);
    assert_eq!(objects.len(), 2, "{objects:?}");
    assert_eq!(objects[0]["message"]["tool_calls"], want);
    assert_eq!(objects[1]["done"], true);

    // The tool's result, then the model's reply: the same history on both routes.
    let arguments = json!({ "city": "Oslo" });
    let result = "Sunny, 21 degrees.";
    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({
            "max_tokens": 40, "tools": tools,
            "messages": with(&openai_history, &[
                question.clone(),
                json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "weather", "arguments": arguments.to_string() } }] }),
                json!({ "role": "tool", "tool_call_id": "c1", "content": result }),
            ]),
        }),
    );
    assert_eq!(status, 200, "{chat}");
    let (status, reply) = whole(
        &server,
        "/api/chat",
        &json!({
            "stream": false, "tools": tools, "options": { "num_predict": 40 },
            "messages": with(&history, &[
                question,
                json!({ "role": "assistant", "content": "", "tool_calls": [{ "function": { "name": "weather", "arguments": arguments } }] }),
                json!({ "role": "tool", "tool_name": "weather", "content": result }),
            ]),
        }),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["prompt_eval_count"], chat["usage"]["prompt_tokens"], "the same prompt on both routes");
    let choice = &chat["choices"][0];
    match choice["finish_reason"] == "tool_calls" {
        true => assert_eq!(reply["message"]["tool_calls"][0]["function"]["name"], "weather", "{reply}"),
        false => assert_eq!(reply["message"]["content"], choice["message"]["content"], "{reply}"),
    }
}

/// The listings say what `sift inspect --json` and `/props` say; embeddings are
/// `/v1/embeddings`' vectors.
#[test]
fn listings_describe_the_model_and_embeddings_are_the_openai_routes() {
    let model = common::default_model();
    let o = Command::new(env!("CARGO_BIN_EXE_sift")).args(["inspect", "--json", "-m"]).arg(&model).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let inspect: Value = serde_json::from_slice(&o.stdout).unwrap();
    let server = Server::start(&["-c", "512"]);
    let (_, props) = server.get("/props", &[]);
    let props: Value = serde_json::from_str(&props).unwrap();

    let (status, tags) = server.get("/api/tags", &[]);
    assert_eq!(status, 200, "{tags}");
    let tags: Value = serde_json::from_str(&tags).unwrap();
    let listed = &tags["models"][0];
    let name = format!("{}:latest", model.file_stem().unwrap().to_str().unwrap());
    assert_eq!((listed["name"].as_str(), listed["model"].as_str()), (Some(&*name), Some(&*name)));
    assert_eq!(listed["size"], inspect["file_bytes"]);
    let arch = inspect["architecture"].as_str().unwrap();
    assert_eq!(listed["details"]["family"], arch);
    assert_eq!(listed["details"]["format"], "gguf");
    // The default model's file is a Q4_K_M of 268 million parameters.
    assert_eq!(listed["details"]["quantization_level"], "Q4_K_M");
    let millions = inspect["parameters"].as_f64().unwrap() / 1e6;
    assert_eq!(listed["details"]["parameter_size"], format!("{millions:.2}M"));

    let (status, text, _) = server.post_raw("/api/show", json!({ "model": name }).to_string().as_bytes(), &[]);
    assert_eq!(status, 200, "{text}");
    let show: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(show["template"], props["chat_template"]);
    assert_eq!(show["details"], listed["details"]);
    let info = &show["model_info"];
    assert_eq!(info["general.architecture"], arch);
    assert_eq!(info["general.parameter_count"], inspect["parameters"]);
    for (key, field) in [("context_length", "n_ctx_train"), ("embedding_length", "n_embd"), ("block_count", "n_layer")]
    {
        assert_eq!(info[format!("{arch}.{key}")], inspect["hparams"][field], "{key}");
    }
    let (status, text, _) = server.post_raw("/api/show", json!({ "model": "llama3:8b" }).to_string().as_bytes(), &[]);
    assert_eq!(status, 404, "{text}");
    assert!(serde_json::from_str::<Value>(&text).unwrap()["error"].as_str().unwrap().contains("llama3:8b"));

    let (_, running) = server.get("/api/ps", &[]);
    let running: Value = serde_json::from_str(&running).unwrap();
    assert_eq!(running["models"][0]["context_length"], props["default_generation_settings"]["n_ctx"]);
    assert_eq!(running["models"][0]["name"], name);
    // The routes that manage models say why they do not; unknown ones are a 404, both in Ollama's shape.
    for (path, status, needle) in [("/api/pull", 501, "serves the one model"), ("/api/nothing", 404, "/api/nothing")] {
        let (got, text, _) = server.post_raw(path, json!({ "model": "llama3:8b" }).to_string().as_bytes(), &[]);
        assert_eq!(got, status, "{path}: {text}");
        assert!(serde_json::from_str::<Value>(&text).unwrap()["error"].as_str().unwrap().contains(needle), "{text}");
    }
    let (_, version) = server.get("/api/version", &[]);
    assert_eq!(serde_json::from_str::<Value>(&version).unwrap()["version"], env!("CARGO_PKG_VERSION"));

    let texts = ["The cat sat on the mat.", "Stock markets fell sharply today."];
    let (status, openai) = server.post("/v1/embeddings", &json!({ "input": texts }));
    assert_eq!(status, 200, "{openai}");
    let (status, embedded) = server.post("/api/embed", &json!({ "model": name, "input": texts }));
    assert_eq!(status, 200, "{embedded}");
    for (i, vector) in embedded["embeddings"].as_array().unwrap().iter().enumerate() {
        assert_eq!(*vector, openai["data"][i]["embedding"], "{}", texts[i]);
    }
    assert_eq!(embedded["prompt_eval_count"], openai["usage"]["prompt_tokens"]);
    let (status, one) = server.post("/api/embeddings", &json!({ "model": name, "prompt": texts[1] }));
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["embedding"], openai["data"][1]["embedding"]);
    let (status, bad) = server.post("/api/embed", &json!({ "input": [] }));
    assert_eq!(status, 400);
    assert!(bad["error"].as_str().unwrap().contains("at least one"), "{bad}");
}

/// `logprobs` with `top_logprobs` gives each token's log-probability and alternatives: those of
/// `/v1/chat/completions` for the same conversation, whole and spread over the lines (each
/// line's tokens spelling its text); without `logprobs` there is no such field; more than 20
/// alternatives is a 400 in Ollama's shape.
#[test]
fn logprobs_are_the_openai_routes_logprobs() {
    common::default_model();
    let server = Server::start(&[]);
    let messages = json!([{ "role": "system", "content": SYSTEM }, { "role": "user", "content": QUESTION }]);
    let want = server.chat_logprobs(&messages, 12, 3);

    let options = json!({ "temperature": 0, "num_predict": 12 });
    let mut request =
        json!({ "messages": messages, "options": options, "stream": false, "logprobs": true, "top_logprobs": 3 });
    let (status, reply) = whole(&server, "/api/chat", &request);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["logprobs"].as_array().unwrap(), &want, "{reply}");

    request["stream"] = json!(true);
    let (status, objects) = lines(&server, "/api/chat", &request, &[]);
    assert_eq!(status, 200);
    let mut streamed = Vec::new();
    for line in &objects {
        let tokens = line["logprobs"].as_array().unwrap_or_else(|| panic!("{line}"));
        assert_eq!(spelled(tokens), line["message"]["content"].as_str().unwrap(), "{line}");
        streamed.extend(tokens.iter().cloned());
    }
    assert_eq!(streamed, want);

    let generate = json!({ "prompt": QUESTION, "system": SYSTEM, "options": options, "stream": false, "logprobs": true, "top_logprobs": 3 });
    let (_, reply) = whole(&server, "/api/generate", &generate);
    assert_eq!(reply["logprobs"].as_array().unwrap(), &want, "{reply}");

    request["stream"] = json!(false);
    request["logprobs"] = json!(false);
    let (_, reply) = whole(&server, "/api/chat", &request);
    assert!(reply.get("logprobs").is_none(), "{reply}");
    request["logprobs"] = json!(true);
    request["top_logprobs"] = json!(21);
    let (status, error) = whole(&server, "/api/chat", &request);
    assert_eq!((status, error["error"].as_str()), (400, Some("top_logprobs must be between 0 and 20")));
}
