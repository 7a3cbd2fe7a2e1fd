// The keys a dense attention workgroup visits: every position from the
// window's start (rounded down to the kernel's KEYS) to its last query, in
// order. Prepended to attention.wgsl and attention_coop.wgsl, which call
// key_span and key_at; see attention_keys_sparse.wgsl for the other choice.

const NO_KEY: u32 = 0xffffffffu;

struct Span {
    begin: u32,
    len: u32,
}

// The keys of queries t_first ..= t_last (of KV head kv_head).
fn key_span(kv_head: u32, t_first: u32, t_last: u32) -> Span {
    var begin = 0u;
    if shape.window != 0u && t_first + 1u > shape.window {
        begin = ((t_first + 1u - shape.window) / KEYS) * KEYS;
    }
    return Span(begin, t_last + 1u - begin);
}

// The position of the span's entry e; entries past its end read as
// positions past the last query, which no mask lets through.
fn key_at(span: Span, e: u32) -> u32 {
    return span.begin + e;
}
