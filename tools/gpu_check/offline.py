"""The offline throughput benchmark (``python -m tools.bench offline``: the whole engine, every
request of a workload submitted at once) on the GPU, once with CUDA graphs and once with
``--enforce-eager``, on the same generated workload: output tokens/s of each and their ratio.
Each run is its own process. Last line: one JSON object.

    python -m tools.gpu_check.offline --model PATH.gguf [--n 64] [--in 128] [--out 128]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tools.gpu_check import last_json


def run(model: str, n: int, prompt_len: int, output_len: int, device: str, timeout: float) -> dict:
    common = [sys.executable, "-m", "tools.bench", "offline", "--model", model, "--n", str(n),
              "--in", str(prompt_len), str(prompt_len), "--out", str(output_len), str(output_len),
              "--seed", "0", "--max-num-seqs", str(n), "--device", device]
    result: dict = {"requests": n, "prompt_len": prompt_len, "output_len": output_len}
    deadline = time.monotonic() + timeout
    for mode, extra in (("graphs", []), ("eager", ["--enforce-eager"])):
        try:
            proc = subprocess.run(common + extra, capture_output=True, text=True,
                                  timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            result[mode], result["ok"] = {"error": f"no result in {exc.timeout:.0f} s"}, False
            return result
        out = last_json(proc.stdout) if proc.returncode == 0 else None
        if out is None:
            result[mode] = {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-1500:]}
            result["ok"] = False
            return result
        result[mode] = {k: out[k] for k in ("output_tok_per_s", "total_tok_per_s", "seconds", "steps",
                                            "engine_overhead_fraction", "max_batch_size", "device")}
    result["speedup"] = round(result["graphs"]["output_tok_per_s"] / result["eager"]["output_tok_per_s"], 2)
    result["ok"] = True
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.offline")
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=64, help="requests (and --max-num-seqs)")
    p.add_argument("--in", dest="prompt_len", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--out", dest="output_len", type=int, default=128, help="output tokens of each request")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    p.add_argument("--timeout", type=float, default=75.0, help="seconds for both runs")
    args = p.parse_args()
    result = run(args.model, args.n, args.prompt_len, args.output_len, args.device, args.timeout)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
