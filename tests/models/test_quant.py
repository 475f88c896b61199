"""Quantized modes: the split-int8 product is within 1e-4 of float32, and on the real model the
GGUF-native and split-int8 paths keep the exact model's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from models.quant import SplitInt8Linear, split_int8


def test_split_int8_reconstructs_to_fourteen_bits():
    t = torch.randn(64, 300) * torch.logspace(-2, 2, 300)      # wide dynamic range per row
    qh, sh, ql, sl = split_int8(t)
    back = qh.float() * sh + ql.float() * sl
    assert ((back - t).abs().amax(1) / t.abs().amax(1)).max() < 1 / 127 / 127


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_split_int8_linear_is_within_1e4_of_float32(rows):
    w, b = torch.randn(96, 160), torch.randn(96)
    x = torch.randn(rows, 160)
    ref = x.double() @ w.double().T + b.double()
    got = SplitInt8Linear(w, b)(x).double()
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gguf", "int8"])
def test_quantized_smollm2_keeps_greedy_tokens_of_a_short_prompt(mode):
    from kernels.attention import allocate_kv_caches, build_attention_metadata
    from models.quant import quantize
    from models.registry import load_model
    from models.resolve import resolve_model
    src = resolve_model(None)
    exact, cfg = load_model(src)
    fast, _ = load_model(src)
    quantize(fast, mode, src.path)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 2]                 # 8 tokens: the native path

    def greedy(model, n=12):
        kv = allocate_kv_caches(cfg, 8, 16)
        out, seq = [], list(ids)
        with torch.inference_mode():
            for step in range(n):
                q = seq if step == 0 else seq[-1:]
                meta = build_attention_metadata([len(q)], [len(seq)], [list(range(1, 8))], 16)
                h = model(torch.tensor(q), torch.arange(len(seq) - len(q), len(seq)), kv, meta)
                tok = int(model.compute_logits(h[-1:]).argmax())
                out.append(tok)
                seq.append(tok)
        return out
    assert greedy(fast) == greedy(exact)
