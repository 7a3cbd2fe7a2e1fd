//! Prompt caches: a session restored from a file goes on exactly as the session that wrote it,
//! in every KV cache mode (coded pages, sketches, sliding-window rings that have wrapped); files
//! for another model or settings, damaged or foreign files are refused, leaving the session
//! empty; `sift run --prompt-cache` gives the output of a run without it.

mod common;

use std::path::PathBuf;

use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::kv::{KvMode, Storage};
use sift::model::Model;
use sift::prompt_cache::{self, PromptCacheError};

/// Past Gemma 3's window of 512 and the quantized modes' exact pages, so that rings wrap and
/// pages are coded; and not a whole number of pages.
const PROMPT: usize = 1100;
const N_CTX: usize = 2048;
const BATCH: usize = 256;

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919) % 20_000 + 100).collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sift-prompt-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn a_restored_session_goes_on_as_the_one_that_wrote_it_in_every_mode() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let fingerprint = file.fingerprint();
    let ids = tokens(PROMPT + 3);
    let storages = [
        Storage { key_sketch: true, ..Storage::default() },
        Storage::from(KvMode::Q8),
        Storage::from(KvMode::Q4),
        Storage::from(KvMode::Q2),
    ];
    for storage in storages {
        let path = scratch(&format!("{:?}.kv", storage.mode));
        let mut written = Session::with_cache(&model, N_CTX, BATCH, storage);
        written.prefill(&ids[..PROMPT]).unwrap();
        prompt_cache::save(&written, &fingerprint, &ids[..PROMPT], &path).unwrap();
        let mut restored = Session::with_cache(&model, N_CTX, BATCH, storage);
        // A session that held something else first.
        restored.prefill(&tokens(40)).unwrap();
        let loaded = prompt_cache::load(&mut restored, &fingerprint, &path).unwrap();
        assert_eq!(loaded, ids[..PROMPT]);
        assert_eq!(restored.n_past(), PROMPT);
        // Two more tokens as a prefill, one as a decoding step: the same logits, bit for bit.
        let want = written.prefill(&ids[PROMPT..PROMPT + 2]).unwrap().to_vec();
        assert_eq!(restored.prefill(&ids[PROMPT..PROMPT + 2]).unwrap(), &want[..], "{storage:?}");
        let want = written.decode(ids[PROMPT + 2]).unwrap().to_vec();
        assert_eq!(restored.decode(ids[PROMPT + 2]).unwrap(), &want[..], "{storage:?}");
    }
}

#[test]
fn a_short_prompt_in_a_long_context_writes_a_short_file() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let size = |n_ctx: usize| {
        let mut session = Session::with_batch(&model, n_ctx, BATCH);
        session.prefill(&tokens(100)).unwrap();
        let path = scratch(&format!("short-{n_ctx}.kv"));
        prompt_cache::save(&session, "m", &tokens(100), &path).unwrap();
        std::fs::metadata(&path).unwrap().len()
    };
    // Every layer writes the two pages its 100 tokens fill, whatever the context (the whole
    // cache at 32K is about 100 MB); only the header's context differs, by a digit.
    assert_eq!(size(32_768) - size(2048), 1);
    assert!(size(2048) < 3_000_000, "{}", size(2048));
}

#[test]
fn files_for_other_settings_damaged_or_foreign_are_refused_and_leave_the_session_empty() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let path = scratch("refused.kv");
    let mut session = Session::with_batch(&model, N_CTX, BATCH);
    session.prefill(&tokens(300)).unwrap();
    prompt_cache::save(&session, "model-a", &tokens(300), &path).unwrap();

    let other = |setting: &str, session: &mut Session| match prompt_cache::load(session, "model-a", &path) {
        Err(PromptCacheError::Mismatch { setting: s, .. }) => assert_eq!(s, setting),
        other => panic!("{setting}: {other:?}"),
    };
    other("context", &mut Session::with_batch(&model, N_CTX * 2, BATCH));
    other("batch", &mut Session::with_batch(&model, N_CTX, BATCH / 2));
    other("KV cache", &mut Session::with_cache(&model, N_CTX, BATCH, Storage::from(KvMode::Q4)));
    let mut fresh = Session::with_batch(&model, N_CTX, BATCH);
    assert!(matches!(prompt_cache::load(&mut fresh, "model-b", &path), Err(PromptCacheError::Mismatch { .. })));

    let bytes = std::fs::read(&path).unwrap();
    let damaged = scratch("damaged.kv");
    std::fs::write(&damaged, &bytes[..bytes.len() - 1000]).unwrap();
    fresh.prefill(&tokens(20)).unwrap();
    assert!(matches!(prompt_cache::load(&mut fresh, "model-a", &damaged), Err(PromptCacheError::Io { .. })));
    assert_eq!(fresh.n_past(), 0, "nothing is left of a failed load");
    std::fs::write(&damaged, [&bytes[..], b"more"].concat()).unwrap();
    assert!(matches!(prompt_cache::load(&mut fresh, "model-a", &damaged), Err(PromptCacheError::Io { .. })));
    std::fs::write(&damaged, b"GGUF and then some").unwrap();
    assert!(matches!(prompt_cache::load(&mut fresh, "model-a", &damaged), Err(PromptCacheError::NotACache { .. })));
    let missing = prompt_cache::load(&mut fresh, "model-a", &scratch("missing.kv")).unwrap_err();
    assert!(missing.is_missing());
    // And the session starts again from nothing.
    let want = Session::with_batch(&model, N_CTX, BATCH).prefill(&tokens(300)).unwrap().to_vec();
    assert_eq!(fresh.prefill(&tokens(300)).unwrap(), &want[..]);
}

/// A document then a question, twice with one question and once with another: the first run
/// makes the file, the second (another question) makes it again with the document alone, the
/// third starts from it; every reply is the one of a run without the cache.
#[test]
fn sift_run_with_a_prompt_cache_replies_as_without_it() {
    let model = common::default_model();
    let path = scratch("run.kv");
    let document = "The lighthouse keeper wrote in his log every night. ".repeat(60);
    let ask = |question: &str, cache: bool| {
        let prompt = format!("{document}\nQuestion: {question}\nAnswer:");
        let mut args = vec!["run", "-m", model.to_str().unwrap(), "-p", "-", "-n", "12", "--temp", "0", "--gpu", "off"];
        if cache {
            args.extend(["--prompt-cache", path.to_str().unwrap()]);
        }
        let o = common::sift_with_stdin(&args, prompt.as_bytes());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (String::from_utf8(o.stdout).unwrap(), String::from_utf8(o.stderr).unwrap())
    };
    let questions = ["What did the keeper write?", "Where did he live?", "What did the keeper write?"];
    let said: Vec<(String, String)> = questions.iter().map(|q| ask(q, true)).collect();
    for (question, (reply, _)) in questions.iter().zip(&said) {
        assert_eq!(reply, &ask(question, false).0, "{question}");
    }
    assert!(said[0].1.contains("prefilled and written"), "{}", said[0].1);
    assert!(said[1].1.contains("prefilled and written"), "{}", said[1].1);
    assert!(said[2].1.contains("tokens from"), "{}", said[2].1);
}

/// A file that is not a prompt cache is neither used nor overwritten (exit 2); a cache that
/// cannot be written is a warning, and the run goes on.
#[test]
fn sift_run_leaves_other_files_alone_and_goes_on_when_it_cannot_write() {
    let model = common::default_model();
    let run = |cache: &str| {
        let args = ["run", "-m", model.to_str().unwrap(), "-p", "-", "-n", "4", "--temp", "0", "--prompt-cache", cache];
        common::sift_with_stdin(&args, b"Once upon a time there was")
    };
    let notes = scratch("notes.txt");
    std::fs::write(&notes, "my notes").unwrap();
    let o = run(notes.to_str().unwrap());
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a sift prompt cache; not using or overwriting it"));
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");

    let o = run("/nonexistent/dir/cache.kv");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("warning: cannot write the prompt cache"));
    assert!(!o.stdout.is_empty());
}
