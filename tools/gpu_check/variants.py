"""The engine's offline benchmark (``python -m tools.bench offline``) on the GPU in the
configurations the feature flags make: bfloat16 with CUDA graphs as the reference, FP8 and INT8
W8A8 checkpoints (written here by ``python -m tools.quantize`` from the checked model), FP8
quantized at load (``--quantization fp8``), AWQ and GPTQ 4-bit checkpoints, ``-O2`` and ``-O3``
compilation (the FP8 checkpoint at ``-O3`` too: its activations' quantization fused into the norms), an FP8 KV cache, ``--async-scheduling`` (the worker computing on its own thread
beside the event loop) and the server's three-process layout with and without it (how much of a
step cycle the engine's own work takes in each: ``engine_overhead_fraction``), at batch 64 and,
for the weight formats,
batch 1; and ``--gpu-memory-utilization`` with the device's memory in use sampled through NVML
during the run (its peak against the share asked for). Each run is its own process; every
ratio is against the reference at the same batch, measured in this same call. Last line: one
JSON object.

    python -m tools.gpu_check.variants --model PATH.gguf [--timeout 200]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from tools.gpu_check import last_json

CHECKPOINTS = {"fp8": ["--scheme", "fp8", "--per-channel"], "int8": ["--scheme", "int8", "--per-channel"],
               "awq": ["--scheme", "awq", "--group-size", "64"], "gptq": ["--scheme", "gptq", "--group-size", "64"]}
# (name, batch, checkpoint or None for the GGUF itself, extra flags); the reference comes first
RUNS = [("bf16", 64, None, []), ("bf16", 1, None, []),
        ("async_scheduling", 64, None, ["--async-scheduling"]),
        ("multiprocess", 64, None, ["--multiprocess"]),      # the server's layout: async scheduling on
        ("multiprocess_sync", 64, None, ["--multiprocess", "--no-async-scheduling"]),
        ("O2", 64, None, ["--compilation-config", "2"]),
        ("kv_fp8", 64, None, ["--kv-cache-dtype", "fp8"]),
        ("memory_0.3", 64, None, ["--gpu-memory-utilization", "0.3"]),
        ("O3", 64, None, ["--compilation-config", "3"]),
        ("fp8_checkpoint", 64, "fp8", []), ("fp8_checkpoint", 1, "fp8", []),
        ("fp8_checkpoint_O3", 64, "fp8", ["--compilation-config", "3"]),   # the norm + quant fusion
        ("int8_checkpoint", 64, "int8", []),
        ("awq", 64, "awq", []), ("awq", 1, "awq", []), ("gptq", 64, "gptq", []),
        ("fp8_at_load", 64, None, ["--quantization", "fp8"])]
KEEP = ("output_tok_per_s", "seconds", "steps", "engine_overhead_fraction", "kv_cache_tokens", "max_batch_size")


class MemorySampler:
    """The device's memory in use (every process's), sampled through NVML every 20 ms."""

    def __init__(self) -> None:
        import pynvml
        import torch
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used))

    def __enter__(self) -> "MemorySampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def checkpoints(model: str, names: set[str], folder: str, deadline: float) -> dict:
    """Write the quantized checkpoints the runs need; name -> path, or an error."""
    made = {}
    for name in sorted(names):
        out = os.path.join(folder, name)
        cmd = [sys.executable, "-m", "tools.quantize", "--model", model, *CHECKPOINTS[name], "-o", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, deadline - time.monotonic()))
            made[name] = out if proc.returncode == 0 else {"error": (proc.stdout + proc.stderr)[-800:]}
        except subprocess.TimeoutExpired:
            made[name] = {"error": "timed out"}
    return made


def run(model: str, device: str, timeout: float, prompt_len: int, output_len: int, runs: list) -> dict:
    deadline = time.monotonic() + timeout
    made = checkpoints(model, {r[2] for r in runs if r[2]}, "/tmp/troupe-variants", deadline)
    results: dict = {"prompt_len": prompt_len, "output_len": output_len, "runs": {}}
    for name, batch, ckpt, extra in runs:
        key = f"{name}@{batch}"
        source = made.get(ckpt) if ckpt else model
        if not isinstance(source, str):
            results["runs"][key] = source or {"error": "no checkpoint"}
            continue
        left = deadline - time.monotonic()
        if left < 8:
            results["runs"][key] = {"error": "no time left"}
            continue
        cmd = [sys.executable, "-m", "tools.bench", "offline", "--model", source, "--n", str(batch),
               "--in", str(prompt_len), str(prompt_len), "--out", str(output_len), str(output_len), "--seed", "0",
               "--max-num-seqs", str(batch), "--device", device, *extra]
        sampler = MemorySampler() if "--gpu-memory-utilization" in extra and device == "cuda" else None
        try:
            if sampler:
                with sampler:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            else:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            results["runs"][key] = {"error": f"no result in {left:.0f} s"}
            continue
        out = last_json(proc.stdout) if proc.returncode == 0 else None
        if out is None:
            results["runs"][key] = {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-1200:]}
            continue
        entry = {k: out.get(k) for k in KEEP}
        if sampler:
            share = float(extra[extra.index("--gpu-memory-utilization") + 1])
            entry |= {"asked_share": share, "peak_used_share": round(sampler.peak / sampler.total, 4),
                      "peak_used_gib": round(sampler.peak / 2**30, 2), "device_gib": round(sampler.total / 2**30, 1)}
        results["runs"][key] = entry
    ref = {b: results["runs"].get(f"bf16@{b}", {}).get("output_tok_per_s") for b in (1, 64)}
    for key, entry in results["runs"].items():
        batch = int(key.rsplit("@", 1)[1])
        if ref.get(batch) and entry.get("output_tok_per_s") and not key.startswith("bf16@"):
            entry["vs_bf16"] = round(entry["output_tok_per_s"] / ref[batch], 3)
    results["ok"] = all("error" not in e for e in results["runs"].values())
    return results


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF checked (the quantized checkpoints are written from it)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds for everything")
    p.add_argument("--in", dest="prompt_len", type=int, default=128)
    p.add_argument("--out", dest="output_len", type=int, default=256)
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default: all)")
    args = p.parse_args()
    runs = [r for r in RUNS if (not args.only or r[0] in args.only.split(","))
            and (not args.batches or str(r[1]) in args.batches.split(","))]
    if args.device == "cpu":          # plumbing only: each configuration once, batch 1, no memory sampling
        first = {}
        for name, _, ckpt, extra in runs:
            first.setdefault(name, (name, 1, ckpt, [] if "--gpu-memory-utilization" in extra else extra))
        runs = list(first.values())
    result = run(args.model, args.device, args.timeout, args.prompt_len, args.output_len, runs)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
