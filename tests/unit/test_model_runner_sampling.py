"""The model runner reuses a step's sampling tensors while the same requests sit in the same
rows: a tiny Llama on the CPU samples exactly what it samples when they are rebuilt every step,
also when a finished request's row goes to a new request with other parameters."""
from __future__ import annotations

import pytest
import torch

from actors.worker.model_runner import ModelRunner
from helpers import save_tiny_llama
from models.registry import load_model
from models.resolve import resolve_model
from tools.gpu_check.driver import GREEDY_LOGPROBS, SEEDED, StepDriver, runner_config
from actors.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
VOCAB = 128
PENALIZED = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.8, max_tokens=1 << 30, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), VOCAB, 64, 96, 4, 2, 16, 256)
    return load_model(resolve_model(path), torch.float32, block_size=BLOCK_SIZE)


def _run(model, rebuild_every_step: bool) -> list:
    runner = ModelRunner(model.model, runner_config(model.config, "cpu", torch.float32, max_num_seqs=4,
                                                    num_blocks=64, block_size=BLOCK_SIZE, max_model_len=256))
    if rebuild_every_step:
        build = runner.sampling_metadata

        def fresh(slots):
            runner._meta_cache = None
            return build(slots)
        runner.sampling_metadata = fresh
    d = StepDriver(runner, BLOCK_SIZE)
    steps = []
    keep = lambda out: steps.append((out.req_ids, out.sampled_token_ids,   # noqa: E731
                                     {r: (lp.token_ids, lp.logprobs) for r, lp in out.logprobs.items()}))
    keep(d.prefill({"a": [5, 9, 2, 7], "b": [3, 3, 1]}, GREEDY_LOGPROBS))
    keep(d.prefill({"s": [8, 1, 4, 4, 6]}, SEEDED))
    for _ in range(4):
        keep(d.decode())
    d.finish(["a"])                                   # a's row goes to c, seeded differently
    keep(d.prefill({"c": [2, 2, 9]}, SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=1 << 30,
                                                    ignore_eos=True, logprobs=2)))
    for _ in range(4):
        keep(d.decode())
    d.finish(["b"])
    keep(d.prefill({"p": [4, 5, 6]}, PENALIZED))      # reads its tokens so far: rebuilt every step
    for _ in range(4):
        keep(d.decode())
    return steps


def test_reused_sampling_tensors_sample_what_rebuilt_ones_do(model):
    reused, rebuilt = _run(model, False), _run(model, True)
    assert reused == rebuilt
    tokens = {}
    for req_ids, sampled, _ in reused:
        for r, t in zip(req_ids, sampled):
            tokens.setdefault(r, []).extend(t)
    assert len(set(tokens["s"])) > 1 and len(set(tokens["c"])) > 1      # the seeded rows did sample


def test_a_new_request_in_a_reused_row_gets_its_own_parameters(model):
    runner = ModelRunner(model.model, runner_config(model.config, "cpu", torch.float32, max_num_seqs=4,
                                                    num_blocks=64, block_size=BLOCK_SIZE, max_model_len=256))
    d = StepDriver(runner, BLOCK_SIZE)
    d.prefill({"a": [5, 9, 2, 7]}, GREEDY_LOGPROBS)
    d.decode()
    greedy = runner._meta_cache[1]
    assert greedy.all_greedy
    d.finish()
    d.prefill({"s": [5, 9, 2, 7]}, SEEDED)
    d.decode()
    assert runner.batch.slot("s") == 0 and not runner._meta_cache[1].all_greedy
