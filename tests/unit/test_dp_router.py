"""The data-parallel router on its own (stub engine cores that record what they are sent): the
least loaded engine by its latest stats and what it was sent since, ties to the one given fewer,
prefix affinity within a slack, aborts to the owner only, and a dead engine failing exactly its
own requests and taking no new one until it is back."""
from __future__ import annotations

import asyncio

from actors.detokenizer.actor import EngineLost
from actors.engine.messages import EngineCoreRequest, SchedulerStats
from actors.engine.sampling_params import SamplingParams
from actors.frontend.dp_router import DataParallelRouter, EngineDown, EngineUp
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams
from actors.scheduler.actor import AbortRequests, AddRequest

BS = 16


class Stub:
    def __init__(self) -> None:
        self.sent: list = []

    def tell(self, msg) -> None:
        self.sent.append(msg)


def _router(n: int = 2) -> tuple[DataParallelRouter, list[Stub], Stub, EngineStats]:
    engines, detok, stats = [Stub() for _ in range(n)], Stub(), EngineStats()
    return DataParallelRouter(engines, stats, OutputStreams(), detok, BS), engines, detok, stats


def _add(router: DataParallelRouter, rid: str, prompt: list[int]) -> None:
    asyncio.run(router.receive(AddRequest(EngineCoreRequest(rid, prompt, SamplingParams(), 0.0))))


def _where(engines: list[Stub], rid: str) -> int:
    (e,) = [i for i, s in enumerate(engines) if any(isinstance(m, AddRequest) and m.request.request_id == rid
                                                     for m in s.sent)]
    return e


def test_requests_go_to_the_least_loaded_engine_counting_those_sent_since_its_stats():
    router, engines, _, stats = _router(3)
    stats.observe_step(SchedulerStats(step=5, num_running=4, num_waiting=2), 0)
    stats.observe_step(SchedulerStats(step=7, num_running=1), 1)
    stats.observe_step(SchedulerStats(step=2, num_running=3), 2)
    placed = []
    for i in range(6):
        _add(router, f"r{i}", [i])                 # short prompts: no prefix affinity
        placed.append(_where(engines, f"r{i}"))
    # loads 6, 1, 3: engine 1 until it reaches 3, then 2 and 1 in turn (ties: the one given fewer)
    assert placed == [1, 1, 2, 1, 2, 1]


def test_a_prefix_goes_back_to_its_engine_unless_it_is_much_busier():
    router, engines, _, stats = _router(2)
    prefix = list(range(100, 100 + 4 * BS))
    _add(router, "a", prefix + [1])
    home = _where(engines, "a")
    _add(router, "b", prefix + [2])                # the other engine was given fewer: affinity wins
    assert _where(engines, "b") == home
    stats.observe_step(SchedulerStats(step=1, num_running=10), home)
    stats.observe_step(SchedulerStats(step=1, num_running=0), 1 - home)
    _add(router, "c", prefix + [3])                # beyond the slack: the idle engine
    assert _where(engines, "c") == 1 - home
    _add(router, "d", prefix + [4])                # and the prefix now lives there
    assert _where(engines, "d") == 1 - home


def test_aborts_reach_the_owner_only_and_unknown_ids_every_engine():
    router, engines, _, _ = _router(2)
    _add(router, "a", [1])
    _add(router, "b", [2])
    asyncio.run(router.receive(AbortRequests(["a", "zzz"])))
    aborts = [[m.request_ids for m in s.sent if isinstance(m, AbortRequests)] for s in engines]
    owner = _where(engines, "a")
    assert sorted(aborts[owner][0]) == ["a", "zzz"] and aborts[1 - owner] == [["zzz"]]


def test_a_dead_engine_fails_exactly_its_requests_and_gets_none_until_it_is_back():
    router, engines, detok, _ = _router(2)
    for i in range(4):
        _add(router, f"r{i}", [i])
    mine = sorted(f"r{i}" for i in range(4) if _where(engines, f"r{i}") == 1)
    asyncio.run(router.receive(EngineDown(1, "engine core 1 died")))
    (lost,) = detok.sent
    assert isinstance(lost, EngineLost) and sorted(lost.request_ids) == mine and lost.reason == "engine core 1 died"
    for i in range(4, 8):
        _add(router, f"r{i}", [i])
        assert _where(engines, f"r{i}") == 0
    asyncio.run(router.receive(EngineDown(0, "engine core 0 died")))
    _add(router, "orphan", [9])                    # nobody serves: it fails at once
    assert detok.sent[-1].request_ids == ["orphan"]
    asyncio.run(router.receive(EngineUp(1)))
    _add(router, "back", [10])
    assert _where(engines, "back") == 1


def test_the_engines_stats_combine_with_every_counter_summed_and_the_cache_usage_averaged():
    import msgspec
    from actors.frontend.stats import combine_stats
    engines = []
    for e in (1, 2):
        values = {}
        for f in msgspec.structs.fields(SchedulerStats):
            if f.type is int or f.type is float:
                values[f.name] = e * 10
        engines.append(SchedulerStats(**values, spec_num_accepted_tokens_per_pos=[e, e],
                                      kv_transfer={"recv_bytes": 100.0 * e, "recv_requests": float(e)}))
    combined = combine_stats(engines)
    for f in msgspec.structs.fields(SchedulerStats):
        if f.name == "kv_cache_usage":
            assert combined.kv_cache_usage == 15
        elif f.type is int or f.type is float:
            assert getattr(combined, f.name) == 30, f.name
    assert combined.spec_num_accepted_tokens_per_pos == [3, 3]
    assert combined.kv_transfer == {"recv_bytes": 300.0, "recv_requests": 3.0}
