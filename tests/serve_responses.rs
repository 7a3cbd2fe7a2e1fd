//! `sift serve`'s `/v1/responses` through a real HTTP client, against `/v1/chat/completions`: the
//! same greedy text, stop and token counts, whole and as the API's named events; structured
//! output through `text.format`; tool calls as `function_call` items and the reply after their
//! output; a conversation gone on from a kept response as the same conversation sent whole;
//! and the 400s for what sift cannot do.

mod common;

use common::server::{spelled, Server};
use serde_json::{json, Value};

const SYSTEM: &str = "Answer in one short sentence.";
const QUESTION: &str = "What is the capital of France?";

/// The text of a response's messages.
fn output_text(response: &Value) -> String {
    let items = response["output"].as_array().unwrap_or_else(|| panic!("{response}"));
    let messages = items.iter().filter(|item| item["type"] == "message");
    messages.flat_map(|item| item["content"].as_array().unwrap()).map(|part| part["text"].as_str().unwrap()).collect()
}

#[test]
fn responses_reply_as_chat_completions_do_whole_and_streamed() {
    common::default_model();
    let server = Server::start(&[]);
    let messages = json!([{ "role": "system", "content": SYSTEM }, { "role": "user", "content": QUESTION }]);
    let (status, chat) =
        server.post("/v1/chat/completions", &json!({ "messages": messages, "temperature": 0, "max_tokens": 24 }));
    assert_eq!(status, 200, "{chat}");
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let (status_want, reason) = match chat["choices"][0]["finish_reason"].as_str() {
        Some("length") => ("incomplete", json!({ "reason": "max_output_tokens" })),
        _ => ("completed", Value::Null),
    };

    let request =
        json!({ "model": "m", "instructions": SYSTEM, "input": QUESTION, "temperature": 0, "max_output_tokens": 24 });
    let (status, response) = server.post("/v1/responses", &request);
    assert_eq!(status, 200, "{response}");
    assert_eq!(output_text(&response), want);
    assert_eq!((response["object"].as_str(), response["status"].as_str()), (Some("response"), Some(status_want)));
    assert_eq!(response["incomplete_details"], reason);
    assert_eq!(response["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(response["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
    assert_eq!(response["usage"]["total_tokens"], chat["usage"]["total_tokens"]);
    assert!(response["id"].as_str().unwrap().starts_with("resp_"), "{response}");
    // The same as items: a system message and a user message of input_text parts.
    let items = json!({
        "temperature": 0, "max_output_tokens": 24,
        "input": [
            { "role": "system", "content": SYSTEM },
            { "type": "message", "role": "user", "content": [{ "type": "input_text", "text": QUESTION }] },
        ],
    });
    let (_, response) = server.post("/v1/responses", &items);
    assert_eq!(output_text(&response), want);

    // Streamed: the named events in the API's order, numbered; their deltas the whole text.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.named_events("/v1/responses", &streamed, &[]);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    let deltas = names.iter().filter(|&&n| n == "response.output_text.delta").count();
    assert!(deltas > 2, "{names:?}");
    let mut order =
        vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    order.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    let end = if status_want == "incomplete" { "response.incomplete" } else { "response.completed" };
    order.extend(["response.output_text.done", "response.content_part.done", "response.output_item.done", end]);
    assert_eq!(names, order);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!((data["type"].as_str(), data["sequence_number"].as_u64()), (Some(name.as_str()), Some(i as u64)));
    }
    let text: String = events.iter().filter_map(|(_, data)| data["delta"].as_str()).collect();
    assert_eq!(text, want);
    let last = &events.last().unwrap().1["response"];
    assert_eq!((output_text(last), last["status"].as_str()), (want.to_string(), Some(status_want)));
    assert_eq!(last["id"], events[0].1["response"]["id"], "one response throughout");
    let (status, kept) = server.get(&format!("/v1/responses/{}", last["id"].as_str().unwrap()), &[]);
    assert_eq!(status, 200, "a streamed response is kept too");
    assert_eq!(serde_json::from_str::<Value>(&kept).unwrap(), *last);
    let item = &events[events.len() - 2].1["item"];
    assert_eq!(item["id"], events[2].1["item"]["id"]);
    assert_eq!(*item, last["output"][0]);

    // text.format holds the reply as response_format does.
    let schema = json!({ "type": "object", "properties": { "city": { "type": "string", "maxLength": 12 } }, "required": ["city"], "additionalProperties": false });
    let (_, chat) = server.post(
        "/v1/chat/completions",
        &json!({ "messages": messages, "temperature": 0, "max_tokens": 40, "response_format": { "type": "json_schema", "json_schema": { "name": "city", "schema": schema } } }),
    );
    let mut formatted = request.clone();
    formatted["max_output_tokens"] = json!(40);
    formatted["text"] =
        json!({ "format": { "type": "json_schema", "name": "city", "schema": schema, "strict": true } });
    let (_, response) = server.post("/v1/responses", &formatted);
    assert_eq!(output_text(&response), chat["choices"][0]["message"]["content"].as_str().unwrap(), "{response}");
    assert_eq!(response["text"]["format"]["type"], "json_schema");

    for (change, needle) in [
        (json!({ "previous_response_id": "resp_1" }), "previous_response_id"),
        (
            json!({ "input": [{ "role": "user", "content": [{ "type": "input_image", "image_url": "x" }] }] }),
            "\"input_image\"",
        ),
        (json!({ "input": [{ "type": "reasoning", "summary": [] }] }), "\"reasoning\""),
        (json!({ "input": [] }), "at least one"),
        (json!({ "tools": [{ "type": "web_search" }] }), "\"web_search\""),
        (json!({ "text": { "format": { "type": "yaml" } } }), "text.format"),
        (json!({ "input": [{ "role": "robot", "content": "hi" }] }), "\"robot\""),
    ] {
        let mut bad = request.clone();
        for (field, value) in change.as_object().unwrap() {
            bad[field] = value.clone();
        }
        let (status, body) = server.post("/v1/responses", &bad);
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(needle), "{bad}: {body}");
    }
}

#[test]
fn function_calls_are_chat_completions_tool_calls() {
    common::default_model();
    let server = Server::start(&["--temp", "0"]);
    let weather = json!({ "type": "object", "properties": { "city": { "enum": ["Oslo", "Rome"] } }, "required": ["city"], "additionalProperties": false });
    let description = "Today's weather in a city";
    let question = "What is the weather in Oslo today?";
    let chat_tools = json!([{ "type": "function", "function": { "name": "weather", "description": description, "parameters": weather } }]);
    let tools = json!([{ "type": "function", "name": "weather", "description": description, "parameters": weather }]);

    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({
            "messages": [{ "role": "user", "content": question }], "max_tokens": 60, "tools": chat_tools,
            "tool_choice": { "type": "function", "function": { "name": "weather" } }, "parallel_tool_calls": false,
        }),
    );
    assert_eq!(status, 200, "{chat}");
    let call = &chat["choices"][0]["message"]["tool_calls"][0]["function"];
    let request = json!({
        "input": question, "max_output_tokens": 60, "tools": tools,
        "tool_choice": { "type": "function", "name": "weather" }, "parallel_tool_calls": false,
    });
    let (status, response) = server.post("/v1/responses", &request);
    assert_eq!(status, 200, "{response}");
    let output = response["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{response}");
    assert_eq!((output[0]["type"].as_str(), output[0]["name"].as_str()), (Some("function_call"), Some("weather")));
    assert_eq!(output[0]["arguments"], call["arguments"], "{response}");
    assert_eq!(response["status"], "completed");

    // Streamed: the call whole, as its item's events, then the response.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.named_events("/v1/responses", &streamed, &[]);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(events[3].1["delta"], call["arguments"]);
    assert_eq!(events[5].1["item"], events[6].1["response"]["output"][0]);

    // The call's output, then the model's reply: the same conversation on both routes.
    let arguments = json!({ "city": "Oslo" }).to_string();
    let result = "Sunny, 21 degrees.";
    let (status, chat) = server.post(
        "/v1/chat/completions",
        &json!({
            "max_tokens": 40, "tools": chat_tools,
            "messages": [
                { "role": "user", "content": question },
                { "role": "assistant", "content": null, "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "weather", "arguments": arguments } }] },
                { "role": "tool", "tool_call_id": "c1", "content": result },
            ],
        }),
    );
    assert_eq!(status, 200, "{chat}");
    let (status, response) = server.post(
        "/v1/responses",
        &json!({
            "max_output_tokens": 40, "tools": tools,
            "input": [
                { "role": "user", "content": question },
                { "type": "function_call", "call_id": "c1", "name": "weather", "arguments": arguments },
                { "type": "function_call_output", "call_id": "c1", "output": result },
            ],
        }),
    );
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["usage"]["input_tokens"], chat["usage"]["prompt_tokens"], "the same prompt on both routes");
    let choice = &chat["choices"][0];
    match choice["finish_reason"] == "tool_calls" {
        true => {
            assert_eq!(response["output"][0]["arguments"], choice["message"]["tool_calls"][0]["function"]["arguments"])
        }
        false => assert_eq!(output_text(&response), choice["message"]["content"].as_str().unwrap(), "{response}"),
    }
}

/// `previous_response_id` goes on from a kept response as if its turns were sent again; a kept
/// response is given back and forgotten on request.
#[test]
fn a_kept_response_goes_on_as_the_whole_conversation_would() {
    common::default_model();
    let server = Server::start(&["--temp", "0"]);
    let (status, first) =
        server.post("/v1/responses", &json!({ "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 16 }));
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap();
    assert_eq!(first["store"], true);
    let (status, text) = server.get(&format!("/v1/responses/{id}"), &[]);
    assert_eq!(status, 200, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), first);

    // The next turn from the kept one (the instructions are the new request's own), and the same
    // conversation sent whole, not kept.
    let (status, next) = server.post(
        "/v1/responses",
        &json!({ "previous_response_id": id, "instructions": SYSTEM, "input": "Why?", "max_output_tokens": 16 }),
    );
    assert_eq!(status, 200, "{next}");
    assert_eq!(next["previous_response_id"], id);
    let whole = json!({
        "instructions": SYSTEM, "max_output_tokens": 16, "store": false,
        "input": [
            { "role": "user", "content": QUESTION },
            { "role": "assistant", "content": output_text(&first) },
            { "role": "user", "content": "Why?" },
        ],
    });
    let (status, sent) = server.post("/v1/responses", &whole);
    assert_eq!(status, 200, "{sent}");
    assert_eq!(output_text(&next), output_text(&sent));
    assert_eq!(next["usage"]["input_tokens"], sent["usage"]["input_tokens"]);
    let (status, _) = server.get(&format!("/v1/responses/{}", sent["id"].as_str().unwrap()), &[]);
    assert_eq!(status, 404, "\"store\": false is not kept");

    // A call's output, on from the response that made the call.
    let weather = json!({ "type": "object", "properties": { "city": { "enum": ["Oslo", "Rome"] } }, "required": ["city"], "additionalProperties": false });
    let tools = json!([{ "type": "function", "name": "weather", "parameters": weather }]);
    let question = "What is the weather in Oslo today?";
    let (_, called) = server.post(
        "/v1/responses",
        &json!({ "input": question, "tools": tools, "tool_choice": "required", "parallel_tool_calls": false, "max_output_tokens": 60 }),
    );
    let call = &called["output"][0];
    assert_eq!(call["type"], "function_call", "{called}");
    let output = json!({ "type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 degrees." });
    let (_, answered) = server.post(
        "/v1/responses",
        &json!({ "previous_response_id": called["id"], "input": [output], "tools": tools, "max_output_tokens": 30 }),
    );
    let whole = json!({
        "tools": tools, "max_output_tokens": 30, "store": false,
        "input": [
            { "role": "user", "content": question },
            { "type": "function_call", "call_id": call["call_id"], "name": "weather", "arguments": call["arguments"] },
            output,
        ],
    });
    let (_, sent) = server.post("/v1/responses", &whole);
    assert_eq!(answered["usage"]["input_tokens"], sent["usage"]["input_tokens"], "{answered} {sent}");
    // The items but for their ids, which are each response's own.
    let items = |response: &Value| -> Vec<Value> {
        let items = response["output"].as_array().unwrap().iter();
        items.map(|item| json!([item["type"], item["name"], item["arguments"], item["content"]])).collect()
    };
    assert_eq!(items(&answered), items(&sent));

    let (status, text) = server.delete(&format!("/v1/responses/{id}"));
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({ "id": id, "object": "response.deleted", "deleted": true })
    );
    let (status, _) = server.get(&format!("/v1/responses/{id}"), &[]);
    assert_eq!(status, 404);
    let (status, body) = server.post("/v1/responses", &json!({ "previous_response_id": id, "input": "Why?" }));
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("no response"), "{body}");
}

/// With `include: ["message.output_text.logprobs"]` the output text carries each token's
/// log-probability and alternatives: those `/v1/chat/completions` gives for the same
/// conversation, whole and spread over the streamed deltas (each delta's tokens spelling its
/// text). Without the include there are none, as in OpenAI's API; more than 20 is a 400.
#[test]
fn included_logprobs_are_chat_completions_logprobs() {
    common::default_model();
    let server = Server::start(&[]);
    let messages = json!([{ "role": "system", "content": SYSTEM }, { "role": "user", "content": QUESTION }]);
    let want = server.chat_logprobs(&messages, 12, 4);

    let mut request = json!({
        "instructions": SYSTEM, "input": QUESTION, "temperature": 0, "max_output_tokens": 12,
        "include": ["message.output_text.logprobs"], "top_logprobs": 4,
    });
    let (status, response) = server.post("/v1/responses", &request);
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["output"][0]["content"][0]["logprobs"].as_array().unwrap(), &want);

    request["stream"] = json!(true);
    let events = server.named_events("/v1/responses", &request, &[]);
    let mut streamed = Vec::new();
    for (_, delta) in events.iter().filter(|(name, _)| name == "response.output_text.delta") {
        let tokens = delta["logprobs"].as_array().unwrap();
        assert_eq!(spelled(tokens), delta["delta"].as_str().unwrap(), "{delta}");
        streamed.extend(tokens.iter().cloned());
    }
    assert_eq!(streamed, want);
    let done = events.iter().find(|(name, _)| name == "response.output_text.done").unwrap();
    assert_eq!(done.1["logprobs"].as_array().unwrap(), &want);

    request["stream"] = json!(false);
    request["include"] = json!([]);
    let (_, response) = server.post("/v1/responses", &request);
    assert_eq!(response["output"][0]["content"][0]["logprobs"], json!([]), "{response}");
    request["top_logprobs"] = json!(21);
    let (status, error) = server.post("/v1/responses", &request);
    assert_eq!((status, error["error"]["message"].as_str()), (400, Some("top_logprobs must be between 0 and 20")));
}
