"""Fast paths keep the exact model's results: packed linear layers (native panels, oneDNN)
equal F.linear to float32 rounding, and the packed and GGUF-native models keep the exact greedy
tokens."""
from __future__ import annotations

import pytest
import torch

from models.layers import Linear
from models.packed import OneDNNLinear, PanelLinear, native_available, onednn_available, prepack_linears


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this PyTorch")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_onednn_linear_equals_plain_linear(rows):
    w, b = torch.randn(96, 160), torch.randn(96)
    x = torch.randn(rows, 160)
    ref = x.double() @ w.double().T + b.double()
    got = OneDNNLinear(w, b)(x).double()
    assert ((got - ref).abs().max() / ref.abs().max()) < 5e-6


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels cannot be built here")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_panel_linear_equals_plain_linear_with_bias_and_leading_dims(rows):
    from kernels.cpu.panels import PanelWeight
    w, b = torch.randn(96, 160), torch.randn(96)
    x = torch.randn(2, rows, 160)
    ref = x.double() @ w.double().T + b.double()
    got = PanelLinear(PanelWeight.pack_f32(w), b)(x).double()
    assert got.shape == (2, rows, 96)
    assert ((got - ref).abs().max() / ref.abs().max()) < 5e-6


@pytest.mark.skipif(not (native_available() or onednn_available()), reason="no packed path here")
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
    kind = PanelLinear if native_available() else OneDNNLinear
    assert isinstance(m.a, kind) and isinstance(m.head, kind)
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
@pytest.mark.parametrize("transform", ["gguf", "packed"])
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
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 2]                 # few-row path
    assert _greedy(fast, cfg, ids) == _greedy(exact, cfg, ids)
    ids = [1] + [(i * 7919) % 40000 + 200 for i in range(40)]      # dequantized-panel path
    assert _greedy(fast, cfg, ids) == _greedy(exact, cfg, ids)
