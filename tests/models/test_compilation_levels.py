"""--compilation-config levels: the CPU kernels' custom-op registrations pass torch's checks,
the flag parses as vLLM's, and every level (eager plain, eager custom ops, torch.compile of the
pieces between attention calls, and that with inductor fusing the elementwise ops) gives the same
greedy tokens on a tiny random Llama."""
from __future__ import annotations

import sys

import pytest
import torch

import kernels.cpu.fused as fused
from actors.api import LLM
from actors.engine.compilation import CompilationConfig, compilation_config
from actors.engine.sampling_params import SamplingParams
from helpers import save_tiny_llama, save_tiny_tokenizer


@pytest.fixture(autouse=True)
def recursion_limit_restored():
    """Inductor raises the interpreter's recursion limit when it compiles; the other tests of
    this process (the request decoder's nesting guard among them) expect the usual one back."""
    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)

PROMPTS = ["t1 t2 t3 t4 t5", "t9 t8 t7", "t3 t3 t3 t3 t3 t3 t3 t3 t3 t3 t3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.skipif(not fused.supports(torch.zeros(1)), reason="the native CPU kernels cannot run here")
def test_cpu_custom_ops_pass_torch_opcheck():
    x = torch.randn(5, 64)
    w = torch.randn(64)
    qkv = torch.randn(5, 4 * 16)
    cos, sin = torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    ops = torch.ops.troupe
    torch.library.opcheck(ops.cpu_rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(ops.cpu_fused_add_rms_norm.default, (x, torch.randn(5, 64), w, 1e-6))
    torch.library.opcheck(ops.cpu_rotary_.default, (qkv[:, :32].view(5, 2, 16), qkv[:, 32:48].view(5, 1, 16),
                                                    cos, sin), test_utils=("test_schema", "test_faketensor"))
    for act in fused.ACTIVATIONS.values():
        torch.library.opcheck(ops.cpu_gated_activation.default, (torch.randn(5, 2 * 64), act))
        torch.library.opcheck(ops.cpu_activation.default, (torch.randn(5, 64), act))


def test_compilation_config_parses_levels_json_and_refuses_what_it_does_not_run():
    assert compilation_config(None) == CompilationConfig(level=1)
    assert compilation_config("3").level == 3
    assert compilation_config(2).level == 2
    c = compilation_config('{"mode": 2, "cudagraph_capture_sizes": [4, 1, 2], "cudagraph_mode": "NONE"}')
    assert (c.level, c.cudagraph_capture_sizes, c.cudagraph_mode) == (2, (1, 2, 4), "NONE")
    for bad in ("4", '{"level": 1, "mode": 2}', '{"cudagraph_mode": "PIECEWISE"}', '{"splitting_ops": ["x"]}',
                '{"inductor_passes": {}}', "fast"):
        with pytest.raises(ValueError, match="compilation-config"):
            compilation_config(bad)


def test_dash_o_and_compilation_config_reach_the_engine_config(tmp_path):
    import argparse

    from actors.engine.args import EngineArgs
    from tools.vllm_flags import add_vllm_flags
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    add_vllm_flags(p)
    assert p.parse_args(["-O3"]).compilation_config == "3"
    assert p.parse_args(["--compilation-config", '{"level": 0}']).compilation_config == '{"level": 0}'
    path = save_tiny_tokenizer(save_tiny_llama(tmp_path / "ckpt", 64, 32, 48, 2, 1, 16, 128), 64)
    config = EngineArgs(model=path, multiprocess=False, compilation_config="2").create_engine_config()
    assert config.compilation.level == 2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    return save_tiny_tokenizer(save_tiny_llama(path, 64, 64, 128, 4, 2, 16, 256), 64)


def _greedy(model: str, level: int) -> list[list[int]]:
    with LLM(model, multiprocess=False, kv_cache_bytes=1 << 22, compilation_config={"level": level}) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_every_compilation_level_gives_the_same_greedy_tokens_on_a_tiny_llama(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))
    expected = _greedy(tiny_llama, 1)
    assert all(len(t) == GREEDY.max_tokens for t in expected)
    for level in (0, 2, 3):
        assert _greedy(tiny_llama, level) == expected, f"level {level}"
    assert list((tmp_path / "compile").iterdir()), "compiled artifacts cached on disk"


@pytest.mark.skipif(not fused.supports(torch.zeros(1)), reason="the native CPU kernels cannot run here")
@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0", "Q4_1_I8X2"])
def test_panel_matmul_is_a_custom_op_that_compiles_without_a_graph_break(kind):
    """The packed (quantized, bfloat16) linear layers inside a compiled graph: one traced op
    (fullgraph would refuse a graph break at the ctypes call), the eager values."""
    import numpy as np
    from gguf import GGMLQuantizationType, quantize as gguf_quantize

    from kernels.cpu.panels import PanelWeight, int8_available
    from models.packed import PanelLinear
    w = torch.randn(40, 64)
    if kind == "F32":
        weight = PanelWeight.pack_f32(w)
    elif kind == "BF16":
        weight = PanelWeight.pack_bf16(w)
    else:
        if kind.endswith("I8X2") and not int8_available():
            pytest.skip("int8 activations need AVX2 or AVX512-VNNI")
        qtype = kind[:4]
        raw = gguf_quantize(w.numpy(), GGMLQuantizationType[qtype])
        weight = PanelWeight.pack_gguf(qtype, np.ascontiguousarray(raw).view(np.uint8), 40, 64,
                                       int8_activations=kind.endswith("I8X2"))
    torch.library.opcheck(torch.ops.troupe.cpu_panel_matmul.default,
                          (torch.randn(3, 64), weight.codes, weight.d, weight.m, weight.kind, 40, 64))
    layer = PanelLinear(weight, None)

    def block(x):
        return torch.relu(layer(x * 2.0)) + 1.0
    x = torch.randn(5, 64)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), block(x))
