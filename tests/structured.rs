//! Structured output: the grammar's mask against a regular language checked byte by byte over
//! the whole vocabulary, replies held to JSON Schemas under wild sampling and checked by a
//! validator written here, and the flags and request fields that ask for them.

mod common;

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::Output;
use std::sync::OnceLock;

use common::assert_fails;
use common::server::{streamed_text, Server};
use serde_json::{json, Value};
use sift::conversation::Conversation;
use sift::generate::{Limits, StopReason};
use sift::gguf::GgufFile;
use sift::kv::Storage;
use sift::model::Model;
use sift::sample::SamplingParams;
use sift::structured::{Format, GrammarCompiler};
use sift::tokenizer::Tokenizer;

fn compiler() -> &'static GrammarCompiler {
    static COMPILER: OnceLock<GrammarCompiler> = OnceLock::new();
    COMPILER.get_or_init(|| GrammarCompiler::new(common::gemma3_tokenizer()).unwrap())
}

/// The tokens `state` allows next, from a mask over zero logits.
fn allowed(state: &mut sift::structured::GrammarState, n_vocab: usize) -> Vec<u32> {
    let mut logits = vec![0.0; n_vocab + 3];
    state.mask(&mut logits).unwrap();
    assert!(logits[n_vocab..].iter().all(|l| *l == f32::NEG_INFINITY), "ids past the vocabulary are never allowed");
    (0..n_vocab as u32).filter(|&id| logits[id as usize] == 0.0).collect()
}

/// Whether `text` can begin a string of `[a-z]+ [a-z]+`, i.e. is a prefix of one.
fn begins_two_words(text: &[u8]) -> bool {
    let first = text.iter().take_while(|b| b.is_ascii_lowercase()).count();
    match &text[first..] {
        [] => true,
        [b' ', rest @ ..] => first > 0 && rest.iter().all(u8::is_ascii_lowercase),
        _ => false,
    }
}

/// At every step the mask allows exactly the tokens whose bytes keep the text a prefix of the
/// language (checked here over all 262,144 tokens of the default model's vocabulary, with
/// SentencePiece's spaces), and end-of-generation tokens exactly where the text is complete.
#[test]
fn the_mask_allows_exactly_the_tokens_that_keep_the_text_in_the_language() {
    let tokenizer = common::gemma3_tokenizer();
    let n_vocab = tokenizer.vocab_size();
    let grammar = compiler().compile(&Format::Lark("start: /[a-z]+ [a-z]+/".into())).unwrap();
    let mut state = grammar.start();
    let mut text = Vec::new();
    let eog: Vec<u32> = (0..n_vocab as u32).filter(|&id| tokenizer.is_eog(id)).collect();
    // Steps towards "hello world": the mask is checked before each token.
    let steps = tokenizer.encode("hello world", false, false).unwrap();
    assert!(steps.len() >= 2, "{steps:?}");
    for (i, &next) in steps.iter().chain([&u32::MAX]).enumerate() {
        let got = allowed(&mut state, n_vocab);
        let complete = text.contains(&b' ') && !text.ends_with(b" ");
        let want: Vec<u32> = (0..n_vocab as u32)
            .filter(|&id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_eog(id) {
                    complete
                } else if tokenizer.is_control(id) || bytes.is_empty() {
                    false
                } else {
                    begins_two_words(&[&text[..], &bytes].concat())
                }
            })
            .collect();
        assert_eq!(got.len(), want.len(), "step {i} after {:?}", String::from_utf8_lossy(&text));
        assert_eq!(got, want, "step {i}");
        if next == u32::MAX {
            assert!(eog.iter().all(|id| got.contains(id)), "the complete text may end");
            break;
        }
        assert!(got.contains(&next));
        state.accept(next).unwrap();
        text.extend(tokenizer.token_bytes(next));
    }
    assert_eq!(text, b"hello world");
}

/// A reply's JSON checked against the test's schema by hand: the validator the grammar must
/// agree with.
fn check_person(reply: &str) -> Result<(), String> {
    let value: Value = serde_json::from_str(reply).map_err(|e| format!("not JSON: {e}: {reply:?}"))?;
    let object = value.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if !matches!(keys[..], ["age", "name", "pets", "role"] | ["age", "name", "role"]) {
        return Err(format!("keys {keys:?}"));
    }
    let name = object["name"].as_str().ok_or("name is not a string")?;
    if name.chars().count() > 12 {
        return Err(format!("name {name:?} is longer than 12"));
    }
    object["age"].as_i64().filter(|a| (0..=120).contains(a)).ok_or("age is not an integer in 0..=120")?;
    if !matches!(object["role"].as_str(), Some("admin" | "user" | "guest")) {
        return Err(format!("role {:?}", object["role"]));
    }
    if let Some(pets) = object.get("pets") {
        let pets = pets.as_array().ok_or("pets is not an array")?;
        if pets.len() > 3 || pets.iter().any(|p| p.as_str().is_none_or(|p| p.chars().count() > 8)) {
            return Err(format!("pets {pets:?}"));
        }
    }
    Ok(())
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": { "type": "string", "maxLength": 12 },
            "age": { "type": "integer", "minimum": 0, "maximum": 120 },
            "role": { "enum": ["admin", "user", "guest"] },
            "pets": { "type": "array", "items": { "type": "string", "maxLength": 8 }, "maxItems": 3 }
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    })
}

/// Hot sampling over the whole vocabulary draws from everything the mask leaves: every reply
/// is complete, ends by itself, and passes the validator; the same draws without the grammar
/// do not (so the check can fail).
#[test]
fn replies_under_wild_sampling_follow_the_schema() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let grammar = compiler().compile(&Format::JsonSchema(person_schema())).unwrap();
    let prompt = tokenizer
        .encode("<start_of_turn>user\nDescribe a person as JSON.<end_of_turn>\n<start_of_turn>model\n", true, true)
        .unwrap();
    let mut unconstrained_valid = 0;
    for seed in 0..6 {
        let sampling =
            SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..SamplingParams::default() };
        let reply = |grammar| {
            let mut conversation = Conversation::new(
                &model,
                &tokenizer,
                1024,
                Storage::default(),
                Box::new(sift::attn::dense::Dense),
                sampling.clone(),
            );
            let limits = Limits { max_tokens: 400, stop: &[], interrupt: None, grammar };
            conversation.generate(&prompt, limits, |_| {}, |_| ControlFlow::Continue(())).unwrap()
        };
        let constrained = reply(Some(&grammar));
        assert_eq!(constrained.stop, StopReason::EndOfGeneration, "seed {seed}: {:?}", constrained.text);
        check_person(constrained.text.trim()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        unconstrained_valid += usize::from(check_person(reply(None).text.trim()).is_ok());
    }
    assert!(unconstrained_valid < 6, "the validator passes unconstrained replies too");
}

fn sift(args: &[&str]) -> Output {
    common::sift_with_stdin(args, b"")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn model_arg() -> String {
    common::default_model().to_string_lossy().into_owned()
}

#[test]
fn run_and_chat_follow_a_schema_or_a_grammar_and_refuse_bad_ones() {
    let model = model_arg();
    let schema = person_schema().to_string();
    let base = ["-m", &model, "--quiet", "--temp", "1.2", "--top-k", "0", "--seed", "7", "-n", "300"];
    let o = sift(&[&["run"][..], &base, &["--chat", "-p", "Who are you?", "--json-schema", &schema]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    check_person(String::from_utf8_lossy(&o.stdout).trim()).unwrap();

    let dir = std::env::temp_dir().join(format!("sift-structured-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let grammar: PathBuf = dir.join("digits.lark");
    std::fs::write(&grammar, "start: /[0-9]{3}-[0-9]{4}/\n").unwrap();
    let g = grammar.to_string_lossy();
    let o = common::sift_with_stdin(&[&["chat"][..], &base, &["--grammar", &g]].concat(), b"A number?\nAnother?\n");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let replies: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(replies.len(), 2, "{out:?}");
    for reply in replies {
        let digits = |s: &str| s.len() == 3 && s.bytes().all(|b| b.is_ascii_digit());
        let (a, b) = reply.split_once('-').unwrap_or_else(|| panic!("{reply:?}"));
        assert!(digits(a) && b.len() == 4 && b.bytes().all(|b| b.is_ascii_digit()), "{reply:?}");
    }

    let run = |extra: &[&str]| sift(&[&["run", "-m", &model, "-p", "x", "-n", "4"][..], extra].concat());
    assert_fails(&run(&["--json-schema", "{not json"]), 1, "--json-schema is not JSON");
    assert_fails(&run(&["--json-schema", r#"{"type": "strin"}"#]), 1, "--json-schema: ");
    let pattern = r#"{"type": "string", "pattern": "[a-z"}"#;
    assert_fails(&run(&["--json-schema", pattern]), 1, "unclosed character class");
    assert_fails(&run(&["--grammar", &format!("{}/missing.lark", dir.display())]), 2, "cannot read");
    assert_fails(&run(&["--json-schema", &format!("@{}/missing.json", dir.display())]), 2, "cannot read");
    std::fs::write(dir.join("bad.lark"), "start: (\n").unwrap();
    assert_fails(
        &run(&["--grammar", &dir.join("bad.lark").to_string_lossy()]),
        1,
        "--grammar: 1(9): Expected token ')'",
    );
    let o = run(&["--json-schema", "{}", "--grammar", &g]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_holds_replies_to_response_format() {
    let server = Server::start(&["--temp", "1.2", "--top-k", "0", "--seed", "3"]);
    let ask = |format: Value, stream: bool| {
        json!({
            "messages": [{ "role": "user", "content": "Describe a person as JSON." }],
            "max_tokens": 300,
            "stream": stream,
            "response_format": format,
        })
    };
    let schema = json!({ "type": "json_schema", "json_schema": { "name": "person", "strict": true, "schema": person_schema() } });
    let (status, body) = server.post("/v1/chat/completions", &ask(schema.clone(), false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    check_person(body["choices"][0]["message"]["content"].as_str().unwrap().trim()).unwrap();

    let chunks = server.stream("/v1/chat/completions", &ask(schema, true)).collect();
    check_person(streamed_text(&chunks).trim()).unwrap();

    let (status, body) = server.post("/v1/chat/completions", &ask(json!({ "type": "json_object" }), false));
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    if body["choices"][0]["finish_reason"] == "stop" {
        let value: Value = serde_json::from_str(content.trim()).unwrap_or_else(|e| panic!("{e}: {content:?}"));
        assert!(value.is_object(), "{content:?}");
    } else {
        assert!(content.trim_start().starts_with('{'), "{content:?}");
    }

    // llama.cpp's server's way of giving a schema.
    let (status, body) =
        server.post("/v1/chat/completions", &ask(json!({ "type": "json_object", "schema": person_schema() }), false));
    assert_eq!(status, 200, "{body}");
    check_person(body["choices"][0]["message"]["content"].as_str().unwrap().trim()).unwrap();

    let bad = json!({ "type": "json_schema", "json_schema": { "name": "x", "schema": { "type": "strin" } } });
    let (status, body) = server.post("/v1/chat/completions", &ask(bad, false));
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("response_format: "), "{body}");
    let (status, body) = server.post("/v1/chat/completions", &ask(json!({ "type": "yaml" }), false));
    assert_eq!(status, 400, "{body}");

    // The server is fine after a refused request, and plain text is still plain.
    let (status, body) = server.post("/v1/chat/completions", &ask(json!({ "type": "text" }), false));
    assert_eq!(status, 200, "{body}");
}

/// The calls of a chat completion's message (name, arguments), or of a stream's deltas.
fn calls_of(message: &Value) -> Vec<(String, String)> {
    let calls = message["tool_calls"].as_array().map_or(&[][..], Vec::as_slice);
    calls
        .iter()
        .map(|c| (c["function"]["name"].as_str().unwrap().into(), c["function"]["arguments"].as_str().unwrap().into()))
        .collect()
}

/// Tool calls under hot sampling: a required call is one object whose every call names a tool
/// and whose arguments pass the tool's validator; a named choice calls that tool; with `auto` a
/// reply is calls or text that does not open with `{`; a stream carries the same calls; `none`
/// offers nothing; a conversation goes on after the call with its result; bad tools are 400s.
#[test]
fn serve_calls_tools_within_their_schemas() {
    let server = Server::start(&["--temp", "1.2", "--top-k", "0"]);
    let weather = json!({ "type": "object", "properties": { "city": { "enum": ["Oslo", "Rome"] } }, "required": ["city"], "additionalProperties": false });
    let tools = json!([
        { "type": "function", "function": { "name": "add_person", "description": "Adds a person", "parameters": person_schema() } },
        { "type": "function", "function": { "name": "weather", "parameters": weather } },
    ]);
    let check_call = |(name, arguments): &(String, String)| match name.as_str() {
        "add_person" => check_person(arguments),
        "weather" => match serde_json::from_str::<Value>(arguments) {
            Ok(v) if v == json!({ "city": "Oslo" }) || v == json!({ "city": "Rome" }) => Ok(()),
            _ => Err(format!("weather arguments {arguments:?}")),
        },
        other => Err(format!("no tool {other:?}")),
    };
    let ask = |choice: Value, seed: u64, parallel: bool| {
        json!({
            "messages": [{ "role": "user", "content": "Add a person named Ada, aged 36." }],
            "max_tokens": 300,
            "seed": seed,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        })
    };
    let named = json!({ "type": "function", "function": { "name": "weather" } });
    for seed in 0..4 {
        for (choice, parallel) in [(json!("required"), false), (named.clone(), false), (json!("required"), true)] {
            let (status, body) = server.post("/v1/chat/completions", &ask(choice.clone(), seed, parallel));
            assert_eq!(status, 200, "{body}");
            let choice_made = &body["choices"][0];
            if choice_made["finish_reason"] == "length" {
                // Parallel calls may go on to the token limit: text, the object unfinished.
                assert!(parallel, "{body}");
                assert!(
                    choice_made["message"]["content"].as_str().unwrap().starts_with("{\"tool_calls\":[{"),
                    "{body}"
                );
                continue;
            }
            assert_eq!(choice_made["finish_reason"], "tool_calls", "{body}");
            assert!(choice_made["message"]["content"].is_null(), "{body}");
            let calls = calls_of(&choice_made["message"]);
            assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{body}");
            for call in &calls {
                check_call(call).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                if choice == named {
                    assert_eq!(call.0, "weather");
                }
            }
            let ids: Vec<&str> = choice_made["message"]["tool_calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["id"].as_str().unwrap())
                .collect();
            assert!(ids.iter().enumerate().all(|(i, id)| !ids[..i].contains(id)), "{ids:?}");
        }
        let (status, body) = server.post("/v1/chat/completions", &ask(json!("auto"), seed, true));
        assert_eq!(status, 200, "{body}");
        let message = &body["choices"][0]["message"];
        match body["choices"][0]["finish_reason"].as_str().unwrap() {
            "tool_calls" => calls_of(message).iter().try_for_each(check_call).unwrap(),
            _ => assert!(!message["content"].as_str().unwrap().starts_with('{'), "{body}"),
        }
    }

    // Streamed, the same calls, in one chunk, and the same finish.
    let (_, whole) = server.post("/v1/chat/completions", &ask(json!("required"), 7, false));
    let mut request = ask(json!("required"), 7, false);
    request["stream"] = json!(true);
    let chunks = server.stream("/v1/chat/completions", &request).collect();
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).collect();
    let streamed: Vec<(String, String)> = deltas.iter().flat_map(|d| calls_of(&d["delta"])).collect();
    assert_eq!(streamed, calls_of(&whole["choices"][0]["message"]));
    assert_eq!(streamed_text(&chunks), "");
    assert_eq!(deltas.last().unwrap()["finish_reason"], "tool_calls");

    // "none": no tools offered, a reply in text.
    let (status, body) = server.post("/v1/chat/completions", &ask(json!("none"), 1, true));
    assert_eq!(status, 200, "{body}");
    assert!(
        body["choices"][0]["message"]["content"].is_string()
            && body["choices"][0]["message"].get("tool_calls").is_none(),
        "{body}"
    );

    // The call and its result go back into the conversation, which goes on.
    let mut request = ask(json!("auto"), 2, true);
    let call = whole["choices"][0]["message"].clone();
    let id = call["tool_calls"][0]["id"].clone();
    request["messages"]
        .as_array_mut()
        .unwrap()
        .extend([call, json!({ "role": "tool", "tool_call_id": id, "content": "done" })]);
    let (status, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{body}");

    for (field, value, needle) in [
        ("tool_choice", json!({ "type": "function", "function": { "name": "nope" } }), "\"nope\""),
        ("tool_choice", json!("sometimes"), "\"sometimes\""),
        ("response_format", json!({ "type": "json_object" }), "cannot both"),
        ("tools", json!([{ "type": "function", "function": { "name": "two words" } }]), "\"two words\""),
        ("tools", json!([{ "type": "retrieval", "function": { "name": "f" } }]), "\"retrieval\""),
        (
            "tools",
            json!([{ "type": "function", "function": { "name": "f", "parameters": { "type": "strin" } } }]),
            "tools: ",
        ),
        (
            "messages",
            json!([{ "role": "assistant", "tool_calls": [{ "id": "x", "type": "function", "function": { "name": "f", "arguments": "{" } }] }]),
            "arguments of f",
        ),
    ] {
        let mut request = ask(json!("required"), 0, true);
        request[field] = value;
        let (status, body) = server.post("/v1/chat/completions", &request);
        assert_eq!(status, 400, "{field}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(needle), "{field}: {body}");
    }
}
