"""The engine's topology: the names of its processes (nodes) and of the actors on them, the one
place they are spelled.

    frontend node            engine node                 worker node (one per rank)
      HTTP, TOKENIZER,         SCHEDULER, KV_MANAGER,      WORKER
      DETOKENIZER, TELEMETRY   GRAMMAR, EXECUTOR

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
SCHEDULER = "scheduler"
KV_MANAGER = "kv_manager"
GRAMMAR = "grammar"
EXECUTOR = "executor"
WORKER = "worker"


def worker_node(rank: int) -> str:
    """The node (process) of worker rank ``rank``."""
    return f"worker{rank}"
