"""The native GGUF kernels: Q4_1 and Q8_0 blocks times float32 activations equal the float32
product with the dequantized weights (to float32 rounding), for any number of rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kernels.cpu.native import available, gguf_gemm

pytestmark = pytest.mark.skipif(not available()[0], reason=f"native kernels: {available()[1]}")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("shape", [(96, 64), (200, 160)])
def test_native_product_matches_dequantized_float32(qtype, rows, shape):
    rng = np.random.default_rng(rows)
    n, k = shape
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = quantize(w, Q[qtype])
    dense = torch.from_numpy(dequantize(raw, Q[qtype]).astype(np.float32))
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    x = torch.randn(rows, k)
    got = gguf_gemm(qtype, blocks, n, k, x)
    ref = (x.double() @ dense.double().T)
    assert got.shape == (rows, n)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 2e-6


def test_bad_shapes_are_refused_with_clear_errors():
    blocks = torch.zeros(20 * 4, dtype=torch.uint8)            # 4 Q4_1 blocks: (2, 64)
    with pytest.raises(ValueError, match="needs 80"):
        gguf_gemm("Q4_1", blocks[:60], 2, 64, torch.randn(1, 64))
    with pytest.raises(ValueError, match=r"x must be \(T, 64\)"):
        gguf_gemm("Q4_1", blocks, 2, 64, torch.randn(1, 32))
    with pytest.raises(ValueError, match="no native kernel"):
        gguf_gemm("Q5_K", blocks, 2, 64, torch.randn(1, 64))
