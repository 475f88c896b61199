"""A headless machine's node (``troupe serve --headless``): the process that runs part of a
server's work on another machine (whole engine cores with --data-parallel-size-local,
actors/frontend/headless.py; an engine core's worker ranks with --nnodes, actors/engine/multinode.py),
joins the actor that coordinates them over TCP, and beats to it. What both share: where the node
receives (its address on the route to the other machine, or ``VLLM_HOST_IP``), the join retried until
answered (either machine may start first), the heartbeats with the other side's loss, and the
teardown."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any, Awaitable, Callable, ClassVar

import msgspec

from actors.runtime.errors import ActorDied, AskTimeout
from actors.runtime.node import Node
from actors.runtime.process import system_actor
from transport.msg import Msg
from transport.zmq_channel import ZmqTransport, endpoint, local_ip

log = logging.getLogger("troupe.headless")

BEAT_S = 1.0                  # between a headless machine's beats to the coordinator
HOST_LOST_S = 6.0             # a headless machine silent this long: what it runs is down
FRONTEND_LOST_S = 30.0        # the coordinator silent this long: the headless machine stops
ASK_TIMEOUT_S = 5.0
FLUSH_S = 0.2                 # for last frames to leave before a node's sockets close


class Registered(msgspec.Struct):
    error: str = ""            # why the coordinator refused ("": accepted)
    retry: bool = False        # refused for now (what the machine joins for may have a server gone without a word yet)


class HeadlessBeat(Msg):
    """A headless machine's node ``host`` (receiving at ``host_address``) is alive, every ``BEAT_S``.
    The answer's error: the coordinator does not know it (it restarted, or counted it lost)."""
    reply_type: ClassVar[Any] = Registered
    host: str
    host_address: str


class HeadlessNode:
    """The node of a headless machine, named ``{kind}-HOSTNAME-PID`` (unique among the machines that
    may join: the coordinator answers a node by its name), joining actor ``coordinator`` on node
    ``peer`` at ``address``:``port`` (``flags``: the options that named them, for the errors).
    ``who`` names the other side in messages ("the server", "the engine core")."""

    def __init__(self, kind: str, address: str, port: int, flags: tuple[str, str], peer: str, coordinator: str,
                 who: str, ready_timeout: float) -> None:
        self.remote = f"tcp://{address}:{port}"
        self.ip = local_ip(address, port, flags[0])
        self.flags = flags
        self.who = f"{who} at {self.remote}"
        self.ready_timeout = ready_timeout
        self.ipc_dir = tempfile.mkdtemp(prefix=f"troupe-{kind}-")
        self.host = f"{kind}-{socket.gethostname()}-{os.getpid()}"
        self.node = Node(self.host, ZmqTransport(endpoint(self.ipc_dir, self.host)))
        self.host_address = self.node.transport.bind(f"tcp://{self.ip}:*")
        system_actor(self.node)
        self.node.connect(peer, self.remote)
        self.coordinator = self.node.ref(coordinator, peer)

    def stop_on_signals(self) -> None:
        """SIGINT and SIGTERM stop the node (what it runs with it)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: self.node.closed.done() or self.node.closed.set_result(0))

    async def join(self, msg: Msg, what: str) -> None:
        """Ask ``msg`` (joining ``what``: "engine core 2", "node rank 1") until the coordinator
        accepts it; TimeoutError when nobody answers or it keeps refusing for ``ready_timeout``,
        RuntimeError when it refuses for good."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                answer = await self.coordinator.ask(msg, timeout=ASK_TIMEOUT_S)
            except (AskTimeout, ActorDied) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing answered at {self.remote} within {self.ready_timeout:g} s "
                                       f"({', '.join(self.flags)}): {exc}") from None
                await asyncio.sleep(0.2)         # not there yet (a refused connection fails at once)
                continue
            if answer.error and not answer.retry:
                raise RuntimeError(f"{self.who} refused {what}: {answer.error}")
            if answer.error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.who} kept refusing {what} for {self.ready_timeout:g} s: "
                                       f"{answer.error}")
                log.warning("%s; asking again", answer.error)
                await asyncio.sleep(BEAT_S)
                continue
            return

    async def beat(self, stopping: str, refused: Callable[[str], Awaitable[bool]]) -> None:
        """Beat every ``BEAT_S``. The coordinator silent for ``FRONTEND_LOST_S`` stops the node
        (``stopping``: what stops with it); an answer that refuses the beat goes to ``refused``,
        whose False ends the beats."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                answer = await self.coordinator.ask(HeadlessBeat(self.host, self.host_address), timeout=ASK_TIMEOUT_S)
            except (AskTimeout, ActorDied):
                if time.monotonic() - last > FRONTEND_LOST_S:
                    self.node.fatal(f"{self.who} has not answered for {time.monotonic() - last:.0f} s; "
                                    f"stopping {stopping}")
                    return
                continue
            last = time.monotonic()
            if answer.error and not await refused(answer.error):
                return

    async def close(self) -> None:
        await self.node.stop()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
