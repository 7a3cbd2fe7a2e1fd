// The KV heads an attention dispatch computes. Prepended to attention.wgsl
// and attention_coop.wgsl with the key-span file: bit h of shape.kv_heads
// selects KV head h, and 0 selects every head. The dispatch's head dimension
// counts the selected heads only, so one layer's heads can be split between
// kernels (RouteSparse sends its dense choices to the dense kernel, the
// others to the sparse one) without a workgroup for a head it leaves out.

// The KV head of the dispatch's i-th selected head.
fn selected_kv_head(i: u32) -> u32 {
    if shape.kv_heads == 0u {
        return i;
    }
    var left = i;
    for (var h = 0u; h < 32u; h++) {
        if (shape.kv_heads & (1u << h)) != 0u {
            if left == 0u {
                return h;
            }
            left -= 1u;
        }
    }
    return 0u;
}
