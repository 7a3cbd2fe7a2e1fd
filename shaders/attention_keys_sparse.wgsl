// The keys a sparse attention workgroup visits: the key lists of its KV head
// and query block (64 positions; the index covers the same number of query
// blocks for every KV head), built by the index builders of src/gpu/route/.
// Entry e of a span is position e % 64 of the span's (e / 64)-th listed key
// block while e is below 64 times their count, then the listed single
// positions (vertical lines that no listed block holds). Both lists ascend.
// Prepended to attention.wgsl, attention_coop.wgsl and route_row_stats.wgsl
// in place of attention_keys_dense.wgsl; the mask stays the causal one, so a
// query sees exactly the listed keys at or before it.
//
// The kernels take entries a tile at a time (16, 32 or 64, dividing the 64
// of a block), so a tile lies in one listed block or among the single
// positions: a block's tile is consecutive positions found from one list
// entry, as a dense tile is, and only single positions are read one by one.

const NO_KEY: u32 = 0xffffffffu;
const INDEX_BLOCK: u32 = 64u;

// Per (KV head, query block): where its blocks and its single positions start
// in the lists, CSR-style (entry kv_head * query_blocks + block, one more at the end).
@group(0) @binding(4) var<storage, read> block_offsets: array<u32>;
@group(0) @binding(5) var<storage, read> block_list: array<u32>;
@group(0) @binding(6) var<storage, read> column_offsets: array<u32>;
@group(0) @binding(7) var<storage, read> column_list: array<u32>;

struct Span {
    block0: u32,
    blocks: u32,
    column0: u32,
    len: u32,
}

// The keys of queries t_first ..= t_last, which lie in one query block.
fn key_span(kv_head: u32, t_first: u32, t_last: u32) -> Span {
    let query_blocks = (arrayLength(&block_offsets) - 1u) / shape.n_kv_head;
    let at = kv_head * query_blocks + t_first / INDEX_BLOCK;
    let block0 = block_offsets[at];
    let blocks = block_offsets[at + 1u] - block0;
    let column0 = column_offsets[at];
    let columns = column_offsets[at + 1u] - column0;
    return Span(block0, blocks, column0, blocks * INDEX_BLOCK + columns);
}

// The span's entries e0 .. e0 + n, for a tile of n dividing 64 (e0 a
// multiple of n): in a listed block, `count` consecutive positions from
// `first`; among the single positions, `count` of them from the column list's
// entry `first` (none past the span's end).
struct Tile {
    first: u32,
    count: u32,
    listed: bool,
}

fn tile_at(span: Span, e0: u32) -> Tile {
    let in_blocks = span.blocks * INDEX_BLOCK;
    if e0 < in_blocks {
        let block = block_list[span.block0 + e0 / INDEX_BLOCK];
        return Tile(block * INDEX_BLOCK + e0 % INDEX_BLOCK, INDEX_BLOCK - e0 % INDEX_BLOCK, false);
    }
    return Tile(span.column0 + e0 - in_blocks, select(0u, span.len - e0, e0 < span.len), true);
}

fn tile_key(tile: Tile, i: u32) -> u32 {
    if i >= tile.count {
        return NO_KEY;
    }
    if tile.listed {
        return column_list[tile.first + i];
    }
    return tile.first + i;
}
