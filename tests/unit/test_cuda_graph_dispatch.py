"""CUDA-graph dispatch on the CPU: the capture-size ladder, which steps are padded to which
captured size, the padded buffers' contents, and, with a real tiny Llama, that running decode
steps through the padded persistent buffers (what a graph replays) gives the real rows exactly
what the plain eager path gives them, with the CPU backend and with the Triton backend under
Triton's interpreter. Capture itself needs CUDA (tests/kernels/test_gpu_worker.py)."""
from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from actors.engine.args import EngineArgs  # noqa: E402
from actors.worker.cuda_graphs import BatchDescriptor, CudaGraphRunner, capture_sizes, graph_sizes  # noqa: E402
from actors.worker.model_runner import ModelRunner  # noqa: E402
from kernels.attention import build_attention_metadata  # noqa: E402
from models.registry import load_model  # noqa: E402
from models.resolve import resolve_model  # noqa: E402
from helpers import assert_same_steps, save_tiny_llama  # noqa: E402
from tools.gpu_check.driver import StepDriver, padding_scenario, runner_config  # noqa: E402
from actors.engine.messages import CachedRequestData, SchedulerOutput  # noqa: E402

BLOCK_SIZE = 16
SIZES = [1, 2, 4, 8]
VOCAB = 128


# -- the ladder and the dispatch --------------------------------------------------------------

def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(50)[-2:] == [48, 50]
    big = capture_sizes(300)
    assert big[-5:] == [248, 256, 272, 288, 300] and big == sorted(set(big))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_vllms_graph_size_flags_pick_the_batches_captured():
    """--cudagraph-capture-sizes and --max-cudagraph-capture-size, as a vLLM command line
    gives them: the sizes the worker captures (larger decode batches run eagerly)."""
    def sizes(*argv: str, max_num_seqs: int = 64) -> list[int]:
        parser = argparse.ArgumentParser()
        EngineArgs.add_cli_args(parser)
        config = EngineArgs.from_cli_args(parser.parse_args(list(argv))).create_engine_config()
        return graph_sizes(config.compilation, max_num_seqs)
    assert sizes() == capture_sizes(64)
    assert sizes("--max-cudagraph-capture-size", "20") == [1, 2, 4, 8, 16, 20]
    assert sizes("--cudagraph-capture-sizes", "4", "1", "32", "2") == [1, 2, 4, 32]
    assert sizes("--cudagraph-capture-sizes", "1", "128", max_num_seqs=64) == [1]
    assert sizes("-cc", '{"max_cudagraph_capture_size": 8}') == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="mutually exclusive"):
        sizes("-cc", '{"cudagraph_capture_sizes": [1]}', "--cudagraph-capture-sizes", "2")
    with pytest.raises(ValueError, match="largest"):
        sizes("--cudagraph-capture-sizes", "1", "2", "--max-cudagraph-capture-size", "4")


def _meta(query_lens, seq_lens):
    tables = [list(range(1 + 8 * i, 1 + 8 * i + -(-s // BLOCK_SIZE))) for i, s in enumerate(seq_lens)]
    return build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)


class _NoModel(torch.nn.Module):
    def forward(self, *args):
        raise AssertionError("dispatch tests never run the model")


def test_dispatch_pads_uniform_decode_and_refuses_the_rest():
    runner = CudaGraphRunner(_NoModel(), [], SIZES, max_model_len=256, block_size=BLOCK_SIZE,
                             device=torch.device("cpu"))
    assert runner.dispatch(_meta([1], [5])) == BatchDescriptor(1, 1, True)
    assert runner.dispatch(_meta([1] * 3, [5, 70, 1])) == BatchDescriptor(4, 4, True)
    assert runner.dispatch(_meta([1] * 5, [9] * 5)) == BatchDescriptor(8, 8, True)
    assert runner.dispatch(_meta([1] * 8, [9] * 8)) == BatchDescriptor(8, 8, True)
    assert runner.dispatch(_meta([1] * 9, [9] * 9)) is None            # larger than every graph
    assert runner.dispatch(_meta([1, 4], [9, 9])) is None              # a prefill chunk: not uniform
    assert runner.dispatch(_meta([7], [7])) is None                    # a prefill
    padded = _meta([1, 1], [9, 9])
    padded.num_tokens = 4                                              # padding tokens: not uniform
    assert runner.dispatch(padded) is None


def test_buffers_hold_the_rows_then_padding():
    runner = CudaGraphRunner(_NoModel(), [], SIZES, max_model_len=256, block_size=BLOCK_SIZE,
                             device=torch.device("cpu"))
    meta = _meta([1] * 3, [5, 40, 17])
    inp = _inputs(meta, input_ids=[11, 12, 13], positions=[4, 39, 16])
    runner.buffers.fill(inp, 4)
    dev = runner.buffers.dev
    assert dev["input_ids"][:4].tolist() == [11, 12, 13, 0]
    assert dev["positions"][:4].tolist() == [4, 39, 16, 0]
    assert dev["slot_mapping"][0, :4].tolist() == meta.slot_mapping.tolist() + [-1]   # group 0, the only one
    assert dev["seq_lens"][:4].tolist() == [5, 40, 17, 1]
    assert dev["block_table"][0, :3, :3].tolist() == meta.block_table.tolist()
    assert dev["block_table"][0, 3].tolist() == [0] * dev["block_table"].shape[2]   # the null block
    m = runner.metas[4]
    assert (m.num_reqs, m.num_tokens, m.max_query_len, m.max_seq_len) == (4, 4, 1, 256)
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert m.seq_lens.data_ptr() == dev["seq_lens"].data_ptr()                   # views, not copies


def _inputs(meta, input_ids, positions):
    from actors.worker.model_runner import StepInputs
    n = meta.num_reqs
    return StepInputs(torch.tensor(input_ids), torch.tensor(positions), meta, np.arange(n), np.arange(n),
                      torch.arange(n))


# -- padded buffers vs plain eager on a real tiny Llama -------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), VOCAB, 64, 96, 4, 2, 16, 256)


def _backend(name: str):
    if name == "cpu":
        from kernels.attention.cpu import CpuAttentionBackend
        return CpuAttentionBackend()
    from kernels.triton import interpreting
    if not interpreting():
        pytest.skip("the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    from kernels.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend()


@pytest.fixture(scope="module", params=["cpu", "triton"])
def model(request, tiny_llama):
    return load_model(resolve_model(tiny_llama), attn_backend=_backend(request.param), block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def cpu_model(tiny_llama):
    return load_model(resolve_model(tiny_llama), attn_backend=_backend("cpu"), block_size=BLOCK_SIZE)


def _runner(model, sizes=None) -> ModelRunner:
    m, config = model
    return ModelRunner(m, runner_config(config, "cpu", torch.float32, max_num_seqs=8, num_blocks=96,
                                        block_size=BLOCK_SIZE), cudagraph_sizes=sizes)


def test_padded_buffers_give_the_real_rows_the_eager_results(model, request):
    plain, padded = _runner(model), _runner(model, SIZES)
    calls = []
    run = padded.graphs.run
    padded.graphs.run = lambda desc, inp: calls.append((desc.num_reqs, inp.meta.num_reqs)) or run(desc, inp)
    triton = request.node.callspec.params["model"] == "triton"
    steps = (5, 4, 2) if triton else (5, 12, 4)              # Triton's interpreter is slow
    expected = padding_scenario(plain, BLOCK_SIZE, VOCAB, decode_steps=steps)
    got = padding_scenario(padded, BLOCK_SIZE, VOCAB, decode_steps=steps)
    assert sorted(set(calls)) == [(1, 1), (2, 2), (4, 3), (8, 6)]
    assert_same_steps(expected, got, atol=1e-4)


def test_padded_hidden_states_equal_unpadded(model):
    runner = _runner(model, SIZES)
    d = StepDriver(runner, BLOCK_SIZE)
    d.prefill({f"r{i}": list(range(1 + i, 30 + 3 * i)) for i in range(3)})
    rids = list(d.num_tokens)
    so = SchedulerOutput(99, [], CachedRequestData(rids, [([],) for _ in rids], [d.num_tokens[r] - 1 for r in rids]),
                         {r: 1 for r in rids}, len(rids), [])
    runner.update_states(so)
    inp = runner.prepare_inputs(so)
    with torch.inference_mode():
        eager = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)     # (3, hidden)
        desc = runner.graphs.dispatch(inp.meta)
        assert desc == BatchDescriptor(4, 4, True)
        padded = runner.graphs.run(desc, inp)
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=0, atol=1e-5)


class _ReplayOnCpu:
    """Stands in for a captured graph: replay recomputes the model over the persistent buffers
    into the static output tensor, which is what a CUDA graph replay does."""

    def __init__(self, graphs: CudaGraphRunner, N: int) -> None:
        self.graphs, self.N, self.replays = graphs, N, 0
        self.out = graphs._forward(N)        # the static output: (N, hidden)

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.graphs._forward(self.N))


def test_replays_read_the_static_output(cpu_model):
    """run() on a step with a graph entry: buffers filled, replay, the static output sliced."""
    plain, replayed = _runner(cpu_model), _runner(cpu_model, SIZES)
    g = replayed.graphs
    with torch.inference_mode():
        fakes = {N: _ReplayOnCpu(g, N) for N in SIZES}
    g.graphs = {BatchDescriptor(N, N, True): (f, f.out) for N, f in fakes.items()}
    expected = padding_scenario(plain, BLOCK_SIZE, VOCAB)
    got = padding_scenario(replayed, BLOCK_SIZE, VOCAB)
    assert all(f.replays for f in fakes.values())
    assert [step[1] for step in got] == [step[1] for step in expected]
