"""vLLM's environment variables a deployment sets work unchanged: the CPU's KV cache size, its
workers' cores, reserved cores, a context length past the model's only when allowed, HTTP
keep-alive and logging; a value that does not parse stops the server naming the variable."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from actors.engine import vllm_env
from actors.engine.args import EngineArgs
from actors.runtime import logs
from models.config import ArchConfig
from tools import serve

ARCH = ArchConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, True, 1, (2,))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolved(cpu_count: int = 8, **options):
    return EngineArgs(**options).create_engine_config().resolve(cuda_available=False, cpu_count=cpu_count, arch=ARCH)


def test_vllm_cpu_kvcache_space_sizes_the_cpu_cache_over_the_flag(monkeypatch):
    per_block = ARCH.kv_bytes_per_token(4) * 16
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert resolved(kv_cache_bytes=1 << 30).cache.num_blocks == (2 << 30) // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")                  # 0 or empty: unset
    assert resolved(kv_cache_bytes=1 << 30).cache.num_blocks == (1 << 30) // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4GB")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be an integer"):
        resolved()


def test_a_context_past_the_models_needs_vllm_allow_long_max_model_len(monkeypatch):
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        resolved(max_model_len=16384, kv_cache_bytes=4 << 30)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert resolved(max_model_len=16384, kv_cache_bytes=4 << 30).model.max_model_len == 16384
    assert resolved(max_model_len=4096).model.max_model_len == 4096


def test_reserved_cores_are_left_out_of_the_workers_threads(monkeypatch):
    assert resolved(cpu_count=8).device.num_threads == 8
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    assert resolved(cpu_count=8).device.num_threads == 6


def test_threads_bind_gives_each_worker_its_cores(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3,6|4-5")
    assert vllm_env.bound_cores(0) == [0, 1, 2, 3, 6] and vllm_env.bound_cores(1) == [4, 5]
    with pytest.raises(ValueError, match="worker 2 has none"):
        vllm_env.bound_cores(2)
    for off in ("auto", "nobind"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", off)
        assert vllm_env.bound_cores(0) is None


@pytest.mark.parametrize("name, value, message", [
    ("VLLM_CPU_OMP_THREADS_BIND", "0-x", "cores are given as 0-3,6"),
    ("VLLM_CPU_OMP_THREADS_BIND", "3-1", "cores are given as 0-3,6"),
    ("VLLM_CPU_OMP_THREADS_BIND", "0|4096", "core(s) [4096] this machine does not"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "-1", "at least 0"),
    ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "soon", "a number of seconds"),
])
def test_a_bad_variable_stops_the_server_naming_it(monkeypatch, capsys, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        serve.parse_args([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and name in err and message in err


def test_vllm_logging_variables_set_the_level_and_file_or_leave_logging_alone(monkeypatch, tmp_path):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "warning")
    assert serve.parse_args([]).log_level == "WARNING"
    config = tmp_path / "logging.json"
    config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(config))
    assert serve.parse_args([]).log_config_file == str(config)
    root = logging.getLogger()
    handlers = list(root.handlers)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    logs.configure("test", "DEBUG", force=True)             # left alone: the application's own
    assert root.handlers == handlers


def test_a_bound_worker_runs_on_its_cores_with_a_thread_each(tmp_path):
    """A real worker, in a process of its own (binding changes the process's affinity)."""
    code = ("import os, torch; from actors.engine.args import EngineArgs; from actors.worker.worker import Worker; "
            "w = Worker(EngineArgs(device='cpu').create_engine_config()); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), w.config.device.num_threads)")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[0] 1 1"
