#!/usr/bin/env python3
"""Writes the reference vectors that simd/tests/reference_vectors.rs checks.

Everything here comes from the `gguf` Python package (llama.cpp's gguf-py), which is
an implementation independent of sift's Rust code:

  NAME.blocks        random but valid raw blocks of weight type NAME (every type sift reads)
  NAME.dequant       gguf.quants.dequantize of NAME.blocks (float32, little-endian)
  NAME.quant.input   random float32 rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 only)
  NAME.quant.blocks  gguf.quants.quantize of NAME.quant.input
  NAME.quant.dequant gguf.quants.dequantize of NAME.quant.blocks

Run from anywhere:  pip install gguf numpy && python3 make_vectors.py
The seed is fixed, so a rerun with the same package versions rewrites identical files.
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

OUT = Path(__file__).resolve().parent
rng = np.random.default_rng(0x51F7)

N = 1536  # elements per file: 48 blocks of 32, 6 super-blocks of 256

WEIGHTS = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Formats added later, drawn after all the others so that the earlier files stay as they were.
LATER_WEIGHTS = ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S"]

# Byte offsets of the f16 scale fields inside each block (the rest is random bits).
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "IQ3_XXS": [0],
    "IQ3_S": [0],
}


def sane_f16(count: int) -> np.ndarray:
    """Finite f16 scales: mostly small normals of both signs, plus zeros, a subnormal
    and a large value now and then."""
    v = (rng.standard_normal(count) * 10.0 ** rng.uniform(-4, 0, count)).astype(np.float16)
    special = np.array([0.0, -0.0, 3e-6, -1e-7, 250.0, 6.1e-5], dtype=np.float16)
    pick = rng.random(count) < 0.1
    v[pick] = rng.choice(special, pick.sum())
    return v


def random_f16_bits(count: int, exp_mask: int, exp_shift: int) -> np.ndarray:
    """Random 16-bit patterns with the all-ones exponent only as infinity (no NaNs)."""
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint32).astype(np.uint16)
    nan = (bits & exp_mask) == exp_mask
    mant = bits & ((1 << exp_shift) - 1)
    bits[nan & (mant != 0)] &= np.uint16(~exp_mask & 0xFFFF)  # make them finite
    return bits


def random_blocks(name: str) -> np.ndarray:
    qtype = T[name]
    if name == "F32":
        v = (rng.standard_normal(N) * 10.0 ** rng.uniform(-6, 6, N)).astype(np.float32)
        v[:8] = [0.0, -0.0, np.inf, -np.inf, 1e-40, -3e-45, 3.4e38, 1.0]
        return v.view(np.uint8)
    if name == "F16":
        return random_f16_bits(N, 0x7C00, 10).view(np.uint8)
    if name == "BF16":
        return random_f16_bits(N, 0x7F80, 7).view(np.uint8)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = N // block_elems
    raw = rng.integers(0, 256, (nb, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        raw[:, off : off + 2] = sane_f16(nb).view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def quant_input() -> np.ndarray:
    nb = N // 32
    x = (rng.standard_normal((nb, 32)) * 10.0 ** rng.uniform(-3, 2, (nb, 1))).astype(np.float32)
    x[0] = 0.0  # all-zero block
    x[1] = 0.0
    x[1, 7] = -2.5  # a single non-zero element
    # Rounding ties for Q8_0: amax 127 makes d = 1 and x·(1/d) = x exactly.
    x[2] = np.array([127.0] + [(k - 15) + 0.5 for k in range(31)], dtype=np.float32)
    x[3] = -x[2]
    x[4] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # equal-magnitude extremes
    x[5] = rng.uniform(0.5, 1.5, 32).astype(np.float32)  # all positive (Q4_1 min > 0)
    return x.reshape(-1)


def dequant(name: str, raw: np.ndarray) -> np.ndarray:
    qtype = T[name]
    out = dequantize(raw.reshape(1, -1), qtype).reshape(-1).astype(np.float32)
    assert out.size == N, (name, out.size)
    return out


def write_random_blocks(name: str) -> None:
    raw = random_blocks(name)
    (OUT / f"{name}.blocks").write_bytes(raw.tobytes())
    (OUT / f"{name}.dequant").write_bytes(dequant(name, raw).astype("<f4").tobytes())


def main() -> None:
    for name in WEIGHTS:
        write_random_blocks(name)
    for name in QUANTIZABLE:
        x = quant_input()
        q = quantize(x.reshape(1, -1), T[name]).reshape(-1)
        (OUT / f"{name}.quant.input").write_bytes(x.astype("<f4").tobytes())
        (OUT / f"{name}.quant.blocks").write_bytes(q.tobytes())
        (OUT / f"{name}.quant.dequant").write_bytes(dequant(name, q).astype("<f4").tobytes())
    for name in LATER_WEIGHTS:
        write_random_blocks(name)


if __name__ == "__main__":
    main()
