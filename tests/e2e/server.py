"""Start ``python -m tools.serve`` as a user would, on a free port, and stop it by pid (or any
other command that serves, e.g. ``python -m tools.cli serve ...``)."""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (for commands that need one named)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports nothing listens on now, below the range the kernel
    hands out for port 0 (so no server started with --port 0 meanwhile can take one of them):
    for a command that listens on a port and the ones after it (a KV side channel per rank)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 30000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports in 20000-30000")


class HeadlessProcess:
    """``python -m tools.serve --headless ARGS``; joined once it prints "Troupe headless:"."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.serve", "--headless", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.joined = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Troupe headless:"):
                self.joined.set()

    def wait_joined(self, timeout: float = 180.0) -> None:
        assert self.joined.wait(timeout), "".join(self.lines)[-3000:]

    def engine_pid(self) -> int:
        """Its one child process (an engine core, or a worker rank)."""
        (pid,) = children(self.proc.pid)
        return pid

    def stop(self) -> None:
        pids = [self.proc.pid, *children(self.proc.pid)]
        pids += [c for p in pids[1:] for c in children(p)]
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        deadline = time.monotonic() + 10
        for p in pids:
            while alive(p) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(p):
                os.kill(p, signal.SIGKILL)


class Server:
    """``python -m tools.serve --port 0 ARGS``; or ``python -m COMMAND...`` when ``command`` is
    given (it names its port itself). Ready once it prints "Troupe ready on URL"."""

    def __init__(self, *args: str, ready_timeout: float = 180.0, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> None:
        argv = command if command is not None else ["tools.serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(ready_timeout):
            self.stop()
            raise RuntimeError("server not ready in time:\n" + self.log())
        if not self.url:
            self.stop()
            raise RuntimeError("server exited before it was ready:\n" + self.errors())

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            # host and port only: a Ray actor's forwarded log can land on the same line
            m = re.search(r"Troupe ready on (https?://[0-9A-Za-z.\-\[\]:]+|unix:\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def log_when(self, holds: Callable[[str], bool], timeout: float = 10.0) -> str:
        """The log once ``holds(log)`` (its lines reach us through a pipe a moment after the
        answer that caused them); the log as it is after ``timeout`` seconds otherwise."""
        deadline = time.monotonic() + timeout
        while not holds(log := self.log()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return log

    def errors(self, limit: int = 2000) -> str:
        """The log without its INFO lines, its last ``limit`` characters (what says why it failed,
        short enough for a test's failure message to show whole)."""
        return "".join(line for line in self.lines if " INFO " not in line)[-limit:]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_pid(self) -> int:
        (pid,) = children(self.pid)
        return pid

    def worker_pid(self) -> int:
        (pid,) = children(self.engine_pid())
        return pid

    def all_pids(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            pids.append(p)
            todo.extend(children(p))
        return pids

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        pids = self.all_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        for p in pids:  # children exit with their parent; make sure of it
            while alive(p) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(p):
                os.kill(p, signal.SIGKILL)


def one_worker_texts(prompts: list[str], tokens: list[int]) -> list[str]:
    """The greedy answers of one in-process worker (the reference of the parallel layouts)."""
    from actors.api import LLM, SamplingParams
    with LLM(multiprocess=False) as llm:
        results = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                         for n in tokens], use_tqdm=False)
    return [r.text for r in results]


def streamed_text_in_thread(url: str, prompt: str, max_tokens: int, result: dict) -> tuple[threading.Thread, threading.Event]:
    """A greedy streamed completion of ``prompt`` in a thread of its own: ``result["text"]`` once it
    ends, and the event set when its first token has arrived (so a fault injected after waiting on
    it lands mid-request, however fast the model decodes)."""
    import asyncio
    import json

    import aiohttp
    first = threading.Event()

    async def main() -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        text = []
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=240)) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        first.set()
        return "".join(text)

    thread = threading.Thread(target=lambda: result.update(text=asyncio.run(main())))
    thread.start()
    return thread, first
