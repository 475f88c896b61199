"""``python -m tools.bench pd``: one server against prefill + decode servers behind the proxy, on
this machine, with the serving load generator (``tools/bench/serve.py``): the same workload,
arrivals and model, one layout after the other in one run. Each layout's servers are started,
measured and stopped before the next starts."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """``python -m ARGS``, ready when it prints "Troupe ready on URL"."""

    def __init__(self, *argv: str, timeout: float = 300.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.url = ""
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                m = re.search(r"Troupe ready on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"{' '.join(argv)} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _serve_args(args: Any, url: str) -> argparse.Namespace:
    return argparse.Namespace(workload=args.workload, n=args.n, inp=args.inp, out=args.out, seed=args.seed,
                              url=url, model=None, request_rate=args.request_rate, concurrency=args.concurrency,
                              timeout=1800)


def _measure(args: Any, url: str) -> dict[str, Any]:
    import uvloop
    from tools.bench import serve
    return uvloop.run(serve.run(_serve_args(args, url)))


def _transfer_counters(url: str) -> dict[str, float]:
    """The server's troupe:kv_transfer_*_total counters (/metrics): how its prompts' KV arrived."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^troupe:kv_transfer_(\w+)_total(?:\{[^}]*\})? (\S+)$",
                                                                 text, re.M)}


def main(args: Any) -> None:
    common = ["--kv-cache-gib", str(args.kv_cache_gib), "--max-num-seqs", str(args.max_num_seqs),
              *(["--model", args.model] if args.model else [])]
    results: dict[str, Any] = {"bench": "pd", "kv_connector": args.kv_connector, "requests": args.n,
                               "in": args.inp, "out": args.out, "request_rate": args.request_rate,
                               "concurrency": args.concurrency or None}
    single = _Proc("tools.serve", "--port", "0", *common)
    try:
        results["single"] = _measure(args, single.url)
    finally:
        single.stop()
    kv = lambda role: json.dumps({"kv_connector": args.kv_connector, "kv_role": role,   # noqa: E731
                                  "kv_port": _free_port()})
    procs: list[_Proc] = []
    try:
        split = ["--threads", str(args.pd_threads)] if args.pd_threads else []
        procs.append(_Proc("tools.serve", "--port", "0", *common, *split, "--kv-transfer-config", kv("kv_producer")))
        procs.append(_Proc("tools.serve", "--port", "0", *common, *split, "--kv-transfer-config", kv("kv_consumer")))
        procs.append(_Proc("tools.pd_proxy", "--prefill", procs[0].url, "--decode", procs[1].url, "--port", "0"))
        results["pd"] = _measure(args, procs[2].url)
        results["pd"]["decode_server_kv_transfer"] = _transfer_counters(procs[1].url)
    finally:
        for p in reversed(procs):
            p.stop()
    for key in ("ttft_s", "itl_s", "e2e_s"):
        s, d = results["single"][key], results["pd"][key]
        results[f"{key.removesuffix('_s')}_p50_ratio_pd_over_single"] = round(d["p50"] / s["p50"], 3) if s["p50"] else None
    print(json.dumps(results), flush=True)
