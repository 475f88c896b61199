"""vLLM's --watermark-config on the real server: sampled answers carry the watermark (``troupe
detect-watermark`` finds it in their token ids and in their text), a request with
``watermarking: false`` and a greedy one do not, /metrics counts each status, and the key shows
neither in /server_info nor on the command line of any process the server starts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests

from server import ROOT, Server, children

pytestmark = pytest.mark.slow

KEY = 20261205
CONFIG = json.dumps({"key": KEY})


@pytest.fixture(scope="module")
def server():
    s = Server("--threads", "1", "--watermark-config", CONFIG, env={"VLLM_SERVER_DEV_MODE": "1"})
    yield s
    s.stop()


def _complete(server, **extra) -> dict:
    body = {"prompt": "Write a short story about a lighthouse keeper:", "max_tokens": 48, "temperature": 1.0,
            "seed": 5, "ignore_eos": True, "return_token_ids": True, **extra}
    resp = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _detect_ids(token_ids: list[int], config: str = CONFIG) -> dict:
    """What ``troupe detect-watermark --token-ids`` answers, in this process."""
    from models.watermark import create_detector
    return vars(create_detector(json.loads(config)).detect(token_ids))


def _detect(*args: str, config: str = CONFIG) -> dict:
    out = subprocess.run([sys.executable, "-m", "tools.cli", "detect-watermark", "--watermark-config", config, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sampled_answers_carry_the_watermark_and_opted_out_or_greedy_ones_do_not(server):
    marked = _complete(server)
    plain = _complete(server, watermarking=False)
    greedy = _complete(server, temperature=0, watermarking=True)
    found = _detect_ids(marked["token_ids"])
    assert found["is_watermarked"] and found["p_value"] < 1e-4 and found["num_scored_tokens"] > 30
    assert _detect("--text", marked["text"])["is_watermarked"]                     # the command, on its text
    assert not _detect_ids(plain["token_ids"])["is_watermarked"]
    assert not _detect_ids(marked["token_ids"], config=json.dumps({"key": KEY + 1}))["is_watermarked"]
    assert greedy["token_ids"] == _complete(server, temperature=0, watermarking=False)["token_ids"]
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    counts = {s: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              for s in ("watermarked", "skipped", "not_watermarked")
              if line.startswith(f'vllm:watermark_requests_total{{') and f'status="{s}"' in line}
    assert counts["watermarked"] >= 1 and counts["not_watermarked"] >= 2 and counts["skipped"] >= 1


def test_the_key_is_in_no_answer_and_on_no_command_line_the_server_starts(server):
    info = requests.get(server.url + "/server_info?config_format=json", timeout=120)
    assert info.status_code == 200 and str(KEY) not in info.text
    assert info.json()["vllm_config"]["watermark"]["key"] == "<redacted>"
    assert str(KEY) not in requests.get(server.url + "/server_info", timeout=120).text
    todo, seen = children(server.pid), 0      # (the server's own is the user's: --config FILE keeps it off)
    while todo:
        pid = todo.pop()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        assert str(KEY) not in cmdline and "TROUPE_NODE_SPEC" not in cmdline
        if "actors.runtime.child" in cmdline:
            seen += 1
            assert len(cmdline.split("\0")) <= 5, cmdline      # python -m actors.runtime.child NAME
        todo.extend(children(pid))
    assert seen >= 2                                           # the engine core and its worker
