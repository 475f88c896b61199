"""GPU checks for a machine with CUDA (``python -m tools.gpu_check``): GPU tests, greedy parity
of the GPU worker with the CPU one, the decode benchmark eager vs CUDA graphs, the quantized
matmuls and the engine in each feature's configuration; ``prepare`` builds, on a machine without
a GPU, the model parts and wheels that travel there."""
from __future__ import annotations

import json


def last_json(text: str) -> dict | None:
    """The last line of ``text`` that starts with "{", parsed (each part's result); None if
    there is none or it does not parse."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
