"""Child processes as supervised nodes.

The parent starts a child with ``python -m actors.runtime.child``; the child builds a node,
runs its entry function, and tells the parent's ``_system`` actor it is ready. The parent
watches the child's pidfd (death noticed at once), reads its heartbeats (a hung child is
killed), and holds the write end of a death pipe: when the parent dies, the child sees EOF and
exits. Nothing is left running either way.

Heartbeats come from a thread of the child that never waits for its event loop, over a pipe of
their own: each says how often the child's event loop has turned and how much CPU the process
has used. A child is hung when neither moved for ``hung_after_s`` (or no beat came): a long
synchronous step (a huge prefill, a first CUDA-graph capture, compilation) keeps using CPU, so it
is not mistaken for a hang.
"""
from __future__ import annotations

import abc
import asyncio
import base64
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from typing import Any, Callable

import msgspec

from actors.runtime.errors import ActorDied, ChildStartError
from actors.runtime.node import Node
from actors.runtime.system import SYSTEM_ACTOR, NodeReady, Shutdown, SystemActor
from transport.zmq_channel import endpoint

log = logging.getLogger("troupe.process")

BEAT = struct.Struct("<Qd")       # a heartbeat: the child's event-loop turns, its process CPU seconds
PROGRESS_CPU_S = 0.05             # CPU the heartbeat thread alone never uses while the loop is stuck


class Liveness:
    """What a parent reads from a child's heartbeats: when it last made progress (an event-loop
    turn, or CPU used beyond the heartbeat thread's own). Hung: no progress for ``hung_after_s``."""

    def __init__(self) -> None:
        self.progress = (0, 0.0)                   # (loop turns, CPU seconds) at the last progress
        self.last = time.monotonic()

    def restart(self) -> None:
        self.last = time.monotonic()

    def beat(self, data: bytes) -> bytes:
        """Read the beats in ``data``; returns the bytes of an incomplete one, kept for the next."""
        n = len(data) // BEAT.size
        for turns, cpu in BEAT.iter_unpack(data[:n * BEAT.size]):
            if turns != self.progress[0] or cpu - self.progress[1] >= PROGRESS_CPU_S:
                self.progress, self.last = (turns, cpu), time.monotonic()
        return data[n * BEAT.size:]

    def stuck_s(self) -> float:
        return time.monotonic() - self.last


SPEC_ENV = "TROUPE_NODE_SPEC"       # a child's NodeSpec, base64 of its msgpack


class NodeSpec(msgspec.Struct):
    name: str
    entry: str                 # "package.module:function": async (node, config: bytes) -> Struct | None
    config: bytes              # msgpack, decoded by the entry function
    ipc_dir: str
    parent: str
    peers: dict[str, str]      # node name -> address, the parent's included
    heartbeat_s: float = 1.0          # between two beats of the child's heartbeat thread
    hung_after_s: float = 45.0        # no loop turn, no CPU used, for this long: hung
    trace: bool = True                # record trace spans
    flight_dir: str = ""              # where flight-recorder files go ("": the default)
    bind: str = ""                    # where the child receives ("": a socket of its own in ipc_dir)
    beats_to: str = ""                # where its heartbeats go when it has no pipe (a Ray actor's child)


class RestartBudget:
    """OTP's restart intensity for a supervised child process: at most ``max_restarts``
    restarts within any ``window_s`` seconds; past that the supervisor gives up."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def spend(self) -> bool:
        """Count a restart now; False when it is one too many for the window."""
        now = time.monotonic()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) <= self.max_restarts

    def describe(self) -> str:
        return f"{len(self._times)} times within {self.window_s:g} s"


class StoppableChild(abc.ABC):
    """What a supervised child node (a process, or a Ray actor hosting one) shares: asked to shut
    down, then killed (``kill``, its own way) if it has not exited within the timeout."""
    node: Node
    spec: NodeSpec
    name: str
    returncode: int | None
    exited: asyncio.Future[int]
    killed_what = "it"

    @abc.abstractmethod
    def kill(self) -> None: ...

    @abc.abstractmethod
    def describe_exit(self) -> str: ...

    async def stop(self, timeout: float = 10.0) -> int:
        """Ask the child to shut down; kill it if it has not exited within ``timeout``."""
        if self.returncode is None:
            try:
                self.node.ref(SYSTEM_ACTOR, self.name).tell(Shutdown())
            except ActorDied:
                pass
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout)
            except TimeoutError:
                log.warning("process '%s' did not stop within %g s; killing %s", self.name, timeout, self.killed_what)
                self.kill()
                await self.exited
        return self.returncode  # type: ignore[return-value]


class ChildProcess(StoppableChild):
    def __init__(self, node: Node, spec: NodeSpec, popen: subprocess.Popen[bytes], death_pipe: int,
                 beats: int, on_exit: Callable[[ChildProcess], None] | None) -> None:
        self.node = node
        self._death_pipe = death_pipe  # the child exits when this end closes (we died) or a byte comes
        self._beats = beats            # read end of the child's heartbeat pipe (non-blocking)
        self.spec = spec
        self.popen = popen
        self.pid = popen.pid
        self.returncode: int | None = None
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._on_exit = on_exit
        self._pidfd = os.pidfd_open(popen.pid)
        self._beat_buf = b""
        self.liveness = Liveness()
        self._watch: asyncio.TimerHandle | None = None
        asyncio.get_running_loop().add_reader(self._pidfd, self._reap)

    @property
    def name(self) -> str:
        return self.spec.name

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc is None:
            return f"process '{self.name}' (pid {self.pid}) is running"
        if rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = str(-rc)
            return f"process '{self.name}' (pid {self.pid}) was killed by {sig}"
        return f"process '{self.name}' (pid {self.pid}) exited with code {rc}"

    def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        loop.remove_reader(self._beats)
        os.close(self._pidfd)
        os.close(self._death_pipe)
        self._death_pipe = -1
        os.close(self._beats)
        self.returncode = self.popen.wait()
        if self._watch is not None:
            self._watch.cancel()
        reason = self.describe_exit()
        self.node.peer_down(self.name, reason)
        if self.returncode != 0:
            system_actor(self.node).child_exited(self.name, self.pid, reason)
        if not self.exited.done():
            self.exited.set_result(self.returncode)
        if self._on_exit is not None:
            self._on_exit(self)

    def start_heartbeat(self) -> None:
        """Watch the child's heartbeats from now on (it is ready)."""
        self.liveness.restart()
        asyncio.get_running_loop().add_reader(self._beats, self._read_beats)
        self._watch = asyncio.get_running_loop().call_later(self.spec.heartbeat_s, self._check)

    def _read_beats(self) -> None:
        try:
            data = os.read(self._beats, 4096)
        except BlockingIOError:
            return
        if not data:                              # the child closed it: it is exiting
            asyncio.get_running_loop().remove_reader(self._beats)
            return
        self._beat_buf = self.liveness.beat(self._beat_buf + data)

    def _check(self) -> None:
        if self.returncode is not None:
            return
        if hung(self, self.liveness):
            return
        self._watch = asyncio.get_running_loop().call_later(self.spec.heartbeat_s, self._check)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def request_stop(self) -> None:
        """Ask the child to shut down as ``stop`` does, through its death pipe: what a parent can
        still do when its event loop (and the transport on it) is gone or going."""
        if self.returncode is None and self._death_pipe >= 0:
            try:
                os.write(self._death_pipe, b"s")
            except OSError:               # it has exited (its end is closed)
                pass

    def wait_exit(self, timeout: float) -> int:
        """Block until the child has exited (``request_stop`` asked it to); kill it after ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("process '%s' did not stop within %g s; killing it", self.name, timeout)
            self.kill()
            return self.popen.wait()

def hung(child: StoppableChild, liveness: Liveness) -> bool:
    """Kill ``child`` when it has made no progress for its spec's ``hung_after_s``; whether it did."""
    stuck = liveness.stuck_s()
    if stuck <= child.spec.hung_after_s:
        return False
    log.error("process '%s' is hung (no event-loop turn and no CPU used for %.0f s); killing %s",
              child.name, stuck, child.killed_what)
    child.kill()
    return True


def system_actor(node: Node) -> SystemActor:
    if SYSTEM_ACTOR not in node.cells:
        node.spawn(SYSTEM_ACTOR, SystemActor)
    return node.cells[SYSTEM_ACTOR].actor  # type: ignore[return-value]


async def start_child(node: Node, spec: NodeSpec, *, ready_timeout: float = 600.0,
                      on_exit: Callable[[ChildProcess], None] | None = None,
                      env: dict[str, str] | None = None, fds: tuple[int, ...] = ()) -> tuple[ChildProcess, NodeReady]:
    """Start a child node and wait until it is ready. Raises ChildStartError if it dies or
    times out first (the child is then killed). ``fds``: file descriptors the child inherits
    under the same numbers (another API server's listening sockets)."""
    waiter = system_actor(node).expect_ready(spec.name)
    if not spec.bind:
        # a socket of this process's own: a process of the same name that outlives its start (a
        # killed engine's worker) can neither receive what is meant for this one nor, exiting,
        # remove this one's socket file
        spec = msgspec.structs.replace(spec, bind=endpoint(spec.ipc_dir, f"{spec.name}-{os.urandom(4).hex()}"))
    wildcard = spec.bind.endswith(":*")     # tcp://IP:*, a free port: reached where its ready message says
    if not wildcard:
        node.connect(spec.name, spec.bind)
    death_r, death_w = os.pipe()
    beats_r, beats_w = os.pipe()
    os.set_inheritable(death_r, True)
    os.set_inheritable(beats_w, True)
    os.set_blocking(beats_r, False)
    # the spec (the engine config in it may hold secrets: a watermark key) goes in the child's
    # environment, which only its user can read, not on its command line, which anyone can
    child_env = {**os.environ, **(env or {}), "TROUPE_DEATH_FD": str(death_r),
                 "TROUPE_HEARTBEAT_FD": str(beats_w),
                 SPEC_ENV: base64.b64encode(msgspec.msgpack.encode(spec)).decode()}
    popen = subprocess.Popen(
        [sys.executable, "-m", "actors.runtime.child", spec.name],
        pass_fds=(death_r, beats_w, *fds), env=child_env)
    os.close(death_r)
    os.close(beats_w)
    child = ChildProcess(node, spec, popen, death_w, beats_r, on_exit)
    ready = await wait_ready(child, waiter, ready_timeout)
    if wildcard:
        node.connect(spec.name, ready.address)
    child.start_heartbeat()
    system_actor(node).children.add(spec.name)
    return child, ready


async def wait_ready(child: StoppableChild, waiter: asyncio.Future[NodeReady], ready_timeout: float) -> NodeReady:
    """The child's ready message; ChildStartError if it exits first, or if it is not ready within
    ``ready_timeout`` (it is killed then)."""
    try:
        done, _ = await asyncio.wait({waiter, child.exited}, timeout=ready_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            return waiter.result()
        if child.exited in done:
            raise ChildStartError(f"{child.describe_exit()} before it was ready")
        child.kill()
        await child.exited
        raise ChildStartError(f"process '{child.name}' was not ready within {ready_timeout:g} s")
    finally:
        if not waiter.done():
            waiter.cancel()


def decode_info(ready: NodeReady, typ: Any) -> Any:
    return msgspec.msgpack.decode(ready.info, type=typ)
