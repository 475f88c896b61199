"""Fast paths keep the exact model's results: oneDNN-prepacked linear layers equal F.linear to
float32 rounding, and the GGUF-native mode keeps the exact greedy tokens on a short prompt."""
from __future__ import annotations

import pytest
import torch

from models.layers import Linear
from models.onednn import OneDNNLinear, available, prepack_linears


@pytest.mark.skipif(not available(), reason="oneDNN is not available in this PyTorch")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_prepacked_linear_equals_plain_linear(rows):
    w, b = torch.randn(96, 160), torch.randn(96)
    x = torch.randn(rows, 160)
    ref = x.double() @ w.double().T + b.double()
    got = OneDNNLinear(w, b)(x).double()
    assert ((got - ref).abs().max() / ref.abs().max()) < 5e-6


@pytest.mark.skipif(not available(), reason="oneDNN is not available in this PyTorch")
def test_prepack_replaces_every_linear_and_keeps_tied_embeddings():
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Parameter(torch.randn(50, 16), requires_grad=False)
            self.a = Linear(16, 16, torch.float32)
            self.head = Linear(16, 50, torch.float32, weight=self.emb)
    m = Tiny()
    m.a.weight.data.normal_()
    assert prepack_linears(m) == 2
    assert isinstance(m.a, OneDNNLinear) and isinstance(m.head, OneDNNLinear)
    assert isinstance(m.emb, nn.Parameter) and m.emb.shape == (50, 16)   # the embedding stays


def _greedy(model, cfg, ids, n=12):
    from kernels.attention import allocate_kv_caches, build_attention_metadata
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


@pytest.mark.slow
@pytest.mark.parametrize("transform", ["gguf", "onednn"])
def test_fast_paths_keep_smollm2_greedy_tokens(transform):
    from models.quant import quantize
    from models.registry import load_model
    from models.resolve import resolve_model
    src = resolve_model(None)
    exact, cfg = load_model(src)
    fast, _ = load_model(src)
    if transform == "gguf":
        quantize(fast, "gguf", src.path)
    else:
        prepack_linears(fast)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 2]                 # 8 tokens: the native path
    assert _greedy(fast, cfg, ids) == _greedy(exact, cfg, ids)
