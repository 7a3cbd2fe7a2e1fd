//! `sift run` on a terminal: when stdout and stderr are one terminal, the timing line starts on
//! a line of its own, even though the generated text ends mid-line; piped, stdout is the text
//! exactly. The terminal is a pseudo-terminal made by util-linux's `script`.

mod common;

use std::process::Command;

fn run_args(model: &str) -> Vec<String> {
    ["run", "-m", model, "-p", "The capital of France is", "-n", "4", "--temp", "0"].map(String::from).to_vec()
}

#[test]
fn the_timing_line_starts_on_a_new_line_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("SKIPPED the terminal test: util-linux's `script` is not installed");
        return;
    }
    let model = common::default_model();
    let args = run_args(model.to_str().unwrap());
    let piped = Command::new(env!("CARGO_BIN_EXE_sift")).args(&args).output().unwrap();
    assert!(piped.status.success());
    let text = String::from_utf8(piped.stdout).unwrap();
    assert!(!text.is_empty() && !text.ends_with('\n'), "piped stdout is the text alone: {text:?}");
    let stderr = String::from_utf8(piped.stderr).unwrap();
    assert!(stderr.lines().any(|l| l.starts_with("sift: prefill")), "{stderr}");

    // Both streams on one pseudo-terminal, as in an interactive shell.
    let quoted: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_sift").to_string())
        .chain(args)
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect();
    let o = Command::new("script").args(["-qec", &quoted.join(" "), "/dev/null"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let screen = String::from_utf8_lossy(&o.stdout).replace("\r\n", "\n");
    let at = screen.find(&text).unwrap_or_else(|| panic!("the text {text:?} is not on the terminal: {screen:?}"));
    let after = &screen[at + text.len()..];
    assert!(after.starts_with("\nsift: prefill"), "the timing line does not start a line: {screen:?}");
}
