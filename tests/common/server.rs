//! A `sift serve` started for a test: on a free loopback port, killed when dropped.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a server may take to load the model and listen.
const STARTUP: Duration = Duration::from_secs(120);

pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    agent: ureq::Agent,
}

impl Server {
    /// `sift serve --host 127.0.0.1 --port 0 --quiet ARGS`, once it listens.
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sift"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0", "--quiet"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start sift serve");
        let stdout = child.stdout.take().unwrap();
        let (line_tx, line_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = line_tx.send(line);
        });
        let line = match line_rx.recv_timeout(STARTUP) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("sift serve did not listen within {STARTUP:?}");
            }
        };
        let base = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("first line: {line:?}"));
        assert!(base.starts_with("http://127.0.0.1:"), "{base}");
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(300)))
            .build()
            .into();
        Server { child, base: base.to_string(), agent }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` (any bytes) with optional headers; the status and the body as text.
    pub fn post_raw(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (u16, String, Option<String>) {
        let mut request = self.agent.post(self.url(path)).header("Content-Type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut response = request.send(body).expect("POST");
        let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().expect("read the body"), retry_after)
    }

    /// POSTs a JSON request; the status and the body as JSON.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text, _) = self.post_raw(path, body.to_string().as_bytes(), &[]);
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    }

    /// The log-probabilities `/v1/chat/completions` gives for the greedy reply to `messages`:
    /// `max_tokens` tokens at most, `top` alternatives each.
    pub fn chat_logprobs(&self, messages: &serde_json::Value, max_tokens: usize, top: usize) -> Vec<serde_json::Value> {
        let request = serde_json::json!({
            "messages": messages, "temperature": 0, "max_tokens": max_tokens, "logprobs": true, "top_logprobs": top,
        });
        let (status, chat) = self.post("/v1/chat/completions", &request);
        assert_eq!(status, 200, "{chat}");
        let tokens = chat["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
        assert!(!tokens.is_empty() && tokens.iter().all(|t| t["top_logprobs"].as_array().unwrap().len() == top));
        tokens
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let mut request = self.agent.get(self.url(path));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut response = request.call().expect("GET");
        (response.status().as_u16(), response.body_mut().read_to_string().expect("read the body"))
    }

    pub fn delete(&self, path: &str) -> (u16, String) {
        let mut response = self.agent.delete(self.url(path)).call().expect("DELETE");
        (response.status().as_u16(), response.body_mut().read_to_string().expect("read the body"))
    }

    /// The headers the official clients send from a browser besides the body's type: the key
    /// (as OpenAI's and Anthropic's send it), Anthropic's version, and the SDKs' own.
    pub const CLIENT_HEADERS: &str =
        "authorization,content-type,x-api-key,anthropic-version,x-stainless-os,x-stainless-retry-count";

    /// A CORS preflight from a page of `origin` before a `method` request to `path` with
    /// [`Self::CLIENT_HEADERS`]: the status and the `Access-Control-Allow-*` headers, by name.
    pub fn preflight(&self, path: &str, origin: &str, method: &str) -> (u16, Vec<(String, String)>) {
        let response = self
            .agent
            .options(self.url(path))
            .header("Origin", origin)
            .header("Access-Control-Request-Method", method)
            .header("Access-Control-Request-Headers", Self::CLIENT_HEADERS)
            .call()
            .expect("OPTIONS");
        (response.status().as_u16(), cors_headers(response.headers()))
    }

    /// A GET from a page of `origin`: the status and the `Access-Control-Allow-*` headers.
    pub fn get_from(&self, path: &str, origin: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
        let mut request = self.agent.get(self.url(path)).header("Origin", origin);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.call().expect("GET");
        (response.status().as_u16(), cors_headers(response.headers()))
    }

    /// POSTs a streaming request and returns the open stream of server-sent events.
    pub fn stream(&self, path: &str, body: &serde_json::Value) -> Events {
        let response = self
            .agent
            .post(self.url(path))
            .header("Content-Type", "application/json")
            .send(body.to_string().as_bytes())
            .expect("POST a stream");
        assert_eq!(response.status().as_u16(), 200);
        let content_type = response.headers().get("content-type").unwrap().to_str().unwrap().to_string();
        assert!(content_type.starts_with("text/event-stream"), "{content_type}");
        Events { reader: BufReader::new(Box::new(response.into_body().into_reader())) }
    }

    /// POSTs a streaming request with `headers` and reads its named server-sent events (Anthropic's
    /// kind, with no `[DONE]`) to the end of the stream: each event's name and data.
    pub fn named_events(
        &self,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> Vec<(String, serde_json::Value)> {
        let mut request = self.agent.post(self.url(path)).header("Content-Type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send(body.to_string().as_bytes()).expect("POST a stream");
        assert_eq!(response.status().as_u16(), 200);
        let (mut events, mut name) = (Vec::new(), None);
        for line in BufReader::new(response.into_body().into_reader()).lines() {
            let line = line.expect("read the stream");
            if let Some(event) = line.strip_prefix("event:") {
                name = Some(event.trim().to_string());
            } else if let Some(data) = line.strip_prefix("data:") {
                let data = serde_json::from_str(data.trim()).unwrap_or_else(|e| panic!("{e}: {data}"));
                events.push((name.take().expect("an event name before its data"), data));
            }
        }
        events
    }

    /// Stops the server as Ctrl-C would have, with SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// Waits (boundedly) for the server to exit; its exit code.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The data lines of a stream of server-sent events.
pub struct Events {
    reader: BufReader<Box<dyn Read + Send>>,
}

impl Events {
    /// The next event's data (`[DONE]` included), or None at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                return Some(data.trim_start().to_string());
            }
        }
    }

    /// Every chunk up to `[DONE]`, parsed; panics if the stream ends without it.
    pub fn collect(mut self) -> Vec<serde_json::Value> {
        let mut chunks = Vec::new();
        while let Some(data) = self.next_data() {
            if data == "[DONE]" {
                return chunks;
            }
            chunks.push(serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}")));
        }
        panic!("the stream ended without [DONE] after {} chunks", chunks.len());
    }
}

fn cors_headers(headers: &ureq::http::HeaderMap) -> Vec<(String, String)> {
    let cors = headers.iter().filter(|(name, _)| name.as_str().starts_with("access-control-allow-"));
    cors.map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_string())).collect()
}

/// The text of a streamed chat completion: its deltas, joined.
pub fn streamed_text(chunks: &[serde_json::Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|choice| choice["delta"]["content"].as_str().or(choice["text"].as_str()))
        .collect()
}

/// The text that log-probability entries' `bytes` spell (in OpenAI's shape, which Ollama's
/// shares).
pub fn spelled(tokens: &[serde_json::Value]) -> String {
    let bytes = tokens.iter().flat_map(|t| t["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
    String::from_utf8(bytes.collect()).unwrap()
}
