"""``python -m tools.bench {offline,embed,serve,frontend,latency,agreement,structured,tracing,workload,kv-dtypes,cascade,softcap,hybrid-kv,spec-decode,lora,moe,kv-transfer,kv-storage,pd,weight-transfer}``: each
prints one JSON line last."""
from __future__ import annotations

import argparse
import logging

from actors.engine.args import EngineArgs
from actors.engine.config import KV_CACHE_DTYPES
from tools.bench import workload


def main(argv: list[str] | None = None, prog: str = "python -m tools.bench") -> None:
    p = argparse.ArgumentParser(prog=prog)
    sub = p.add_subparsers(dest="cmd", required=True)

    off = sub.add_parser("offline", help="offline throughput of an in-process engine")
    workload.add_arguments(off)
    EngineArgs.add_cli_args(off, skip=("seed",), max_num_seqs=256)   # the workload's --seed seeds the engine too
    off.add_argument("--multiprocess", action="store_true", help="the server's 3-process layout")

    emb = sub.add_parser("embed", help="embedding throughput of an in-process pooling model (--runner pooling)")
    workload.add_arguments(emb)
    EngineArgs.add_cli_args(emb, skip=("seed",), max_num_seqs=256, runner="pooling")
    emb.add_argument("--multiprocess", action="store_true", help="the server's 3-process layout")

    srv = sub.add_parser("serve", help="load generator against an OpenAI-compatible server")
    workload.add_arguments(srv)
    srv.add_argument("--url", required=True)
    srv.add_argument("--model", default=None, help="model name (default: the server's first)")
    srv.add_argument("--request-rate", type=float, default=float("inf"),
                     help="Poisson arrivals per second (inf: all at once)")
    srv.add_argument("--concurrency", type=int, default=0, help="fixed concurrency instead of a rate")
    srv.add_argument("--timeout", type=float, default=1800)

    fe = sub.add_parser("frontend", help="the server's own work (POST /tokenize of long texts) in requests per "
                                         "second: what --api-server-count spreads")
    fe.add_argument("--url", required=True)
    fe.add_argument("--n", type=int, default=1500)
    fe.add_argument("--concurrency", type=int, default=32)

    lat = sub.add_parser("latency", help="single-stream prefill, decode and cold start")
    EngineArgs.add_cli_args(lat)
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--decode-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)

    st = sub.add_parser("structured", help="structured outputs: throughput against free requests, compile "
                                           "times, bitmask fill time")
    EngineArgs.add_cli_args(st, max_num_seqs=64)
    st.add_argument("--n", type=int, default=32, help="concurrent requests of each kind")
    st.add_argument("--bitmask-batch", type=int, default=64)

    tr = sub.add_parser("tracing", help="what tracing costs per actor message (on against --no-trace)")
    tr.add_argument("--messages", type=int, default=200_000)
    tr.add_argument("--repeats", type=int, default=5)

    wl = sub.add_parser("workload", help="write a workload JSON file (random prompt token ids) to stdout, "
                                         "for the peers' harnesses to read the same requests")
    workload.add_arguments(wl)
    wl.add_argument("--format", choices=["json", "batch"], default="json",
                    help="'batch': an OpenAI batch file of the same requests, for python -m tools.batch")

    agr = sub.add_parser("agreement", help="greedy agreement of a quantized mode with exact mode")
    agr.add_argument("--model", default=None)
    agr.add_argument("--quantized-model", default=None,
                     help="a quantized checkpoint of --model (e.g. written by python -m tools.quantize) run against "
                          "--model's exact weights; its config.json says its quantization (default "
                          "--quantization: none)")
    agr.add_argument("--quantization", default=None, choices=["gguf", "gguf-i8", "none"],
                     help="'none': exact weights (with --kv-cache-dtype, the KV cache's effect alone)")
    agr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="the fast mode's --dtype (bfloat16: bfloat16 weights, see README)")
    agr.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    agr.add_argument("--calculate-kv-scales", action="store_true",
                     help="with an fp8 KV cache: per-layer K/V scales from the first batch (else 1.0)")
    agr.add_argument("--n", type=int, default=20)
    agr.add_argument("--tokens", type=int, default=64)

    kvd = sub.add_parser("kv-dtypes", help="decode attention and a decode step over each KV cache dtype "
                                           "(float32, float16, fp8_e4m3, fp8_e5m2)")
    kvd.add_argument("--model", default=None)
    kvd.add_argument("--batch", type=int, default=32)
    kvd.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    kvd.add_argument("--repeats", type=int, default=12)
    kvd.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")

    spd = sub.add_parser("spec-decode", help="speculative decoding (ngram, self_draft) against plain decoding: "
                                             "tok/s by batch size, acceptance, same tokens")
    spd.add_argument("--model", default=None)
    spd.add_argument("--quantization", default="none", choices=["gguf", "gguf-i8", "none"])
    spd.add_argument("--sets", nargs="+", default=["repetitive", "chat"], choices=["repetitive", "chat"])
    spd.add_argument("--n", type=int, default=4, help="chat prompts")
    spd.add_argument("--methods", nargs="+", default=["ngram", "self_draft"], choices=["ngram", "self_draft"])
    spd.add_argument("--k", type=int, default=4, help="num_speculative_tokens (ngram)")
    spd.add_argument("--draft-k", type=int, default=6, help="num_speculative_tokens (self_draft)")
    spd.add_argument("--draft-quantization", default="gguf-i8", choices=["gguf", "gguf-i8"],
                     help="the self-draft's quantization")
    spd.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    spd.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    spd.add_argument("--max-tokens", type=int, default=96)
    spd.add_argument("--repeats", type=int, default=2)
    spd.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")

    cas = sub.add_parser("cascade", help="a decode step of N requests sharing a long prefix, with cascade "
                                         "attention and without")
    cas.add_argument("--model", default=None)
    cas.add_argument("--batch", type=int, default=64)
    cas.add_argument("--prefixes", type=int, nargs="+", default=[512, 2048, 4096], help="shared prefix tokens")
    cas.add_argument("--suffix", type=int, default=64, help="each request's own tokens after the prefix")
    cas.add_argument("--repeats", type=int, default=8)
    cas.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    cap = sub.add_parser("softcap", help="one layer's attention with Gemma 2's capped scores and without: "
                                         "decodes and fresh prompts on the CPU backend")
    cap.add_argument("--heads", type=int, default=8)
    cap.add_argument("--kv-heads", type=int, default=4)
    cap.add_argument("--head-size", type=int, default=256)
    cap.add_argument("--cap", type=float, default=50.0, help="the score cap (Gemma 2's attn_logit_softcapping)")
    cap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    cap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024], help="decodes' context tokens")
    cap.add_argument("--prompts", type=int, nargs="+", default=[512], help="fresh prompts' tokens")
    cap.add_argument("--repeats", type=int, default=5)
    cap.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    hyb = sub.add_parser("hybrid-kv", help="long requests a KV cache holds with and without the hybrid KV cache "
                                           "manager (computed, then run through the scheduler)")
    hyb.add_argument("--model", default="gemma3-270m")
    hyb.add_argument("--kv-cache-gib", type=float, default=1.0)
    hyb.add_argument("--prompt-len", type=int, default=4000)
    hyb.add_argument("--num-requests", type=int, default=40, help="queued at once (and the batch's limit)")
    hyb.add_argument("--max-tokens", type=int, default=64)

    lra = sub.add_parser("lora", help="offline throughput with the requests spread over 0, 1, 4 and 8 distinct "
                                      "LoRA adapters")
    workload.add_arguments(lra)
    EngineArgs.add_cli_args(lra, skip=("seed", "enable_lora", "lora_modules", "max_loras", "max_cpu_loras",
                                       "max_lora_rank"), max_num_seqs=256)
    lra.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8], help="distinct adapters per round")
    lra.add_argument("--rank", type=int, default=16)
    lra.add_argument("--repeats", type=int, default=2, help="rounds of each count, alternated; the best is kept")
    lra.add_argument("--multiprocess", action="store_true", help="the server's 3-process layout")

    moe = sub.add_parser("moe", help="one mixture-of-experts layer's experts: the native fused kernel against "
                                     "the torch loop over experts, by batch size")
    moe.add_argument("--experts", type=int, default=64)
    moe.add_argument("--hidden", type=int, default=1024)
    moe.add_argument("--intermediate", type=int, default=384, help="one expert's intermediate size")
    moe.add_argument("--top-k", type=int, default=8)
    moe.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 512])
    moe.add_argument("--repeats", type=int, default=10)
    moe.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    kvt = sub.add_parser("kv-transfer", help="the KV connector's transfer throughput (ZeroMQ TCP frames, shared memory, "
                                             "cross-memory attach, NIXL, from a producer process) against a memory copy's")
    kvt.add_argument("--blocks", type=int, default=256, help="KV blocks per transfer")
    kvt.add_argument("--block-size", type=int, default=16)
    kvt.add_argument("--layers", type=int, default=30, help="(SmolLM2-135M: 30 layers, 3 KV heads of 64)")
    kvt.add_argument("--kv-heads", type=int, default=3)
    kvt.add_argument("--head-size", type=int, default=64)
    kvt.add_argument("--repeats", type=int, default=3)

    kvs = sub.add_parser("kv-storage", help="ExampleConnector: a prompt's time to first token computed, computed and "
                                            "saved layer by layer, and loaded from the directory by another engine")
    kvs.add_argument("--prompt-len", type=int, default=1024)
    kvs.add_argument("--repeats", type=int, default=5)
    kvs.add_argument("--storage-dir", default=None, help="where the entries are written (a temporary directory in it)")

    pdb = sub.add_parser("pd", help="serving latency (TTFT, ITL) of one server against prefill + decode servers "
                                    "behind tools/pd_proxy.py, on this machine, one after the other")
    workload.add_arguments(pdb)
    pdb.add_argument("--model", default=None)
    pdb.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals per second (inf: all at once)")
    pdb.add_argument("--concurrency", type=int, default=0, help="fixed concurrency instead of a rate")
    pdb.add_argument("--kv-cache-gib", type=float, default=0.5)
    pdb.add_argument("--max-num-seqs", type=int, default=16)
    pdb.add_argument("--kv-connector", default="TroupeConnector", help="the two servers' connector (NixlConnector: "
                                                                        "through NIXL)")
    pdb.add_argument("--pd-threads", type=int, default=0,
                     help="compute threads of the prefill and of the decode server each (0: all cores each)")

    wtb = sub.add_parser("weight-transfer", help="seconds per round of a trainer pushing a checkpoint's tensors "
                                                 "into a running engine (--weight-transfer-config), beside "
                                                 "reload_weights from the same directory")
    EngineArgs.add_cli_args(wtb)
    wtb.add_argument("--trainer-weights", required=True, help="a Hugging Face checkpoint directory of the served "
                                                             "architecture: the trainer's tensors")
    wtb.add_argument("--trainer-dtype", default="as-is", choices=["as-is", "float32", "bfloat16"])
    wtb.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True)
    wtb.add_argument("--rounds", type=int, default=3)
    wtb.add_argument("--prompt", default="The capital of France is")

    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.cmd == "offline":
        from tools.bench import offline
        offline.main(args)
    elif args.cmd == "embed":
        from tools.bench import embed
        embed.main(args)
    elif args.cmd == "structured":
        from tools.bench import structured
        structured.main(args)
    elif args.cmd == "pd":
        from tools.bench import pd
        pd.main(args)
    elif args.cmd == "kv-transfer":
        from tools.bench import kv_transfer
        kv_transfer.main(args)
    elif args.cmd == "kv-storage":
        from tools.bench import kv_storage
        kv_storage.main(args)
    elif args.cmd == "frontend":
        from tools.bench import frontend
        frontend.main(args)
    elif args.cmd == "serve":
        from tools.bench import serve
        serve.main(args)
    elif args.cmd == "workload":
        import json
        import sys
        reqs = workload.from_args(args)
        if args.format == "batch":
            sys.stdout.write("".join(line + "\n" for line in workload.batch_lines(reqs)))
        else:
            json.dump(reqs, sys.stdout)
            sys.stdout.write("\n")
    elif args.cmd == "tracing":
        from tools.bench import tracing
        tracing.main(args)
    elif args.cmd == "kv-dtypes":
        from tools.bench import kv_dtypes
        kv_dtypes.main(args)
    elif args.cmd == "spec-decode":
        from tools.bench import spec_decode
        spec_decode.main(args)
    elif args.cmd == "cascade":
        from tools.bench import cascade
        cascade.main(args)
    elif args.cmd == "softcap":
        from tools.bench import softcap
        softcap.main(args)
    elif args.cmd == "lora":
        from tools.bench import lora
        lora.main(args)
    elif args.cmd == "hybrid-kv":
        from tools.bench import hybrid_kv
        hybrid_kv.main(args)
    elif args.cmd == "moe":
        from tools.bench import moe as moe_bench
        moe_bench.main(args)
    elif args.cmd == "weight-transfer":
        from tools.bench import weight_transfer
        weight_transfer.main(args)
    elif args.cmd == "latency":
        from tools.bench import latency
        latency.main(args)
    else:
        from tools.bench import agreement
        agreement.main(args)


if __name__ == "__main__":
    main()
