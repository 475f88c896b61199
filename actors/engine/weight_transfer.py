"""vLLM's ``--weight-transfer-config``: how a trainer pushes new weights into a running engine
(RL loops; the worker side is actors/worker/weight_transfer.py, the HTTP routes
/init_weight_transfer_engine ... /finish_weight_update). Torch-free: the engine core and the
server import it."""
from __future__ import annotations

from typing import Any, Mapping

import msgspec

from actors.engine.json_flags import checked_fields, convert, parse_object

# gloo: any device (a CUDA worker receives on the host, then copies); nccl: CUDA workers only
BACKENDS = ("gloo", "nccl")
MAX_TIMEOUT_S = 540.0
NOT_CONFIGURED = ("Weight transfer not configured. Please set weight_transfer_config to enable weight "
                  "transfer (--weight-transfer-config '{\"backend\": \"gloo\"}').")   # vLLM's words, then ours


class WeightTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    backend: str = "gloo"        # vLLM's default is nccl, which needs CUDA on both sides
    timeout_s: float = 300.0     # the trainer's rendezvous and each broadcast wait at most this long

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight transfer backend {self.backend!r} is not one Troupe has; "
                             f"choose {' or '.join(BACKENDS)}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"weight transfer timeout_s must be positive and at most {MAX_TIMEOUT_S:g} (the engine's "
                             f"calls to its workers wait 600 s), got {self.timeout_s}")


def weight_transfer_config(value: Mapping[str, Any] | str | WeightTransferConfig | None) -> WeightTransferConfig | None:
    """--weight-transfer-config's JSON text, or the offline API's dict, checked."""
    if value is None or isinstance(value, WeightTransferConfig):
        return value
    what = "weight transfer config"
    raw = parse_object(value, "--weight-transfer-config") if isinstance(value, str) else value
    return convert(WeightTransferConfig, checked_fields(WeightTransferConfig, raw, what), what)
