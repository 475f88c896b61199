"""Entry point of a child node process: ``python -m actors.runtime.child <name>``, its NodeSpec in
the environment (``TROUPE_NODE_SPEC``)."""
from __future__ import annotations

import asyncio
import base64
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

import msgspec

from actors.runtime import heap, logs
from actors.runtime.node import Node
from actors.runtime.plugins import PluginError, load_general_plugins
from actors.runtime.process import BEAT, SPEC_ENV, NodeSpec, system_actor
from actors.runtime.system import SYSTEM_ACTOR, NodeReady
from actors.runtime.tracing import Tracer, write_flight_record
from transport.zmq_channel import ZmqTransport, endpoint

log = logging.getLogger("troupe.child")
EXIT_GRACE_S = 5.0               # how long a stopped node's threads have to finish before the process exits
START_ERROR_FLUSH_S = 0.2        # a failed start's reason is on its way to the parent before the node stops
# A SIGTERM to the whole process group (systemd's stop of a service, ``kill -- -PGID``) reaches a
# child as its parent starts a graceful stop that ends by shutting the child down (after the
# server's --shutdown-timeout drain, which needs the engine and workers running): the child waits
# that long for it. 90 s is systemd's own stop timeout, after which it kills the group anyway.
TERM_GRACE_S = 90.0


def on_sigterm(node: Node, parent: str, grace_s: float = TERM_GRACE_S) -> Callable[[], None]:
    """The child's SIGTERM handler: the first one waits up to ``grace_s`` for the parent to shut
    this node down (or to die, which the death pipe tells), a second one stops it at once."""
    timer: list[asyncio.TimerHandle] = []

    def handle() -> None:
        if timer:
            node.fatal("SIGTERM (twice)", 143)
            return
        log.info("node '%s': SIGTERM; it stops when '%s' shuts it down (a whole group's stop), or in %g s",
                 node.name, parent, grace_s)
        timer.append(asyncio.get_running_loop().call_later(
            grace_s, lambda: node.fatal(f"SIGTERM, and '{parent}' did not shut it down within {grace_s:g} s", 143)))
    return handle


def resolve_entry(path: str):
    module, _, func = path.partition(":")
    return getattr(importlib.import_module(module), func)


def _beat(send: Callable[[bytes], None], interval: float, turns: list[int]) -> None:
    """The heartbeat thread: never waits for the event loop, so a long synchronous step does not
    silence it; what it reports (loop turns, CPU used) lets the parent tell a step from a hang."""
    while True:
        send(BEAT.pack(turns[0], time.process_time()))
        time.sleep(interval)


def _pipe_beats(fd: int, interval: float, turns: list[int]) -> None:
    try:
        _beat(lambda data: os.write(fd, data), interval, turns)
    except OSError:               # the parent is gone; the death pipe ends this process
        return


def _zmq_beats(address: str, interval: float, turns: list[int]) -> None:
    """Beats over ZeroMQ, for a child with no pipe to its parent (hosted by a Ray actor, on any
    machine of the cluster): a socket of this thread's own, never blocking."""
    import zmq
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(address)

    def send(data: bytes) -> None:
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.Again:         # the parent is not reading: it sees no beats, as it should
            pass
    try:
        _beat(send, interval, turns)
    except zmq.ZMQError:
        return


def start_heartbeat(loop: asyncio.AbstractEventLoop, interval: float, fd: int | None = None,
                    address: str = "") -> None:
    """Beat to the parent through pipe ``fd``, or to ``address`` over ZeroMQ."""
    turns = [0]                   # event-loop turns, counted by a callback the loop runs

    def tick() -> None:
        turns[0] += 1
        loop.call_later(interval / 2, tick)
    tick()
    target, where = (_pipe_beats, fd) if fd is not None else (_zmq_beats, address)
    threading.Thread(target=target, args=(where, interval, turns), name="heartbeat", daemon=True).start()


async def run_child(spec: NodeSpec, death_fd: int | None, heartbeat_fd: int | None) -> int:
    """Run the child node until it stops; returns its exit code. A child hosted by a Ray actor
    (actors/runtime/ray_nodes.py) has no death pipe, no heartbeat pipe and no signal handlers of
    its own: Ray watches its process and ends it with its owner, and its heartbeats go to the
    parent over ZeroMQ (``spec.beats_to``)."""
    loop = asyncio.get_running_loop()
    if heartbeat_fd is not None:
        start_heartbeat(loop, spec.heartbeat_s, fd=heartbeat_fd)
    elif spec.beats_to:
        start_heartbeat(loop, spec.heartbeat_s, address=spec.beats_to)
    node = Node(spec.name, ZmqTransport(spec.bind or endpoint(spec.ipc_dir, spec.name)),
                tracer=Tracer(spec.name, enabled=spec.trace))
    system = system_actor(node)
    if spec.flight_dir:
        system.flight_dir = spec.flight_dir
    for peer, address in spec.peers.items():
        node.connect(peer, address)

    def parent_says() -> None:
        try:
            data = os.read(death_fd, 64)
        except BlockingIOError:
            return
        loop.remove_reader(death_fd)
        if not data:
            node.fatal(f"parent node '{spec.parent}' died")
        elif not node.closed.done():     # a stop the parent asked without its event loop (ChildProcess.request_stop)
            log.info("node '%s': '%s' asked it to stop", node.name, spec.parent)
            node.closed.set_result(0)

    if death_fd is not None:
        loop.add_reader(death_fd, parent_says)
        loop.add_signal_handler(signal.SIGTERM, on_sigterm(node, spec.parent))
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the parent handles Ctrl-C
    entry = asyncio.ensure_future(resolve_entry(spec.entry)(node, spec.config))
    # the node may close while its entry still runs (its parent died, a second SIGTERM): the entry
    # (a model loading, an engine core waiting for other machines' ranks) stops with it
    await asyncio.wait({entry, node.closed}, return_when=asyncio.FIRST_COMPLETED)
    if not entry.done():
        entry.cancel()
        try:
            await entry
        except BaseException:            # cancelled, or what the cancellation made it raise
            pass
        code = node.closed.result()
        await node.stop()
        return code
    try:
        info = entry.result()
    except Exception as exc:
        log.exception("node '%s' failed to start", spec.name)
        # the parent's start fails saying why (not only that this process exited)
        node.ref(SYSTEM_ACTOR, spec.parent).tell(NodeReady(spec.name, os.getpid(),
                                                           error=f"{type(exc).__name__}: {exc}"[:2000]))
        await asyncio.sleep(START_ERROR_FLUSH_S)
        await node.stop()
        return 1
    payload = msgspec.msgpack.encode(info) if info is not None else b""
    heap.started()
    node.ref(SYSTEM_ACTOR, spec.parent).tell(NodeReady(spec.name, os.getpid(), payload, node.transport.address))
    code = await node.closed
    if code != 0:
        flight_record(node, system.flight_dir, f"exit code {code}")
    await node.stop()
    return code


def flight_record(node: Node, directory: str, reason: str) -> None:
    """A node stopping on a failure writes its own last seconds (its parent writes what reached
    it when the process is killed outright)."""
    records = node.tracer.recent()
    if not records:
        return
    steps = [(node.name, s) for s in node.tracer.steps.since(0)[0] if s.end_ns >= records[0].start_ns]
    path = write_flight_record(directory, node.name, os.getpid(), reason, records, steps)
    if path:
        log.error("flight recorder: the last seconds of node '%s' are in %s", node.name, path)


def main() -> None:
    spec = msgspec.msgpack.decode(base64.b64decode(os.environ.pop(SPEC_ENV)), type=NodeSpec)
    death_fd = int(os.environ.pop("TROUPE_DEATH_FD"))
    heartbeat_fd = int(os.environ.pop("TROUPE_HEARTBEAT_FD"))
    heap.starting()
    logs.configure(spec.name)
    try:
        load_general_plugins()         # before anything else: a plugin may register what the entry needs
    except PluginError as exc:
        log.error("node '%s' cannot start: %s", spec.name, exc)
        sys.exit(1)
    import uvloop
    code = uvloop.run(run_child(spec, death_fd, heartbeat_fd))
    heap.exiting()
    if not threads_finished(EXIT_GRACE_S):
        # a thread still in its work (a worker's step blocked in a collective whose peer died):
        # the interpreter would wait for it forever at exit, and an orphan has nobody to kill it
        log.error("node '%s': threads still running %.0f s after it stopped (%s); exiting without them",
                  spec.name, EXIT_GRACE_S, ", ".join(t.name for t in threading.enumerate()
                                                    if t is not threading.main_thread() and not t.daemon))
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def release_idle_pool_threads() -> None:
    """Tell every thread pool's workers to end once idle, without waiting for them: what the
    interpreter's exit does for them, done before ``threads_finished`` waits (a pool nobody shut
    down, torch.compile's compile workers, would otherwise keep its idle threads waiting for work
    through the grace period). A worker in the middle of a task ends after it."""
    from concurrent.futures import thread as pool_threads
    with pool_threads._global_shutdown_lock:
        pool_threads._shutdown = True
        for queue in list(pool_threads._threads_queues.values()):
            queue.put(None)


def threads_finished(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds in all for this process's non-daemon threads to end."""
    release_idle_pool_threads()
    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(deadline - time.monotonic(), 0.0))
    return not any(t.is_alive() for t in threading.enumerate()
                   if t is not threading.main_thread() and not t.daemon)


if __name__ == "__main__":
    main()
