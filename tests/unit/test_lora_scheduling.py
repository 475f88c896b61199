"""The scheduler's side of LoRA: a step never holds more adapters than --max-loras (a request of
another adapter waits, keeping its place, while base-model requests and those of adapters
already running pass it); an adapter's request is refused when LoRA is off; equal prompts with
different adapters never share cached blocks."""
from __future__ import annotations

from actors.engine.lora import LoRAConfig, LoRARequest
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.request import Request
from actors.scheduler.scheduler import Scheduler
from tests.unit.sched_utils import EOS, FakeWorker, engine_config

LORAS = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc")}


def _harness(max_loras: int) -> tuple[Scheduler, FakeWorker]:
    config = engine_config(64).replace(lora=LoRAConfig(max_loras=max_loras))
    return Scheduler(config, KVCacheManager(64, 4, True)), FakeWorker(64, 4)


def _add(s: Scheduler, rid: str, lora: str | None, max_tokens: int) -> None:
    err = s.add_request(EngineCoreRequest(rid, [100 + len(rid), 5, 6], SamplingParams(max_tokens=max_tokens,
                                          temperature=0), 0.0, [EOS], lora_request=LORAS.get(lora)))
    assert err is None, err


def test_a_step_holds_at_most_max_loras_adapters_and_the_others_wait_their_turn():
    s, worker = _harness(max_loras=2)
    for rid, lora, n in [("r0", "a", 2), ("r1", "b", 6), ("r2", "c", 3), ("r3", None, 6), ("r4", "a", 6)]:
        _add(s, rid, lora, n)
    first_step_of: dict[str, int] = {}
    for step in range(30):
        so = s.schedule()
        adapters = {s.requests[rid].lora_request.lora_int_id for rid in so.num_scheduled_tokens
                    if s.requests[rid].lora_request is not None}
        assert len(adapters) <= 2
        for rid in so.num_scheduled_tokens:
            first_step_of.setdefault(rid, step)
        for r in so.new_reqs:
            assert r.lora_request == s.requests[r.req_id].lora_request   # the worker learns its adapter
        s.update_from_output(so, worker.run(so, 7))
        if not s.has_work():
            break
    assert not s.has_work()
    assert first_step_of["r3"] == first_step_of["r4"] == 0      # base and adapter "a" pass the waiting "c"
    assert first_step_of["r2"] > 0                               # "c" started once "a" or "b" was done


def test_an_adapter_request_is_refused_when_lora_is_off():
    s = Scheduler(engine_config(64), KVCacheManager(64, 4, True))
    err = s.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(), 0.0, [EOS], lora_request=LORAS["a"]))
    assert err is not None and err.finish_reason == "error" and "--enable-lora" in err.error


def test_equal_prompts_with_different_adapters_hash_their_blocks_apart():
    def hashes(lora: str | None) -> list:
        return Request("r", list(range(12)), SamplingParams(), 0.0, block_size=4, lora_request=LORAS.get(lora)).block_hashes
    assert len(hashes(None)) == 3
    assert hashes("a") == hashes("a")
    assert not set(hashes(None)) & set(hashes("a")) and not set(hashes("a")) & set(hashes("b"))
