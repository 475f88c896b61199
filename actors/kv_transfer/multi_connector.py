"""MultiConnector (vLLM's name and config): several KV connectors at once, say prompts' KV moved
between a prefill and a decode server (TroupeConnector) and kept on shared storage for later
requests (ExampleConnector):

    {"kv_connector": "MultiConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"connectors": [
         {"kv_connector": "TroupeConnector", "kv_role": "kv_producer", "kv_port": 14579},
         {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": "/data/kv"}}]}}

Each entry of ``connectors`` is a ``--kv-transfer-config`` object of its own; the keys it leaves
out (``kv_role``, ``engine_id``, ``kv_ip``, ``kv_port``, ``kv_load_failure_policy``) are the
outer config's.

A waiting request asks the connectors in their order how many of its tokens they hold: the first
that holds any loads them (the others get the request's blocks with no tokens to load, as in
vLLM). Every connector sees every step (its own metadata), every layer's hooks and every
request's end; a request's blocks are held while any connector holds them, and freed once each
connector that held them reported its send finished (the scheduler's side tells the worker's how
many hold each, so each rank reports a request once, when all its connectors are done). At most
one connector may answer a finished request with ``kv_transfer_params``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import msgspec

from actors.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole, extra_config

if TYPE_CHECKING:
    from actors.engine.config import EngineConfig
    from actors.kv_transfer.config import KVTransferConfig
    from actors.scheduler.request import Request

EXTRA_KEYS = {"connectors": []}
INHERITED = ("kv_role", "engine_id", "kv_ip", "kv_port", "kv_load_failure_policy")


def sub_configs(kv_config: Any) -> list[KVTransferConfig]:
    """The connectors' own configs (each validated, with the outer config's keys it left out)."""
    from actors.kv_transfer.config import KVTransferConfig
    raw = extra_config(kv_config, EXTRA_KEYS)["connectors"]
    if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
        raise ValueError("MultiConnector: kv_connector_extra_config.connectors must be a non-empty list of "
                         "KV transfer config objects")
    out = []
    for i, c in enumerate(raw):
        if c.get("kv_connector") == "MultiConnector":
            raise ValueError(f"MultiConnector: connectors[{i}] is a MultiConnector")
        inherited = {k: getattr(kv_config, k) for k in INHERITED if k not in c}
        try:
            out.append(KVTransferConfig.from_dict({**inherited, **c}))
        except ValueError as exc:
            why = str(exc).removeprefix("invalid kv_transfer_config: ")
            raise ValueError(f"MultiConnector: connectors[{i}]: {why}") from None
    return out


class MultiConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        from actors.kv_transfer.factory import KVConnectorFactory
        self._rank = 0
        self.connectors: list[KVConnectorBase] = []
        try:
            for sub in sub_configs(self.kv_config):
                self.connectors.append(KVConnectorFactory.create_connector(config.replace(kv_transfer=sub), role))
        except BaseException:
            self.shutdown()
            raise
        self._chosen: dict[str, int] = {}          # request -> the connector that loads it
        self._new_holders: dict[str, int] = {}     # request -> connectors that hold its blocks (for the worker)
        self._expected: dict[str, int] = {}        # worker: request -> connectors holding its blocks
        self._reported: dict[str, int] = {}        # worker: request -> their sends reported finished so far
        self._ready: list[str] = []                # worker: all of them finished, to report

    @classmethod
    def check_config(cls, kv_config: Any) -> None:
        sub_configs(kv_config)

    @classmethod
    def check_engine_config(cls, config: EngineConfig) -> None:
        from actors.kv_transfer.factory import KVConnectorFactory
        for sub in sub_configs(config.kv_transfer):
            KVConnectorFactory.check_engine(config.replace(kv_transfer=sub))

    @property
    def rank(self) -> int:          # type: ignore[override]
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value
        for c in getattr(self, "connectors", ()):
            c.rank = value

    # ==== scheduler side =======================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._chosen.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._chosen[request.request_id] = i
                return n, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, -1)
        for i, c in enumerate(self.connectors):
            if i == chosen:
                c.update_state_after_alloc(request, block_ids, num_external_tokens)
            else:
                c.update_state_after_alloc(request, tuple([] for _ in block_ids), 0)

    def build_connector_meta(self, scheduled: list[Request],
                             block_ids: Callable[[str], tuple[list[int], ...]] | None = None) -> bytes:
        holders, self._new_holders = self._new_holders, {}
        return msgspec.msgpack.encode([holders, [c.build_connector_meta(scheduled, block_ids)
                                                 for c in self.connectors]])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(request.request_id, None)
        holders, params = 0, None
        for c in self.connectors:
            delay, p = c.request_finished(request, block_ids)
            holders += bool(delay)
            if p is not None:
                if params is not None:
                    raise RuntimeError("MultiConnector: more than one connector answered with kv_transfer_params")
                params = p
        if holders:
            self._new_holders[request.request_id] = holders
        return holders > 0, params

    def request_added(self, request: Request) -> None:
        for c in self.connectors:
            c.request_added(request)

    def request_dropped(self, request_id: str) -> None:
        self._chosen.pop(request_id, None)
        for c in self.connectors:
            c.request_dropped(request_id)

    def reset(self) -> None:
        self._chosen.clear()
        self._new_holders.clear()
        for c in self.connectors:
            c.reset()

    def set_rank_hosts(self, hosts: list[str]) -> None:
        for c in self.connectors:
            c.set_rank_hosts(hosts)

    def has_pending(self) -> bool:
        return any(c.has_pending() for c in self.connectors)

    def is_loading(self, request_id: str) -> bool:
        return any(c.is_loading(request_id) for c in self.connectors)

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()

    # ==== worker side ==========================================================================
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: bytes) -> None:
        holders, metas = msgspec.msgpack.decode(metadata) if metadata else ({}, [b""] * len(self.connectors))
        for rid, n in holders.items():
            self._expected[rid] = n
            if self._settled(rid):
                self._ready.append(rid)
        for c, meta in zip(self.connectors, metas):
            c.start_load_kv(meta)

    def has_layer_work(self) -> bool:
        return any(c.has_layer_work() for c in self.connectors)

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: Any, attn_metadata: Any) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(self._ready, [], {}, {}, [])
        self._ready = []
        for c in self.connectors:
            o = c.get_finished()
            for rid in o.finished_sending:    # a request held by n connectors: once, after the n-th
                self._reported[rid] = self._reported.get(rid, 0) + 1
                if self._settled(rid):
                    out.finished_sending.append(rid)
            out.finished_recving += o.finished_recving
            out.failed_recving.update(o.failed_recving)
            for k, v in o.stats.items():
                out.stats[k] = out.stats.get(k, 0.0) + v
            out.transfers += o.transfers
        return out

    def _settled(self, rid: str) -> bool:
        """Whether every connector holding the request's blocks reported its send finished (a
        send may end before the scheduler's count of holders reaches this side)."""
        n = self._expected.get(rid)
        if n is None or self._reported.get(rid, 0) < n:
            return False
        del self._expected[rid]
        self._reported.pop(rid, None)
        return True
