//! The chat page in headless Chromium, driven through the DevTools protocol: type a message,
//! press Enter, watch the reply grow as it streams, and compare it with `sift run --chat`'s
//! greedy reply. A screenshot of the page is written to `target/serve-chat.png`.
//!
//! The browser is `$SIFT_TEST_CHROMIUM`, else `chromium` (`.ci/run` installs Debian's); without
//! one the test says it is skipped, except under CI, where it fails.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use common::server::Server;
use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

type Socket = WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>;

/// A headless browser, killed when dropped, with its profile in a folder of its own.
struct Browser {
    child: Child,
    profile: std::path::PathBuf,
    /// `127.0.0.1:PORT` of its DevTools endpoint.
    devtools: String,
}

impl Browser {
    fn open(program: &str, url: &str) -> Browser {
        // A profile of its own: the tests' browsers run side by side.
        static OPENED: AtomicUsize = AtomicUsize::new(0);
        let n = OPENED.fetch_add(1, Ordering::Relaxed);
        let profile = std::env::temp_dir().join(format!("sift-chromium-{}-{n}", std::process::id()));
        let mut child = Command::new(program)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=900,640"])
            .args(["--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start chromium");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("ws://") {
                    let _ = tx.send(line[at + 5..].split('/').next().unwrap_or_default().to_string());
                }
            }
        });
        let devtools = rx.recv_timeout(Duration::from_secs(60)).expect("chromium printed no DevTools address");
        Browser { child, profile, devtools }
    }

    /// The DevTools socket of the page showing `url`.
    fn page(&self, url: &str) -> Socket {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let list: Value = ureq::get(format!("http://{}/json/list", self.devtools))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_json().ok())
                .unwrap_or(Value::Null);
            let target = list
                .as_array()
                .into_iter()
                .flatten()
                .find(|t| t["type"] == "page" && t["url"].as_str().is_some_and(|u| u.starts_with(url)));
            if let Some(ws) = target.and_then(|t| t["webSocketDebuggerUrl"].as_str()) {
                return tungstenite::connect(ws).expect("connect to the page").0;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("chromium never showed {url}");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// One DevTools call: its result (events that arrive meanwhile are passed over).
fn call(socket: &mut Socket, id: &mut u64, method: &str, params: Value) -> Value {
    *id += 1;
    let request = json!({ "id": *id, "method": method, "params": params });
    socket.send(Message::text(request.to_string())).unwrap();
    loop {
        let message = socket.read().expect("read from DevTools");
        let Ok(text) = message.to_text() else { continue };
        let Ok(reply) = serde_json::from_str::<Value>(text) else { continue };
        if reply["id"] == *id {
            assert!(reply["error"].is_null(), "{method}: {reply}");
            return reply["result"].clone();
        }
    }
}

/// The value of a JavaScript expression in the page.
fn evaluate(socket: &mut Socket, id: &mut u64, expression: &str) -> Value {
    let result = call(socket, id, "Runtime.evaluate", json!({ "expression": expression, "returnByValue": true }));
    result["result"]["value"].clone()
}

/// The browser to test with, or `None` (outside CI) when there is none.
fn chromium() -> Option<String> {
    let program = std::env::var("SIFT_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    if Command::new(&program).arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "no {program}; .ci/run installs Debian's chromium");
        eprintln!("SKIPPED the browser test: {program} is not installed");
        return None;
    }
    Some(program)
}

/// The chat page of `server` open in a browser, once it shows the model.
fn open_page(program: &str, server: &Server) -> (Browser, Socket) {
    let url = server.url("/");
    let browser = Browser::open(program, &url);
    let mut page = browser.page(&url);
    let mut id = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while evaluate(&mut page, &mut id, "document.getElementById('model').textContent").as_str().unwrap_or("").is_empty()
    {
        assert!(Instant::now() < deadline, "the page never showed the model");
        std::thread::sleep(Duration::from_millis(50));
    }
    (browser, page)
}

#[test]
fn the_chat_page_streams_a_reply_in_headless_chromium() {
    let Some(program) = chromium() else { return };
    let model = common::default_model();
    let message = "What is the capital of France?";
    let reference = Command::new(env!("CARGO_BIN_EXE_sift"))
        .args(["run", "--quiet", "--chat", "--temp", "0", "--json", "-n", "40", "-p", message, "-m"])
        .arg(&model)
        .output()
        .unwrap();
    let reference: Value = serde_json::from_slice(&reference.stdout).unwrap();
    let want = reference["text"].as_str().unwrap();

    // Greedy, so that the page's reply can be compared; the page sends no sampling settings.
    let server = Server::start(&["--temp", "0", "-n", "40"]);
    let (_browser, mut page) = open_page(&program, &server);
    let mut id = 1000;

    // Type the message and press Enter, as a user would.
    evaluate(&mut page, &mut id, "document.getElementById('input').focus()");
    call(&mut page, &mut id, "Input.insertText", json!({ "text": message }));
    let enter = |kind: &str| json!({ "type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r" });
    call(&mut page, &mut id, "Input.dispatchKeyEvent", enter("keyDown"));
    call(&mut page, &mut id, "Input.dispatchKeyEvent", enter("keyUp"));

    let watch = "(() => { const a = document.querySelector('.assistant'); \
                 return a ? [a.textContent, a.classList.contains('done')] : ['', false]; })()";
    let mut partial = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let reply = loop {
        assert!(Instant::now() < deadline, "no whole reply; seen so far: {partial:?}");
        let state = evaluate(&mut page, &mut id, watch);
        let (text, done) = (state[0].as_str().unwrap_or("").to_string(), state[1].as_bool().unwrap_or(false));
        if done {
            break text;
        }
        if !text.is_empty() && partial.last() != Some(&text) {
            partial.push(text);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(reply, want);
    assert!(partial.len() >= 2, "the reply appeared in pieces as it streamed: {partial:?}");
    assert!(partial.iter().all(|p| want.starts_with(p.as_str())), "{partial:?}");
    let user = evaluate(&mut page, &mut id, "document.querySelector('.user').textContent");
    assert_eq!(user, message);
    let speed = evaluate(&mut page, &mut id, "document.getElementById('speed').textContent");
    assert!(speed.as_str().is_some_and(|s| s.contains("tok/s")), "tokens/s shown: {speed}");

    let shot = call(&mut page, &mut id, "Page.captureScreenshot", json!({ "format": "png" }));
    let png = base64::engine::general_purpose::STANDARD.decode(shot["data"].as_str().unwrap()).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    std::fs::write(common::repo_root().join("target/serve-chat.png"), png).unwrap();
}

/// A conversation longer than the server's context: the page leaves its oldest exchanges out of
/// what it sends, says so, and gets the reply the API gives to the messages it kept.
#[test]
fn the_chat_page_leaves_out_the_oldest_exchanges_past_the_context() {
    let Some(program) = chromium() else { return };
    common::default_model();
    let server = Server::start(&["--temp", "0", "-n", "8", "-c", "96"]);
    let (_browser, mut page) = open_page(&program, &server);
    let mut id = 1000;
    let questions = [
        "Tell me about the history of Rome in detail please.",
        "And what about Greece and its many city states?",
        "And Egypt with its pharaohs and pyramids?",
        "And Persia?",
    ];
    for question in questions {
        let ask = json!({ "expression": format!("ask({})", json!(question)), "awaitPromise": true });
        call(&mut page, &mut id, "Runtime.evaluate", ask);
    }
    let state = evaluate(
        &mut page,
        &mut id,
        "[forgotten, JSON.stringify(messages), document.querySelectorAll('.error').length, \
          (document.querySelector('.note') || {}).textContent]",
    );
    let forgotten = state[0].as_u64().unwrap() as usize;
    let messages: Vec<Value> = serde_json::from_str(state[1].as_str().unwrap()).unwrap();
    assert_eq!(state[2], 0, "no error shown: {state}");
    assert_eq!(messages.len(), 8, "every message is kept on the page: {state}");
    assert!(forgotten >= 2, "{state}");
    assert!(state[3].as_str().is_some_and(|note| note.contains("left out")), "{state}");

    let sent = &messages[forgotten..7];
    let request = json!({ "messages": sent, "temperature": 0, "max_tokens": 8 });
    let (status, reply) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], messages[7]["content"]);
}
