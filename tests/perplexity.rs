//! Perplexity and the KL divergence between KV cache modes on the tiny
//! random-weight Llama, through the library and through `sift perplexity`.

mod common;

use std::path::PathBuf;
use std::process::Command;

use sift::engine::Session;
use sift::gguf::GgufFile;
use sift::kv::{KvMode, Storage};
use sift::model::Model;
use sift::perplexity::{evaluate, KlReport, PerplexityReport, Scored, Scoring, Windows, TOP_K};
use sift::tokenizer::Tokenizer;

fn tiny_llama(test: &str) -> Option<PathBuf> {
    common::shared_dir(test).map(|dir| dir.join("anchors/models/tiny-llama.gguf"))
}

fn text() -> String {
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled \
     into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. "
        .repeat(40)
}

/// The f16 cache against itself is the same distribution at every position;
/// q8 stays close. Batches of 64 make later batches read coded pages.
#[test]
fn kl_divergence_between_cache_modes() {
    let Some(path) = tiny_llama("kl_divergence_between_cache_modes") else { return };
    let file = GgufFile::open(&path).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(&file).unwrap();
    let tokens = tokenizer.encode(&text(), true, false).unwrap();
    let windows = Windows { max: Some(2), ..Windows::default() };
    let run = |mode, keep_top, base: Option<&[Scored]>| {
        let mut session = Session::with_cache(&model, 512, 64, Storage { mode, ..Storage::default() });
        evaluate(&mut session, &tokens, tokenizer.bos(), windows, keep_top, base, |_| {}).unwrap()
    };
    let base = run(KvMode::F16, TOP_K, None);
    assert_eq!(base.scored.len(), 2 * 255);
    assert!(base.scored.iter().all(|s| s.top.len() == TOP_K && s.top.windows(2).all(|w| w[0].1 >= w[1].1)));

    let same = run(KvMode::F16, 0, Some(&base.scored));
    let kl = KlReport::of(&same.scored, &base.scored).unwrap();
    assert_eq!((kl.kl_mean, kl.kl_max, kl.top1_agreement), (0.0, 0.0, 1.0));
    assert_eq!(PerplexityReport::of(&same.scored, 2).ppl, kl.base_ppl);

    let q8 = run(KvMode::Q8, 0, Some(&base.scored));
    let kl = KlReport::of(&q8.scored, &base.scored).unwrap();
    let ppl = PerplexityReport::of(&q8.scored, 2).ppl;
    eprintln!(
        "q8: KL mean {} p99 {} max {}, top-1 {}, PPL {ppl} vs {}",
        kl.kl_mean, kl.kl_p99, kl.kl_max, kl.top1_agreement, kl.base_ppl
    );
    // Random weights make this model's distributions sensitive; a trained
    // model's KL is far smaller (see the README).
    assert!(kl.kl_mean > 0.0 && kl.kl_mean < 0.02, "{kl:?}");
    assert!(kl.top1_agreement > 0.9, "{kl:?}");
    assert!((ppl / kl.base_ppl - 1.0).abs() < 0.01, "{ppl} vs {}", kl.base_ppl);

    // The same run twice gives the same numbers.
    let again = run(KvMode::Q8, 0, Some(&base.scored));
    assert_eq!(again.scored, q8.scored);
}

/// A window cut short after position `P1` scores its last `P1 − P0`
/// positions as the full window scores them: the same tokens before them,
/// and a dense prefill of `P0` writes the cache that decoding steps would
/// have. So `-c P1+1 --stride P1−P0` scores a piece `[P0, P1)` of a longer
/// chunk's scored half, and the pieces of a split run put together are the
/// whole run (for dense attention; a sparse policy's earlier outputs no
/// longer reach a later piece's cache).
#[test]
fn a_window_cut_short_scores_as_the_long_one() {
    let Some(path) = tiny_llama("a_window_cut_short_scores_as_the_long_one") else { return };
    let file = GgufFile::open(&path).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(&file).unwrap();
    let tokens = tokenizer.encode(&text(), true, false).unwrap();
    let run = |n_ctx, stride| {
        let mut session = Session::with_cache(&model, n_ctx, 64, Storage::default());
        let windows = Windows { max: Some(1), stride, scoring: Scoring::Decoded };
        evaluate(&mut session, &tokens, tokenizer.bos(), windows, TOP_K, None, |_| {}).unwrap().scored
    };
    // The full window scores positions 128..255; the piece 160..192 of it.
    let (full, piece) = (run(256, None), run(193, Some(32)));
    assert_eq!(full.len(), 127);
    assert_eq!(piece, full[32..64]);
}

fn sift(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sift")).args(args).env_remove("SIFT_MODEL").output().unwrap()
}

/// Two books and a directory of them, a base file, and the comparison: the
/// table, the JSON, and KL 0 for the base's own mode.
#[test]
fn several_books_with_a_base_run() {
    let Some(model) = tiny_llama("several_books_with_a_base_run") else { return };
    let dir = std::env::temp_dir().join(format!("sift-ppl-{}", std::process::id()));
    let books = dir.join("books");
    std::fs::create_dir_all(&books).unwrap();
    std::fs::write(books.join("a.txt"), text()).unwrap();
    std::fs::write(books.join("b.txt"), text().to_uppercase()).unwrap();
    std::fs::write(books.join("notes.md"), "not a book").unwrap();
    let base = dir.join("base.kld");
    let (model, books, base) = (model.to_str().unwrap(), books.to_str().unwrap(), base.to_str().unwrap());
    let common = ["perplexity", "-m", model, "-f", books, "-c", "128", "--chunks", "2"];

    let o = sift(&[&common[..], &["--kl-divergence-base", base]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert!(stdout.starts_with("| file |") && stdout.contains("a.txt") && stdout.contains("b.txt"), "{stdout}");
    assert!(stdout.lines().last().unwrap().starts_with("PPL = "), "{stdout}");

    let o = sift(&[&common[..], &["--kl-divergence-base", base, "--kl-divergence", "--json"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let files = json["files"].as_array().unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(json["tokens_scored"], 2 * 2 * 63);
    assert_eq!(json["chunks"], 4);
    for f in files {
        assert_eq!(f["tokens_scored"], 2 * 63);
        assert_eq!(f["kl"]["kl_mean"], 0.0);
    }
    assert_eq!(json["kl"]["kl_max"], 0.0);
    assert_eq!(json["kl"]["top1_agreement"], 1.0);
    assert_eq!(json["kl"]["base_ppl"], json["ppl"]);

    // A base of other text is refused.
    let other = sift(
        &[&common[..5], &["-c", "128", "--chunks", "1", "--kl-divergence-base", base, "--kl-divergence"]].concat(),
    );
    assert_eq!(other.status.code(), Some(2), "{}", String::from_utf8_lossy(&other.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
