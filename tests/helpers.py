"""Small helpers shared by the tests."""
import asyncio


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh uvloop event loop with a deadline."""
    import uvloop
    return uvloop.run(asyncio.wait_for(coro, timeout))


def run_steps(model, caches, tables, steps, block_size):
    """Logits (rows, vocab) of engine-like steps on a model: steps[i] holds each request's new
    token ids (a prompt, then one token per decode step), requests appended to their KV caches
    through the block tables ``tables``; one row per scheduled token."""
    import torch

    from kernels.attention import build_attention_metadata
    done = [0] * len(tables)
    logits = []
    for new in steps:
        ids = torch.cat(new)
        pos = torch.cat([torch.arange(d, d + len(n)) for d, n in zip(done, new)])
        done = [d + len(n) for d, n in zip(done, new)]
        meta = build_attention_metadata([len(n) for n in new], done, tables, block_size)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(logits)
