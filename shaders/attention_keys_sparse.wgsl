// The keys a sparse attention workgroup visits: the key lists of its KV head
// and query block (64 positions; the index covers the same number of query
// blocks for every KV head),
// built by the index builders of src/gpu/route/. Entry e of a span is
// position e % 64 of the span's (e / 64)-th listed key block while e is below
// 64 times their count, then the listed single positions (vertical lines that
// no listed block holds). Both lists ascend. Prepended to attention.wgsl and
// attention_coop.wgsl in place of attention_keys_dense.wgsl; the mask stays
// the causal one, so a query sees exactly the listed keys at or before it.

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
    columns: u32,
    len: u32,
    // Every block up to the query block's own is listed: the keys are the
    // positions 0 .. len in order, and need not be read from the list.
    every: bool,
}

// The keys of queries t_first ..= t_last, which lie in one query block.
fn key_span(kv_head: u32, t_first: u32, t_last: u32) -> Span {
    let query_blocks = (arrayLength(&block_offsets) - 1u) / shape.n_kv_head;
    let at = kv_head * query_blocks + t_first / INDEX_BLOCK;
    let block0 = block_offsets[at];
    let blocks = block_offsets[at + 1u] - block0;
    let column0 = column_offsets[at];
    let columns = column_offsets[at + 1u] - column0;
    // Distinct blocks at or before the query block's, as many as there are.
    let every = blocks == t_first / INDEX_BLOCK + 1u;
    return Span(block0, blocks, column0, columns, blocks * INDEX_BLOCK + columns, every);
}

fn key_at(span: Span, e: u32) -> u32 {
    if span.every {
        return select(NO_KEY, e, e < span.len);
    }
    let in_blocks = span.blocks * INDEX_BLOCK;
    if e < in_blocks {
        return block_list[span.block0 + e / INDEX_BLOCK] * INDEX_BLOCK + e % INDEX_BLOCK;
    }
    if e < span.len {
        return column_list[span.column0 + e - in_blocks];
    }
    return NO_KEY;
}
