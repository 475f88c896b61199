"""Speculative decoding against plain decoding on the same engine: output tokens per second at
batch sizes 1 and up (every prompt at least once, b requests at a time; greedy, run to max_tokens
or their end, prompt processing included), at batch 1 the decoding rate alone (tokens after the
first over the time from the first to the last: what speculation speeds up), the acceptance rate
(accepted / drafted tokens) and whether the tokens were the same. Methods: ``ngram`` (prompt
lookup) and ``self_draft`` (the model's own weights, quantized, draft for the exact ones). Two
prompt sets: ``repetitive`` (editing code and quoting text: what prompt lookup finds) and ``chat``
(the agreement prompts). Modes alternate, one engine load each, so a noisy machine weighs on all
alike."""
from __future__ import annotations

import json
import time
from typing import Any

from tools.bench.agreement import PROMPTS

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
REPETITIVE = [
    "Rename the variable subtotal to net_total in this function and show the whole function:\n" + CODE,
    "Add a docstring to this function and show the whole function:\n" + CODE,
    "Quote the first sentence exactly, then explain it: \"The quick brown fox jumps over the lazy dog. "
    "The dog did not move. The fox jumped again.\"",
    "Repeat this list exactly, one item per line: apples, oranges, pears, apples, oranges, pears, plums.",
]


def _run(mode: dict | None, prompts: list[str], batches: list[int], args: Any) -> dict[str, Any]:
    from actors.api import LLM, SamplingParams
    quantization = None if args.quantization == "none" else args.quantization
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with LLM(args.model, quantization=quantization, speculative_config=mode, num_threads=args.threads) as llm:
        llm.chat([[{"role": "user", "content": prompts[0]}]], params, use_tqdm=False)     # warm-up
        before = llm.client.stats.last
        out: dict[str, Any] = {"tokens": {}}
        for b in batches:        # every prompt at least once, b at a time
            convs = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(max(b, len(prompts)))]
            if b == 1:
                decoded, seconds, out["tokens"]["decode"] = llm._run(_decode_rate(llm._engine(), convs, params))
                out["batch_1_decode_tok_per_s"] = round(decoded / seconds, 2)
            t0 = time.perf_counter()
            results = [r for i in range(0, len(convs), b) for r in llm.chat(convs[i:i + b], params, use_tqdm=False)]
            seconds = time.perf_counter() - t0
            out[f"batch_{b}_tok_per_s"] = round(sum(len(r.token_ids) for r in results) / seconds, 2)
            out["tokens"][b] = [r.token_ids for r in results]
        s = llm.client.stats.last
        drafted = s.spec_num_draft_tokens - (before.spec_num_draft_tokens if before else 0)
        accepted = s.spec_num_accepted_tokens - (before.spec_num_accepted_tokens if before else 0)
        out["acceptance"] = round(accepted / drafted, 3) if drafted else None
    return out


async def _decode_rate(llm: Any, convs: list[list[dict]], params: Any) -> tuple[int, float, list[list[int]]]:
    """One conversation at a time, streamed: the tokens after each one's first, the seconds from
    its first token to its last (summed), and every conversation's tokens."""
    decoded, seconds, tokens = 0, 0.0, []
    for conv in convs:
        ids: list[int] = []
        first = 0.0
        async for out in llm.chat(conv, params):
            if not ids and out.token_ids:
                first = time.perf_counter()
            ids += out.token_ids
        seconds += time.perf_counter() - first
        decoded += len(ids) - 1
        tokens.append(ids)
    return decoded, seconds, tokens


def main(args: Any) -> None:
    sets = {"repetitive": REPETITIVE, "chat": PROMPTS[:args.n]}
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
                         "prompt_lookup_max": args.lookup[1]},
               "self_draft": {"method": "self_draft", "quantization": args.draft_quantization,
                              "num_speculative_tokens": args.draft_k}}
    modes = [("none", None)] + [(m, configs[m]) for m in args.methods]
    report: dict[str, Any] = {"bench": "spec_decode", "quantization": args.quantization, "k": args.k,
                              "draft_k": args.draft_k, "lookup": args.lookup, "max_tokens": args.max_tokens,
                              "threads": args.threads}
    for name in args.sets:
        runs: dict[str, list[dict]] = {mode: [] for mode, _ in modes}
        for _ in range(args.repeats):
            for mode, cfg in modes:
                runs[mode].append(_run(cfg, sets[name], args.batches, args))
        same = all(r["tokens"] == runs["none"][0]["tokens"] for rs in runs.values() for r in rs)
        entry: dict[str, Any] = {"same_tokens": same,
                                 "acceptance": {m: runs[m][0]["acceptance"] for m in args.methods}}
        for b in args.batches:
            for key, name_b in ((f"batch_{b}_tok_per_s", f"batch_{b}"), (f"batch_{b}_decode_tok_per_s", f"batch_{b}_decode")):
                if key not in runs["none"][0]:
                    continue
                best = {mode: max(r[key] for r in rs) for mode, rs in runs.items()}
                entry[name_b] = {**best, **{f"{m}_speedup": round(best[m] / best["none"], 2) for m in args.methods}}
        report[name] = entry
        print(f"{name}: {json.dumps(entry)}", flush=True)
    print(json.dumps(report), flush=True)
