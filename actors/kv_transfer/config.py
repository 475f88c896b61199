"""KVTransferConfig: what ``--kv-transfer-config`` says (vLLM's JSON object and keys), parsed and
validated at the edge.

    {"kv_connector": "TroupeConnector", "kv_role": "kv_producer", "kv_port": 14579}
    {"kv_connector": "TroupeConnector", "kv_role": "kv_consumer",
     "kv_connector_extra_config": {"kv_lease_duration": 30}}

``kv_role``: ``kv_producer`` computes prompts and keeps their KV blocks for a remote reader,
``kv_consumer`` loads prompts' KV blocks from a producer instead of computing them, ``kv_both``
does either per request (the request's ``kv_transfer_params`` decide). ``kv_ip`` / ``kv_port``:
where the producer's side channel listens (a consumer needs none). TroupeConnector's own keys
go in ``kv_connector_extra_config`` (EXTRA_KEYS).
"""
from __future__ import annotations

from typing import Any, Mapping

import msgspec

from actors.engine.json_flags import struct_of

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_PORT = 14579                       # vLLM's


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kv_connector: str                         # a name in KVConnectorFactory's registry
    kv_role: str = "kv_both"                  # KV_ROLES
    engine_id: str = ""                       # this instance's name in kv_transfer_params ("": host:port)
    kv_rank: int | None = None                # accepted as vLLM's (the P2P connectors' rank); unused
    kv_parallel_size: int = 1                 # accepted as vLLM's; unused
    kv_ip: str = "127.0.0.1"                  # the producer's side channel: address to listen on
    kv_port: int = DEFAULT_KV_PORT            # and its port
    kv_buffer_device: str = "cpu"             # accepted as vLLM's; transfers are staged in host memory
    kv_buffer_size: float = 1e9               # the largest read a producer stages in shared memory (bytes; larger: frames)
    kv_connector_extra_config: dict[str, Any] = {}
    kv_connector_module_path: str | None = None   # a module to import that registers kv_connector
    kv_load_failure_policy: str = "recompute"    # a failed load: compute the prompt here, or fail the request

    def __post_init__(self) -> None:
        check_kv_transfer_config(self)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVTransferConfig:
        return struct_of(cls, raw, "--kv-transfer-config", "kv_transfer_config")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        return struct_of(cls, text, "--kv-transfer-config", "kv_transfer_config")


def check_kv_transfer_config(c: KVTransferConfig) -> None:
    if c.kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {c.kv_role!r}")
    if c.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                         f"got {c.kv_load_failure_policy!r}")
    if not 0 <= c.kv_port < 65536:
        raise ValueError(f"kv_port must be in [0, 65535], got {c.kv_port}")
    if c.kv_parallel_size < 1:
        raise ValueError(f"kv_parallel_size must be at least 1, got {c.kv_parallel_size}")
    if c.kv_buffer_size < 0:
        raise ValueError(f"kv_buffer_size must be at least 0, got {c.kv_buffer_size}")
    from actors.kv_transfer.factory import KVConnectorFactory
    KVConnectorFactory.check(c)


def kv_transfer_config(value: Mapping[str, Any] | str | KVTransferConfig | None) -> KVTransferConfig | None:
    """--kv-transfer-config's JSON text, or the offline API's dict, parsed and validated."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    return KVTransferConfig.from_json(value) if isinstance(value, str) else KVTransferConfig.from_dict(value)
