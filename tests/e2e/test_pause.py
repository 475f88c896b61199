"""vLLM's generation control for RL loops (VLLM_SERVER_DEV_MODE=1): POST /pause in its three
modes, /resume, /is_paused and /abort_requests, and sleep mode (--enable-sleep-mode: /sleep,
/wake_up, /is_sleeping), on the real server; and vLLM's profiler (--profiler-config, given with
its dotted keys: /start_profile, /stop_profile)."""
from __future__ import annotations

import asyncio
import glob
import gzip
import json
import os
import time

import aiohttp
import pytest

from server import Server

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--threads", "1", "--max-num-seqs", "2", "--enable-sleep-mode")
BODY = {"prompt": "Count: 1, 2, 3,", "max_tokens": 40, "temperature": 0}
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def server(traces):
    s = Server(*SERVER_ARGS, "--profiler-config.profiler", "torch", f"--profiler-config.torch_profiler_dir={traces}",
               env={"VLLM_SERVER_DEV_MODE": "1"})
    yield s
    s.stop()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, seen: list) -> list:
    """A streamed completion; ``seen`` gets (text, finish_reason) per chunk as it arrives."""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                seen.append((choice["text"], choice["finish_reason"]))
    return seen


async def _until(seen: list, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(seen) < n:
        assert time.monotonic() < deadline, "the stream did not start"
        await asyncio.sleep(0.01)


async def _text(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["text"]


async def _post(session: aiohttp.ClientSession, url: str, **kw) -> dict:
    async with session.post(url, **kw) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _paused(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url + "/is_paused") as resp:
        return (await resp.json())["is_paused"]


def test_keep_freezes_a_stream_and_resume_finishes_it_with_the_tokens_it_would_have_had(server):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            alone = await _text(s, server.url, BODY)
            seen: list = []
            stream = asyncio.create_task(_stream(s, server.url, BODY, seen))
            await _until(seen, 5)
            assert await _post(s, server.url + "/pause?mode=keep") == {"status": "paused"}
            assert await _paused(s, server.url)
            frozen = len(seen)
            late = asyncio.create_task(_text(s, server.url, BODY))
            await asyncio.sleep(1.0)
            assert len(seen) == frozen and not late.done()     # nothing runs, the new one queues
            assert await _post(s, server.url + "/resume") == {"status": "resumed"}
            await stream
            assert not await _paused(s, server.url)
            assert "".join(t for t, _ in seen) == alone and seen[-1][1] == "length"
            assert await late == alone
    asyncio.run(run())


def test_wait_returns_once_the_running_request_finished_and_new_ones_wait_for_resume(server):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            seen: list = []
            stream = asyncio.create_task(_stream(s, server.url, BODY, seen))
            await _until(seen, 3)
            await _post(s, server.url + "/pause", params={"mode": "wait", "clear_cache": "false"})
            assert seen[-1][1] == "length"                    # finished whole before /pause answered
            late = asyncio.create_task(_text(s, server.url, BODY))
            await asyncio.sleep(1.0)
            assert not late.done()
            await _post(s, server.url + "/resume")
            assert await late == "".join(t for t, _ in await stream)
    asyncio.run(run())


def test_abort_mode_ends_running_requests_with_finish_reason_abort(server):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            seen: list = []
            stream = asyncio.create_task(_stream(s, server.url, {**BODY, "max_tokens": 400}, seen))
            await _until(seen, 3)
            await _post(s, server.url + "/pause")             # mode=abort is vLLM's default
            await asyncio.wait_for(stream, 10)
            assert seen[-1][1] == "abort" and len(seen) < 400
            await _post(s, server.url + "/resume")
            assert await _text(s, server.url, {**BODY, "max_tokens": 4})
    asyncio.run(run())


def test_abort_requests_ends_the_request_named_by_its_answer_id_and_no_other(server):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            named, other = [], []
            long = {**BODY, "max_tokens": 400}
            async with s.post(server.url + "/v1/completions", json={**long, "stream": True}) as resp:
                first = json.loads((await resp.content.readline())[6:])
                rest = asyncio.create_task(_stream(s, server.url, {**BODY, "max_tokens": 60}, other))
                await _until(other, 2)
                body = await _post(s, server.url + "/abort_requests", json={"request_ids": [first["id"]]})
                assert body == {"status": "aborted", "aborted": 1}
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        named.append(json.loads(line[6:])["choices"][0]["finish_reason"])
            assert named[-1] == "abort"
            await rest
            assert other[-1][1] == "length"
    asyncio.run(run())


def test_a_pause_mode_vllm_does_not_know_is_a_400_and_pauses_nothing(server):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(server.url + "/pause?mode=later") as resp:
                assert resp.status == 400
                assert "Invalid pause mode: later" in (await resp.json())["error"]["message"]
            assert not await _paused(s, server.url)
    asyncio.run(run())


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def test_sleep_gives_back_the_workers_memory_and_wake_up_serves_the_same_tokens(server):
    """Level 2: the worker gives back the weights and the KV cache (its resident memory drops by
    more than 180 MB: the weights are the GGUF file's 92 MB of blocks and a 113 MB float32
    embedding), a request sent meanwhile waits, /wake_up reads the weights again and it is
    answered with the tokens it had before; level 1 wakes in two steps (tags)."""
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            before = await _text(session, server.url, BODY)
            worker = server.worker_pid()
            awake_mib = _rss_mib(worker)
            assert await _post(session, server.url + "/sleep?level=2") == {"status": "sleeping", "level": 2}
            asleep_mib = _rss_mib(worker)
            async with session.get(server.url + "/is_sleeping") as resp:
                assert (await resp.json())["is_sleeping"] is True
            async with session.get(server.url + "/metrics") as resp:
                assert 'vllm:engine_sleep_state{model_name="HuggingFaceTB/SmolLM2-135M-Instruct",engine="0",' \
                       'sleep_state="discard_all"} 1' in await resp.text()
            waiting = asyncio.ensure_future(_text(session, server.url, BODY))
            await asyncio.sleep(1.0)
            assert not waiting.done()                              # asleep: it waits
            assert (await _post(session, server.url + "/wake_up"))["status"] == "awake"
            after = await asyncio.wait_for(waiting, 60)
            await _post(session, server.url + "/sleep?level=1")
            partly = await _post(session, server.url + "/wake_up?tags=weights")
            whole = await _post(session, server.url + "/wake_up?tags=kv_cache")
            async with session.get(server.url + "/is_sleeping") as resp:
                still = (await resp.json())["is_sleeping"]
            again = await _text(session, server.url, BODY)
            async with session.post(server.url + "/sleep?level=3") as resp:
                bad = resp.status
            return before, awake_mib, asleep_mib, after, partly, whole, still, again, bad
    before, awake_mib, asleep_mib, after, partly, whole, still, again, bad = asyncio.run(main())
    print(f"\nworker resident memory: {awake_mib:.0f} MiB awake, {asleep_mib:.0f} MiB asleep (level 2)")
    assert awake_mib - asleep_mib > 180
    assert after == before == again
    assert partly == {"status": "sleeping", "tags": ["weights"]}          # the KV cache still asleep
    assert whole == {"status": "awake", "tags": ["kv_cache"]} and not still
    assert bad == 400


def test_release_kv_cache_memory_after_a_level_0_sleep_and_wake_up_takes_it_back(server):
    """vLLM's /release_kv_cache_memory: refused unless a pause completed with no request held;
    then the worker gives back its KV cache (resident memory drops by most of the cache), the
    weights staying; /wake_up?tags=scheduling alone does not resume without a KV cache, tags
    kv_cache does, and the same tokens come back. vLLM's sleep-mode operation metrics count it."""
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            before = await _text(s, server.url, BODY)
            async with s.post(server.url + "/release_kv_cache_memory") as resp:
                refused = resp.status, (await resp.json())["error"]["message"]
            assert await _post(s, server.url + "/sleep?level=0") == {"status": "sleeping", "level": 0}
            worker = server.worker_pid()
            paused_mib = _rss_mib(worker, "VmSize")
            assert await _post(s, server.url + "/release_kv_cache_memory") == {"status": "kv_cache_released"}
            released_mib = _rss_mib(worker, "VmSize")
            not_yet = await _post(s, server.url + "/wake_up?tags=scheduling")
            async with s.get(server.url + "/is_sleeping") as resp:
                still = (await resp.json())["is_sleeping"]
            whole = await _post(s, server.url + "/wake_up?tags=kv_cache")
            after = await _text(s, server.url, BODY)
            async with s.get(server.url + "/metrics") as resp:
                metrics = await resp.text()
            return before, refused, paused_mib, released_mib, not_yet, still, whole, after, metrics
    before, refused, paused_mib, released_mib, not_yet, still, whole, after, metrics = asyncio.run(main())
    print(f"\nworker address space: {paused_mib:.0f} MiB paused, {released_mib:.0f} MiB with the KV cache released")
    assert refused[0] == 400 and "requires a completed pause first" in refused[1]
    assert paused_mib - released_mib > 900                      # --kv-cache-gib's default 1 GiB
    assert not_yet == {"status": "sleeping", "tags": ["scheduling"]} and still is True
    assert whole == {"status": "awake", "tags": ["kv_cache"]} and after == before
    assert 'operation="release_kv_cache_memory"} 2' in metrics     # vllm:sleep_mode_operation_duration_seconds_count


def test_sleep_with_keep_recomputes_a_frozen_stream_after_wake_up(server):
    """vLLM's sleep mode=keep: a request the pause froze loses its KV cache with the sleep and is
    computed again after /wake_up, finishing with the tokens it would have had."""
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            alone = await _text(s, server.url, BODY)
            seen: list = []
            stream = asyncio.create_task(_stream(s, server.url, BODY, seen))
            await _until(seen, 5)
            assert await _post(s, server.url + "/sleep?level=1&mode=keep") == {"status": "sleeping", "level": 1}
            frozen = len(seen)
            await asyncio.sleep(0.5)
            assert len(seen) == frozen
            assert (await _post(s, server.url + "/wake_up"))["status"] == "awake"
            await asyncio.wait_for(stream, 60)
            assert "".join(t for t, _ in seen) == alone and seen[-1][1] == "length"
    asyncio.run(run())


def _trace_events(path: str) -> list[str]:
    with gzip.open(path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_start_and_stop_profile_write_a_trace_per_process_with_every_step_labelled(server, traces):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(server.url + "/start_profile", json={"profile_prefix": "one"}) as resp:
                assert resp.status == 200, await resp.text()
            async with s.post(server.url + "/start_profile") as resp:
                assert resp.status == 409 and "already active" in (await resp.json())["error"]["message"]
            await _text(s, server.url, {**BODY, "max_tokens": 6})
            async with s.post(server.url + "/stop_profile") as resp:
                assert resp.status == 200
            # a session of at most 2 steps ends by itself: its trace is written before /stop_profile
            async with s.post(server.url + "/start_profile", json={"profile_prefix": "two", "max_iterations": 2}) as resp:
                assert resp.status == 200
            await _text(s, server.url, {**BODY, "max_tokens": 6})
            deadline = time.monotonic() + 60
            while not glob.glob(f"{traces}/two_dp0_*.pt.trace.json.gz"):
                assert time.monotonic() < deadline, os.listdir(traces)
                await asyncio.sleep(0.2)
            async with s.post(server.url + "/stop_profile") as resp:
                assert resp.status == 200
            for body in ({"profile_prefix": "no spaces"}, {"delay_iterations": -1}, {"max_iterations": "2"}):
                async with s.post(server.url + "/start_profile", json=body) as resp:
                    assert resp.status == 400, body
    asyncio.run(run())
    worker = glob.glob(f"{traces}/one_dp0_pp0_tp0_dcp0_ep0_rank0.*.pt.trace.json.gz")
    frontend = glob.glob(f"{traces}/one_*.async_llm.*.pt.trace.json.gz")
    assert len(worker) == 1 and len(frontend) == 1, os.listdir(traces)
    assert os.path.exists(f"{traces}/one_dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt")
    names = _trace_events(worker[0])
    steps = [n for n in names if n.startswith("execute_")]
    prompt_tokens = int(steps[0].split("(")[1].split(")")[0])
    assert steps[0] == f"execute_context_1({prompt_tokens})_generation_0(0)" and prompt_tokens > 5
    assert steps[1:] == ["execute_context_0(0)_generation_1(1)"] * 5          # one step per further token
    assert any("native_decode.py" in n for n in names)      # the native kernels' calls show
    assert any("actors/frontend/completions.py" in n for n in _trace_events(frontend[0]))
    (two,) = glob.glob(f"{traces}/two_dp0_*.pt.trace.json.gz")
    assert len([n for n in _trace_events(two) if n.startswith("execute_")]) == 2


def test_server_info_shows_the_resolved_config_the_environment_and_the_system_and_world_size_the_ranks(server):
    """... and the multi-modal and encoder cache resets answer 200 (a text model has neither)."""
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.get(server.url + "/server_info?config_format=json") as resp:
                info = await resp.json()
            async with s.get(server.url + "/server_info") as resp:
                text = (await resp.json())["vllm_config"]
            async with s.get(server.url + "/server_info?config_format=yaml") as resp:
                bad = resp.status
            sizes = []
            for query in ("", "?include_dp=false"):
                async with s.get(server.url + "/get_world_size" + query) as resp:
                    sizes.append((await resp.json())["world_size"])
            resets = []
            for path in ("/reset_mm_cache", "/reset_encoder_cache"):     # vLLM's; a text model has none
                async with s.post(server.url + path) as resp:
                    resets.append(resp.status)
            return info, text, bad, sizes + resets
    info, text, bad, sizes = asyncio.run(run())
    config = info["vllm_config"]
    assert config["model"]["max_model_len"] > 0 and config["scheduler"]["max_num_seqs"] == 2
    assert config["model"]["enable_sleep_mode"] is True and config["profiler"]["profiler"] == "torch"
    assert info["vllm_env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert info["system_env"]["torch_version"].startswith("2.") and info["system_env"]["troupe_version"]
    assert text.startswith("EngineConfig(") and "max_num_seqs=2" in text
    assert bad == 400 and sizes == [1, 1, 200, 200]


def test_collective_rpc_reloads_the_weights_and_refuses_what_workers_do_not_answer(server, tmp_path):
    """... and float weights, which the GGUF file's blocks that exact mode runs cannot take."""
    from helpers import save_tiny_llama
    floats = save_tiny_llama(tmp_path / "floats", 49152, 64, 128, 4, 2, 16, 512)

    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            before = await _text(s, server.url, BODY)
            statuses = []
            for body in ({"method": "execute_model"}, {"args": []}, {"method": "reload_weights", "kwargs": {"x": "1"}},
                         {"method": "reload_weights", "kwargs": {"weights_path": "/nowhere"}},
                         {"method": "reload_weights", "args": "x"},
                         {"method": "reload_weights", "kwargs": {"weights_path": floats}}):
                async with s.post(server.url + "/collective_rpc", json=body) as resp:
                    statuses.append((resp.status, (await resp.json())["error"]["message"]))
            async with s.post(server.url + "/collective_rpc", json={"method": "reload_weights"}) as resp:
                assert resp.status == 200, await resp.text()
                reloaded = await resp.json()
            return before, statuses, reloaded, await _text(s, server.url, BODY)
    before, statuses, reloaded, after = asyncio.run(run())
    assert [s for s, _ in statuses] == [400] * 6
    assert "unknown worker method 'execute_model'" in statuses[0][1] and "Missing 'method'" in statuses[1][1]
    assert "unexpected keyword argument 'x'" in statuses[2][1] and "unknown model '/nowhere'" in statuses[3][1]
    assert "runs its GGUF file's Q4_1 / Q8_0 blocks" in statuses[5][1]
    assert "TROUPE_GGUF_FLOAT_WEIGHTS=1" in statuses[5][1]
    assert reloaded == {"results": [None]} and after == before      # the same weights read again
