"""The quantized matmuls of kernels/triton/quant.py against bfloat16's (torch's cuBLAS) on
layer shapes large enough for a decode step to be bound by reading the weights (a 7-8B model's
4096 x 4096 attention projection and 14336 x 4096 MLP projections), at batch 1, 16 and 64:
microseconds per call replayed from a CUDA graph (the per-token quantization of the activations
included), the weights' bytes over that time, and the speed-up over bfloat16. FP8 and INT8 both
with the tensor cores' own 8-bit MMA and with the codes widened to float32 (the path Triton's
interpreter checks); int4 with groups in order (one zero and scale per tile column) and in
act-order; each 8-bit and grouped int4 case also with K left whole (``_unsplit``) against the
split-K the kernels choose where the tiles leave multiprocessors idle, and the split chosen
(``splits``); grouped int4 also with each packed word loaded once (``_words_once``). Last line:
one JSON object.

    python -m tools.gpu_check.quant_bench [--device cuda] [--rep-ms 25]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]      # (N out, K in)
BATCHES = [1, 16, 64]
GROUP = 128


def _time_us(fn, device: str, rep_ms: float) -> float:
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench_cudagraph
    return float(do_bench_cudagraph(fn, rep=rep_ms)) * 1e3


def cases(N: int, K: int, M: int, device: str) -> dict:
    """name -> (callable, weight bytes)."""
    from kernels.triton import quant
    gen = torch.Generator().manual_seed(N + K + M)
    w = (torch.randn(N, K, generator=gen) * 0.02).to(device)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    wb = w.to(torch.bfloat16)
    f8, s8 = quant.per_token_quant(w, quant.FMT_FP8)
    i8, si8 = quant.per_token_quant(w, quant.FMT_INT8)
    q4 = torch.randint(0, 16, (K, N), generator=gen)
    packed = quant.pack_int4(q4).to(device)
    zeros = torch.full((K // GROUP, N), 8, dtype=torch.int8, device=device)
    scales = torch.full((K // GROUP, N), 0.01, dtype=torch.float16, device=device)
    g_idx = (torch.arange(K) // GROUP).int().to(device)
    bf = torch.bfloat16

    def w8(codes, scale, fmt, native, splits=None):
        def run():
            q, s = quant.per_token_quant(x, fmt)
            return quant.scaled_mm(q, codes, s, scale, fmt, bf, native, splits)
        return run

    four = N * K // 2 + 3 * N * K // GROUP
    return {"bf16": (lambda: torch.nn.functional.linear(x, wb), 2 * N * K),
            "fp8": (w8(f8, s8, quant.FMT_FP8, None), N * K),
            "fp8_widened": (w8(f8, s8, quant.FMT_FP8, False), N * K),
            "int8": (w8(i8, si8, quant.FMT_INT8, None), N * K),
            "int8_widened": (w8(i8, si8, quant.FMT_INT8, False), N * K),
            "fp8_unsplit": (w8(f8, s8, quant.FMT_FP8, None, 1), N * K),
            "int8_unsplit": (w8(i8, si8, quant.FMT_INT8, None, 1), N * K),
            "int4_grouped": (lambda: quant.int4_linear(x, packed, zeros, scales, g_idx, GROUP, bf), four),
            "int4_grouped_unsplit": (lambda: quant.int4_linear(x, packed, zeros, scales, g_idx, GROUP, bf, 1), four),
            "int4_grouped_words_once": (lambda: quant.int4_linear(x, packed, zeros, scales, g_idx, GROUP, bf,
                                                                  words_once=True), four),
            "int4_act_order": (lambda: quant.int4_linear(x, packed, zeros, scales, g_idx, 0, bf), four)}


def run(device: str, rep_ms: float, shapes: list, batches: list) -> dict:
    from kernels.triton import quant
    out: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "rep_ms": rep_ms,
                 "group": GROUP, "results": {}, "splits": {}}
    for N, K in shapes:
        for M in batches:
            row = {}
            for name, (fn, nbytes) in cases(N, K, M, device).items():
                try:
                    fn()
                    us = _time_us(fn, device, rep_ms)
                    row[name] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
                except Exception as exc:          # one variant failing to compile keeps the others
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            base = row.get("bf16", {}).get("us")
            for name, r in row.items():
                if base and "us" in r and name != "bf16":
                    r["speedup"] = round(base / r["us"], 2)
            out["results"][f"{N}x{K}@{M}"] = row
            bm, bn, bk, _ = quant._tiles(M, N)
            out["splits"][f"{N}x{K}@{M}"] = quant.split_k(M, N, K, torch.device(device), bm, bn, bk)
    out["ok"] = all("error" not in r for row in out["results"].values() for r in row.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.quant_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run (Triton's interpreter)")
    p.add_argument("--rep-ms", type=float, default=25.0)
    args = p.parse_args()
    if args.device == "cpu":          # the kernels run on CPU tensors under Triton's interpreter only
        os.environ["TRITON_INTERPRET"] = "1"
    shapes, batches = (SHAPES, BATCHES) if args.device == "cuda" else ([(128, 256)], [1])
    result = run(args.device, args.rep_ms, shapes, batches)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
