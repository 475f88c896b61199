"""The CPU's ``--dtype bfloat16``: bfloat16 weights in the native panels (AVX512-BF16 dot products
where the CPU has them) around float32 activations, norms and attention; a bfloat16 model where
the linear layers are not packed."""
from __future__ import annotations

import pytest
import torch

from actors.api import LLM, SamplingParams
from actors.engine.args import EngineArgs
from actors.worker.platforms import CpuPlatform
from kernels.cpu.native import available
from models.packed import PanelLinear
from helpers import save_tiny_llama, save_tiny_tokenizer

pytestmark = pytest.mark.skipif(not available()[0], reason=f"native kernels unavailable: {available()[1]}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    return save_tiny_tokenizer(save_tiny_llama(path, 64, 64, 96, 4, 2, 16, 128), 64)


def test_bfloat16_on_the_cpu_packs_bfloat16_weights_around_float32_activations(tiny):
    from actors.worker.worker import Worker
    config = EngineArgs(model=tiny, multiprocess=False, dtype="bfloat16",
                        kv_cache_bytes=1 << 22).create_engine_config()
    worker = Worker(config)
    linears = [m for m in worker.model.modules() if isinstance(m, PanelLinear)]
    assert linears and all(m.weight.kind == "BF16" for m in linears)
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())     # embeddings, norms
    assert worker.config.cache.cache_dtype == "bfloat16"                         # KV cache: the model's dtype
    worker.init_kv_cache()
    assert all(c.dtype == torch.bfloat16 for c in worker.runner.kv_caches)


def test_bfloat16_without_packed_linears_is_a_bfloat16_model():
    assert CpuPlatform.compute_dtype("bfloat16", packs_linears=True) == "float32"
    assert CpuPlatform.compute_dtype("bfloat16", packs_linears=False) == "bfloat16"
    assert CpuPlatform.compute_dtype("float32", packs_linears=True) == "float32"


def test_bfloat16_greedy_tokens_equal_float32_ones_on_a_stable_model(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[3, 17, 5, 9], [40, 2, 11, 8, 30, 6, 21]]
    outs = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(tiny, multiprocess=False, dtype=dtype) as llm:
            outs[dtype] = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["bfloat16"] == outs["float32"]
    assert all(len(t) == 12 for t in outs["float32"])
