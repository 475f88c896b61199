"""How pipeline parallelism splits a model's decoder layers over stages (no torch: the engine
core sizes its KV cache blocks with it). ``models/pipeline_parallel.py`` applies it.

vLLM's split: contiguous runs as even as they go, the layers left over given one each to the
stages before the last (the last stage also runs the final norm, the LM head and sampling).
``TROUPE_PP_LAYER_PARTITION`` (vLLM's ``VLLM_PP_LAYER_PARTITION``), comma-separated layer
counts, one per stage, sets the split instead."""
from __future__ import annotations

import os

ENV = "TROUPE_PP_LAYER_PARTITION"


def pp_partition(num_layers: int, pp_size: int) -> list[int]:
    """Each stage's number of layers, in stage order. ValueError when a stage would get none,
    or the environment's partition does not match the model and the stages."""
    text = os.environ.get(ENV)
    if text:
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: give one layer count per stage, comma-separated") from None
        if len(parts) != pp_size or sum(parts) != num_layers:
            raise ValueError(f"{ENV}={text!r}: needs {pp_size} counts (one per stage) adding up to the model's "
                             f"{num_layers} layers")
    else:
        base, extra = divmod(num_layers, pp_size)
        parts = [base] * pp_size
        for i in range(2, extra + 2):             # the leftovers go to the stages before the last
            parts[-i] += 1
    if min(parts) < 1:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages: each stage needs "
                         "at least one")
    return parts


def pp_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """(start, end) of the layers stage ``pp_rank`` runs."""
    parts = pp_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]
