"""Drives a ModelRunner without the engine, for tools and tests: it plays scheduler and block
manager. Every prompt is prefilled in one step, then all live requests decode together, one
token per step. Blocks come from a counter (block 0 is the null block and never handed out)."""
from __future__ import annotations

import numpy as np
import torch

from actors.engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from actors.engine.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from actors.engine.sampling_params import SamplingParams
from actors.worker.cuda_graphs import capture_sizes
from actors.worker.model_runner import ModelRunner
from models.config import ArchConfig
from models.resolve import ModelSource

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=1 << 30, ignore_eos=True, logprobs=3)


class StepDriver:
    def __init__(self, runner, block_size: int) -> None:   # runner: actors.worker.model_runner.ModelRunner
        self.runner = runner
        self.block_size = block_size
        self.step = 0
        self.next_block = 1
        self.num_blocks: dict[str, int] = {}      # blocks held by each live request
        self.num_tokens: dict[str, int] = {}      # prompt + sampled tokens of each live request
        self.outputs: dict[str, list[int]] = {}

    def _take_blocks(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        """Fresh blocks for ``num_tokens`` tokens in each KV cache group of the runner."""
        need = -(-num_tokens // self.block_size) - self.num_blocks.get(req_id, 0)
        G = self.runner.num_kv_cache_groups
        if self.next_block + G * need > self.runner.config.cache.num_blocks:
            raise RuntimeError(f"out of KV blocks ({self.runner.config.cache.num_blocks}); give the runner more")
        ids = tuple(list(range(self.next_block + g * need, self.next_block + (g + 1) * need)) for g in range(G))
        self.next_block += G * need
        self.num_blocks[req_id] = self.num_blocks.get(req_id, 0) + need
        return ids

    def _run(self, new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int],
             finished: list[str] | None = None) -> ModelRunnerOutput:
        so = SchedulerOutput(self.step, new, cached, scheduled, sum(scheduled.values()), finished or [])
        self.step += 1
        out = self.runner.execute_model(so)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            self.outputs[rid] += toks
            self.num_tokens[rid] += len(toks)
        return out

    def prefill(self, prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
                loras: dict | None = None) -> ModelRunnerOutput:
        """One step scheduling every prompt whole; each samples its first token. ``loras``: the
        LoRARequest of some of them."""
        new = []
        for rid, prompt in prompts.items():
            self.num_tokens[rid], self.outputs[rid] = len(prompt), []
            new.append(NewRequestData(rid, list(prompt), [], params, self._take_blocks(rid, len(prompt)), 0,
                                      (loras or {}).get(rid)))
        return self._run(new, CachedRequestData(), {rid: len(p) for rid, p in prompts.items()})

    def decode(self) -> ModelRunnerOutput:
        """One step scheduling one token (the last sampled) for every live request."""
        rids = list(self.num_tokens)
        computed = [self.num_tokens[r] - 1 for r in rids]
        blocks = [self._take_blocks(r, self.num_tokens[r]) for r in rids]
        return self._run([], CachedRequestData(rids, blocks, computed), {r: 1 for r in rids})

    def finish(self, req_ids: list[str] | None = None) -> None:
        """Drop these live requests (default: all) from the runner; their blocks are not reused."""
        done = list(self.num_tokens) if req_ids is None else req_ids
        for rid in done:
            del self.num_tokens[rid]
        self._run([], CachedRequestData(), {}, done)


def generate(runner, prompts: list[list[int]], max_tokens: int, block_size: int) -> list[list[int]]:
    """Greedy continuations of ``prompts``, batched together, max_tokens tokens each."""
    driver = StepDriver(runner, block_size)
    driver.prefill({f"r{i}": p for i, p in enumerate(prompts)})
    for _ in range(max_tokens - 1):
        driver.decode()
    outs = [driver.outputs[f"r{i}"] for i in range(len(prompts))]
    driver.finish()
    return outs


def padding_scenario(runner, block_size: int, vocab_size: int, seeded: bool = True,
                     decode_steps: tuple[int, int, int] = (5, 12, 4)) -> list:
    """A fixed sequence of steps that covers decode padding for capture sizes (1, 2, 4, 8):
    batches of 6 (padded to 8), 3 (to 4, crossing block boundaries), then, once everything
    finished, 2 and 1 new short requests in rows that held longer block tables (stale columns).
    One request samples with a seed (``seeded``). ``decode_steps``: the decode steps of the 6-,
    3- and 2-row phases (with block size 16, (5, 4, 2) still crosses a block boundary in the
    first two: the short form for Triton's slow interpreter). Returns, per step, (req_ids,
    sampled tokens, {req_id: (top token ids, their log-probs)})."""
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(1, vocab_size, n).tolist()   # noqa: E731
    d = StepDriver(runner, block_size)
    record = []
    keep = lambda out: record.append((out.req_ids, out.sampled_token_ids,   # noqa: E731
                                      {r: (lp.token_ids, lp.logprobs) for r, lp in out.logprobs.items()}))
    keep(d.prefill({f"a{i}": prompt(n) for i, n in enumerate([3, 17, 40, 33, 9])}, GREEDY_LOGPROBS))
    keep(d.prefill({"s": prompt(12)}, SEEDED if seeded else GREEDY_LOGPROBS))
    six, three, two = decode_steps
    for _ in range(six):
        keep(d.decode())                                  # 6 rows -> 8
    d.finish(["a0", "a2", "s"])
    for _ in range(three):                                # 3 rows -> 4
        keep(d.decode())
    d.finish()
    keep(d.prefill({"b0": prompt(2), "b1": prompt(5)}, GREEDY_LOGPROBS))
    for _ in range(two):
        keep(d.decode())                                  # 2 rows, no padding
    d.finish(["b1"])
    keep(d.decode())                                      # 1 row
    return record


def runner_config(arch: ArchConfig, device: str, dtype: torch.dtype, *, max_num_seqs: int, num_blocks: int,
                  block_size: int = 16, max_model_len: int | None = None,
                  kv_cache_dtype: torch.dtype | None = None) -> EngineConfig:
    """The resolved config of a ModelRunner for a model the caller loaded itself."""
    name = lambda t: str(t).removeprefix("torch.")                    # noqa: E731
    source = ModelSource("hf_dir", "", arch.architecture)              # no checkpoint to resolve
    return EngineConfig(
        model=ModelConfig(source=source, dtype=name(dtype), arch=arch,
                          max_model_len=max_model_len or arch.max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          cache_dtype=name(kv_cache_dtype or dtype)),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), device=DeviceConfig(device=device))


def build_runner(model, config: ArchConfig, device: str, dtype: torch.dtype, *, graphs: bool, max_num_seqs: int,
                 num_blocks: int, block_size: int = 16, max_model_len: int | None = None):
    """A ModelRunner for an already loaded model, with decode graphs captured when ``graphs``
    (on the CPU ``graphs`` runs the same padded buffers eagerly). -> (runner, capture seconds)."""
    sizes = capture_sizes(max_num_seqs) if graphs else None
    runner = ModelRunner(model, runner_config(config, device, dtype, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                                              block_size=block_size, max_model_len=max_model_len), sizes)
    seconds = runner.capture_cudagraphs() if graphs and device == "cuda" else 0.0
    return runner, seconds
