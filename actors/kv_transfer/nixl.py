"""NIXL (NVIDIA's inference transfer library, vLLM's ``NixlConnector`` transport): the consumer
reads the producer's KV blocks straight out of the producer's registered cache with one-sided
READs, over UCX: RDMA or GPU-direct between machines, CUDA IPC or cross-memory attach and shared
memory inside one. Each worker registers its whole KV cache with its agent once; the handshake
carries the agent's metadata (its name, backends and registered memory), and a load is one
transfer of every (local block run, remote block run) pair of the request.

``pip install nixl-cu12`` (or ``nixl``, which pulls the CUDA 12 and 13 builds); the import is
tried under each of its module names. ``reason()`` says why it cannot run here, or None.
"""
from __future__ import annotations

import importlib
import time
import uuid
from typing import Any

BACKENDS = ["UCX"]
MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _api() -> Any:
    last: Exception | None = None
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:        # the meta package without a backend raises ImportError too
            last = exc
    raise ImportError(f"NIXL is not installed (pip install nixl-cu12): {last}")


def reason() -> str | None:
    """Why NIXL cannot be used here (None: it can)."""
    try:
        _api()
    except Exception as exc:              # a broken install (missing UCX plugin, ...) as well
        return f"{type(exc).__name__}: {exc}"
    return None


def _mem_type(device: Any) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class NixlAgent:
    """One worker's agent with its KV cache registered (every layer's tensor)."""

    def __init__(self, label: str, tensors: list[Any]) -> None:
        api = _api()
        self.name = f"troupe-{label}-{uuid.uuid4().hex[:8]}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=BACKENDS))
        self.mem, self.dev = _mem_type(tensors[0].device)
        self._reg = self.agent.register_memory(list(tensors), self.mem, BACKENDS)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._peers: dict[bytes, str] = {}

    def add_peer(self, metadata: bytes) -> str:
        """The remote agent's name, its metadata loaded once."""
        name = self._peers.get(metadata)
        if name is None:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[metadata] = name
        return name

    def read(self, peer: str, copies: list[tuple[int, int, int]], remote_mem: str, remote_dev: int,
             timeout_s: float) -> int:
        """Copy (local address, remote address, bytes) triples from the peer's registered memory
        into ours in one transfer; the bytes read. RuntimeError when it fails or outlasts
        ``timeout_s`` (the transfer is then released unfinished: the caller drops the blocks)."""
        if not copies:
            return 0
        local = self.agent.get_xfer_descs([(dst, n, self.dev) for dst, _, n in copies], self.mem)
        remote = self.agent.get_xfer_descs([(src, n, remote_dev) for _, src, n in copies], remote_mem)
        handle = self.agent.initialize_xfer("READ", local, remote, peer)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):     # each check moves the transfer on (UCX copies in it)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL read from {peer} unfinished after {timeout_s:g} s")
                time.sleep(0)                        # other threads of the process get the GIL between checks
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL read from {peer} failed")
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:              # still in flight after a timeout: NIXL keeps it
                pass
        return sum(n for _, _, n in copies)

    def progress(self) -> None:
        """Move this agent's transfers on (its backend's progress, run by reading notifications):
        a producer serving reads calls it while they last (no progress thread spins a core)."""
        self.agent.get_new_notifs()

    def close(self) -> None:
        for name in list(self._peers.values()):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:              # the agent goes with the process anyway
                pass
        self._peers.clear()
        reg, self._reg = self._reg, None
        if reg is not None:
            self.agent.deregister_memory(reg, BACKENDS)
