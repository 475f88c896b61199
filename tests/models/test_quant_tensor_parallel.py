"""Quantized checkpoints over two tensor-parallel ranks (real processes in a gloo group): each rank
takes its rows (q|k|v, gate|up) or its columns (o, down) of the checkpoint's quantized tensors
before they are processed, and the two give the logits of the unsplit quantized model: fp8 per
tensor and per channel, int8 W8A8 per channel and per group, AWQ and GPTQ 4-bit (groups of 128,
so each rank's 192 columns of down_proj start or end inside a group), GPTQ with act-order, and
``--quantization fp8`` of a float checkpoint (the ranks keep the whole layer's scale)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention import allocate_kv_caches
from models.registry import build_model, load_model, open_checkpoint
from models.resolve import resolve_model
from models.tensor_parallel import shard_model
from tests.helpers import run_ranks, run_steps, save_tiny_llama
from tools.quantize import quantize_checkpoint

# (name, tools.quantize scheme or None, --per-channel, --group-size, --quantization), error bound
CASES = [
    ("fp8 per tensor", "fp8", False, 0, None, 1e-5),
    ("fp8 per channel", "fp8", True, 0, None, 1e-5),
    ("int8 W8A8 per channel", "int8", True, 0, None, 1e-3),      # activations rounded to int8 on each side
    ("int8 W8A8 groups of 32", "int8", False, 32, None, 1e-3),
    ("awq", "awq", False, 128, None, 1e-5),
    ("gptq", "gptq", False, 128, None, 1e-5),
    ("gptq act-order", None, False, 128, None, 1e-5),
    ("--quantization fp8", None, False, 0, "fp8", 1e-5),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_quant")
    float_dir = save_tiny_llama(root / "float", vocab=96, hidden=128, intermediate=384, heads=4, kv_heads=2,
                                head_dim=32, max_positions=64)
    paths = {}
    for name, scheme, per_channel, group, _, _ in CASES:
        out = str(root / name.replace(" ", "_"))
        if scheme is not None:
            quantize_checkpoint(float_dir, scheme, per_channel, out, group)
        elif name == "gptq act-order":
            from test_quant_formats import _int4_checkpoint
            out = _int4_checkpoint(float_dir, root / "act_order", "gptq", act_order=True)[0]
        else:
            out = float_dir
        paths[name] = out
    return paths


def _logits(model: torch.nn.Module, path: str, kv_heads: int) -> torch.Tensor:
    cfg = dataclasses.replace(open_checkpoint(resolve_model(path)).config, num_kv_heads=kv_heads)
    caches = allocate_kv_caches(cfg, 4, 16)
    prompt = torch.tensor([3, 17, 42, 5, 88, 61, 9, 30, 2, 77])
    return run_steps(model, caches, [[0, 1, 2]], [[prompt], [torch.tensor([11])], [torch.tensor([54])]], 16)


def _rank(rank: int, world: int, paths: dict[str, str]) -> dict:
    """Each format's logits on this rank, and the kinds of its first layer's down and qkv projections."""
    saved = {}
    for name, *_, flag, _ in CASES:
        path = paths[name]
        model = build_model(open_checkpoint(resolve_model(path)), quantization=flag,
                            transform=lambda m: shard_model(m, world, rank))
        layer = model.layers[0]
        saved[name] = (_logits(model, path, 1), type(layer.mlp.down_proj.linear).__name__,
                       type(layer.self_attn.qkv_proj).__name__)
    return saved


def test_two_ranks_of_each_quantized_format_give_the_unsplit_quantized_models_logits(checkpoints, tmp_path):
    ranks = run_ranks(_rank, 2, tmp_path, checkpoints)
    for name, *_, flag, bound in CASES:
        path = checkpoints[name]
        model, _ = load_model(resolve_model(path), quantization=flag)
        want = _logits(model, path, 2)
        float_model, _ = load_model(resolve_model(checkpoints["--quantization fp8"]))
        assert (want - _logits(float_model, path, 2)).abs().max() > 0, name        # quantized, not float
        for r, rank in enumerate(ranks):
            err = float((rank[name][0] - want).abs().max() / want.abs().max())
            assert err < bound, f"{name}: relative error {err:.2e}"
        # each rank's down_proj starts or ends inside a group of 128: its blocks of 32 still hold the codes
        if name in ("awq", "gptq"):
            assert [r[name][1] for r in ranks] == ["PanelLinear", "PanelLinear"], name
