"""Child nodes placed on a Ray cluster, as vLLM's Ray executor places its workers and its Ray
data-parallel backend its engine cores: Ray does the placement and the lifecycle, our frames stay
the data plane.

Two users: an engine core with ``--distributed-executor-backend ray`` places its worker ranks, a
bundle of one device each (``{"CPU": 1}``, or ``{"GPU": 1}`` on GPUs); a server with
``--data-parallel-backend ray`` places its engine cores, a bundle each holding the engine core
and, when it starts its workers itself, their devices. Either joins a running cluster (``ray
start --head`` on one machine, ``ray start --address=HEAD:PORT`` on the others; ``RAY_ADDRESS``
names another), reserves one placement group (vLLM's PACK strategy: as few machines as hold the
bundles), and starts one Ray actor per child in its bundle. That actor hosts the same child-node
main a child process runs (``actors.runtime.child.run_child``, the same entry and arguments),
except that the node receives on ``tcp://NODE_IP:PORT`` instead of a socket in the IPC
directory, and says where in its ready message, so children on other machines are reached.

Supervision is Ray's: the actor's ``run`` call ends when the node stops (its exit code) or when
its process dies (Ray's ActorDiedError), which the parent sees as it sees a child process exit
(``RayChild`` answers as ``ChildProcess`` does). A hung child (alive, its event loop stuck and no
CPU used) is ours to find, as with processes: its heartbeat thread sends the same beats over
ZeroMQ to a socket of the parent's, and the parent kills the actor once they show no progress
for the spec's ``hung_after_s``. Actors are owned by the process that placed
them, so Ray ends them if it dies; stopping kills them and removes the placement group."""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import socket
import threading
from typing import Any, Callable

import msgspec

from actors.runtime import logs
from actors.runtime.node import Node
from actors.runtime.process import (ChildStartError, Liveness, NodeSpec, StoppableChild, hung, system_actor,
                                    wait_ready)
from actors.runtime.system import NodeReady

log = logging.getLogger("troupe.ray")

NAMESPACE = "troupe"                  # the Ray namespace of our actors
PLACEMENT_TIMEOUT_S = 120.0           # for the cluster to have room for every rank's bundle
FORWARDED_ENV = ("TROUPE_",)          # environment the ranks get from the engine core
NODE_IP_ENV = "TROUPE_NODE_IP"        # in a Ray-hosted child (and its own children): its machine's cluster IP


def ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:                # sys.modules["ray"] is None: ray cannot be imported
        return False


class RayClusterError(RuntimeError):
    pass


def connect() -> None:
    """Join the running Ray cluster (``RAY_ADDRESS``, else the one started on this machine)."""
    import ray
    if ray.is_initialized():
        return
    where = os.environ.get("RAY_ADDRESS") or "auto"
    advice = ("Start one with `ray start --head` on this machine (and `ray start --address=HEAD_IP:6379` on "
              "the others), or set RAY_ADDRESS to a running cluster's address")
    host, _, port = where.rpartition(":")
    if host and port.isdigit() and "://" not in where:    # fail now rather than after Ray's retries
        try:
            socket.create_connection((host, int(port)), timeout=5.0).close()
        except OSError as exc:
            raise RayClusterError(f"the Ray backend: no Ray cluster answers at RAY_ADDRESS "
                                  f"{where} ({exc}). {advice}") from None
    main = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=where, namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise RayClusterError(f"the Ray backend found no Ray cluster to join ({where}: "
                              f"{exc}). {advice}") from None
    finally:
        if main:                      # ray.init sets its own SIGTERM handler: the node's stays
            signal.signal(signal.SIGTERM, term)


class NodeHost:
    """The Ray actor of one rank: it hosts a child node's main in its own process."""

    def where(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A port free now on this actor's machine (torch.distributed's meeting point)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, spec_bytes: bytes, env: dict[str, str]) -> int:
        """Run the child node ``spec_bytes`` (a NodeSpec in msgpack) until it stops; its exit code."""
        import ray
        import uvloop
        from actors.runtime.child import run_child
        from actors.runtime.plugins import load_general_plugins
        os.environ.update(env)
        os.environ[NODE_IP_ENV] = ip = ray.util.get_node_ip_address()     # its processes, and their children's
        spec = msgspec.msgpack.decode(spec_bytes, type=NodeSpec)
        spec = msgspec.structs.replace(spec, bind=f"tcp://{ip}:*")
        logs.configure(spec.name, force=True)
        load_general_plugins()
        return uvloop.run(run_child(spec, None, None))


_host_class: Any = None


def host_class() -> Any:
    global _host_class
    if _host_class is None:
        import ray
        _host_class = ray.remote(max_restarts=0)(NodeHost)
    return _host_class


class RayPlacement:
    """A placement group of ``count`` bundles and the Ray actors hosting a child node in each:
    the ranks of one engine core (a device each: ``units=1``) or the engine cores of a server
    (``host_cpu``: a CPU for the engine core itself, plus the ``units`` devices of the workers it
    starts where it runs; 0 when it places them on the cluster too)."""

    def __init__(self, count: int, device: str, label: str, *, units: int = 1, host_cpu: bool = False,
                 what: str = "ranks") -> None:
        self.count = count
        self.device = device          # "cpu", "cuda" or "auto" (GPUs when the cluster has any)
        self.label = label            # names the actors: troupe-LABEL-NODE-gGENERATION
        self.units = units
        self.host_cpu = host_cpu
        self.what = what
        self.pg: Any = None
        self.bundle: dict[str, int] = {}
        self.hosts: dict[int, Any] = {}           # bundle index -> its actor

    async def start(self) -> None:
        """Join the cluster and reserve the bundles (a clear error when it cannot hold them)."""
        import ray
        from ray.util.placement_group import placement_group
        connect()
        total = ray.cluster_resources()
        gpu = self.device == "cuda" or (self.device == "auto" and total.get("GPU", 0) > 0)
        if gpu:
            self.bundle = {**({"CPU": 1} if self.host_cpu else {}), **({"GPU": self.units} if self.units else {})}
        else:
            self.bundle = {"CPU": max(self.units, 1)}
        for key, n in self.bundle.items():
            have = int(total.get(key, 0))
            if have < self.count * n:
                raise RayClusterError(
                    f"the Ray cluster has {have} {key}s in all and the {self.count} {self.what} need {n} each: "
                    f"add machines with `ray start --address=HEAD_IP:6379`, or ask for fewer {self.what}")
        self.pg = placement_group([dict(self.bundle)] * self.count, strategy="PACK", name=f"troupe-{self.label}")
        try:
            await asyncio.wait_for(self.pg.ready(), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            self.remove()
            raise RayClusterError(
                f"the Ray cluster had no room for {self.count} bundles of {self.describe()} within "
                f"{PLACEMENT_TIMEOUT_S:g} s (others hold them: `ray status` shows the cluster's use)") from None
        log.info("Ray placement group of %d bundle%s (%s each) for the %s ready (cluster: %s)", self.count,
                 "s" if self.count > 1 else "", self.describe(), self.what,
                 ", ".join(f"{int(v)} {k}" for k, v in sorted(total.items()) if k in ("CPU", "GPU")))

    def describe(self) -> str:
        return " + ".join(f"{n} {key}" for key, n in self.bundle.items())

    def engine_address(self, node: Node) -> str:
        """Where ranks on any machine reach ``node`` (bound once, on this machine's cluster IP)."""
        import ray
        return node.transport.bind(f"tcp://{ray.util.get_node_ip_address()}:*")

    def new_host(self, index: int, name: str, generation: int) -> Any:
        """A Ray actor in bundle ``index``, for child node ``name`` (replacing the one before)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.hosts[index] = host_class().options(
            num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
            name=f"troupe-{self.label}-{name}-g{generation}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
        ).remote()
        return self.hosts[index]

    def new_hosts(self, names: list[str], generation: int) -> list[Any]:
        """A Ray actor per rank, each in its rank's bundle."""
        return [self.new_host(rank, name, generation) for rank, name in enumerate(names)]

    async def host_ips(self) -> list[str]:
        """Each bundle's machine (its cluster IP), in bundle order."""
        return [ip for ip, _ in await asyncio.gather(*(self.hosts[i].where.remote() for i in range(self.count)))]

    async def meeting_point(self) -> str:
        """torch.distributed's init method: the first rank's machine, a port free there."""
        (ip, _), port = await asyncio.gather(self.hosts[0].where.remote(), self.hosts[0].free_port.remote())
        return f"tcp://{ip}:{port}"

    def remove(self) -> None:
        """Kill the ranks' actors and remove the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group
        for host in self.hosts.values():
            ray.kill(host, no_restart=True)
        self.hosts = {}
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def close(self) -> None:
        """``remove``, then leave the cluster."""
        import ray
        self.remove()
        ray.shutdown()


class RayChild(StoppableChild):
    """A child node in a Ray actor, supervised as ``ChildProcess`` supervises a process."""
    killed_what = "its Ray actor"

    def __init__(self, node: Node, spec: NodeSpec, host: Any, run_ref: Any,
                 on_exit: Callable[[RayChild], None] | None) -> None:
        self.node = node
        self.spec = spec
        self.host = host
        self.pid = 0
        self.ip = ""
        self.address = ""                      # where its node receives (TCP), once ready
        self.returncode: int | None = None
        self.reason = ""                       # why the actor died (no exit code)
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._on_exit = on_exit
        self.liveness = Liveness()
        self._beats: Any = None               # the socket its heartbeats come to (beats_socket)
        self._beat_tasks: list[asyncio.Task[None]] = []
        self._watch = asyncio.get_running_loop().create_task(self._wait(run_ref), name=f"ray:{spec.name}")

    @property
    def name(self) -> str:
        return self.spec.name

    def describe_exit(self) -> str:
        where = f"Ray actor pid {self.pid} on {self.ip}" if self.pid else "Ray actor"
        if self.returncode is None:
            return f"process '{self.name}' ({where}) is running"
        if self.reason:
            return f"process '{self.name}' ({where}) died: {self.reason}"
        return f"process '{self.name}' ({where}) exited with code {self.returncode}"

    async def _wait(self, run_ref: Any) -> None:
        import ray
        try:
            code = int(await run_ref)
        except asyncio.CancelledError:
            raise
        except ray.exceptions.RayError as exc:
            code, self.reason = -1, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        self.returncode = code
        self._stop_heartbeat()
        ray.kill(self.host, no_restart=True)        # the actor outlives its node's main otherwise
        reason = self.describe_exit()
        self.node.peer_down(self.name, reason)
        if code != 0:
            system_actor(self.node).child_exited(self.name, self.pid, reason)
        self.exited.set_result(code)
        if self._on_exit is not None:
            self._on_exit(self)

    def kill(self) -> None:
        if self.returncode is None:
            import ray
            ray.kill(self.host, no_restart=True)

    # -- heartbeats: over ZeroMQ, as a process's come through its pipe ----------------------
    def start_heartbeat(self, sock: Any) -> None:
        """Watch the heartbeats arriving on ``sock`` from now on (it is ready): a child that
        neither turns its event loop nor uses CPU for the spec's ``hung_after_s`` is killed."""
        self._beats = sock
        self.liveness.restart()
        self._beat_tasks = [asyncio.get_running_loop().create_task(self._read_beats(), name=f"beats:{self.name}"),
                            asyncio.get_running_loop().create_task(self._check(), name=f"hung:{self.name}")]

    async def _read_beats(self) -> None:
        while True:
            self.liveness.beat(await self._beats.recv())

    async def _check(self) -> None:
        while self.returncode is None and not hung(self, self.liveness):
            await asyncio.sleep(self.spec.heartbeat_s)

    def _stop_heartbeat(self) -> None:
        for task in self._beat_tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._beat_tasks = []
        if self._beats is not None:
            self._beats.close(linger=0)
            self._beats = None


def beats_socket() -> tuple[Any, str]:
    """A socket receiving one child's heartbeats, bound on this machine's cluster IP; its address."""
    import ray
    import zmq
    import zmq.asyncio
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{ray.util.get_node_ip_address()}:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def start_ray_child(node: Node, spec: NodeSpec, host: Any, *, ready_timeout: float = 600.0,
                          on_exit: Callable[[RayChild], None] | None = None,
                          env: dict[str, str] | None = None) -> tuple[RayChild, NodeReady]:
    """Run child node ``spec`` in Ray actor ``host`` and wait until it is ready (connected to
    the address it reports). ``env``: set in the actor's process before the node starts, beside
    this process's ``TROUPE_*`` variables. Raises ChildStartError if it dies or times out first
    (the actor is then killed)."""
    import ray
    try:
        ip, pid = await host.where.remote()          # the actor is up (its node's main blocks it next)
    except ray.exceptions.RayError as exc:
        ray.kill(host, no_restart=True)
        raise ChildStartError(f"the Ray actor of process '{spec.name}' did not start: "
                              f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}") from None
    waiter = system_actor(node).expect_ready(spec.name)
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)} | (env or {})
    beats, address = beats_socket()
    spec = msgspec.structs.replace(spec, beats_to=address)
    child = RayChild(node, spec, host, host.run.remote(msgspec.msgpack.encode(spec), env), None)
    child.ip, child.pid = ip, pid
    try:
        ready = await wait_ready(child, waiter, ready_timeout)
    except BaseException:
        beats.close(linger=0)
        raise
    if child.returncode is None:
        child.start_heartbeat(beats)
    else:
        beats.close(linger=0)
    node.connect(spec.name, ready.address)
    child.address = ready.address
    system_actor(node).children.add(spec.name)
    child._on_exit = on_exit
    if child.exited.done():                  # died between its ready message and now
        raise ChildStartError(f"{child.describe_exit()} as it became ready")
    return child, ready
