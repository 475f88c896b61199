"""``python -m tools.batch`` on a 100-line OpenAI batch file, as a user runs it: every line gets
one output line; chat, completions, streaming flags (ignored), a structured-output request and
bad lines side by side; the bodies are those the server answers for the same bodies (greedy);
a run of 48 requests killed a quarter of the way and rerun with ``--resume`` holds each custom id
exactly once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from server import ROOT, Server, alive, children

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                          "population": {"type": "integer", "maximum": 99999999}},
          "required": ["city", "population"]}
GOOD = 92                  # lines that run, then 8 more: a structured output and seven that cannot run
TOPICS = ["the sea", "a cat", "Paris", "winter", "music", "a robot", "the moon", "bread"]


def batch_lines() -> list[str]:
    """100 lines: chat, completions (text and token-id prompts) and responses, some asking to
    stream, one structured output, and seven that cannot run."""
    lines = []
    for i in range(GOOD):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2 == 0:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say one thing about {topic}."}],
                    "max_tokens": 4 + i % 5, "temperature": 0}
            url = "/v1/chat/completions"
        elif i % 16 == 15:
            body = {"model": MODEL, "input": f"Say one thing about {topic}.", "max_output_tokens": 4 + i % 5,
                    "temperature": 0}
            url = "/v1/responses"
        else:
            prompt = f"A story about {topic}, part {i}:" if i % 3 else [1, 2, 3, 40 + i]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4 + i % 5, "temperature": 0}
            url = "/v1/completions"
        if i % 7 == 0:
            body["stream"] = True
        if i % 14 == 0:
            body["stream_options"] = {"include_usage": True}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    lines.append(json.dumps({"custom_id": "structured", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "max_tokens": 60, "temperature": 0,
                                      "messages": [{"role": "user", "content": "A city and its population."}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "city", "schema": SCHEMA}}}}))
    lines.append("{this is not json")
    lines.append(json.dumps(["a", "list"]))
    lines.append(json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}}))
    lines.append(json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/images/generations", "body": {}}))
    lines.append(json.dumps({"custom_id": "bad-method", "method": "GET", "url": "/v1/completions", "body": {}}))
    lines.append(json.dumps({"custom_id": "bad-value", "method": "POST", "url": "/v1/completions",
                             "body": {"model": MODEL, "prompt": "x", "temperature": -1}}))
    lines.append(json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "no-such-model", "prompt": "x"}}))
    assert len(lines) == GOOD + 8
    return lines


def run_batch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.batch", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    path.write_text("\n".join(batch_lines()) + "\n")
    return path


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch") / "results.jsonl"
    proc = run_batch("-i", str(inputs), "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    return read_jsonl(out), summary


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_every_line_gets_one_output_line(results):
    records, summary = results
    assert len(records) == GOOD + 8
    ids = [r["custom_id"] for r in records if r["custom_id"] is not None]
    assert len(ids) == len(set(ids)) == GOOD + 5     # three lines have no custom id to give back
    assert all(r["id"].startswith("batch_req_") for r in records)
    assert summary["requests"] == GOOD + 8 and summary["not_run"] == 0


def test_good_lines_are_answered_and_stream_flags_ignored(results):
    by_id = {r["custom_id"]: r for r in results[0]}
    for i in range(GOOD):
        rec = by_id[f"req-{i}"]
        assert rec["error"] is None
        response = rec["response"]
        assert response["status_code"] == 200, response
        body = response["body"]
        assert response["request_id"] == body["id"]
        if i % 16 == 15:
            assert body["object"] == "response" and body["usage"]["output_tokens"] == 4 + i % 5
            continue
        assert body["object"] == ("chat.completion" if i % 2 == 0 else "text_completion")   # never chunks
        assert body["usage"]["completion_tokens"] == 4 + i % 5


def test_structured_output_line_follows_its_schema(results):
    by_id = {r["custom_id"]: r for r in results[0]}
    content = by_id["structured"]["response"]["body"]["choices"][0]["message"]["content"]
    value = json.loads(content)
    assert isinstance(value["city"], str) and isinstance(value["population"], int)


def test_bad_lines_become_error_records_and_the_run_goes_on(results):
    records = results[0]
    unreadable = sorted((r["error"]["line"], r["error"]["code"]) for r in records if r["custom_id"] is None)
    assert unreadable == [(GOOD + 2, "invalid_json"), (GOOD + 3, "invalid_request"), (GOOD + 4, "missing_custom_id")]
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["bad-url"]["error"]["code"] == "invalid_url" and by_id["bad-url"]["response"] is None
    assert by_id["bad-method"]["error"]["code"] == "invalid_method"
    bad_value = by_id["bad-value"]["response"]
    assert bad_value["status_code"] == 400 and bad_value["body"]["error"]["param"] == "temperature"
    assert by_id["bad-model"]["response"]["status_code"] == 404


def test_bodies_match_what_the_server_answers(results, server):
    """The same bodies sent to the server (greedy): the same status, choices and usage."""
    by_id = {r["custom_id"]: r for r in results[0]}
    lines = {}
    for text in batch_lines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and "custom_id" in line:
            lines[line["custom_id"]] = line
    for cid in ["req-0", "req-1", "req-3", "req-6", "req-9", "req-14", "req-63", "req-77", "structured",
                "bad-value", "bad-model"]:
        line = lines[cid]
        body = {k: v for k, v in line["body"].items() if k not in ("stream", "stream_options")}
        status, answer = post(server.url + line["url"], body)
        got = by_id[cid]["response"]
        assert got["status_code"] == status, cid
        if status == 200 and line["url"] == "/v1/responses":
            text = [[part["text"] for part in item["content"]] for item in answer["output"]]
            assert [[part["text"] for part in item["content"]] for item in got["body"]["output"]] == text, cid
            counts = ("input_tokens", "output_tokens")     # the cached share depends on what ran before
            assert [got["body"]["usage"][k] for k in counts] == [answer["usage"][k] for k in counts], cid
        elif status == 200:
            assert (got["body"]["choices"], got["body"]["usage"]) == (answer["choices"], answer["usage"]), cid
        else:
            assert got["body"] == answer, cid


def test_duplicate_custom_ids_are_refused_before_starting(tmp_path):
    path = tmp_path / "dup.jsonl"
    line = {"custom_id": "same", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    path.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    proc = run_batch("-i", str(path), "-o", str(tmp_path / "out.jsonl"), timeout=60)
    assert proc.returncode == 2
    assert "duplicate custom_id" in proc.stderr and "'same'" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert "loaded" not in proc.stderr             # refused before any model is loaded


def test_killed_halfway_then_resumed_holds_each_custom_id_once(tmp_path):
    lines = [json.dumps({"custom_id": f"k-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"Count from {i}:", "max_tokens": 16,
                                  "temperature": 0, "ignore_eos": True}}) for i in range(48)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "tools.batch", "--no-progress", "--max-num-seqs", "16",
                             "-i", str(inp), "-o", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    family = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            family = sorted(set(family) | set(children(proc.pid)) |
                            {g for c in children(proc.pid) for g in children(c)})
            done = out.read_text().count("\n") if out.exists() else 0
            if done >= 12 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the batch finished before it could be killed"
        assert 12 <= done < 48
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        deadline = time.monotonic() + 30
        for pid in family:                       # the engine and worker follow their parent
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    first = read_jsonl(out) if out.read_bytes().endswith(b"\n") else None
    resumed = run_batch("--resume", "--max-num-seqs", "16", "-i", str(inp), "-o", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "already in" in resumed.stderr
    records = read_jsonl(out)
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(f"k-{i}" for i in range(48))         # each exactly once
    assert all(r["response"]["status_code"] == 200 for r in records)
    if first is not None:
        assert len(first) < 48
