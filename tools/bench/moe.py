"""One mixture-of-experts layer's experts on the CPU (float32, random weights): the native fused
kernel (kernels/cpu/moe.c) against the torch reference, a loop over the experts with torch
matmuls (models/moe.py), at several batch sizes, side by side in one run. Each point is the
median of ``--repeats`` timed calls after a warm-up; the outputs are checked equal first."""
from __future__ import annotations

import json
import statistics
import time
from typing import Any


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(args: Any) -> None:
    import torch

    from kernels.cpu import moe as cpu_moe
    from kernels.cpu.native import available
    from models.moe import fused_experts_ref, select_experts
    ok, reason = available()
    if not ok:
        raise SystemExit(f"the native CPU kernels are unavailable: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    E, H, I, k = args.experts, args.hidden, args.intermediate, args.top_k
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    router = torch.randn(E, H, generator=g)
    rows = []
    for T in args.batches:
        x = torch.randn(T, H, generator=g)
        weights, ids = select_experts(x @ router.T, k, renormalize=True)
        want = fused_experts_ref(x, w13, w2, weights, ids)
        torch.testing.assert_close(cpu_moe.fused_experts(x, w13, w2, weights, ids), want, rtol=1e-4, atol=1e-4)
        native = _median_ms(lambda: cpu_moe.fused_experts(x, w13, w2, weights, ids), args.repeats)
        loop = _median_ms(lambda: fused_experts_ref(x, w13, w2, weights, ids), args.repeats)
        rows.append({"tokens": T, "experts_hit": int(ids.unique().numel()), "native_ms": round(native, 3),
                     "torch_loop_ms": round(loop, 3), "speedup": round(loop / native, 2)})
        print(f"T={T:5d}  experts hit {rows[-1]['experts_hit']:3d}  native {native:8.3f} ms  "
              f"torch loop {loop:8.3f} ms  x{loop / native:.2f}", flush=True)
    print(json.dumps({"bench": "moe", "experts": E, "hidden": H, "intermediate": I, "top_k": k,
                      "threads": torch.get_num_threads(), "rows": rows}))
