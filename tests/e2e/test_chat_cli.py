"""``python -m tools.chat`` driven as a user would: a real process fed through its stdin, Ctrl-C
sent as SIGINT to its pid while a reply streams and while it waits at the prompt, in both modes
(the engine in the process, and ``--url`` against a real server)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from server import ROOT, Server

pytestmark = pytest.mark.slow

LONG_ASK = "Write a very long story about a dragon who learns to paint, with many chapters."
TIMEOUT_S = 120.0


class Chat:
    """The chat process, its stdout and stderr collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.chat", "--temperature", "0", *args], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out = {"stdout": "", "stderr": ""}
        self._changed = threading.Condition()
        for name in self.out:
            threading.Thread(target=self._pump, args=(name,), daemon=True).start()

    def _pump(self, name: str) -> None:
        stream = getattr(self.proc, name)
        while chunk := stream.read1(4096):
            with self._changed:
                self.out[name] += chunk.decode(errors="replace")
                self._changed.notify_all()
        with self._changed:            # the end of the output: waiters see the exit at once
            self._changed.notify_all()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait_for(self, name: str, ok, timeout: float = TIMEOUT_S) -> str:
        """Wait until ``ok(text so far)`` holds for stdout or stderr; returns that text."""
        with self._changed:
            if not self._changed.wait_for(lambda: ok(self.out[name]) or self.proc.poll() is not None, timeout):
                raise AssertionError(f"timed out waiting on {name}: {self.out}")
            assert ok(self.out[name]), f"the chat exited ({self.proc.returncode}): {self.out}"
            return self.out[name]

    def interrupt(self) -> None:
        os.kill(self.proc.pid, signal.SIGINT)

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def stop_a_reply_then_chat_on(chat: Chat) -> str:
    """Ctrl-C a long reply, check the conversation kept what was shown, ask again, Ctrl-C at the
    prompt, then leave with /exit. Returns the part of the reply that was shown."""
    chat.send(LONG_ASK)
    chat.wait_for("stdout", lambda s: len(s.strip()) >= 20)          # the reply is streaming
    chat.interrupt()
    chat.wait_for("stderr", lambda s: "[stopped]" in s)
    time.sleep(0.2)                                                # stdout's last piece comes in
    shown = chat.out["stdout"]
    assert chat.proc.poll() is None and "Traceback" not in chat.out["stderr"]
    chat.send("/history")
    history = chat.wait_for("stdout", lambda s: "assistant: " in s[len(shown):])[len(shown):]
    assert f"user: {LONG_ASK}\nassistant: {shown}" in history     # the partial reply is the turn
    chat.send("What is the capital of France?")
    chat.wait_for("stdout", lambda s: "Paris" in s[len(shown) + len(history):])
    chat.send("/help")                                             # answered once the reply ended
    chat.wait_for("stdout", lambda s: "/history" in s[len(shown) + len(history):])
    chat.interrupt()                                               # at the prompt: the line is cleared
    chat.wait_for("stderr", lambda s: "Ctrl-C clears the line" in s)
    assert chat.proc.poll() is None
    chat.send("/exit")
    assert chat.proc.wait(60) == 0, chat.out
    assert "Traceback" not in chat.out["stderr"], chat.out["stderr"]
    return shown


def test_ctrl_c_stops_a_local_reply_keeps_the_conversation_and_returns_to_the_prompt():
    chat = Chat("--max-tokens", "4000")
    try:
        chat.send(LONG_ASK)
        chat.wait_for("stdout", lambda s: len(s.strip()) >= 20)
        chat.interrupt()
        chat.wait_for("stderr", lambda s: "[stopped]" in s)
        before = chat.cpu_seconds()
        time.sleep(2.0)
        assert chat.cpu_seconds() - before < 0.5      # the aborted request no longer runs
        chat.send("/reset")
        chat.wait_for("stderr", lambda s: "conversation cleared" in s)
        chat.out["stdout"] = ""
        stop_a_reply_then_chat_on(chat)
    finally:
        chat.close()


@pytest.fixture(scope="module")
def server():
    s = Server("--threads", "1")
    yield s
    s.stop()


def engine_stats(server: Server) -> dict:
    with urllib.request.urlopen(server.url + "/debug/engine", timeout=10) as resp:
        return json.loads(resp.read())


def test_ctrl_c_stops_a_remote_reply_and_the_server_aborts_it(server):
    chat = Chat("--url", server.url, "--max-tokens", "4000")
    try:
        stop_a_reply_then_chat_on(chat)
    finally:
        chat.close()
    deadline = time.monotonic() + 10
    while (stats := engine_stats(server))["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["requests_finished"].get("abort") == 1, stats
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0, stats


def test_vllm_chat_and_complete_command_lines_answer_once_with_stats(server):
    """`troupe chat` and `troupe complete` with vLLM's flags (a /v1 url, --model-name, -q, --stats):
    one reply, the same text the server gives the same request, and the stats lines."""
    model = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=10).read())["data"][0]["id"]
    common = ["--url", server.url + "/v1", "--model-name", model, "--temperature", "0", "--max-tokens", "6",
              "--stats"]
    for command, ask, path, body in (
            ("chat", "What is the capital of France?", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
            ("complete", "The capital of France is", "/v1/completions", {"prompt": "The capital of France is"})):
        run = subprocess.run([sys.executable, "-m", "tools.cli", command, *common, "-q", ask], cwd=ROOT,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        assert run.returncode == 0, run.stderr
        request = urllib.request.Request(server.url + path, headers={"Content-Type": "application/json"},
                                         data=json.dumps({**body, "temperature": 0, "max_tokens": 6}).encode())
        answer = json.loads(urllib.request.urlopen(request, timeout=TIMEOUT_S).read())
        choice = answer["choices"][0]
        text = choice["text"] if command == "complete" else choice["message"]["content"]
        lines = run.stdout.splitlines()
        assert lines[0] == text.split("\n")[0] and run.stdout.startswith(text), run.stdout
        assert lines[-2].startswith("TTFT:") and lines[-1].startswith("TPS:"), run.stdout
        assert f"({answer['usage']['completion_tokens']} tokens in" in lines[-1]
