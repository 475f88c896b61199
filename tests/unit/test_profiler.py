"""vLLM's --profiler-config: the config checked as vLLM checks it, and the recorder a worker runs
(sessions counted in steps: a delay, a limit, torch's schedule; each step labelled as vLLM labels
it), writing real torch traces."""
from __future__ import annotations

import glob
import gzip
import json
import os

import pytest
import torch

from actors.engine.args import EngineArgs
from actors.engine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from actors.engine.profiler import ProfilerConfig, check_prefix, profiler_config
from actors.engine.sampling_params import SamplingParams
from actors.worker.profiler import rank_name, step_label, worker_profiler
from tools import serve


def test_a_torch_profiler_needs_its_folder_which_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = profiler_config('{"profiler": "torch", "torch_profiler_dir": "traces"}')
    assert config.enabled and config.torch_profiler_dir == str(tmp_path / "traces")
    assert config.profiles_frontend and not config.uses_schedule
    assert not profiler_config(None).enabled
    config = EngineArgs.from_options("HuggingFaceTB/SmolLM2-135M-Instruct", {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": "/tmp/t", "max_iterations": 3}}).create_engine_config()
    assert config.profiler.max_iterations == 3


@pytest.mark.parametrize("value, message", [
    ({"profiler": "torch"}, "torch_profiler_dir must be set"),
    ({"profiler": "cuda", "torch_profiler_dir": "/tmp/x"}, "only applicable when profiler is set to 'torch'"),
    ({"torch_profiler_activities": ["CPU"]}, "only applicable when profiler is set to 'torch'"),
    ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["CPU", "CPU"]}, "duplicates"),
    ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["XPU"]}, "not one of"),
    ({"profiler": "proton", "proton_profiler_dir": "/t"}, "Proton"),
    ({"profiler": "torch", "torch_profiler_dir": "/t", "proton_context": "python"}, "only applicable when profiler is set to 'proton'"),
    ({"profiler": "nvtx"}, "profiler must be one of"),
    ({"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": -1}, "greater than or equal to 0"),
    ({"profiler": "torch", "torch_profiler_dir": "/t", "with_stack": True}, "unsupported profiler config field"),
    ({"profiler": "torch", "torch_profiler_dir": "gs://bucket/x"}, "local folder"),
])
def test_a_bad_profiler_config_is_refused_naming_the_fault(value, message):
    with pytest.raises(ValueError, match=message):
        profiler_config(value)


def test_the_server_refuses_a_bad_profiler_config_at_once(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--profiler-config.profiler", "torch"])
    assert exc.value.code == 2 and "torch_profiler_dir must be set" in capsys.readouterr().err
    assert serve.parse_args(["--profiler-config", '{"profiler": "cuda"}']).profiling


def test_a_session_prefix_follows_vllms_rule():
    check_prefix("run-1.a_b")
    for bad in ("", "-x", "a b", "é", "x" * 129):
        with pytest.raises(ValueError, match="profile_prefix"):
            check_prefix(bad)
    assert rank_name("p", 1, 0, 1, 2, 1) == "p_dp1_pp0_tp1_dcp0_ep3_rank3"
    assert rank_name(None, 0, 1, 0, 2, 2) == "dp0_pp1_tp0_dcp0_ep0_rank2"


def _step(new: dict[str, tuple[int, int]], cached: dict[str, tuple[int, int]]) -> SchedulerOutput:
    """new / cached: request -> (computed tokens, scheduled tokens)."""
    reqs = [NewRequestData(r, list(range(10)), [], SamplingParams(), ([1],), c) for r, (c, _) in new.items()]
    cache = CachedRequestData(list(cached), [([],)] * len(cached), [c for c, _ in cached.values()])
    scheduled = {r: n for r, (_, n) in {**new, **cached}.items()}
    return SchedulerOutput(0, reqs, cache, scheduled, sum(scheduled.values()), [])


def test_a_step_is_labelled_with_its_prompt_and_decode_requests_as_vllm_does():
    so = _step({"a": (0, 10)}, {"b": (4, 6), "c": (20, 1), "d": (30, 1)})
    in_prompt = {"b": True, "c": False, "d": False}.__getitem__
    assert step_label(so, in_prompt, False) == "execute_context_2(16)_generation_2(2)"
    assert step_label(so, in_prompt, True) == ("execute_18_context_2(sq16sk20sqsq136sqsk160)"
                                               "_generation_2(sq2sk52sqsq2sqsk52)")


def _events(path: str) -> list[str]:
    with gzip.open(path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _run_steps(profiler, n: int) -> None:
    for i in range(n):
        profiler.step()
        with profiler.annotate(_step({}, {"x": (i, 1)}), lambda rid: False):
            torch.ones(4).add_(1)


def test_a_session_records_the_steps_after_its_delay_up_to_its_limit(tmp_path):
    config = profiler_config({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False})
    profiler = worker_profiler(config, "w", "cpu", first_rank=False)
    profiler.start("delayed", delay_iterations=2, max_iterations=3)
    _run_steps(profiler, 8)            # steps 2-4 recorded, then it stops by itself
    assert not profiler.active and not profiler.running
    (trace,) = glob.glob(str(tmp_path / "delayed.*.pt.trace.json.gz"))
    labels = [n for n in _events(trace) if n.startswith("execute_")]
    assert labels == ["execute_context_0(0)_generation_1(1)"] * 3
    assert os.path.exists(tmp_path / "delayed.profiler_out.txt")
    profiler.stop()                    # nothing open: nothing happens
    profiler.start("again")            # a new session after one that ended by itself
    _run_steps(profiler, 2)
    profiler.stop()
    (trace,) = glob.glob(str(tmp_path / "again.*.pt.trace.json.gz"))
    assert len([n for n in _events(trace) if n.startswith("execute_")]) == 2


def test_torchs_schedule_keeps_only_the_active_steps(tmp_path):
    config = profiler_config({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "wait_iterations": 1,
                              "warmup_iterations": 1, "active_iterations": 2, "torch_profiler_use_gzip": False})
    profiler = worker_profiler(config, "s", "cpu", first_rank=False)
    profiler.start()
    _run_steps(profiler, 6)
    profiler.stop()
    (trace,) = glob.glob(str(tmp_path / "s.*.pt.trace.json"))
    with open(trace) as f:
        labels = [e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("execute_")]
    assert len(labels) == 2


def test_the_cuda_profiler_and_cuda_activities_need_a_gpu():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        worker_profiler(ProfilerConfig(profiler="cuda"), "w", "cpu", True)
    with pytest.raises(ValueError, match="CUDA needs a CUDA device"):
        worker_profiler(profiler_config({"profiler": "torch", "torch_profiler_dir": "/t",
                                         "torch_profiler_activities": ["CUDA"]}), "w", "cpu", True)


def test_when_torchs_table_cannot_be_read_the_table_is_the_traces_totals(tmp_path, monkeypatch):
    """torch reads back names of functions whose code was freed (a module imported mid-session)
    and its table fails on them: the table then comes from the trace, which is whole."""
    config = profiler_config({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False})
    profiler = worker_profiler(config, "w", "cpu", first_rank=False)
    profiler.start("broken")

    def unreadable(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xa0", 0, 1, "invalid start byte")
    monkeypatch.setattr(profiler._profile, "key_averages", unreadable)
    _run_steps(profiler, 3)
    profiler.stop()
    table = (tmp_path / "broken.profiler_out.txt").read_text()
    assert table.startswith("Name") and "execute_context_0(0)_generation_1(1)" in table
    row = next(line for line in table.splitlines() if line.startswith("execute_context_0(0)_generation_1(1)"))
    assert row.split()[-2] == "3"             # the three steps
