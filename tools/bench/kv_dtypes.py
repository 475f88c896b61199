"""What a narrower KV cache buys a decode step: decode attention alone (the native kernel over a
paged cache of each dtype) and a whole decode step of the model (exact weights, the one-call decode
stack), at a batch of requests with equal contexts. Dtypes alternate within each repeat and the
minimum is kept, so a shared, noisy machine still gives usable ratios."""
from __future__ import annotations

import json
import time
from typing import Any

DTYPES = ("float32", "float16", "fp8_e4m3", "fp8_e5m2")


def _caches(base: list, names: tuple[str, ...]) -> dict[str, list]:
    import torch

    from kernels.attention.fp8 import FP8_NAMES, quantize_kv
    return {n: [quantize_kv(c, FP8_NAMES[n] if n in FP8_NAMES else getattr(torch, n)) for c in base] for n in names}


def _best(fns: dict[str, Any], repeats: int, calls: int = 1) -> dict[str, float]:
    best = {n: float("inf") for n in fns}
    for _ in range(repeats):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[n] = min(best[n], (time.perf_counter() - t0) / calls)
    return best


def load_packed(args: Any) -> tuple[Any, Any, Any]:
    """``args.model`` in float32 on the CPU backend, its linears packed, with its native decode
    stack (None where it does not apply): (model, arch config, stack). ``args.threads``: compute
    threads (0: all cores)."""
    import torch

    from kernels.attention import CpuAttentionBackend
    from models.native_decode import attach
    from models.packed import prepack_linears
    from models.registry import load_model
    from models.resolve import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(resolve_model(args.model), torch.float32, CpuAttentionBackend())
    prepack_linears(lm.model)
    return lm.model, lm.config, attach(lm.model)


def run(args: Any) -> dict[str, Any]:
    import torch

    from kernels.attention import allocate_kv_caches, build_attention_metadata
    from kernels.cpu.native import paged_decode
    from models.resolve import resolve_model

    model, cfg, stack = load_packed(args)
    B, BS = args.batch, 16
    g = torch.Generator().manual_seed(0)
    one = torch.tensor(1.0)
    out: dict[str, Any] = {"bench": "kv_dtypes", "model": resolve_model(args.model).served_name, "batch": B,
                           "threads": torch.get_num_threads(), "native_decode_stack": stack, "contexts": {}}
    for ctx in args.contexts:
        per = -(-ctx // BS)
        tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(B)]
        base = allocate_kv_caches(cfg, B * per + 1, BS, torch.float32)
        for c in base:
            c.normal_(0, 1, generator=g)
        caches = _caches(base, DTYPES)
        del base
        meta = build_attention_metadata([1] * B, [ctx] * B, tables, BS)
        q = torch.randn(B, cfg.num_heads, cfg.head_size, generator=g)
        table = meta.block_table
        attn = _best({n: (lambda c=c[0]: paged_decode(q, c, table, meta.seq_lens, cfg.head_size ** -0.5, None, one,
                                                       one)) for n, c in caches.items()}, args.repeats, 5)
        ids = torch.randint(0, cfg.vocab_size, (B,), generator=g)
        pos = torch.full((B,), ctx - 1)
        with torch.inference_mode():
            step = _best({n: (lambda c=c: model(ids, pos, c, meta)) for n, c in caches.items()}, args.repeats)
        out["contexts"][ctx] = {n: {"attention_ms": round(attn[n] * 1e3, 3), "step_ms": round(step[n] * 1e3, 2),
                                    "attention_x_float32": round(attn["float32"] / attn[n], 2),
                                    "step_x_float32": round(step["float32"] / step[n], 2),
                                    "step_x_float16": round(step["float16"] / step[n], 2)} for n in DTYPES}
        del caches
    return out


def main(args: Any) -> None:
    print(json.dumps(run(args)), flush=True)
