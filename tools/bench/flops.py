"""Model FLOPs of a workload and the machine's measured matmul ceiling."""
from __future__ import annotations

import time

from models.config import ArchConfig


def flops_per_token(c: ArchConfig, context: int) -> float:
    """Decoder FLOPs of one token at ``context`` tokens of attention (2 per multiply-add)."""
    q, kv = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    linear = c.hidden_size * (q + 2 * kv + q) + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * q * context            # scores and weighted sum
    return 2.0 * c.num_layers * (linear + attention)


def workload_flops(c: ArchConfig, reqs: list[dict]) -> float:
    """Every prompt and output token through the decoder, one LM head per output token."""
    head = 2.0 * c.hidden_size * c.vocab_size
    total = 0.0
    for r in reqs:
        n_in, n_out = len(r["prompt_token_ids"]), r["max_tokens"]
        n = n_in + n_out
        total += n * flops_per_token(c, n // 2) + n_out * head
    return total


def matmul_peak_gflops(rows: int = 256, seconds: float = 1.0) -> float:
    """float32 matmul throughput for this model's shapes at ``rows`` rows, on all threads, by the
    fastest path this machine offers (the packed linear layer the worker uses)."""
    import torch

    from models.layers import Linear
    from models.packed import prepack_linears
    a = torch.randn(rows, 576)
    holder = torch.nn.Module()
    holder.mm = Linear(576, 1536, torch.float32)
    holder.mm.weight.data.normal_()
    prepack_linears(holder)
    mm = holder.mm
    for _ in range(10):
        mm(a)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            mm(a)
        n += 20
    return 2.0 * rows * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9
