"""Weight transfer (``--weight-transfer-config``): seconds per round of a trainer in this process
pushing a Hugging Face checkpoint's tensors into a running engine, beside ``reload_weights`` from
the same checkpoint directory (what an RL loop does without a transfer: write, then reload)."""
from __future__ import annotations

import glob
import json
import socket
import statistics
import time
from typing import Any


def main(args: Any) -> None:
    import torch
    from safetensors.torch import load_file

    from actors.api import LLM, SamplingParams
    from actors.engine.args import EngineArgs
    from actors.worker.weight_transfer import LLMWeightSyncClient, TrainerWeightTransferEngine

    files = sorted(glob.glob(f"{args.trainer_weights}/*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {args.trainer_weights}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    if args.trainer_dtype != "as-is":
        weights = {k: v.to(getattr(torch, args.trainer_dtype)) if v.is_floating_point() else v
                   for k, v in weights.items()}
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    engine_args = EngineArgs.from_cli_args(args, weight_transfer_config={"backend": "gloo"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    with LLM.from_engine_args(engine_args) as llm:
        ranks = llm.get_world_size()
        t0 = time.perf_counter()
        trainer = TrainerWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": port, "world_size": 1 + ranks, "packed": args.packed},
            client=LLMWeightSyncClient(llm), source=weights)
        init_s = time.perf_counter() - t0
        rounds, reloads = [], []
        for i in range(args.rounds):
            t0 = time.perf_counter()
            trainer.send_weights(weight_version=f"round-{i}")
            rounds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": args.trainer_weights})
            reloads.append(time.perf_counter() - t0)
        trainer.send_weights()
        text = llm.generate([args.prompt], greedy, use_tqdm=False)[0].outputs[0].text
        trainer.shutdown()
    print(json.dumps({"bench": "weight-transfer", "tensors": len(weights), "mbytes": round(nbytes / 1e6, 1),
                      "trainer_dtype": args.trainer_dtype, "packed": args.packed, "workers": ranks,
                      "init_s": round(init_s, 3), "round_s": [round(r, 3) for r in rounds],
                      "round_median_s": round(statistics.median(rounds), 3),
                      "mbytes_per_s": round(nbytes / 1e6 / statistics.median(rounds), 1),
                      "reload_weights_s": [round(r, 3) for r in reloads],
                      "reload_median_s": round(statistics.median(reloads), 3),
                      "answer_after": text}), flush=True)
