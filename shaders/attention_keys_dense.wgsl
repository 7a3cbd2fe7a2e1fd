// The keys a dense attention workgroup visits: every position from the
// window's start (rounded down to the kernel's KEYS) to its last query, in
// order. Prepended to attention.wgsl, attention_coop.wgsl and
// route_row_stats.wgsl, which call key_span once, then tile_at and tile_key
// for each tile of entries; see attention_keys_sparse.wgsl for the other
// choice.

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

// The span's entries e0 .. e0 + n, for a tile of n dividing 64 (e0 a
// multiple of n): `count` consecutive positions from `first` (none past the
// span's end).
struct Tile {
    first: u32,
    count: u32,
}

fn tile_at(span: Span, e0: u32) -> Tile {
    return Tile(span.begin + e0, select(0u, span.len - e0, e0 < span.len));
}

// The position of the tile's entry i; entries past the span's end read as
// NO_KEY, a position past the last query, which no mask lets through.
fn tile_key(tile: Tile, i: u32) -> u32 {
    return select(NO_KEY, tile.first + i, i < tile.count);
}
