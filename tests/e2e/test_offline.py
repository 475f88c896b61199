"""The offline API and the terminal chat, on the real default model."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from actors.api import LLM, AsyncLLM, SamplingParams
from server import ROOT, alive

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:
        yield engine


def test_llm_chat_answers_paris(llm):
    (result,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in result.text and result.finish_reason == "stop"


def test_llm_generate_batches_prompts_and_matches_one_at_a_time(llm):
    prompts = ["The sky is", "One, two, three,", "def fibonacci(n):", "Dear diary,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in together)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    a = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    b = llm.generate(["Once upon a time", "Unrelated prompt in the batch"], params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids


def test_a_vllm_script_reads_n_seeded_sequences_per_prompt_from_outputs(llm):
    """vLLM's offline shape: each result's ``outputs`` holds the prompt's n sequences; sequence i
    of a seeded request samples with seed + i, so it equals a one-sequence request seeded so."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=40, ignore_eos=True)
    results = llm.generate(["The capital of France is", "Once upon a time"], sampling_params=params,
                           use_tqdm=False)                      # vLLM's keyword
    for result in results:
        assert [o.index for o in result.outputs] == [0, 1, 2]
        assert result.finished and result.prompt_token_ids and result.text == result.outputs[0].text
        assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in result.outputs)
        for i, o in enumerate(result.outputs):
            alone = llm.generate(result.prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=40 + i,
                                                               ignore_eos=True), use_tqdm=False)[0]
            assert o.token_ids == alone.token_ids and o.text == alone.text
        assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    chats = llm.chat(messages=[[{"role": "user", "content": "Name a colour."}]] * 2, use_tqdm=False,
                     sampling_params=[SamplingParams(n=2, temperature=0, max_tokens=6),
                                      SamplingParams(temperature=0, max_tokens=3)])
    assert len(chats[0].outputs) == 2 and chats[0].outputs[0].token_ids == chats[0].outputs[1].token_ids
    assert chats[1].token_ids == chats[0].token_ids[:3] and len(chats[1].outputs) == 1
    many = list(llm.generate_many(["a", "b"], SamplingParams(n=2, max_tokens=2), use_tqdm=False))
    assert sorted((r.index, len(r.outputs)) for r in many) == [(0, 2), (1, 2)]
    for bad in (0, 129, 2.5):
        with pytest.raises(ValueError, match="n must be an integer in"):
            llm.generate("x", SamplingParams(n=bad), use_tqdm=False)


def test_logprobs_come_back_as_vllms_per_position_dicts(llm):
    """``logprobs=k``: per generated token, {token id: Logprob(logprob, rank, decoded_token)} with
    the sampled token and the top k; ``cumulative_logprob`` sums the sampled ones;
    ``prompt_logprobs`` starts with None for the first prompt token."""
    (result,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5,
                                                                        logprobs=3, prompt_logprobs=2),
                             use_tqdm=False)
    out = result.outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1            # greedy: the most likely
        assert 3 <= len(entry) <= 4 and sorted(lp.rank for lp in entry.values())[:3] == [1, 2, 3]
        assert entry[token].decoded_token == llm.client.tokenizer.decode([token])
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(result.prompt_token_ids)
    assert all(result.prompt_token_ids[i] in entry for i, entry in enumerate(result.prompt_logprobs) if i)
    plain = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5),
                         use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


def test_vllm_prompt_dicts_are_the_prompts_they_hold(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    text = llm.generate("The sky is", greedy, use_tqdm=False)[0]
    ids = text.prompt_token_ids
    by_dict = llm.generate([{"prompt": "The sky is"}, {"prompt_token_ids": ids, "cache_salt": "s"}], greedy,
                           use_tqdm=False)
    assert [r.token_ids for r in by_dict] == [text.token_ids] * 2
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].token_ids == text.token_ids
    with pytest.raises(ValueError, match=r"prompt keys \['multi_modal_uuids'\] are not supported"):
        llm.generate({"prompt": "x", "multi_modal_uuids": {}}, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="this model takes no images"):       # a text model
        llm.generate({"prompt": "x", "multi_modal_data": {"image": "data:image/png;base64,AAAA"}}, greedy,
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]}, greedy, use_tqdm=False)


def test_vllms_tokenizer_defaults_and_prefix_cache_reset_are_there(llm):
    tok = llm.get_tokenizer()
    (first,) = llm.generate("A prompt long enough to fill a cached block of sixteen tokens, and then some more words",
                            SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert tok.decode(first.prompt_token_ids) == first.prompt
    again = llm.generate(first.prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(first.prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    assert llm.get_default_sampling_params() == SamplingParams()     # the GGUF has no generation config


def test_truncate_prompt_tokens_keeps_the_last_tokens_offline(llm):
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    full = llm.generate("One, two, three, four, five, six, seven, eight, nine, ten",
                        SamplingParams(**greedy), use_tqdm=False)[0]
    cut = llm.generate(full.prompt, SamplingParams(truncate_prompt_tokens=6, **greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == full.prompt_token_ids[-6:]
    assert cut.token_ids == llm.generate(full.prompt_token_ids[-6:], SamplingParams(**greedy),
                                         use_tqdm=False)[0].token_ids
    whole = llm.generate(full.prompt, SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert whole.token_ids == full.token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        llm.generate(full.prompt, SamplingParams(truncate_prompt_tokens=0, **greedy), use_tqdm=False)


def test_bad_sampling_parameters_are_refused_by_name_and_the_engine_serves_on(llm):
    """Before, an out-of-vocabulary allowed_token_ids or logit_bias key, or a seed past 64 bits,
    reached the worker and failed the whole step: the neighbour in the batch failed too."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for bad, field in ((dict(allowed_token_ids=[10 ** 9]), "allowed_token_ids"),
                       (dict(logit_bias={10 ** 9: 1.0}), "logit_bias"), (dict(seed=2 ** 70), "seed"),
                       (dict(temperature=-1.0), "temperature"), (dict(logprobs=10 ** 6), "logprobs")):
        with pytest.raises(ValueError, match=f"sampling parameters of prompt 1: {field}"):
            llm.generate(["The sky is", "Hello"], [greedy, SamplingParams(max_tokens=4, **bad)], use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        list(llm.generate_many(["The sky is", "Hello"], [greedy, SamplingParams(allowed_token_ids=[])],
                               use_tqdm=False))
    engine = llm._engine()

    async def streamed() -> list:
        errors = []
        try:
            async for _ in engine.generate("Hello", SamplingParams(allowed_token_ids=[])):
                pass
        except ValueError as exc:
            errors.append(str(exc))
        return errors
    assert llm._run(streamed(), timeout=60) == ["allowed_token_ids must not be empty (None: no restriction)"]
    assert llm.generate("The sky is", greedy, use_tqdm=False)[0].finish_reason == "length"


def test_generate_many_yields_every_prompt_kind_as_it_finishes(llm):
    """Text, token ids and a conversation, one sampling parameter each; results carry the
    prompt's index and equal what generate and chat give for the same prompt."""
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    conversation = [{"role": "user", "content": "Name a colour."}]
    prompts = ["The sky is", [1, 2, 3, 4], conversation]
    results = list(llm.generate_many(prompts, [long, long, short], use_tqdm=False))
    assert results[0].index == 2                       # the shortest finished first
    by_index = {r.index: r for r in results}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0].token_ids == llm.generate("The sky is", long, use_tqdm=False)[0].token_ids
    assert by_index[1].token_ids == llm.generate([1, 2, 3, 4], long, use_tqdm=False)[0].token_ids
    assert by_index[2].token_ids == llm.chat(conversation, short, use_tqdm=False)[0].token_ids


def test_generate_many_holds_at_most_max_pending_requests(llm):
    taken = []

    def prompts():                     # an input that could go on for ever
        for i in range(1000):
            taken.append(i)
            yield f"Item {i}:"
    results = llm.generate_many(prompts(), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                max_pending=3, use_tqdm=False)
    first = next(results)
    time.sleep(0.5)                    # unconsumed results hold their slots: nothing more is read
    assert len(taken) <= 4
    assert first.index in (0, 1, 2)
    results.close()


def test_progress_bar_shows_requests_and_tokens_per_second(llm, capfd):
    llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    err = capfd.readouterr().err
    assert "3/3" in err and "tok/s" in err



def test_flat_logprobs_hold_the_log_probs_of_the_plain_lists(llm):
    """vLLM's SamplingParams(flat_logprobs=True): the result's logprobs and prompt_logprobs are
    FlatLogprobs (flat lists), read position by position as the plain lists read."""
    from actors.api import FlatLogprobs
    fields = dict(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    plain = llm.generate(["The sky is"], SamplingParams(**fields), use_tqdm=False)[0]
    flat = llm.generate(["The sky is"], SamplingParams(**fields, flat_logprobs=True), use_tqdm=False)[0]
    lps, prompt = flat.outputs[0].logprobs, flat.prompt_logprobs
    assert isinstance(lps, FlatLogprobs) and isinstance(prompt, FlatLogprobs)
    assert len(lps) == 6 and list(lps) == plain.outputs[0].logprobs and lps == plain.outputs[0].logprobs
    assert len(prompt) == len(plain.prompt_logprobs) and prompt[0] == {} and plain.prompt_logprobs[0] is None
    assert list(prompt)[1:] == plain.prompt_logprobs[1:]
    assert lps[2:4] == plain.outputs[0].logprobs[2:4] and isinstance(lps[2:4], FlatLogprobs)
    assert len(lps.logprobs) == lps.end_indices[-1] <= 6 * 4        # the sampled token and up to 3 more each
    with pytest.raises(TypeError):
        lps[0] = {}

def test_use_tqdm_may_be_the_callable_that_makes_the_bar(llm):
    """vLLM's use_tqdm=functools.partial(tqdm, ...): the bar is made by it, and counts the requests."""
    from tqdm import tqdm
    made = []

    def make(**kwargs):
        made.append(tqdm(file=io.StringIO(), **kwargs))
        return made[-1]
    llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=make)
    assert len(made) == 1 and made[0].total == 3 and made[0].n == 3


def test_chat_repl_streams_a_reply_from_piped_input():
    proc = subprocess.run([sys.executable, "-m", "tools.chat", "--temperature", "0"],
                          input="What is the capital of France?\n/exit\n", capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_an_engine_in_the_users_process_runs_its_openmp_threads_with_the_short_spin():
    """The offline API's worker shares the user's process: torch (loaded by the engine) gets the
    bounded spin a worker process gets, and the user's environment is as it was."""
    script = ("import os\nfrom actors.api import LLM, SamplingParams\n"
              "with LLM(max_model_len=256) as llm:\n"
              "    out = llm.generate('Hello', SamplingParams(max_tokens=2), use_tqdm=False)[0]\n"
              "print(len(out.token_ids), os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={**env, "OMP_DISPLAY_ENV": "VERBOSE"})
    assert proc.returncode == 0, proc.stderr
    assert "GOMP_SPINCOUNT = '3000'" in proc.stderr
    assert proc.stdout.split()[-2:] == ["2", "None"]


UNCLEAN = ("Task was destroyed", "CRITICAL", "flight recorder", "Traceback")   # what a clean exit never logs


def run_script(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` run by a fresh interpreter here; it must succeed."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc


def assert_clean_exit(proc: subprocess.CompletedProcess, pids: list[int] | tuple[()] = (), unclean: tuple[str, ...] = UNCLEAN) -> None:
    """``proc`` logged none of ``unclean``, and the processes ``pids`` are gone (within 10 s)."""
    for bad in unclean:
        assert bad not in proc.stderr, proc.stderr[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)]


def test_a_script_that_never_closes_its_llms_exits_cleanly_and_leaves_no_process():
    """vLLM's scripts make an ``LLM`` and never close it: at the interpreter's exit an in-process
    engine and one with processes of its own both stop as ``close()`` stops them (no pending tasks
    destroyed, no engine core mourning its parent, no flight record, no process left)."""
    script = ("import psutil\nfrom actors.api import LLM, SamplingParams\n"
              "here = LLM(max_model_len=256)\n"
              "apart = LLM(max_model_len=256, multiprocess=True)\n"
              "for llm in (here, apart):\n"
              "    print(len(llm.generate('Hello', SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids))\n"
              "print(*[p.pid for p in psutil.Process().children(recursive=True)])\n")
    proc = run_script(script, TROUPE_LOG_LEVEL="info")
    lines = proc.stdout.split("\n")
    assert lines[:2] == ["2", "2"]
    children = [int(p) for p in lines[2].split()]
    assert len(children) >= 2                                   # the engine core and its worker
    assert_clean_exit(proc, children)


def test_an_async_llm_never_shut_down_stops_its_processes_when_asyncio_run_ends_or_at_exit():
    """An ``AsyncLLM`` whose ``shutdown()`` is never awaited: one collected when its
    ``asyncio.run`` ends has stopped its processes by the time ``asyncio.run`` returns, one kept
    alive in a global stops them when the interpreter exits; neither engine core mourns its
    parent or writes a flight record."""
    script = ("import asyncio, os, psutil\nfrom actors.api import AsyncLLM, SamplingParams\n"
              "KEPT = []\n"
              "async def main(keep):\n"
              "    llm = await AsyncLLM.create(max_model_len=256, multiprocess=True)\n"
              "    out = await llm.complete('Hello', SamplingParams(max_tokens=2))\n"
              "    print(len(out.outputs[0].token_ids), flush=True)\n"
              "    if keep:\n"
              "        KEPT.append(llm)\n"
              "    return [p.pid for p in psutil.Process().children(recursive=True)]\n"
              "dropped = asyncio.run(main(False))\n"
              "print(*[psutil.pid_exists(p) and psutil.Process(p).status() != 'zombie' for p in dropped])\n"
              "print(*asyncio.run(main(True)))\n")
    proc = run_script(script, TROUPE_LOG_LEVEL="info")
    lines = proc.stdout.split("\n")
    assert lines[0] == "2" and lines[2] == "2"
    assert lines[1].split() == ["False", "False"]                  # engine core and worker, gone
    kept = [int(p) for p in lines[3].split()]
    assert len(kept) == 2
    assert proc.stderr.count("'frontend' asked it to stop") == 2
    assert_clean_exit(proc, kept)


def test_vllms_async_llm_example_runs_with_only_its_imports_changed():
    """vLLM's examples/offline_inference/async_llm_streaming.py: ``AsyncLLM.from_engine_args``
    without ``await`` (started by the first ``generate``), DELTA outputs streamed by keyword
    arguments, and ``engine.shutdown()`` without ``await`` in ``finally``; the script prints its
    answers and exits cleanly with no process left."""
    script = ("import asyncio, psutil\n"
              "from actors.api import AsyncLLM, RequestOutputKind, SamplingParams\n"
              "from actors.engine.args import AsyncEngineArgs\n"
              "async def main():\n"
              "    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=256, multiprocess=True))\n"
              "    params = SamplingParams(max_tokens=8, temperature=0, output_kind=RequestOutputKind.DELTA)\n"
              "    try:\n"
              "        for i, prompt in enumerate(['The capital of France is', 'One, two,']):\n"
              "            text = ''\n"
              "            async for output in engine.generate(request_id=f'stream-{i}', prompt=prompt,\n"
              "                                                sampling_params=params):\n"
              "                text += ''.join(c.text for c in output.outputs)\n"
              "                if output.finished:\n"
              "                    print(output.request_id, repr(text), flush=True)\n"
              "        print(*[p.pid for p in psutil.Process().children(recursive=True)], flush=True)\n"
              "    finally:\n"
              "        engine.shutdown()\n"
              "asyncio.run(main())\n")
    proc = run_script(script, TROUPE_LOG_LEVEL="info")
    lines = proc.stdout.split("\n")
    assert lines[0].startswith("stream-0 ' Paris") and lines[1].startswith("stream-1 ")
    children = [int(p) for p in lines[2].split()]
    assert len(children) == 2
    assert_clean_exit(proc, children)


def test_ctrl_c_during_generate_aborts_its_requests_and_the_llm_serves_on():
    """Ctrl-C in ``LLM.generate`` raises KeyboardInterrupt in the script and aborts the batch's
    requests (the engine runs nothing for nobody); the same LLM then answers, and the script exits
    without a traceback."""
    script = ("import os, signal, threading, time\nfrom actors.api import LLM, SamplingParams\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"   # a test runner's workers ignore it
              "llm = LLM(max_model_len=512, multiprocess=True)\n"
              "threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
              "try:\n"
              "    llm.generate(['Tell me a story'] * 8, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted', llm.client.num_open, flush=True)\n"
              "deadline = time.monotonic() + 10\n"
              "while llm.client.stats.last.num_running and time.monotonic() < deadline:\n"
              "    time.sleep(0.1)\n"
              "print(llm.client.stats.last.num_running)\n"
              "out = llm.generate('The capital of France is', SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
              "print(repr(out[0].outputs[0].text))\n")
    proc = run_script(script)
    assert proc.stdout.split("\n")[:3] == ["interrupted 0", "0", repr(" Paris.\n\n")], proc.stdout
    assert_clean_exit(proc, unclean=(*UNCLEAN, "ERROR"))


@pytest.mark.parametrize("multiprocess", [True, False], ids=["processes", "in-process"])
def test_shutdown_with_requests_running_ends_each_with_an_error_and_logs_no_failure(multiprocess):
    """``AsyncLLM.shutdown()`` while requests stream: each ends at once with the reason (none
    hangs), the engine stops its steps before its workers (no failed step logged), and nothing
    is left running."""
    script = ("import asyncio, psutil\nfrom actors.api import AsyncLLM, SamplingParams\n"
              "async def main():\n"
              f"    llm = await AsyncLLM.create(max_model_len=512, multiprocess={multiprocess})\n"
              "    params = SamplingParams(max_tokens=400, ignore_eos=True)\n"
              "    runs = [asyncio.create_task(llm.complete('Tell me a story', params)) for _ in range(6)]\n"
              "    while not llm.client.stats.last.num_running:\n"
              "        await asyncio.sleep(0.05)\n"
              "    await asyncio.sleep(0.5)\n"
              "    await asyncio.wait_for(llm.shutdown(), 30)\n"
              "    for r in await asyncio.wait_for(asyncio.gather(*runs), 10):\n"
              "        print(r.outputs[0].finish_reason, r.error, 0 < len(r.outputs[0].token_ids) < 400)\n"
              "    print(len(psutil.Process().children(recursive=True)))\n"
              "asyncio.run(main())\n")
    proc = run_script(script)
    lines = proc.stdout.split("\n")
    assert lines[:6] == ["error the engine was shut down True"] * 6, proc.stdout
    assert lines[6] == "0"
    assert_clean_exit(proc, unclean=(*UNCLEAN, "ERROR", "killing"))


def test_async_llm_streams_vllms_request_outputs_cumulative_delta_or_final_only():
    """``AsyncLLM.generate`` yields vLLM's RequestOutput shape (``request_id``,
    ``prompt_token_ids``, ``outputs[0].text`` / ``token_ids`` / ``logprobs``, ``finished`` on the
    last): by default each output holds everything so far (vLLM's CUMULATIVE), with DELTA only
    what is new, with FINAL_ONLY one output; all three give the greedy tokens and log-probs of
    the offline LLM."""
    import asyncio

    from actors.api import RequestOutputKind
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    async def scenario() -> dict:
        llm = await AsyncLLM.create(max_model_len=256)
        seen = {}
        try:
            for kind in RequestOutputKind:
                p = msgspec.structs.replace(params, output_kind=kind)
                seen[kind] = [(o.request_id, list(o.prompt_token_ids), o.outputs[0].text, list(o.outputs[0].token_ids),
                               len(o.outputs[0].logprobs or []), o.outputs[0].cumulative_logprob, o.finished)
                              async for o in llm.generate("The capital of France is", p, request_id=f"r{kind}")]
            whole = await llm.complete("The capital of France is", params)
            two = SamplingParams(n=2, max_tokens=6, seed=1, ignore_eos=True)    # vLLM's n: one stream, n sequences
            pair = await llm.complete("One, two,", two)
            for kind in RequestOutputKind:
                texts = ["", ""]
                async for o in llm.generate("One, two,", msgspec.structs.replace(two, output_kind=kind)):
                    for c in o.outputs:
                        texts[c.index] = texts[c.index] + c.text if kind == RequestOutputKind.DELTA else c.text
                seen[("n=2", kind)] = (texts, o.finished, len(o.outputs))
        finally:
            await llm.shutdown()
        seen["pair"] = [c.text for c in pair.outputs]
        return seen, whole

    seen, whole = asyncio.run(scenario())
    assert seen["pair"][0] != seen["pair"][1]
    for kind in RequestOutputKind:
        texts, finished, width = seen[("n=2", kind)]
        assert texts == seen["pair"] and finished
        assert width == (1 if kind == RequestOutputKind.DELTA else 2)
    cumulative, delta, final = (seen[k] for k in RequestOutputKind)     # n = 1
    assert len(cumulative) == len(delta) > 1 and len(final) == 1
    for outs, kind in ((cumulative, 0), (delta, 1), (final, 2)):
        assert all(o[0] == f"r{kind}" and o[1] == whole.prompt_token_ids for o in outs)
        assert [o[6] for o in outs] == [False] * (len(outs) - 1) + [True]
    assert cumulative[-1][2:5] == final[0][2:5] == (whole.text, whole.token_ids, 10)
    assert cumulative[-1][5] == pytest.approx(whole.outputs[0].cumulative_logprob)
    lengths = [len(o[3]) for o in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 10
    assert "".join(o[2] for o in delta) == whole.text
    assert sum((o[3] for o in delta), []) == whole.token_ids
    assert sum(o[4] for o in delta) == 10
    assert [len(o[3]) for o in delta] == [b - a for a, b in zip([0] + lengths, lengths)]


def test_an_async_llm_used_from_another_event_loop_fails_at_once_saying_why():
    """An AsyncLLM made in one ``asyncio.run`` and used in a later one (whose loop its actors do
    not run on) refuses at once with the reason instead of waiting for an answer that never
    comes; its ``shutdown()`` there still stops its processes."""
    import asyncio

    import psutil

    async def make() -> AsyncLLM:
        return await AsyncLLM.create(max_model_len=256, multiprocess=True)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = asyncio.run(make())
    children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]

    async def use() -> None:
        with pytest.raises(RuntimeError, match="created on"):
            await llm.complete("Hello", SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="created on"):
            async for _ in llm.generate("Hello", SamplingParams(max_tokens=2)):
                pass
        await asyncio.wait_for(llm.shutdown(), 30)
    asyncio.run(use())
    assert len(children) >= 2
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)]


def test_async_llm_aborts_by_request_id_and_reports_its_health_as_vllms_does(caplog):
    """vLLM's AsyncLLM calls: ``abort(request_id)`` ends that stream with finish reason "abort"
    (the other request runs to its end), ``check_health()`` passes while serving, and after
    ``shutdown()`` ``errored`` is true and ``check_health()`` raises EngineDeadError; and its
    queries: unfinished requests counted and drained, supported tasks, tracing, KV event
    sources, the tokenizer, weight checksums, statistics logged on demand."""
    import asyncio
    import logging
    caplog.set_level(logging.INFO, logger="troupe.stats")

    from actors.frontend.client import EngineDeadError

    async def scenario() -> tuple:
        llm = await AsyncLLM.create(max_model_len=256)
        try:
            await llm.check_health()
            running = (llm.is_running, llm.errored)
            long = SamplingParams(max_tokens=200, ignore_eos=True)

            unfinished = []

            async def last(request_id: str, params: SamplingParams):
                async for out in llm.generate("Tell me a story", params, request_id=request_id):
                    unfinished.append(llm.get_num_unfinished_requests())
                    if request_id == "doomed" and len(out.outputs[0].token_ids) >= 2:
                        await llm.abort("doomed")
                return out.outputs[0].finish_reason, len(out.outputs[0].token_ids)
            doomed, kept = await asyncio.wait_for(asyncio.gather(
                last("doomed", long), last("kept", SamplingParams(max_tokens=12, ignore_eos=True))), 120)
            await llm.wait_for_requests_to_drain(10)
            assert max(unfinished) == 2 and llm.get_num_unfinished_requests() == 0
            assert await llm.get_supported_tasks() == ("generate",) and not await llm.is_tracing_enabled()
            assert llm.get_kv_event_sources() == {}
            assert llm.tokenizer.decode(llm.tokenizer.encode("Paris", add_special_tokens=False)) == "Paris"
            (checksums,) = await llm.compute_weight_checksums()
            assert all(k.startswith("dp0:pp0:pcp0:tp0:") and len(v) == 64 for k, v in checksums.items())
            await llm.do_log_stats()
        finally:
            await llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await llm.check_health()
        return running, doomed, kept, llm.errored

    running, doomed, kept, errored = asyncio.run(scenario())
    assert running == (True, False)
    assert doomed[0] == "abort" and 2 <= doomed[1] < 200
    assert kept == ("length", 12)
    assert errored
    assert any("Avg generation throughput" in r.getMessage() for r in caplog.records)


def test_enqueue_and_wait_for_completion_run_by_priority_as_vllms_llm_does():
    """vLLM's ``LLM.enqueue`` / ``enqueue_chat`` / ``wait_for_completion`` and ``priority``: with
    scheduling paused (``sleep(level=0)``), one request at a time and the priority policy, the
    request of priority 0 runs first though enqueued second (the other then finds the prompt in
    the prefix cache); results come in enqueue order under the returned ids; a prompt too long
    is refused by ``enqueue`` itself and nothing of that call stays queued."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 4           # 40 tokens: two whole blocks
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(max_model_len=256, max_num_seqs=1, scheduling_policy="priority") as llm:
        with pytest.raises(ValueError, match="maximum context length"):
            llm.enqueue(["Hello", "word " * 400], greedy)
        assert llm.client.num_open == 0 and llm.wait_for_completion() == []
        llm.sleep(level=0)
        ids = llm.enqueue([prompt, prompt], greedy, priority=[5, 0])
        ids += llm.enqueue_chat([{"role": "user", "content": "Hi"}], greedy)
        llm.wake_up(tags=["scheduling"])
        results = llm.wait_for_completion(use_tqdm=False)
        assert [r.request_id for r in results] == ids and len(set(ids)) == 3
        assert [r.num_cached_tokens for r in results[:2]] == [32, 0]          # priority 0 ran first
        assert results[0].token_ids == results[1].token_ids and len(results[2].token_ids) == 6
        alone = llm.generate(prompt, greedy, priority=3, use_tqdm=False)[0]
        assert alone.token_ids == results[0].token_ids


def test_chat_hands_vllms_tools_argument_to_the_chat_template(llm):
    """``LLM.chat(messages, tools=[...])`` (vLLM's argument) renders the tools through the chat
    template, as a chat request's tools are (a template that names them shows them)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    template = ("{% for t in tools or [] %}Tool: {{ t.function.name }}. {% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    one = SamplingParams(max_tokens=1)
    with_tools = llm.chat(messages, one, tools=tools, chat_template=template, use_tqdm=False)[0]
    without = llm.chat(messages, one, chat_template=template, use_tqdm=False)[0]
    decode = llm.get_tokenizer().decode
    assert decode(with_tools.prompt_token_ids) == "Tool: get_weather. Weather in Paris?"
    assert decode(without.prompt_token_ids) == "Weather in Paris?"


def test_vllms_sampling_params_for_text_cache_and_streaming_take_effect(llm):
    """vLLM's SamplingParams fields: ``detokenize=False`` gives the token ids without text (and
    refuses stop strings in vLLM's words), ``skip_reading_prefix_cache`` computes a prompt the
    cache holds, and ``stream_interval`` batches a stream's tokens (the first output at once)."""
    from actors.api import RequestOutputKind
    prompt = "A river winds through the valley below the old stone bridge. " * 3      # over two blocks
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texted = llm.generate(prompt, greedy, use_tqdm=False)[0]
    bare = llm.generate(prompt, msgspec.structs.replace(greedy, detokenize=False), use_tqdm=False)[0]
    assert bare.token_ids == texted.token_ids and texted.text and bare.text == ""
    with pytest.raises(ValueError, match="only supported when detokenize is True"):
        llm.generate(prompt, SamplingParams(stop=["."], detokenize=False), use_tqdm=False)
    cached = llm.generate(prompt, greedy, use_tqdm=False)[0]
    fresh = llm.generate(prompt, msgspec.structs.replace(greedy, skip_reading_prefix_cache=True), use_tqdm=False)[0]
    assert cached.num_cached_tokens >= 32 and fresh.num_cached_tokens == 0
    assert fresh.token_ids == cached.token_ids

    async def sizes() -> list[int]:
        params = msgspec.structs.replace(greedy, max_tokens=10, stream_interval=4,
                                         output_kind=RequestOutputKind.DELTA)
        return [len(o.outputs[0].token_ids) async for o in llm._engine().generate(prompt, params)]
    assert llm._run(sizes()) == [1, 4, 4, 1]


def test_beam_search_keeps_the_most_likely_sequences_with_their_true_logprobs(llm):
    """vLLM's LLM.beam_search: width 1 is greedy decoding; wider, the beams are distinct, best
    first by length-penalized score, and each beam's cumulative log-prob is what the model gives
    its tokens when they are scored as a prompt."""
    from actors.frontend.beam_search import BeamSearchParams, score
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    one = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=1, max_tokens=6))[0]
    assert one.sequences[0].tokens[len(one.prompt_token_ids):] == greedy.token_ids
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    out, = llm.beam_search([{"prompt": "One, two,"}], params)
    seqs = out.sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    eos = frozenset(llm.client.config.model.arch.eos_token_ids)
    scores = [score(s.tokens, s.cum_logprob, eos, 0.5) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    for s in seqs:
        if s.finish_reason == "stop":      # its end-of-sequence token counts in cum_logprob, not in tokens
            continue
        n = len(out.prompt_token_ids)
        assert s.text == llm.get_tokenizer().decode(s.tokens[n:], skip_special_tokens=True)
        scored = llm.generate({"prompt_token_ids": s.tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0].prompt_logprobs
        true = sum(scored[i][t].logprob for i, t in enumerate(s.tokens) if i >= n)
        assert s.cum_logprob == pytest.approx(true, abs=1e-3)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search("x", BeamSearchParams(beam_width=0, max_tokens=2))


def test_sleep_needs_enable_sleep_mode_and_level_0_only_pauses(llm):
    """vLLM's LLM.sleep / wake_up: levels 1 and 2 need enable_sleep_mode (they are run on the
    server: tests/e2e/test_pause.py); level 0 pauses, and wake_up(["scheduling"]) resumes."""
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(3)
    llm.sleep(0)
    assert llm.is_sleeping() and llm.wake_up(["scheduling"]) and not llm.is_sleeping()
    assert llm.generate(["The capital of France is"], params, use_tqdm=False)[0].token_ids == before


def test_start_profile_needs_a_profiler_config(llm):
    """vLLM's LLM.start_profile / stop_profile record only with profiler_config (they are run on
    the server: tests/e2e/test_pause.py; the recorder: tests/unit/test_profiler.py)."""
    with pytest.raises(ValueError, match="--profiler-config"):
        llm.start_profile()
    with pytest.raises(ValueError, match="--profiler-config"):
        llm.stop_profile()


def test_prompt_logprob_token_ids_score_chosen_ids_at_each_prompt_row_in_any_chunking(llm):
    """vLLM's prompt_logprob_token_ids: row i scores its ids as prompt token start + i + 1; the
    prompt's own next token scores what prompt_logprobs reads for it, -1 pads (-inf), the rows
    from prompt_logprob_start are the full rows' tail, and a prompt computed in chunks of 8
    tokens gives the rows of one computed whole. A row count that is not the prompt's is refused."""
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog because it was bored")
    n = len(ids)
    rows = [[ids[i + 1], 17, -1] for i in range(n - 1)]
    whole = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=1, prompt_logprobs=0, prompt_logprob_token_ids=rows), use_tqdm=False)[0]
    scores = whole.prompt_token_id_logprobs
    assert scores.shape == (n - 1, 3) and scores.dtype == np.float32 and np.isneginf(scores[:, 2]).all()
    own = [next(iter(d.values())).logprob for d in whole.prompt_logprobs[1:]]
    assert np.allclose(scores[:, 0], own, atol=1e-5) and (scores[:, 1] < 0).all()
    tail = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=1, prompt_logprob_token_ids=rows[5:], prompt_logprob_start=5), use_tqdm=False)[0]
    assert np.allclose(tail.prompt_token_id_logprobs, scores[5:], atol=1e-5) and tail.prompt_logprobs is None
    with LLM(multiprocess=False, max_num_batched_tokens=8, enable_prefix_caching=False) as chunked:
        again = chunked.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=1, prompt_logprob_token_ids=rows), use_tqdm=False)[0]
    assert np.allclose(again.prompt_token_id_logprobs, scores, atol=1e-4)
    with pytest.raises(ValueError, match=r"prompt_logprob_token_ids has 3 rows, but the prompt has"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(prompt_logprob_token_ids=rows[:3]), use_tqdm=False)


def test_return_sampling_mask_gives_each_tokens_support_and_refuses_greedy_or_unbounded_requests():
    with LLM(multiprocess=False, return_sampling_mask=True) as masked:
        (result,) = masked.generate("The sky is", SamplingParams(temperature=0.9, top_k=8, top_p=0.95, max_tokens=6,
                                                                 seed=5, ignore_eos=True), use_tqdm=False)
        support = result.outputs[0].sampling_mask.token_ids
        assert len(support) == len(result.token_ids) == 6
        assert all(tok in s and 1 <= len(s) <= 8 and s == sorted(s) for tok, s in zip(result.token_ids, support))
        for params, words in ((SamplingParams(temperature=0, max_tokens=2), "requires temperature > 0"),
                              (SamplingParams(temperature=1.0, max_tokens=2), "requires top_k > 0")):
            with pytest.raises(ValueError, match=words):
                masked.generate("The sky is", params, use_tqdm=False)


def test_a_closed_llm_frees_the_engines_memory_while_still_referenced(llm):
    """Runs last with the module's LLM: ``close()`` (a ``with`` block ending) lets go of the
    weights and KV cache even though the name still refers to it; using it then says it is closed."""
    import ctypes
    import gc

    def rss_mib() -> float:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = rss_mib()
    llm.close()
    freed = before - rss_mib()
    assert freed > 180, f"closing freed only {freed:.0f} MiB"     # the weights alone: 92 MB of blocks, a 113 MB embedding
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate("The capital of France is")
    llm.close()                        # a second close does nothing


