"""LoRA decode steps through the CUDA graphs' padded buffers, on the CPU (what a graph captured
with the LoRA slot buffer replays): each row gets the tokens and log-probs of the eager LoRA path,
steps with adapters dispatch to the descriptors with has_lora, steps without to the plain ones.
Capture itself needs CUDA."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")   # before any kernel module

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from actors.engine.lora import LoRAConfig, LoRARequest  # noqa: E402
from actors.engine.sampling_params import SamplingParams  # noqa: E402
from actors.worker.lora_manager import LoRAModelManager  # noqa: E402
from actors.worker.model_runner import ModelRunner  # noqa: E402
from kernels.attention.cpu import CpuAttentionBackend  # noqa: E402
from models.registry import load_model  # noqa: E402
from models.resolve import resolve_model  # noqa: E402
from tests.helpers import save_tiny_llama, save_tiny_lora  # noqa: E402
from tools.gpu_check.driver import StepDriver, runner_config  # noqa: E402

BLOCK, VOCAB = 16, 128
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, logprobs=3)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-graphs")
    path = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    loras = {}
    for i, name in enumerate(("a", "b")):
        save_tiny_lora(path, root / name, 8, ALL, seed=i, scale=0.2)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
    model, config = load_model(resolve_model(path), attn_backend=CpuAttentionBackend(), block_size=BLOCK)
    LoRAModelManager(model, LoRAConfig(max_loras=2), config, torch.device("cpu"))
    return model, config, loras


def _scenario(runner: ModelRunner, loras: dict) -> list:
    rng = np.random.default_rng(0)
    d = StepDriver(runner, BLOCK)
    record = []
    keep = lambda out: record.append((out.sampled_token_ids, {r: lp.logprobs for r, lp in out.logprobs.items()}))  # noqa: E731
    prompts = {f"r{i}": rng.integers(1, VOCAB, n).tolist() for i, n in enumerate([5, 12, 7, 20, 3])}
    keep(d.prefill(prompts, PARAMS, {"r0": loras["a"], "r2": loras["b"], "r3": loras["a"]}))
    for _ in range(4):
        keep(d.decode())                     # 5 rows with two adapters, padded to 8
    d.finish(["r0", "r2", "r3"])
    for _ in range(3):
        keep(d.decode())                     # 2 base rows: the plain graph
    return record


def test_lora_decode_steps_through_the_graph_buffers_match_eager(lora_model):
    model, config, loras = lora_model
    cfg = runner_config(config, "cpu", torch.float32, max_num_seqs=8, num_blocks=64, block_size=BLOCK)
    plain, padded = ModelRunner(model, cfg), ModelRunner(model, cfg, cudagraph_sizes=[1, 2, 4, 8])
    descs = []
    run = padded.graphs.run
    padded.graphs.run = lambda desc, inp: descs.append(desc) or run(desc, inp)
    expected, got = _scenario(plain, loras), _scenario(padded, loras)
    assert [(d.num_reqs, d.has_lora) for d in descs] == [(8, True)] * 4 + [(2, False)] * 3
    for (tok_e, lp_e), (tok_g, lp_g) in zip(expected, got, strict=True):
        assert tok_g == tok_e
        for rid in lp_e:
            np.testing.assert_allclose(lp_g[rid], lp_e[rid], rtol=0, atol=1e-4)


def test_lora_slots_live_on_the_models_device_with_every_buffer_the_kernels_read():
    """The GPU kernel refuses inputs on two devices: a layer made for a device keeps its A, B, slot
    ranks and slice offsets there (the meta device stands in for CUDA here)."""
    from models.layers import Linear
    from models.lora_layers import LoRALinear, LoRAMapping
    meta = torch.device("meta")
    layer = LoRALinear(Linear(64, 96, torch.float32), 64, {"": 96}, 2, 8, LoRAMapping(meta), meta)
    assert {name: b.device for name, b in layer.named_buffers() if not name.startswith("base_layer")} == {
        "offsets": meta, "lora_a": meta, "lora_b": meta, "slot_ranks_t": meta}
