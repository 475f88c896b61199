"""ZeroMQ channels between nodes: each node binds one PULL socket and keeps a PUSH per peer."""
from __future__ import annotations

import os
import socket
from typing import Any

import zmq
import zmq.asyncio


def endpoint(ipc_dir: str, node: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, node)}.sock"


def local_ip(address: str, port: int, flag: str) -> str:
    """This machine's address on the route to ``address`` (VLLM_HOST_IP names it, as in vLLM);
    ``flag``: the option that gave ``address``, named when there is no route to it."""
    named = os.environ.get("VLLM_HOST_IP", "").strip()
    if named:
        return named
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, port))           # no packet is sent: the kernel picks the route
            return s.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"{flag} {address}: no route to it from this machine ({exc})") from None


class ZmqTransport:
    """Frames in through one bound PULL socket; frames out through one PUSH socket per peer.

    ``send`` never waits: ZMQ queues up to the high-water mark (unbounded here; the engine's
    own flow control bounds what is in flight)."""

    def __init__(self, bind: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._ipc: list[str] = []
        self.address = self.bind(bind)
        self._peers: dict[str, zmq.asyncio.Socket] = {}

    def bind(self, address: str) -> str:
        """Receive on ``address`` too (``tcp://IP:*``: a free port); returns the address bound,
        the port resolved, for peers on other machines to connect to."""
        self._pull.bind(address)
        if address.startswith("ipc://"):
            self._ipc.append(address)
            return address
        return self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def ipc_address(self) -> str:
        """The first ``ipc://`` address bound ("" when none): where processes of this machine
        reach this one."""
        return self._ipc[0] if self._ipc else ""

    def add_peer(self, name: str, address: str) -> None:
        self.drop_peer(name)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._peers[name] = sock

    def drop_peer(self, name: str) -> None:
        sock = self._peers.pop(name, None)
        if sock is not None:
            sock.close(linger=0)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def send(self, peer: str, frames: list[Any]) -> None:
        sock = self._peers.get(peer)
        if sock is None:
            raise KeyError(peer)
        sock.send_multipart(frames, copy=False)

    async def recv(self) -> list[Any]:
        return await self._pull.recv_multipart(copy=False)

    def close(self) -> None:
        if self.ctx.closed:
            return
        for name in list(self._peers):
            self.drop_peer(name)
        self._pull.close(linger=0)
        self.ctx.term()
        for address in self._ipc:
            try:
                os.unlink(address.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
