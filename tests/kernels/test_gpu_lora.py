"""LoRA on the GPU worker (``-m gpu``, skipped without CUDA): with --enable-lora the worker
captures a plain and a LoRA graph per decode size, and a batch mixing two adapters and base rows
replays them to the greedy tokens the eager worker (--enforce-eager) gives."""
from __future__ import annotations

import asyncio
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from helpers import save_tiny_llama, save_tiny_lora  # noqa: E402
from kernels.triton import interpreting  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels would not be compiled"),
]

BLOCK_SIZE, VOCAB = 16, 256
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from actors.engine.lora import LoRARequest
    root = tmp_path_factory.mktemp("gpu_lora")
    path = save_tiny_llama(root / "base", VOCAB, 128, 256, 4, 2, 32, 512)
    loras = {}
    for i, name in enumerate(("a", "b")):
        save_tiny_lora(path, root / name, 16, ALL, seed=i, scale=0.2)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
    return path, loras


def _runner(path: str, **options):
    import msgspec
    from actors.engine.args import EngineArgs
    from actors.worker.actor import InitKVCache, LoadModel, WorkerActor
    config = EngineArgs(model=path, block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=512, dtype="float32",
                        enable_lora=True, max_loras=2, **options).create_engine_config()
    config = config.replace(cache=msgspec.structs.replace(config.cache, num_blocks=128))
    worker = WorkerActor()
    asyncio.run(worker.receive(LoadModel(config)))
    asyncio.run(worker.receive(InitKVCache()))
    return worker.core.runner


def _generate(runner, loras) -> dict[str, list[int]]:
    from tools.gpu_check.driver import StepDriver
    d = StepDriver(runner, BLOCK_SIZE)
    prompts = {"r0": [1, 2, 3], "r1": list(range(5, 40)), "r2": [7] * 20, "r3": [9, 8, 7, 6]}
    d.prefill(prompts, loras={"r0": loras["a"], "r2": loras["b"], "r3": loras["a"]})
    for _ in range(10):
        d.decode()
    return d.outputs


def test_lora_decode_graphs_give_the_eager_tokens(files):
    from actors.worker.cuda_graphs import BatchDescriptor
    path, loras = files
    graphs = _runner(path)
    assert BatchDescriptor(4, 4, True, True) in graphs.graphs.graphs
    replays = []
    run = graphs.graphs.run
    graphs.graphs.run = lambda desc, inp: replays.append(desc) or run(desc, inp)
    got = _generate(graphs, loras)
    assert replays and all(d.has_lora for d in replays)
    assert got == _generate(_runner(path, enforce_eager=True), loras)
