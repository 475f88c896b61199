"""``python -m tools.bench kv-transfer``: TroupeConnector's transfer throughput against the
machine's memory bandwidth. A producer process holds a request of ``--blocks`` KV blocks of the
model's shape (SmolLM2-135M by default: 30 layers, 3 KV heads of 64, blocks of 16 tokens); the
consumer (this process) loads them into its own cache, over ZeroMQ TCP frames, through a
shared-memory segment, straight from the producer's cache (cross-memory attach) and, where NIXL
is installed, through NIXL's READs (UCX),
``--repeats`` times each (the best kept). The bandwidth is a large tensor copy's
(bytes copied per second by one large tensor copy, the best of a few)."""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Any

import msgspec

from actors.engine.config import CacheConfig, EngineConfig, ModelConfig
from actors.kv_transfer.base import KVConnectorRole
from actors.kv_transfer.config import KVTransferConfig
from models.resolve import ModelSource


def _config(role: str, port: int, shm: bool, block_size: int, layers: int, num_blocks: int,
            cma: bool = False, nixl: bool = False) -> EngineConfig:
    kv = KVTransferConfig(kv_connector="TroupeConnector", kv_role=role, kv_port=port,
                          kv_connector_extra_config={"shm": shm, "cma": cma, "nixl": nixl, "kv_lease_duration": 600.0,
                                                     "transfer_timeout_s": 60.0})
    return EngineConfig(model=ModelConfig(source=ModelSource("hf_dir", "", "bench"), max_model_len=1024),
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), kv_transfer=kv)


def _caches(layers: int, num_blocks: int, block_size: int, heads: int, head_size: int) -> list:
    import torch
    return [torch.randn(2, num_blocks, block_size, heads, head_size) for _ in range(layers)]


def _producer(port: int, args: dict[str, Any], ready: Any, stop: Any) -> None:
    from actors.kv_transfer.troupe_connector import TroupeConnector
    n = args["blocks"]
    cfg = _config("kv_producer", port, True, args["block_size"], args["layers"], n + 1, nixl=args["nixl"])
    conn = TroupeConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches(_caches(args["layers"], n + 1, args["block_size"], args["heads"], args["head_size"]))
    # the request's blocks, saved as a step's forward would leave them (one renewed lease per read)
    conn.start_load_kv(msgspec.msgpack.encode({"saves": {f"r{i}": [list(range(1, n + 1))]     # one KV cache group
                                                         for i in range(4 * args["repeats"] + 2)}}))
    conn.wait_for_save()
    ready.set()
    stop.wait()
    conn.shutdown()


def memcpy_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes copied per second by one large tensor copy (the best of ``repeats``): each byte is
    read once and written once, as a transfer's copy into the cache does at least."""
    import torch
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure(blocks: int, block_size: int, layers: int, heads: int, head_size: int, repeats: int) -> dict[str, Any]:
    from actors.kv_transfer.troupe_connector import TroupeConnector, _Load
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from actors.kv_transfer import nixl
    with_nixl = nixl.reason() is None
    shape = {"blocks": blocks, "block_size": block_size, "layers": layers, "heads": heads,
             "head_size": head_size, "repeats": repeats, "nixl": with_nixl}
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_producer, args=(port, shape, ready, stop), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the producer process did not start (exit code {proc.exitcode})")
        nbytes = blocks * layers * 2 * block_size * heads * head_size * 4
        out: dict[str, Any] = {"bytes_per_transfer": nbytes}
        i = 0
        paths = [("zmq_tcp", False, False, False), ("shm", True, False, False), ("cma", True, True, False)]
        if with_nixl:
            paths.append(("nixl", True, True, True))
        else:
            out["nixl"] = {"error": nixl.reason()}
        for path, shm, cma, use_nixl in paths:
            cfg = _config("kv_consumer", 0, shm, block_size, layers, blocks + 1, cma, use_nixl)
            conn = TroupeConnector(cfg, KVConnectorRole.WORKER)
            conn.register_kv_caches(_caches(layers, blocks + 1, block_size, heads, head_size))
            best = float("inf")
            for _ in range(repeats):
                ids = [list(range(1, blocks + 1))]
                load = _Load(["127.0.0.1"], port, f"r{i}", ids, ids)
                i += 1
                t0 = time.perf_counter()
                conn._load(f"c{i}", load)
                best = min(best, time.perf_counter() - t0)
                done = conn.get_finished()
                if done.failed_recving:
                    raise RuntimeError(f"the load failed: {done.failed_recving}")
                if done.stats.get(f"{path}_reads", 1) != 1:
                    raise RuntimeError(f"the load did not go through {path}: {done.stats}")
            conn.shutdown()
            out[path] = {"seconds": round(best, 4), "gb_per_s": round(nbytes / best / 1e9, 3)}
        return out
    finally:
        stop.set()
        proc.join(10)


def main(args: Any) -> None:
    bw = memcpy_gbs()
    res = measure(args.blocks, args.block_size, args.layers, args.kv_heads, args.head_size, args.repeats)
    res = {"bench": "kv-transfer", "blocks": args.blocks, "block_size": args.block_size, "layers": args.layers,
           "kv_heads": args.kv_heads, "head_size": args.head_size, "dtype": "float32",
           "memcpy_gb_per_s": round(bw, 2), **res}
    for path in ("zmq_tcp", "shm", "cma", "nixl"):
        if "gb_per_s" in res[path]:
            res[path]["of_memcpy"] = round(res[path]["gb_per_s"] / bw, 3)
    print(json.dumps(res), flush=True)
