//! Text from tokens as they are generated.

use super::Tokenizer;

/// Turns generated tokens into text one at a time. A character can span tokens (an emoji spelled
/// as four `<0xXX>` byte tokens), so the bytes of an unfinished character are held back until the
/// token that completes it arrives.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self { tokenizer, pending: Vec::new() }
    }

    /// The text that `id` completes; empty while a character is unfinished. Bytes that cannot
    /// start or continue a character come out as U+FFFD.
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend(self.tokenizer.token_bytes(id));
        let ready = self.pending.len() - unfinished_tail(&self.pending);
        let text = String::from_utf8_lossy(&self.pending[..ready]).into_owned();
        self.pending.drain(..ready);
        text
    }

    /// Whatever is still held back, an unfinished character shown as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// The length of the character at the end of `bytes` that more bytes could still complete (a
/// UTF-8 character is at most four bytes, so at most three are waiting).
fn unfinished_tail(bytes: &[u8]) -> usize {
    (1..=bytes.len().min(3))
        .rev()
        .find(|&n| {
            matches!(std::str::from_utf8(&bytes[bytes.len() - n..]), Err(e) if e.valid_up_to() == 0 && e.error_len().is_none())
        })
        .unwrap_or(0)
}
