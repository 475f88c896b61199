"""The GPU worker (``-m gpu``, skipped without CUDA): device and dtype chosen automatically, the
model and KV cache on CUDA with the Triton backend, decode graphs captured at InitKVCache, and
graph replays giving what the eager CUDA path and the CPU path give, on a tiny random Llama."""
from __future__ import annotations

import asyncio
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import save_tiny_llama  # noqa: E402
from kernels.triton import interpreting  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels would not be compiled"),
]

BLOCK_SIZE = 16
VOCAB = 256


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_gpu"), VOCAB, 128, 256, 4, 2, 32, 512)


def _worker(path: str, **options):
    """(the worker's core, the config it resolved, its KV cache bytes) for engine ``options``."""
    import msgspec
    from actors.engine.args import EngineArgs
    from actors.worker.actor import InitKVCache, LoadModel, WorkerActor
    config = EngineArgs(model=path, block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=512,
                        **options).create_engine_config()
    config = config.replace(cache=msgspec.structs.replace(config.cache, num_blocks=128))
    worker = WorkerActor()
    resolved = asyncio.run(worker.receive(LoadModel(config)))
    kv_bytes = asyncio.run(worker.receive(InitKVCache()))
    return worker.core, resolved, kv_bytes


def test_worker_goes_to_cuda_in_bfloat16_and_captures_decode_graphs(tiny_llama, monkeypatch):
    from actors.worker.cuda_graphs import BatchDescriptor, capture_sizes
    from kernels.attention.triton_backend import TritonAttentionBackend
    from kernels.triton import fused as triton_fused
    from tools.gpu_check.driver import generate
    calls = dict.fromkeys(("rms_norm", "rotary_", "silu_and_mul"), 0)
    for name in calls:
        def counted(*args, _fn=getattr(triton_fused, name), _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(triton_fused, name, counted)
    worker, resolved, kv_bytes = _worker(tiny_llama)
    assert (resolved.device.device, resolved.model.dtype) == ("cuda", "bfloat16")
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in worker.model.parameters())
    assert isinstance(worker.model.layers[0].self_attn.backend, TritonAttentionBackend)
    runner = worker.runner
    assert all(t.is_cuda for t in runner.kv_caches) and kv_bytes > 0
    assert list(runner.graphs.graphs) == [BatchDescriptor(n, n, True) for n in reversed(capture_sizes(8))]
    outs = generate(runner, [[1, 2, 3], list(range(5, 40)), [7] * 20], 12, BLOCK_SIZE)
    assert [len(o) for o in outs] == [12, 12, 12] and all(0 <= t < VOCAB for o in outs for t in o)
    assert all(calls.values()), f"the layers did not all run their Triton kernels: {calls}"


def test_enforce_eager_and_cpu_capture_nothing(tiny_llama):
    worker, resolved, _ = _worker(tiny_llama, enforce_eager=True)
    assert resolved.device.device == "cuda" and worker.runner.graphs is None
    worker, resolved, _ = _worker(tiny_llama, device="cpu")
    assert (resolved.device.device, resolved.model.dtype) == ("cpu", "float32") and worker.runner.graphs is None


def _runner(path: str, device: str, sizes: list[int] | None):
    from actors.worker.model_runner import ModelRunner
    from models.registry import load_model
    from models.resolve import resolve_model
    from tools.gpu_check.driver import runner_config
    model, config = load_model(resolve_model(path), torch.float32, block_size=BLOCK_SIZE, device=device)
    runner = ModelRunner(model, runner_config(config, device, torch.float32, max_num_seqs=8, num_blocks=96,
                                              block_size=BLOCK_SIZE), sizes)
    if sizes and device == "cuda":
        runner.capture_cudagraphs()
    return runner


def _assert_same(expected, got, atol: float, skip: tuple[str, ...] = ()) -> None:
    for (ids_e, tok_e, lp_e), (ids_g, tok_g, lp_g) in zip(expected, got, strict=True):
        assert ids_g == ids_e
        for rid, te, tg in zip(ids_e, tok_e, tok_g):
            if rid not in skip:
                assert tg == te, rid
        for rid, (ids, vals) in lp_e.items():
            if rid not in skip:
                assert lp_g[rid][0][0][:1] == ids[0][:1]
                np.testing.assert_allclose(lp_g[rid][1][0][0], vals[0][0], rtol=0, atol=atol)


def test_graph_replays_equal_eager_cuda_and_cpu_in_float32(tiny_llama):
    """float32 everywhere, so the three paths agree to rounding: graphs (padded replays) vs the
    eager CUDA path (seeded row included: same device, same generator), and vs the CPU path
    (seeded row excluded: CUDA and CPU generators draw different streams)."""
    from tools.gpu_check.driver import padding_scenario
    graphs = _runner(tiny_llama, "cuda", [1, 2, 4, 8])
    replays = []
    run = graphs.graphs.run
    graphs.graphs.run = lambda desc, inp: replays.append(desc.num_reqs) or run(desc, inp)
    got = padding_scenario(graphs, BLOCK_SIZE, VOCAB)
    assert set(replays) == {1, 2, 4, 8}
    eager = padding_scenario(_runner(tiny_llama, "cuda", None), BLOCK_SIZE, VOCAB)
    cpu = padding_scenario(_runner(tiny_llama, "cpu", None), BLOCK_SIZE, VOCAB)
    _assert_same(eager, got, atol=1e-4)
    _assert_same(cpu, got, atol=2e-3, skip=("s",))


def test_batches_beyond_the_largest_graph_run_eagerly(tiny_llama):
    from tools.gpu_check.driver import generate
    small = _runner(tiny_llama, "cuda", [1, 2])
    replays = []
    run = small.graphs.run
    small.graphs.run = lambda desc, inp: replays.append(desc.num_reqs) or run(desc, inp)
    prompts = [[3, 4, 5], [9] * 7, list(range(10, 30))]
    assert generate(small, prompts, 6, BLOCK_SIZE) == generate(_runner(tiny_llama, "cuda", None), prompts, 6,
                                                                BLOCK_SIZE)
    assert replays == []              # 3 rows: no graph that large, so every decode ran eagerly
