"""``python -m tools.bench kv-storage``: what ExampleConnector (KV saved to a directory layer by
layer during the forward, loaded by a later instance) costs and saves, on the default model.

Three engines in this process, each a real Worker, Scheduler and KV manager: one without a
connector, one that saves every prompt (``kv_producer``), one that loads them (``kv_consumer``)
from the same directory. Each repeat takes a new random prompt of ``--prompt-len`` tokens: the
first engine computes it, the second computes and saves it, the third loads it; the figure is the
time to the first token (the prompt's steps), the median over ``--repeats``. The entries are read
back right after they were written, so from the page cache, not from the disk."""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from typing import Any, Callable

from actors.engine.args import EngineArgs
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from actors.worker.worker import Worker
from models.resolve import DEFAULT_MODEL


class LocalEngine:
    """A Worker, a Scheduler and a KV manager stepped in this process (no actors, no processes)."""

    def __init__(self, model: str = DEFAULT_MODEL, kv_transfer_config: dict | None = None, **engine_args: Any) -> None:
        args = EngineArgs(model=model, multiprocess=False, kv_transfer_config=kv_transfer_config,
                          **{"kv_cache_bytes": 64 << 20, **engine_args})
        self.worker = Worker(args.create_engine_config())
        self.worker.init_kv_cache()
        cfg = self.worker.config
        self.kv = KVCacheManager(cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                                 cfg.kv_cache_groups())
        self.scheduler = Scheduler(cfg, self.kv)

    @property
    def connector(self) -> Any:
        return self.worker.kv_connector

    def run(self, rid: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0,
            kv_transfer_params: dict | None = None) -> tuple[list[int], list[float], float]:
        """The request's greedy tokens, their log-probabilities and the seconds to the first
        token; steps (and polls the connector's transfers) until the request is done. The
        ``kv_transfer_params`` it finished with are left in ``self.kv_transfer_params``."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, extra_args=extra)
        t0 = time.perf_counter()
        error = self.scheduler.add_request(EngineCoreRequest(rid, prompt, sp, 0.0, [2]))
        if error is not None:
            raise RuntimeError(f"request {rid} refused: {error}")
        tokens: list[int] = []
        logprobs: list[float] = []
        ttft = 0.0
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} not done in {timeout_s:g} s")
            so = self.scheduler.schedule()
            for out in self.scheduler.update_from_output(so, self.worker.execute_model(so)):
                if out.request_id != rid:
                    continue
                if out.error is not None:
                    raise RuntimeError(f"request {rid} failed: {out.error}")
                if out.new_token_ids and not tokens:
                    ttft = time.perf_counter() - t0
                tokens += out.new_token_ids
                if out.logprobs is not None:
                    logprobs += [row[0] for row in out.logprobs.logprobs]
                if out.finish_reason is not None:
                    self.kv_transfer_params = out.kv_transfer_params
                    return tokens, logprobs, ttft
            if not so.num_scheduled_tokens:
                time.sleep(0.002)

    def poll(self, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Steps (polls of the connector's transfers, with no requests) until ``done()``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done in {timeout_s:g} s")
            so = self.scheduler.schedule()
            self.scheduler.update_from_output(so, self.worker.execute_model(so))
            time.sleep(0.005)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()


def measure(prompt_len: int, repeats: int, path: str) -> dict[str, Any]:
    kv = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": path}}
    plain = LocalEngine()
    saver = LocalEngine(kv_transfer_config={**kv, "kv_role": "kv_producer"})
    loader = LocalEngine(kv_transfer_config={**kv, "kv_role": "kv_consumer"})
    rng = random.Random(0)
    times: dict[str, list[float]] = {"computed": [], "computed_and_saved": [], "loaded": []}
    flush_s: list[float] = []
    try:
        for r in range(repeats + 1):                   # the first round warms up
            prompt = [1] + [rng.randrange(100, 40000) for _ in range(prompt_len - 1)]
            other = [1] + [rng.randrange(100, 40000) for _ in range(prompt_len - 1)]
            computed = plain.run(f"plain-{r}", other, 1)[2]
            saved = saver.run(f"save-{r}", prompt, 1)[2]
            t0 = time.perf_counter()
            if not saver.connector.flush(60):
                raise RuntimeError("the saves were not written in 60 s")
            flushed = time.perf_counter() - t0
            loaded = loader.run(f"load-{r}", prompt, 1)[2]
            if r:
                times["computed"].append(computed)
                times["computed_and_saved"].append(saved)
                times["loaded"].append(loaded)
                flush_s.append(flushed)
        stats = loader.scheduler.stats()
        saved_stats = saver.scheduler.stats()
    finally:
        for e in (plain, saver, loader):
            e.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    recv = stats.kv_transfer
    return {
        "ttft_s": {k: round(v, 4) for k, v in med.items()},
        "save_overhead": round(med["computed_and_saved"] / med["computed"], 3),
        "loaded_vs_computed": round(med["loaded"] / med["computed"], 3),
        "write_after_step_s": round(statistics.median(flush_s), 4),
        "loaded_tokens": stats.external_prefix_cache_hits,
        "load_gb_per_s": round(recv.get("recv_bytes", 0) / max(recv.get("recv_seconds", 0), 1e-9) / 1e9, 3),
        "bytes_per_token": round(saved_stats.kv_transfer.get("sent_bytes", 0)
                                 / max(saved_stats.kv_transfer.get("sent_blocks", 1), 1) / saver.worker.config.cache.block_size),
    }


def main(args: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="troupe-kv-bench-", dir=args.storage_dir) as path:
        res = measure(args.prompt_len, args.repeats, path)
    print(json.dumps({"bench": "kv-storage", "model": DEFAULT_MODEL, "prompt_len": args.prompt_len,
                      "repeats": args.repeats, **res}), flush=True)
