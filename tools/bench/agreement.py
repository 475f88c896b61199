"""Greedy agreement of a fast mode (a --quantization mode, or a quantized checkpoint of the same
model) with exact (float32) mode: the fraction of the first N greedy tokens, over a fixed set of
chat prompts, that are equal position by position."""
from __future__ import annotations

import json
from typing import Any

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "List three uses of copper.",
    "How do vaccines work?", "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?", "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What is a prime number? Give examples.", "Describe a cat to someone who has never seen one.",
    "How does a bicycle stay upright?", "Write a short poem about autumn leaves.",
    "What are the benefits of regular exercise?", "Explain what a database index is.",
    "Who was Ada Lovelace?", "How do airplanes fly?",
    "Give three tips for learning a new language.", "What is the difference between weather and climate?",
]


def generate(quantization: str | None, prompts: list[str], tokens: int, model: str | None,
             kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
             dtype: str = "auto") -> list[list[int]]:
    from actors.api import LLM, SamplingParams
    with LLM(model, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
             calculate_kv_scales=calculate_kv_scales, dtype=dtype) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return [r.token_ids for r in results]


def agreement(exact: list[list[int]], fast: list[list[int]]) -> float:
    equal = sum(a == b for xs, ys in zip(exact, fast) for a, b in zip(xs, ys))
    return equal / sum(len(xs) for xs in exact)


def main(args: Any) -> None:
    prompts = PROMPTS[:args.n]
    exact = generate(None, prompts, args.tokens, args.model)
    quantized_model = getattr(args, "quantized_model", None)
    flag = args.quantization or ("none" if quantized_model else "gguf")
    quantization = None if flag == "none" else flag
    fast = generate(quantization, prompts, args.tokens, quantized_model or args.model, args.kv_cache_dtype,
                    args.calculate_kv_scales, args.dtype)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(exact, fast)]
    print(json.dumps({"bench": "agreement", "quantization": quantization, "quantized_model": quantized_model,
                      "dtype": args.dtype,
                      "kv_cache_dtype": args.kv_cache_dtype, "calculate_kv_scales": args.calculate_kv_scales,
                      "prompts": len(prompts),
                      "tokens": args.tokens, "agreement": round(agreement(exact, fast), 4),
                      "identical_prompts": sum(d is None for d in first_diff),
                      "first_divergence": first_diff}), flush=True)
