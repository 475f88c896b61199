"""Quantized safetensors checkpoints (fp8, compressed-tensors fp8 / int8 W8A8, AWQ, GPTQ with and
without act-order) of a tiny random Llama load through the quantization registry and give the
logits of the float model holding their dequantized weights; unsupported or mismatched
quantization is refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.attention import allocate_kv_caches
from models.registry import load_model
from models.resolve import resolve_model
from tests.helpers import run_steps, save_tiny_llama
from tools.quantize import quantize_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("float"), vocab=96, hidden=128, intermediate=256, heads=4,
                           kv_heads=2, head_dim=32, max_positions=64)


def _logits(path: str) -> torch.Tensor:
    model, cfg = load_model(resolve_model(path))
    caches = allocate_kv_caches(cfg, 4, 16)
    prompt = torch.tensor([3, 17, 42, 5, 88, 61, 9, 30, 2, 77])
    steps = [[prompt], [torch.tensor([11])], [torch.tensor([54])]]
    return run_steps(model, caches, [[0, 1, 2]], steps, 16)


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _write(out, tensors: dict, float_dir: str, quantization_config: dict | None) -> str:
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(float_dir, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out)


def _float_weights(float_dir: str) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(os.path.join(float_dir, "model.safetensors")).items()}


def _assert_close(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


# --- fp8 and int8 from our quantize tool: the dequantized model, written from its tensors ------

def _dequantized_dir(quant_dir: str, float_dir: str, out) -> str:
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    deq = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if _is_linear(name):
            scale = tensors[name.removesuffix(".weight") + ".weight_scale"].float()
            if scale.dim() == 2 and scale.shape[1] > 1:                     # per group of input features
                scale = scale.repeat_interleave(t.shape[1] // scale.shape[1], dim=1)
            deq[name] = t.float() * (scale if scale.dim() == 2 else scale.reshape(-1, 1))
        else:
            deq[name] = t.float()
    return _write(out, deq, float_dir, None)


@pytest.mark.parametrize("scheme,per_channel,group,rtol", [
    ("fp8", False, 0, 1e-5), ("fp8", True, 0, 1e-5),   # the CPU dequantizes fp8 at load: float32 rounding only
    ("int8", True, 0, 2e-2), ("int8", False, 32, 2e-2),  # int8 weights exactly; activations in two int8 parts
])
def test_compressed_tensors_checkpoint_gives_the_dequantized_models_logits(float_dir, tmp_path, scheme, per_channel,
                                                                            group, rtol):
    quant = tmp_path / "q"
    report = quantize_checkpoint(float_dir, scheme, per_channel, str(quant), group)
    assert report["quantized_layers"] == 2 * len(LINEARS)
    with open(quant / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    stored = load_file(str(quant / "model.safetensors"))
    expected = torch.float8_e4m3fn if scheme == "fp8" else torch.int8
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == expected
    assert stored["model.layers.1.mlp.down_proj.weight_scale"].shape == (
        (128, 256 // group) if group else (128, 1) if per_channel else (1,))
    assert stored["lm_head.weight"].dtype == torch.float32
    ref = _logits(_dequantized_dir(str(quant), float_dir, tmp_path / "ref"))
    _assert_close(_logits(str(quant)), ref, rtol)
    assert (ref - _logits(float_dir)).abs().max() > 0          # the quantization did change the weights


def test_vllm_fp8_layout_with_static_input_scale_loads(float_dir, tmp_path):
    """vLLM's own "fp8" quant_method: per-tensor weight_scale as a scalar, an input_scale."""
    tensors, deq = {}, {}
    for name, w in _float_weights(float_dir).items():
        if not _is_linear(name):
            tensors[name] = deq[name] = w
            continue
        scale = w.abs().max() / 448
        codes = (w / scale).to(torch.float8_e4m3fn)
        stem = name.removesuffix(".weight")
        tensors[name], tensors[stem + ".weight_scale"] = codes, scale.reshape(())
        tensors[stem + ".input_scale"] = torch.tensor(0.01)
        deq[name] = codes.float() * scale
    quant = _write(tmp_path / "q", tensors, float_dir, {"quant_method": "fp8", "activation_scheme": "static"})
    _assert_close(_logits(quant), _logits(_write(tmp_path / "ref", deq, float_dir, None)), 1e-5)


# --- AWQ and GPTQ, packed here with a reference 4-bit quantizer -----------------------------

def _quantize_int4(w: torch.Tensor, g_idx: torch.Tensor):
    """(q (K, N), zeros (G, N), scales (G, N) float16, dequantized (N, K))."""
    from models.quantization.formats import quantize_int4
    q, zeros, scales = quantize_int4(w, g_idx)
    deq = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t()
    return q, zeros, scales, deq


def _int4_checkpoint(float_dir: str, out, fmt: str, act_order: bool = False):
    from models.quantization.formats import awq_order, pack_int32
    tensors, deq = {}, {}
    gen = torch.Generator().manual_seed(1)
    for name, w in _float_weights(float_dir).items():
        if not _is_linear(name):
            tensors[name] = deq[name] = w
            continue
        k = w.shape[1]
        g_idx = torch.randperm(k, generator=gen) // GROUP if act_order else torch.arange(k) // GROUP
        q, zeros, scales, deq[name] = _quantize_int4(w, g_idx)
        stem = name.removesuffix(".weight")
        tensors[stem + ".scales"] = scales
        if fmt == "awq":
            tensors[stem + ".qweight"] = pack_int32(awq_order(q), 4, 1)       # (K, N / 8)
            tensors[stem + ".qzeros"] = pack_int32(awq_order(zeros), 4, 1)    # (G, N / 8)
        else:
            tensors[stem + ".qweight"] = pack_int32(q, 4, 0)                  # (K / 8, N)
            tensors[stem + ".qzeros"] = pack_int32(zeros - 1, 4, 1)           # gptq v1 stores zero - 1
            tensors[stem + ".g_idx"] = g_idx.int()
    config = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
              if fmt == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
                                    "sym": False, "checkpoint_format": "gptq"})
    return _write(out / "q", tensors, float_dir, config), _write(out / "ref", deq, float_dir, None)


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_int4_checkpoint_gives_the_dequantized_models_logits(float_dir, tmp_path, fmt, act_order):
    """W4A16: the codes and float16 scales are held exactly (Q8_0 blocks; act-order: float32),
    activations stay float32, so only the summation order differs."""
    quant, ref = _int4_checkpoint(float_dir, tmp_path, fmt, act_order)
    model, _ = load_model(resolve_model(quant))
    kind = "Linear" if act_order else "PanelLinear"
    assert type(model.layers[0].mlp.down_proj).__name__ == kind
    _assert_close(_logits(quant), _logits(ref), 1e-5)


@pytest.mark.parametrize("scheme", ["awq", "gptq"])
def test_quantize_tool_writes_int4_checkpoints_that_load_as_the_rounded_float_model(float_dir, tmp_path, scheme):
    """The tool's AWQ (asymmetric) and GPTQ (symmetric) checkpoints hold the float weights rounded to
    4 bits per group of 128: they give the logits of a float model holding those rounded weights,
    computed here from the float weights, not read back from the packed file."""
    from models.quantization.formats import quantize_int4
    report = quantize_checkpoint(float_dir, scheme, False, str(tmp_path / "q"))
    assert report["quantized_layers"] == 2 * len(LINEARS) and report["group_size"] == GROUP
    with open(tmp_path / "q" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"]) == (scheme, 4, GROUP)
    rounded = {}
    for name, w in _float_weights(float_dir).items():
        if _is_linear(name):
            g_idx = torch.arange(w.shape[1]) // GROUP
            q, zeros, scales = quantize_int4(w, g_idx, symmetric=scheme == "gptq")
            w = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t()
        rounded[name] = w
    ref = _logits(_write(tmp_path / "ref", rounded, float_dir, None))
    _assert_close(_logits(str(tmp_path / "q")), ref, 1e-5)
    assert (ref - _logits(float_dir)).abs().max() > 0


def test_quantize_tool_refuses_int4_groups_that_do_not_divide_the_layers(float_dir, tmp_path):
    with pytest.raises(ValueError, match="choose --group-size"):
        quantize_checkpoint(float_dir, "awq", False, str(tmp_path / "q"), 96)
    with pytest.raises(ValueError, match="--per-channel is for fp8 and int8"):
        quantize_checkpoint(float_dir, "gptq", True, str(tmp_path / "q"))


# --- resolution ---------------------------------------------------------------------------

def test_unsupported_quantization_method_is_refused_by_name(float_dir, tmp_path):
    path = _write(tmp_path / "bnb", _float_weights(float_dir), float_dir,
                  {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="quantization method 'bitsandbytes' in config.json is not supported; "
                                         "supported: fp8, compressed-tensors, awq, gptq"):
        load_model(resolve_model(path))


def test_flag_disagreeing_with_the_checkpoint_is_refused(float_dir, tmp_path):
    quant = str(tmp_path / "q")
    quantize_checkpoint(float_dir, "int8", True, quant)
    with pytest.raises(ValueError, match="--quantization awq does not match .*'compressed-tensors'"):
        load_model(resolve_model(quant), quantization="awq")
    with pytest.raises(ValueError, match="needs a model loaded from a .gguf file"):
        load_model(resolve_model(float_dir), quantization="gguf")


def test_fp8_flag_quantizes_a_float_checkpoint_at_load(float_dir, tmp_path):
    """--quantization fp8 on a float checkpoint: fp8 weights with one scale per (fused) layer, as
    vLLM's online fp8 quantizes them (q|k|v share a scale, as do gate|up)."""
    weights = _float_weights(float_dir)
    fused = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    amax = {}
    for name, w in weights.items():
        if _is_linear(name):
            key = name.replace(name.split(".")[-2], fused.get(name.split(".")[-2], name.split(".")[-2]))
            amax[key] = max(amax.get(key, 0.0), float(w.abs().max()))
    deq = {}
    for name, w in weights.items():
        if not _is_linear(name):
            deq[name] = w
            continue
        scale = torch.tensor(amax[name.replace(name.split(".")[-2], fused.get(name.split(".")[-2], name.split(".")[-2]))]
                             / 448)
        deq[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    ref = _logits(_write(tmp_path / "ref", deq, float_dir, None))
    model, _ = load_model(resolve_model(float_dir), quantization="fp8")
    caches = allocate_kv_caches(model.config, 4, 16)
    prompt = torch.tensor([3, 17, 42, 5, 88, 61, 9, 30, 2, 77])
    got = run_steps(model, caches, [[0, 1, 2]], [[prompt], [torch.tensor([11])], [torch.tensor([54])]], 16)
    _assert_close(got, ref, 1e-5)


def test_ignore_list_keeps_named_layers_float(float_dir, tmp_path):
    quant = str(tmp_path / "q")
    quantize_checkpoint(float_dir, "int8", True, quant)
    with open(os.path.join(quant, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] += ["re:.*down_proj"]
    tensors = load_file(os.path.join(quant, "model.safetensors"))
    for i in range(2):
        stem = f"model.layers.{i}.mlp.down_proj"
        tensors[stem + ".weight"] = tensors[stem + ".weight"].float() * tensors.pop(stem + ".weight_scale")
    save_file(tensors, os.path.join(quant, "model.safetensors"))
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(config, f)
    model, _ = load_model(resolve_model(quant))
    assert type(model.layers[0].mlp.down_proj).__name__ == "Linear"
    assert type(model.layers[0].mlp.gate_up_proj).__name__ == "PanelLinear"


def test_quantization_flag_accepts_exactly_the_registered_formats():
    from actors.engine.config import QUANTIZATIONS
    from models.quantization import QUANTIZATION_METHODS
    assert set(QUANTIZATIONS) == set(QUANTIZATION_METHODS)
