"""Pipeline parallelism on tiny random models of each architecture: the model cut into two
stages (the first with the embedding, the last with the final norm and LM head, each stage's KV
cache holding its layers only), the first stage's intermediate tensors fed to the second, gives
the unsplit model's logits within float32 rounding over a prompt step and decode steps; with a
tensor-parallel split inside each stage too (two ranks per stage in a gloo group). And how the
layers, the KV cache and the unsupported combinations are decided."""
from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from actors.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from actors.kv_manager.kv_cache_spec import group_size, stage_groups
from actors.spec_decode.config import SpeculativeConfig
from models.pipeline_parallel import PPMissingLayer, split_stage
from models.pp_layout import ENV, pp_layers, pp_partition
from models.tensor_parallel import shard_model
from models.tp_layout import head_split
from models.resolve import ModelSource
from helpers import run_steps
from test_tensor_parallel import BS, _arch, _logits, _model

CASES = [
    ("LlamaForCausalLM", 4, 2, {}),
    ("Qwen3ForCausalLM", 4, 2, {}),                                  # per-head q/k norms
    ("MistralForCausalLM", 4, 2, {}),                                # sliding window, biases
    ("Gemma3ForCausalLM", 4, 2, {}),                                 # sliding and full layers, no residual stream
    ("LlamaForCausalLM", 4, 2, {"tie_word_embeddings": True}),       # the last stage keeps the tied head alone
]


class _Pipeline:
    """Stages run one after the other on one step, each on its layers' KV caches, handing its
    intermediate tensors to the next (what the workers do through send/recv)."""

    def __init__(self, stages: list[torch.nn.Module]) -> None:
        self.stages = stages

    def __call__(self, ids, pos, caches, meta):
        out = None
        for stage in self.stages:
            own = caches[stage.start_layer:stage.end_layer]
            out = stage(ids, pos, own, meta) if out is None else stage(ids, pos, own, meta, intermediate=out)
        return out

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden)


def _stages(model: torch.nn.Module, pp: int) -> list[torch.nn.Module]:
    return [split_stage(copy.deepcopy(model), pp, r) for r in range(pp)]


@pytest.mark.parametrize("name,heads,kv_heads,more", CASES, ids=[f"{c[0]}{'-tied' if c[3] else ''}" for c in CASES])
def test_two_stages_give_the_unsplit_models_logits(name, heads, kv_heads, more):
    arch = _arch(name, heads, kv_heads, **more)
    model = _model(arch)
    want = _logits(model, arch, kv_heads)
    stages = _stages(model, 2)
    first, last = stages
    assert (first.start_layer, first.end_layer, last.start_layer, last.end_layer) == (0, 2, 2, 3)
    assert isinstance(first.lm_head, PPMissingLayer) and isinstance(first.norm, PPMissingLayer)
    assert isinstance(last.embed_tokens, PPMissingLayer) and isinstance(last.layers[0], PPMissingLayer)
    got = _logits(_Pipeline(stages), arch, kv_heads)
    assert want.std() > 0.3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_three_stages_of_one_layer_each_give_the_unsplit_models_logits():
    arch = _arch("LlamaForCausalLM", 4, 2)
    model = _model(arch)
    got = _logits(_Pipeline(_stages(model, 3)), arch, 2)
    torch.testing.assert_close(got, _logits(model, arch, 2), rtol=1e-5, atol=1e-5)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    """One rank of a 2 x 2 group: stage rank // 2, tensor-parallel rank rank % 2 in its stage's
    group; the stages' tensors sent and received between ranks r and r + 2. Rank 2 (the last
    stage's first rank) saves each case's logits."""
    try:
        torch.set_num_threads(1)
        dist = torch.distributed
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pp_rank, tp_rank = divmod(rank, 2)
        results = []
        for name, heads, kv_heads, more in CASES:
            arch = _arch(name, heads, kv_heads, **more)
            stage = shard_model(split_stage(_model(arch), 2, pp_rank), 2, tp_rank, groups[pp_rank])
            results.append(_logits(_Linked(stage, pp_rank, rank), arch, head_split(heads, kv_heads, 2, tp_rank)[3]))
        if rank == 2:
            torch.save(results, out)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


class _Linked:
    """One stage of a step across processes: the first stage sends its tensors on, the last
    receives them (the logits of the first stage's steps are not looked at)."""

    def __init__(self, stage: torch.nn.Module, pp_rank: int, rank: int) -> None:
        self.stage, self.pp_rank, self.rank = stage, pp_rank, rank

    def __call__(self, ids, pos, caches, meta):
        own = caches[self.stage.start_layer:self.stage.end_layer]
        keys = self.stage.intermediate_keys
        if self.pp_rank == 0:
            out = self.stage(ids, pos, own, meta)
            for k in keys:
                torch.distributed.send(out[k].contiguous(), dst=self.rank + 2)
            return torch.zeros(len(ids), self.stage.config.hidden_size)
        got = {}
        for k in keys:
            got[k] = torch.empty(len(ids), self.stage.config.hidden_size)
            torch.distributed.recv(got[k], src=self.rank - 2)
        return self.stage(ids, pos, own, meta, intermediate=got)

    def compute_logits(self, hidden):
        if self.pp_rank == 0:
            return torch.zeros(len(hidden), 1)
        return self.stage.compute_logits(hidden)


def test_two_stages_of_two_tensor_parallel_ranks_give_the_unsplit_models_logits(tmp_path):
    out = str(tmp_path / "logits.pt")
    mp.start_processes(_rank, args=(4, f"file://{tmp_path}/init", out), nprocs=4, start_method="spawn", join=True)
    for (name, heads, kv_heads, more), got in zip(CASES, torch.load(out), strict=True):
        arch = _arch(name, heads, kv_heads, **more)
        torch.testing.assert_close(got, _logits(_model(arch), arch, kv_heads), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


def test_layers_split_as_vllm_splits_them(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert pp_partition(30, 2) == [15, 15]                   # SmolLM2-135M
    assert pp_partition(3, 2) == [2, 1] and pp_partition(10, 4) == [2, 3, 3, 2]    # leftovers before the last
    assert [pp_layers(10, 4, r) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 pipeline stages"):
        pp_partition(3, 4)
    monkeypatch.setenv(ENV, "1,2")
    assert pp_layers(3, 2, 1) == (1, 3)
    with pytest.raises(ValueError, match=f"{ENV}='1,2': needs 2 counts .* adding up to the model's 4 layers"):
        pp_partition(4, 2)


def _config(pp: int, arch, **parts) -> EngineConfig:
    cfg = EngineConfig(model=ModelConfig(source=ModelSource("gguf", "/nonexistent", "tiny")),
                       cache=CacheConfig(kv_cache_memory_bytes=1 << 20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64),
                       parallel=ParallelConfig(pipeline_parallel_size=pp), **parts)
    return cfg.resolve(cuda_available=False, cpu_count=4, arch=arch)


def test_each_stage_caches_its_own_layers_so_the_same_memory_holds_more_blocks(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    llama = _arch("LlamaForCausalLM", 4, 2, num_layers=4)      # one KV cache group of 4 layers: 2 per stage
    one, two = _config(1, llama), _config(2, llama)
    assert two.kv_cache_groups() == one.kv_cache_groups()     # the scheduler sees every layer's groups
    assert two.cache.num_blocks == 2 * one.cache.num_blocks
    assert two.scheduler.async_scheduling is False and two.device.num_threads == 2
    gemma = _arch("Gemma3ForCausalLM", 4, 2)      # 3 groups of one layer each (2 sliding, 1 full)
    groups = _config(2, gemma).kv_cache_groups()
    stages = [stage_groups(groups, *pp_layers(3, 2, r)) for r in range(2)]
    assert [[g.layer_ids for g in s] for s in stages] == [[(1,), (0,), ()], [(), (), (2,)]]
    assert _config(2, gemma).cache.num_blocks == _config(1, gemma).cache.num_blocks   # a page per block either way


def test_the_last_stage_holds_a_draft_models_layers_so_it_sizes_the_blocks(monkeypatch):
    """self_draft on 4 layers over 2 stages: the first stage caches 2 layers, the last 2 + the
    draft's 4; a block's memory is sized by the last (6 pages, not 8 as on one worker)."""
    monkeypatch.delenv(ENV, raising=False)
    llama = _arch("LlamaForCausalLM", 4, 2, num_layers=4)
    source = ModelSource("gguf", "/nonexistent", "tiny")

    def drafted(pp: int) -> EngineConfig:
        cfg = EngineConfig(model=ModelConfig(source=source, draft_source=source),
                           speculative=SpeculativeConfig.from_dict({"method": "self_draft", "quantization": "gguf-i8",
                                                                   "num_speculative_tokens": 2}),
                           cache=CacheConfig(kv_cache_memory_bytes=1 << 20), scheduler=SchedulerConfig(max_num_batched_tokens=64),
                           parallel=ParallelConfig(pipeline_parallel_size=pp))
        return cfg.resolve(cuda_available=False, cpu_count=4, arch=llama, draft_arch=llama)
    one, two = drafted(1), drafted(2)
    assert [group_size(stage_groups(two.kv_cache_groups(), *s)) for s in ((0, 2), (2, 8))] == [2, 6]
    assert two.cache.num_blocks == one.cache.num_blocks * 8 // 6


@pytest.mark.parametrize("parts,named", [
    (dict(scheduler=SchedulerConfig(async_scheduling=True)), "--async-scheduling"),
])
def test_what_stages_do_not_run_yet_is_refused_naming_the_combination(parts, named):
    with pytest.raises(ValueError, match=f"{named}.* with pipeline parallelism \\(pipeline_parallel_size=2\\) "
                                         "is not supported yet"):
        EngineConfig(model=ModelConfig(source=ModelSource("gguf", "/nonexistent", "tiny"), quantization=None),
                     parallel=ParallelConfig(pipeline_parallel_size=2), **parts)
    with pytest.raises(ValueError, match="pipeline parallelism runs each stage in a worker process of its own"):
        EngineConfig(model=ModelConfig(source=ModelSource("gguf", "/x", "t")),
                     parallel=ParallelConfig(pipeline_parallel_size=2, multiprocess=False))
