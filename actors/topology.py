"""The engine's topology: the names of its processes (nodes) and of the actors on them, the one
place they are spelled.

    frontend node            engine node                 worker node (one per rank)
      HTTP, TOKENIZER,         SCHEDULER, KV_MANAGER,      WORKER
      DETOKENIZER, TELEMETRY   GRAMMAR, EXECUTOR
      DP_ROUTER, STAT_LOGGER

With data parallelism (--data-parallel-size N) there are N engine nodes ("engine", "engine1",
...), each with its own worker nodes, and the frontend's DP_ROUTER sends each request to one.
With --api-server-count N, API servers 1 .. N-1 are child nodes "api1", ... of the frontend node,
each with its own HTTP, TOKENIZER, DETOKENIZER (and DP_ROUTER), all of them accepting on the
frontend's listening socket; every API server node has an API_PEER, and the engine cores send each
request's outputs to the DETOKENIZER of the API server that sent it.

Engine nodes on other machines (--headless there) are children of a "headless<RANK>-..." node on
their machine and join the frontend's DP_COORDINATOR. Worker ranks on other machines (--nnodes,
--headless there) are children of a "ranks<NODE_RANK>-..." node on their machine, which joins the
engine node's RANK_HOSTS.

Offline (``LLM()``, ``AsyncLLM.create()``) every actor runs on the frontend node, in one event
loop; the names do not change.
"""
from __future__ import annotations

FRONTEND_NODE = "frontend"
ENGINE_NODE = "engine"

HTTP = "http"
TOKENIZER = "tokenizer"
DETOKENIZER = "detokenizer"
TELEMETRY = "telemetry"
STAT_LOGGER = "stat_logger"
SCHEDULER = "scheduler"
KV_MANAGER = "kv_manager"
GRAMMAR = "grammar"
EXECUTOR = "executor"
WORKER = "worker"
DP_ROUTER = "dp_router"
DP_COORDINATOR = "dp_coordinator"    # where headless machines' engine cores join (--headless)
RANK_HOSTS = "rank_hosts"            # on an engine node: where other machines' worker ranks join (--nnodes)
RANK_HOST = "rank_host"              # on such a machine's "ranks<NODE_RANK>-..." node: starts and stops them
API_PEER = "api_peer"                # on every API server's node (--api-server-count): what they share


def api_node(index: int) -> str:
    """The node (process) of API server ``index`` (--api-server-count): 0 is the frontend node."""
    return FRONTEND_NODE if index == 0 else f"api{index}"


def engine_node(dp_rank: int = 0) -> str:
    """The node (process) of engine core ``dp_rank`` (data parallelism)."""
    return ENGINE_NODE if dp_rank == 0 else f"{ENGINE_NODE}{dp_rank}"


def worker_node(rank: int, dp_rank: int = 0) -> str:
    """The node (process) of worker rank ``rank`` of engine core ``dp_rank``."""
    return f"worker{rank}" if dp_rank == 0 else f"dp{dp_rank}-worker{rank}"
