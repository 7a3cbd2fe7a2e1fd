//! `sift`: the command line.
//!
//! Stdout carries only results (generated text, a perplexity line, ids, JSON);
//! everything else goes to stderr. Exit codes are part of the interface:
//! 0 success, 1 usage, 2 model or input file unusable, 3 prompt does not fit
//! the context, 4 any other failure.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = match cli::Cli::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { cli::EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli::dispatch(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sift: {}", cli::one_line(&e));
            ExitCode::from(cli::exit_code(&e))
        }
    }
}
