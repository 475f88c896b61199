"""The example plugin package (tests/plugins, installed by `make install`) in a real engine: its
architecture name serves a Llama checkpoint, its general plugin runs in the frontend, the engine
core and the worker, its logits processor bans tokens for the requests that ask (vllm_xargs /
extra_args) in a batch where the others emit them, its endpoint answers; a broken plugin stops the
server's start-up, naming itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from actors.api import LLM, SamplingParams
from actors.runtime import plugins
from helpers import save_tiny_llama, save_tiny_tokenizer, write_distribution
from server import ROOT, Server

pytestmark = pytest.mark.slow

VOCAB = 128
PROMPT = [5, 9, 2, 7, 3]
ARCHITECTURE = "TroupeExampleLlamaForCausalLM"
BAN = "troupe_example_plugins.logits:BanTokensLogitsProcessor"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint whose config.json names the plugin's architecture."""
    path = save_tiny_llama(tmp_path_factory.mktemp("plugin_llama"), VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(path, VOCAB)
    config = os.path.join(path, "config.json")
    with open(config) as f:
        raw = json.load(f)
    raw["architectures"] = [ARCHITECTURE]
    with open(config, "w") as f:
        json.dump(raw, f)
    return path


@pytest.fixture(scope="module")
def pid_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("plugin_pids"))


@pytest.fixture(scope="module")
def server(checkpoint, pid_dir):
    s = Server("--model", checkpoint, "--max-num-seqs", "4", env={"TROUPE_EXAMPLE_PID_DIR": pid_dir})
    yield s
    s.stop()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _complete(server: Server, **body) -> list[int]:
    """The token ids of a greedy completion (the tokenizer's words are "t<id>")."""
    req = urllib.request.Request(f"{server.url}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                  "ignore_eos": True, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    return [int(w[1:]) for w in text.split()]


def test_general_plugin_runs_in_the_frontend_engine_core_and_worker(server, pid_dir):
    recorded = {int(name) for name in os.listdir(pid_dir)}
    assert {server.pid, server.engine_pid(), server.worker_pid()} <= recorded


def test_plugin_architecture_serves_a_llama_checkpoint(server):
    assert len(_complete(server)) == 10


def test_logits_processor_bans_the_tokens_a_request_names_in_vllm_xargs(server):
    plain = _complete(server)
    banned = plain[0]
    asking = _complete(server, vllm_xargs={"banned_token_ids": [banned]})
    assert banned not in asking and asking != plain
    assert _complete(server) == plain                       # the next request is left alone


def test_endpoint_plugin_route_is_served_by_the_frontend(server):
    assert _get(f"{server.url}/example/plugin") == {"plugin": "troupe-example-plugins", "pid": server.pid}


def test_logits_processors_flag_bans_in_a_batch_where_other_rows_emit_the_token(checkpoint, monkeypatch):
    """Offline, with the entry point filtered out (TROUPE_PLUGINS): the processor comes from
    --logits-processors alone; both requests run in the same steps."""
    monkeypatch.setenv(plugins.ENV, "troupe_example_register")
    plugins.reset_for_tests(general_too=False)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        with LLM(checkpoint, multiprocess=False, logits_processors=[BAN]) as llm:
            (plain,) = llm.generate([PROMPT], greedy, use_tqdm=False)
            banned = plain.token_ids[0]
            asking = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                    extra_args={"banned_token_ids": [banned]})
            other, ban = llm.generate([PROMPT, PROMPT], [greedy, asking], use_tqdm=False)
        assert other.token_ids == plain.token_ids and banned in other.token_ids
        assert banned not in ban.token_ids
    finally:
        plugins.reset_for_tests(general_too=False)


def test_a_broken_plugin_stops_the_server_naming_it(tmp_path, checkpoint):
    write_distribution(tmp_path, "[troupe.general_plugins]\ntroupe_test_broken = brokenserve_mod:register\n",
                       module="def register():\n    raise RuntimeError('cannot reach the licence server')\n",
                       name="brokenserve")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tools.serve", "--port", "0", "--model", checkpoint],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "plugin 'troupe_test_broken' (troupe.general_plugins) failed when called" in proc.stderr
    assert "cannot reach the licence server" in proc.stderr
