"""What cascade attention buys a decode step: N requests whose contexts share a long prefix in the
same blocks (a common system prompt) and have a short suffix of their own, attended with the
prefix once for all (cascade) and plainly, on the CPU backend. Measured for one layer's attention
and for a whole decode step of the model (plain: the one-call native decode stack; cascade: the
per-layer path). The two alternate within each repeat and the minimum is kept."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from tools.bench.kv_dtypes import _best, load_packed


def run(args: Any) -> dict[str, Any]:
    import torch

    from kernels.attention import CpuAttentionBackend, allocate_kv_caches, build_attention_metadata
    from kernels.attention.cascade import use_cascade_attention
    from models.resolve import resolve_model

    model, cfg, stack = load_packed(args)
    B, BS, S = args.batch, 16, args.suffix
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"bench": "cascade", "model": resolve_model(args.model).served_name, "batch": B,
                           "suffix": S, "threads": torch.get_num_threads(), "native_decode_stack": stack,
                           "prefixes": {}}
    backend = CpuAttentionBackend()
    for P in args.prefixes:
        shared, own = P // BS, -(-S // BS)
        tables = [list(range(1, 1 + shared)) + list(range(1 + shared + i * own, 1 + shared + (i + 1) * own))
                  for i in range(B)]
        caches = allocate_kv_caches(cfg, 1 + shared + B * own, BS, torch.float32)
        for c in caches:
            c.normal_(0, 1, generator=g)
        plain = build_attention_metadata([1] * B, [P + S] * B, tables, BS)
        cascade = dataclasses.replace(plain, common_prefix_len=P)
        q = torch.randn(B, cfg.num_heads, cfg.head_size, generator=g)
        kv = torch.randn(2, B, cfg.num_kv_heads, cfg.head_size, generator=g)
        scale = cfg.head_size ** -0.5
        attn = _best({n: (lambda m=m: backend.forward(q, kv[0], kv[1], caches[0], m, scale))
                      for n, m in (("plain", plain), ("cascade", cascade))}, args.repeats, 5)
        ids = torch.randint(0, cfg.vocab_size, (B,), generator=g)
        pos = torch.full((B,), P + S - 1)
        with torch.inference_mode():
            step = _best({n: (lambda m=m: model(ids, pos, caches, m))
                          for n, m in (("plain", plain), ("cascade", cascade))}, args.repeats)
        out["prefixes"][P] = {
            "chosen": use_cascade_attention(P, torch.ones(B).numpy(), cfg.num_heads, cfg.num_kv_heads,
                                            min_prefix=backend.cascade_min_prefix),
            "attention_ms": {n: round(t * 1e3, 3) for n, t in attn.items()},
            "attention_x": round(attn["plain"] / attn["cascade"], 2),
            "step_ms": {n: round(t * 1e3, 2) for n, t in step.items()},
            "step_tok_s": {n: round(B / t, 1) for n, t in step.items()},
            "step_x": round(step["plain"] / step["cascade"], 2)}
        del caches
    return out


def main(args: Any) -> None:
    print(json.dumps(run(args)), flush=True)
