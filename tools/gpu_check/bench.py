"""Offline decode benchmark of the GPU worker, eager and with CUDA graphs: a batch of requests
prefilled together, then timed decode steps (one token per request per step, sampling and the
host round trip included). Reports tokens/s, the speed-up of graphs over eager, and achieved
memory bandwidth (weights plus the KV cache read per step, over the step time and over the
forward time alone) against the device's peak; at the largest batch, also graphs with the
layers' plain torch ops instead of the Triton elementwise kernels. Last line: one JSON object.

The model has its source's full depth: a cut GGUF (see prepare.py) records the original layer
count, and its kept layers are repeated to fill it, so shapes, bytes and kernel counts are
SmolLM2's own.

    python -m tools.gpu_check.bench --model PATH.gguf [--batches 1,64] [--steps 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import time
from typing import Iterator

import numpy as np
import torch

from tools.gpu_check.driver import StepDriver, build_runner
from tools.gpu_check.prepare import SOURCE_BLOCK_COUNT

BLOCK_SIZE = 16
H200_PEAK = 4.8e12


def load_full_depth(path: str, dtype: torch.dtype, device: str):
    """The model of a GGUF at its source's depth (layers repeated when the file was cut)."""
    from kernels.attention.selector import select_backend
    from models.gguf_loader import gguf_model_config, iter_gguf_weights, read_gguf
    from models.registry import attention_requirements, get_model_class, load_weights
    gguf = read_gguf(path)
    config = gguf_model_config(gguf)
    depth = int(gguf.metadata.get(SOURCE_BLOCK_COUNT, config.num_layers))
    if config.layer_types is not None and depth != config.num_layers:
        raise ValueError("repeating layers of a model with per-layer attention types is not supported")
    full = dataclasses.replace(config, num_layers=depth)
    backend = select_backend(attention_requirements(full, dtype, BLOCK_SIZE, device))
    model = get_model_class(full.architecture)(full, backend, dtype)
    weights = _repeat_layers(iter_gguf_weights(gguf, config), config.num_layers, depth)
    load_weights(model, weights, model.gguf_tensor_map)
    return model.eval().to(device), full, config.num_layers


def _repeat_layers(weights: Iterator, kept: int, depth: int) -> Iterator:
    for name, tensor in weights:
        m = re.match(r"blk\.(\d+)\.(.*)", name)
        if m is None:
            yield name, tensor
            continue
        for j in range(int(m.group(1)), depth, kept):
            yield f"blk.{j}.{m.group(2)}", tensor


def peak_bandwidth() -> tuple[float, str]:
    """Bytes/s the device's memory can move: bus width x memory clock x 2 (double data rate)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        bus = pynvml.nvmlDeviceGetMemoryBusWidth(h)                       # bits
        clock = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)  # MHz
        return 2 * clock * 1e6 * bus / 8, f"nvml: {bus}-bit bus, {clock} MHz memory clock, double data rate"
    except Exception as exc:  # no NVML: fall back to the H200's data-sheet number, and say so
        return H200_PEAK, f"assumed H200 data sheet 4.8 TB/s (NVML unavailable: {type(exc).__name__}: {exc})"


def bench(model, config, dtype: torch.dtype, device: str, batch: int, graphs: bool, prompt_len: int,
          warmup: int, steps: int) -> dict:
    num_blocks = batch * -(-(prompt_len + warmup + steps + 2) // BLOCK_SIZE) + 1
    runner, capture_s = build_runner(model, config, device, dtype, graphs=graphs, max_num_seqs=batch,
                                     num_blocks=num_blocks, block_size=BLOCK_SIZE)
    forward, timings = runner._forward, []

    def timed_forward(inp):               # CUDA events on the GPU (no sync), the host clock on the CPU
        on_cuda = device == "cuda"
        start = torch.cuda.Event(enable_timing=True) if on_cuda else time.perf_counter()
        if on_cuda:
            start.record()
        hidden = forward(inp)
        if on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timings.append((start, end))
        else:
            timings.append(time.perf_counter() - start)
        return hidden

    rng = np.random.default_rng(0)
    d = StepDriver(runner, BLOCK_SIZE)
    d.prefill({f"r{i}": rng.integers(100, config.vocab_size - 100, prompt_len).tolist() for i in range(batch)})
    for _ in range(warmup):
        d.decode()
    runner._forward = timed_forward
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        d.decode()
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    forward_s = sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3 for t in timings) / len(timings)
    mean_len = prompt_len + warmup + (steps + 1) / 2
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())   # tied: counted once
    kv_bytes = batch * mean_len * config.kv_bytes_per_token(dtype.itemsize)
    moved = weight_bytes + kv_bytes
    out = {"tokens_per_s": round(batch / step_s, 1), "step_ms": round(step_s * 1e3, 3),
           "forward_ms": round(forward_s * 1e3, 3), "bytes_per_step": int(moved),
           "GBps_step": round(moved / step_s / 1e9, 1), "GBps_forward": round(moved / forward_s / 1e9, 1)}
    if graphs:
        out |= {"capture_s": round(capture_s, 2), "graphs": len(runner.graphs.graphs)}
    del runner, d, forward, timed_forward      # a cycle (runner -> timed_forward -> runner): collect it
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(path: str, batches: list[int], prompt_len: int, warmup: int, steps: int, device: str = "cuda",
        compare_torch_ops: bool = True) -> dict:
    """device "cpu" is a dry run of this script (float32, the padded path run eagerly).
    ``compare_torch_ops``: also time the largest batch's graphs with the plain torch ops."""
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, config, kept = load_full_depth(path, dtype, device)
    peak, peak_source = peak_bandwidth() if device == "cuda" else (None, "not measured on the CPU")
    name, sms = ((torch.cuda.get_device_properties(0).name, torch.cuda.get_device_properties(0).multi_processor_count)
                 if device == "cuda" else ("cpu", 0))
    result = {"device": name, "sms": sms, "dtype": str(dtype).removeprefix("torch."),
              "layers": config.num_layers, "distinct_layers": kept, "prompt_len": prompt_len,
              "warmup_steps": warmup, "timed_steps": steps, "peak_GBps": round(peak / 1e9, 1) if peak else None,
              "peak_source": peak_source, "batches": {}}
    for batch in batches:
        eager = bench(model, config, dtype, device, batch, False, prompt_len, warmup, steps)
        graphs = bench(model, config, dtype, device, batch, True, prompt_len, warmup, steps)
        result["batches"][str(batch)] = {
            "eager": eager, "graphs": graphs,
            "speedup": round(graphs["tokens_per_s"] / eager["tokens_per_s"], 2),
            "bandwidth_fraction_step": round(graphs["GBps_step"] * 1e9 / peak, 4) if peak else None,
            "bandwidth_fraction_forward": round(graphs["GBps_forward"] * 1e9 / peak, 4) if peak else None}
    # A/B at the largest batch, with time to spare: the layers' Triton elementwise kernels (RMSNorm,
    # rotary, SiLU-and-mul) against the plain torch ops they replace, both with graphs
    if compare_torch_ops and time.perf_counter() - t0 < 45:
        from kernels.triton import fused as triton_fused
        batch = max(batches)
        triton_fused.ENABLED = False
        try:
            torch_ops = bench(model, config, dtype, device, batch, True, prompt_len, warmup, steps)
        finally:
            triton_fused.ENABLED = True
        entry = result["batches"][str(batch)]
        entry["graphs_torch_ops"] = torch_ops
        entry["triton_ops_speedup"] = round(entry["graphs"]["tokens_per_s"] / torch_ops["tokens_per_s"], 2)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.bench")
    p.add_argument("--model", required=True, help="a GGUF file (a cut one is run at its source's depth)")
    p.add_argument("--batches", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA device (--device cpu: a dry run)")
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps(run(args.model, batches, args.prompt_len, args.warmup, args.steps, args.device)))


if __name__ == "__main__":
    main()
