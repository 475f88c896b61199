"""KV connectors' per-layer hooks on the GPU path (``-m gpu``, skipped without CUDA): ExampleConnector
saves a prompt's blocks from the CUDA cache layer by layer during the forward (that step runs
eagerly, outside the captured decode graphs) and a new engine loads them into its CUDA cache, on a
tiny random Llama: the same greedy tokens as an engine without a connector."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from helpers import save_tiny_llama  # noqa: E402
from kernels.triton import interpreting  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels would not be compiled"),
]

PROMPT = [1] + [3 + (37 * i) % 250 for i in range(59)]      # 60 tokens: 3 full blocks before the last


def test_a_prompt_saved_from_the_cuda_cache_loads_into_another_engines(tmp_path):
    from tools.bench.kv_storage import LocalEngine
    model = save_tiny_llama(tmp_path / "tiny", 256, 128, 256, 4, 2, 32, 512)
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    engines = []
    try:
        plain = LocalEngine(model, block_size=16, max_model_len=512)
        engines.append(plain)
        assert plain.worker.config.device.device == "cuda"
        reference = plain.run("plain", PROMPT, 8)[0]
        saver = LocalEngine(model, kv_transfer_config=kv, block_size=16, max_model_len=512)
        engines.append(saver)
        assert saver.run("save", PROMPT, 8)[0] == reference
        assert saver.connector.flush()
        loader = LocalEngine(model, kv_transfer_config=kv, block_size=16, max_model_len=512)
        engines.append(loader)
        assert loader.run("load", PROMPT, 8)[0] == reference
        assert loader.scheduler.stats().external_prefix_cache_hits == 3 * 16
    finally:
        for e in engines:
            e.close()
