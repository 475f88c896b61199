"""Workloads shared by our benchmarks and the peers' harnesses: a JSON list of
{"prompt_token_ids": [...], "max_tokens": N}; greedy, every request runs to max_tokens."""
from __future__ import annotations

import json
import random
from typing import Any


def generate(n: int, inp: tuple[int, int], out: tuple[int, int], seed: int = 0,
             vocab: int = 49152) -> list[dict[str, Any]]:
    """``n`` requests of random prompt token ids (100 <= id < vocab) and random output lengths,
    the same for the same parameters."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        n_in = rng.randint(*inp)
        reqs.append({"prompt_token_ids": [rng.randint(100, vocab - 1) for _ in range(n_in)],
                     "max_tokens": rng.randint(*out)})
    return reqs


def batch_lines(reqs: list[dict[str, Any]], model: str | None = None) -> list[str]:
    """The workload as an OpenAI batch file (``python -m tools.batch``): one completion per
    request, greedy, run to its max_tokens."""
    lines = []
    for i, r in enumerate(reqs):
        body = {"prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"], "temperature": 0,
                "ignore_eos": True, **({"model": model} if model else {})}
        lines.append(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body}))
    return lines


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        reqs = json.load(f)
    if not isinstance(reqs, list) or not all(
            isinstance(r, dict) and "prompt_token_ids" in r and "max_tokens" in r for r in reqs):
        raise ValueError(f"{path}: expected a list of {{prompt_token_ids, max_tokens}} objects")
    return reqs


def from_args(args: Any) -> list[dict[str, Any]]:
    if args.workload:
        return load(args.workload)
    return generate(args.n, tuple(args.inp), tuple(args.out), args.seed, args.vocab)


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", help="a workload JSON file (python -m tools.bench workload writes one)")
    p.add_argument("--n", type=int, default=32, help="requests to generate (no --workload)")
    p.add_argument("--in", dest="inp", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"))
    p.add_argument("--out", type=int, nargs=2, default=[64, 128], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=49152,
                   help="prompt token ids are drawn below this (the model's vocabulary; default: SmolLM2's)")
