"""What Gemma 2's capped attention scores (``logits_soft_cap``: C * tanh(s / C)) cost on the CPU
backend: one layer's attention with the cap and without, for decodes (the native decode kernel's
capped portable tile against its vectorized tiles) and for fresh prompts (the capped torch path
against the native prefill kernel), on Gemma-2-2B's head shapes by default. The two alternate
within each repeat and the minimum is kept."""
from __future__ import annotations

import json
from typing import Any

from tools.bench.kv_dtypes import _best


def run(args: Any) -> dict[str, Any]:
    import torch

    from kernels.attention import CpuAttentionBackend, build_attention_metadata

    if args.threads:
        torch.set_num_threads(args.threads)
    H, KVH, D, BS = args.heads, args.kv_heads, args.head_size, 16
    backend, g = CpuAttentionBackend(), torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"bench": "softcap", "heads": H, "kv_heads": KVH, "head_size": D, "cap": args.cap,
                           "threads": torch.get_num_threads(), "decode": {}, "prefill": {}}

    def time_both(reqs: list[tuple[int, int]]) -> dict[str, Any]:
        blocks = [-(-(c + n) // BS) for c, n in reqs]
        tables = [list(range(1 + sum(blocks[:i]), 1 + sum(blocks[:i + 1]))) for i in range(len(reqs))]
        meta = build_attention_metadata([n for _, n in reqs], [c + n for c, n in reqs], tables, BS)
        T = sum(n for _, n in reqs)
        cache = torch.randn(2, 1 + sum(blocks), BS, KVH, D, generator=g)
        q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
        best = _best({"plain": lambda: backend.forward(q, k, v, cache, meta, D ** -0.5),
                      "capped": lambda: backend.forward(q, k, v, cache, meta, D ** -0.5, logits_soft_cap=args.cap)},
                     args.repeats, 3)
        return {"ms": {n: round(t * 1e3, 3) for n, t in best.items()}, "x": round(best["capped"] / best["plain"], 2)}

    for batch, context in ((b, c) for b in args.batches for c in args.contexts):
        out["decode"][f"{batch}x{context}"] = time_both([(context, 1)] * batch)
    for length in args.prompts:
        out["prefill"][str(length)] = time_both([(0, length)])
    return out


def main(args: Any) -> None:
    print(json.dumps(run(args)), flush=True)
