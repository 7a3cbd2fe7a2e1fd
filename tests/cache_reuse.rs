//! Going back in the cache: a session that forgets its last positions goes on exactly as one
//! that never held them, where the cache can still rewrite them; where it cannot, nothing
//! changes. A conversation uses it for prompts that share only a beginning with what it holds.

mod common;

use sift::conversation::Conversation;
use sift::engine::{EngineError, Session};
use sift::gguf::GgufFile;
use sift::kv::{KvMode, Storage};
use sift::model::Model;
use sift::sample::SamplingParams;
use sift::tokenizer::Tokenizer;

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + salt * 104_729) % 20_000 + 100).collect()
}

#[test]
fn a_session_that_forgets_its_last_tokens_goes_on_as_one_that_never_held_them() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let (prompt, decoded, question) = (tokens(700, 1), tokens(20, 2), tokens(3, 3));
    for storage in [Storage::default(), Storage::from(KvMode::Q4)] {
        let mut went_back = Session::with_cache(&model, 2048, 256, storage);
        went_back.prefill(&prompt).unwrap();
        for &t in &decoded {
            went_back.decode(t).unwrap();
        }
        went_back.truncate(prompt.len() + 5).unwrap();
        let got = went_back.prefill(&question).unwrap().to_vec();

        let mut straight = Session::with_cache(&model, 2048, 256, storage);
        straight.prefill(&prompt).unwrap();
        for &t in &decoded[..5] {
            straight.decode(t).unwrap();
        }
        assert_eq!(got, straight.prefill(&question).unwrap(), "{storage:?}");
    }
}

#[test]
fn where_the_cache_has_let_a_position_go_nothing_changes() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let prompt = tokens(700, 1);
    // Gemma 3's sliding layers keep a ring of about window + batch positions; the q4 cache
    // codes all but its newest 128.
    let mut session = Session::with_cache(&model, 2048, 256, Storage::from(KvMode::Q4));
    session.prefill(&prompt).unwrap();
    assert!(!session.can_truncate(10));
    assert!(matches!(session.truncate(10), Err(EngineError::Rectify(_))));
    assert_eq!(session.n_past(), prompt.len());
    let got = session.prefill(&tokens(3, 3)).unwrap().to_vec();
    let mut untouched = Session::with_cache(&model, 2048, 256, Storage::from(KvMode::Q4));
    untouched.prefill(&prompt).unwrap();
    assert_eq!(got, untouched.prefill(&tokens(3, 3)).unwrap());
}

/// A prompt that shares a beginning with what the conversation holds (the reply dropped, a new
/// one asked for) prefills only what follows the shared tokens, and generates what a fresh
/// conversation generates.
#[test]
fn a_regenerated_reply_reuses_the_prompt_and_equals_a_fresh_one() {
    let file = GgufFile::open(common::default_model()).unwrap();
    let model = Model::load(&file).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let conversation = || {
        let policy = Box::new(sift::attn::dense::Dense);
        Conversation::new(&model, &tokenizer, 2048, Storage::default(), policy, greedy.clone())
    };
    let limits = sift::generate::Limits { max_tokens: 16, stop: &[], interrupt: None, grammar: None };
    let generate = |c: &mut Conversation, ids: &[u32]| {
        c.generate(ids, limits, |_| {}, |_| std::ops::ControlFlow::Continue(())).unwrap().tokens
    };
    let first = tokens(300, 1);
    let mut asked = conversation();
    let reply = generate(&mut asked, &first);
    // The same prompt again, then one that drops the prompt's last 10 tokens for others.
    let other: Vec<u32> = first[..290].iter().copied().chain(tokens(12, 4)).collect();
    for ids in [first.clone(), other] {
        let shared = first.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        assert_eq!(asked.reusable(&ids), shared.min(ids.len() - 1));
        let again = generate(&mut asked, &ids);
        assert_eq!(again, generate(&mut conversation(), &ids));
        assert_eq!(asked.stats().re_prefills, 0);
    }
    assert_eq!(generate(&mut conversation(), &first), reply);
}
