"""Worker ranks on other machines: vLLM's multi-node tensor and pipeline parallelism with the mp
backend, without Ray.

    machine A (node rank 0):  troupe serve MODEL -tp 4 --nnodes 2 --node-rank 0 \\
                                  --master-addr A_IP --master-port 29501
    machine B (node rank 1):  troupe serve MODEL -tp 4 --nnodes 2 --node-rank 1 \\
                                  --master-addr A_IP --master-port 29501 --headless

An engine core's ranks (tensor-parallel ranks x pipeline stages) are split evenly over the
machines in rank order: node rank n runs ranks n L .. (n + 1) L - 1, L = ranks / nnodes. A runs
the server, the engine core and its own ranks; its engine core listens at --master-addr:
--master-port. B runs no server and no engine core: its ``ranks<N>-...`` node joins A's engine
core (``JoinRanks``, with the digest of B's configuration: one started with another model or other
engine flags is refused, naming both digests), then starts the worker processes A asks for
(``StartRanks``: a generation's ranks, each with its part of the model to load and the meeting
point of their process group, torch.distributed's, on A), supervises them as A supervises its own
(heartbeats, a hung one killed), and reports a death (``RankExited``). The engine core runs them
as its own ranks: every step goes to each rank at once, and one that dies, on either machine,
brings the whole group back (B is asked to stop its ranks, then to start the next generation's);
the requests in flight are recomputed, as with one machine.

B beats to A every second. A B silent for ``HOST_LOST_S`` (killed, or its machine gone) is down:
its ranks count as dead, and the engine core waits up to the worker's load timeout for a headless
server of that node rank to join again. A B whose engine core no longer knows it (A's engine core
was restarted) stops its ranks and joins again; one that hears nothing from A for
``FRONTEND_LOST_S``, or that A's shutdown tells, stops, as vLLM's headless nodes end with their
server.

The frames between the machines are the engine's own (msgspec over ZeroMQ, unencrypted and
unauthenticated, as vLLM's): run them on a network only the machines of the deployment reach. The
ranks' collectives are torch.distributed's (gloo on the CPU: ``GLOO_SOCKET_IFNAME`` names the
network interface where a machine has several)."""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, Callable, ClassVar

import msgspec

from actors import topology
from actors.engine.config import EngineConfig
from actors.runtime import Actor, Msg
from actors.runtime.errors import ActorDied, AskTimeout, ChildStartError
from actors.runtime.headless_node import BEAT_S, FLUSH_S, HOST_LOST_S, HeadlessBeat, HeadlessNode, Registered
from actors.runtime.process import ChildProcess, NodeSpec, start_child, system_actor
from actors.runtime.system import SYSTEM_ACTOR, Shutdown
from actors.runtime.ticker import Ticker
from actors.worker.actor import LOAD_TIMEOUT_S
from actors.worker.openmp import openmp_env

log = logging.getLogger("troupe.multinode")

STOP_TIMEOUT_S = 30.0         # for a machine to stop its ranks (each is killed after 10 s)


# -- frames between the machines ------------------------------------------------------------------
class JoinRanks(Msg):
    """Machine ``node_rank``'s ranks host ``host`` (receiving at ``host_address``, on ``ip``) joins,
    started with the configuration of digest ``config_hash``."""
    reply_type: ClassVar[Any] = Registered
    node_rank: int
    host: str
    host_address: str
    ip: str
    config_hash: str


class RankExited(Msg):
    """Rank ``rank`` of ``generation`` on ``host`` died (``reason``)."""
    generation: int
    rank: int
    reason: str
    host: str


class RankToStart(msgspec.Struct):
    rank: int
    node: str                  # its node's name
    config: bytes              # its LoadModel, in msgpack (the worker entry's payload)


class StartedRank(msgspec.Struct):
    rank: int
    node: str
    address: str               # where it receives
    pid: int
    info: bytes                # its ready message's payload (the config it resolved)


class StartedRanks(msgspec.Struct):
    ranks: list[StartedRank] = []
    error: str = ""            # why they did not all start ("": they did)


class StartRanks(Msg):
    """Start ``ranks`` as generation ``generation``, replying to engine node ``engine`` at
    ``engine_address``."""
    reply_type: ClassVar[Any] = StartedRanks
    generation: int
    ranks: list[RankToStart]
    engine: str
    engine_address: str
    trace: bool = True
    flight_dir: str = ""


class StopRanks(Msg):
    """Stop the ranks of ``generation`` and before."""
    reply_type: ClassVar[Any] = bool
    generation: int


class _CheckHosts(Msg):
    pass


# -- node rank 0: the engine core's side ----------------------------------------------------------
class RemoteRank:
    """The engine core's handle on a rank of another machine (as ``ChildProcess`` on its own)."""

    def __init__(self, hosts: RankHosts, host: str, ip: str, generation: int, started: StartedRank) -> None:
        self.hosts = hosts
        self.host = host
        self.ip = ip
        self.generation = generation
        self.rank = started.rank
        self.name = started.node
        self.pid = started.pid
        self.reason = ""                          # why it died ("": running)

    def describe_exit(self) -> str:
        where = f"process '{self.name}' (pid {self.pid} on {self.host})"
        return f"{where} {self.reason}" if self.reason else f"{where} is running"

    async def stop(self, timeout: float = 10.0) -> int:
        await self.hosts.stop_ranks(self.host, self.generation)
        return 0


class _Host(msgspec.Struct):
    name: str
    address: str
    ip: str
    last_beat: float


class RankHosts(Actor):
    """On the engine node of node rank 0: where the other machines' ranks hosts join, and the
    engine core's way to start and stop the ranks there."""
    protocol = JoinRanks | HeadlessBeat | RankExited | _CheckHosts

    def __init__(self, config: EngineConfig, on_exit: Callable[[RemoteRank], None]) -> None:
        p = config.parallel
        self.config_hash = p.nodes_digest or config.compute_hash()
        self.nnodes = p.nnodes
        self.address = f"tcp://{p.master_addr}:{p.master_port}"
        self.on_exit = on_exit
        self.hosts: dict[int, _Host] = {}                     # node rank -> the host serving it
        self.changed = asyncio.Event()                         # a host joined (the start waits for one)
        self.running: dict[str, list[RemoteRank]] = {}        # host -> its ranks of the current generation
        self._stopping: dict[tuple[str, int], asyncio.Future[None]] = {}
        self.ticker: Ticker | None = None

    async def started(self) -> None:
        self.ticker = Ticker(self.ctx.self_ref, _CheckHosts, BEAT_S)
        self.ticker.again()

    async def stopped(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()

    async def receive(self, msg: Any) -> Any:
        match msg:
            case JoinRanks():
                return self._join(msg)
            case HeadlessBeat(host=host, host_address=address):
                for entry in self.hosts.values():
                    if entry.name == host:
                        entry.last_beat = time.monotonic()
                        return Registered()
                self.ctx.node.connect(host, address)          # to answer it
                return Registered(f"the engine core at {self.address} does not know ranks host {host} (it "
                                  f"restarted, or heard nothing from it for {HOST_LOST_S:g} s)")
            case RankExited(generation=generation, rank=rank, reason=reason, host=host):
                for handle in self.running.get(host, []):
                    if handle.rank == rank and handle.generation == generation and not handle.reason:
                        self._rank_down(handle, reason)
            case _CheckHosts():
                self.ticker.again()
                now = time.monotonic()
                for node_rank, entry in list(self.hosts.items()):
                    if now - entry.last_beat > HOST_LOST_S:
                        self._host_lost(node_rank, f"ranks host {entry.name} (node rank {node_rank}) sent no "
                                                   f"heartbeat for {now - entry.last_beat:.0f} s")
        return None

    def _join(self, msg: JoinRanks) -> Registered:
        node = self.ctx.node
        node.connect(msg.host, msg.host_address)             # to answer it, whatever the answer
        if not 1 <= msg.node_rank < self.nnodes:
            return Registered(f"this engine core runs on {self.nnodes} machines, node ranks 0 to {self.nnodes - 1} "
                              f"(0 its own), not {msg.node_rank}: check --nnodes and --node-rank")
        if msg.config_hash != self.config_hash:
            return Registered(f"node rank {msg.node_rank} was started with another configuration than this server "
                              f"(config digest {msg.config_hash[:12]}, the server's {self.config_hash[:12]}): start "
                              "it with the same model and engine flags")
        current = self.hosts.get(msg.node_rank)
        if current is not None and current.name == msg.host:
            return Registered()                                  # a retried join that arrived twice
        if current is not None and time.monotonic() - current.last_beat <= HOST_LOST_S:
            return Registered(f"node rank {msg.node_rank} already runs on ranks host {current.name}", retry=True)
        if current is not None:
            self._host_lost(msg.node_rank, f"ranks host {current.name} was replaced by {msg.host}")
        self.hosts[msg.node_rank] = _Host(msg.host, msg.host_address, msg.ip, time.monotonic())
        self.changed.set()
        log.info("node rank %d joined: ranks host %s (%s)", msg.node_rank, msg.host, msg.host_address)
        return Registered()

    def _host_lost(self, node_rank: int, reason: str) -> None:
        entry = self.hosts.pop(node_rank)
        log.error("%s: its ranks are down until one joins again", reason)
        self.ctx.node.peer_down(entry.name, reason)
        for handle in self.running.pop(entry.name, []):
            if not handle.reason:
                self._rank_down(handle, f"was lost with its machine ({reason})")

    def _rank_down(self, handle: RemoteRank, reason: str) -> None:
        handle.reason = reason
        self.ctx.node.peer_down(handle.name, handle.describe_exit())    # its pending steps fail now
        system_actor(self.ctx.node).child_exited(handle.name, handle.pid, handle.describe_exit())
        self.on_exit(handle)

    async def host(self, node_rank: int, timeout: float) -> _Host:
        """The ranks host of ``node_rank``, once one has joined."""
        deadline = time.monotonic() + timeout
        while node_rank not in self.hosts:
            self.changed.clear()
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self.changed.wait(), max(left, 0.0))
            except TimeoutError:
                raise ChildStartError(
                    f"node rank {node_rank} did not join within {timeout:g} s: start it on its machine with "
                    f"`troupe serve MODEL --headless --nnodes {self.nnodes} --node-rank {node_rank} --master-addr "
                    f"HOST --master-port PORT` and this server's engine flags (this engine core listens at "
                    f"{self.address})") from None
        return self.hosts[node_rank]

    async def start_ranks(self, node_rank: int, generation: int, ranks: list[RankToStart], engine_address: str,
                          trace: bool, flight_dir: str) -> list[tuple[RemoteRank, StartedRank]]:
        """Machine ``node_rank``'s ranks of ``generation``, started there and ready."""
        entry = await self.host(node_rank, LOAD_TIMEOUT_S)
        node = self.ctx.node
        msg = StartRanks(generation, ranks, node.name, engine_address, trace, flight_dir)
        try:
            answer = await node.ref(topology.RANK_HOST, entry.name).ask(msg, timeout=LOAD_TIMEOUT_S + 60.0)
        except (AskTimeout, ActorDied) as exc:
            raise ChildStartError(f"node rank {node_rank} (ranks host {entry.name}) did not start its ranks: "
                                  f"{exc}") from None
        if answer.error:
            raise ChildStartError(f"node rank {node_rank} (ranks host {entry.name}): {answer.error}")
        handles = []
        for started in answer.ranks:
            node.connect(started.node, started.address)
            handles.append((RemoteRank(self, entry.name, entry.ip, generation, started), started))
        self.running[entry.name] = [h for h, _ in handles]
        system_actor(node).children.update(h.name for h, _ in handles)      # their telemetry, and flight records
        return handles

    async def stop_ranks(self, host: str, generation: int) -> None:
        """Ask ``host`` to stop its ranks of ``generation`` (once, whichever handle asks)."""
        key = (host, generation)
        if key not in self._stopping:
            self._stopping[key] = asyncio.ensure_future(self._stop(host, generation))
        await asyncio.shield(self._stopping[key])

    async def _stop(self, host: str, generation: int) -> None:
        node = self.ctx.node
        for handle in self.running.get(host, []):
            if handle.generation <= generation:
                handle.reason = handle.reason or "was stopped"
                system_actor(node).children.discard(handle.name)
        if host not in {e.name for e in self.hosts.values()}:
            return                                        # lost: its ranks went with it
        try:
            await node.ref(topology.RANK_HOST, host).ask(StopRanks(generation), timeout=STOP_TIMEOUT_S)
        except (AskTimeout, ActorDied) as exc:
            log.warning("ranks host %s did not confirm stopping its ranks: %s", host, exc)

    async def shut_down_hosts(self) -> None:
        """The engine core stops: so do the other machines' ranks hosts (their ranks with them)."""
        for entry in self.hosts.values():
            try:
                self.ctx.node.ref(SYSTEM_ACTOR, entry.name).tell(Shutdown(reason="the server stopped"))
            except ActorDied:
                pass
        if self.hosts:
            await asyncio.sleep(FLUSH_S)     # on their way before this node's sockets close


def describe_ranks(ranks: range) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def free_port(address: str) -> int:
    """A port free now at ``address`` (the ranks' process group meets there)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# -- node ranks past 0: the ranks host ------------------------------------------------------------
class RankHost(Actor):
    """On a ranks host's node: starts and stops this machine's ranks as the engine core asks."""
    protocol = StartRanks | StopRanks

    def __init__(self, server: RankHostServer) -> None:
        self.server = server

    async def receive(self, msg: Any) -> Any:
        match msg:
            case StartRanks():
                return await self.server.start_ranks(msg)
            case StopRanks(generation=generation):
                await self.server.stop_ranks(generation)
                return True
        return None


class RankHostServer(HeadlessNode):
    """A machine of node rank past 0: joins the engine core of node rank 0 and runs its ranks here."""

    def __init__(self, config: EngineConfig, ready_timeout: float) -> None:
        p = config.parallel
        super().__init__(f"ranks{p.node_rank}", p.master_addr, p.master_port, ("--master-addr", "--master-port"),
                         topology.ENGINE_NODE, topology.RANK_HOSTS, "the engine core", ready_timeout)
        self.config = config
        self.node_rank = p.node_rank
        self.joining = JoinRanks(p.node_rank, self.host, self.host_address, self.ip, config.compute_hash())
        self.ranks: dict[int, tuple[int, ChildProcess]] = {}    # rank -> (generation, its process)
        self.stopping = False

    async def run(self) -> int:
        """Join, run the ranks asked for, beat until told to stop; the exit code."""
        self.stop_on_signals()
        self.node.spawn(topology.RANK_HOST, lambda: RankHost(self))
        try:
            joining = asyncio.ensure_future(self.join(self.joining, f"node rank {self.node_rank}"))
            await asyncio.wait([joining, self.node.closed], return_when=asyncio.FIRST_COMPLETED)
            if not joining.done():
                joining.cancel()
                return self.node.closed.result()
            joining.result()
            print(f"Troupe headless: node rank {self.node_rank} (worker ranks "
                  f"{describe_ranks(self.config.parallel.node_ranks(self.node_rank))}) joined the engine core at "
                  f"{self.remote}", flush=True)
            beating = asyncio.ensure_future(self.beat("its ranks", self._join_again))
            try:
                return await self.node.closed
            finally:
                beating.cancel()
        finally:
            self.stopping = True
            await self.stop_ranks(None)
            await self.close()

    async def _join_again(self, error: str) -> bool:
        """The engine core no longer knows this machine (it was restarted): its ranks are of no use;
        join the new one."""
        log.warning("%s: stopping this machine's ranks and joining again", error)
        await self.stop_ranks(None)
        try:
            await self.join(self.joining, f"node rank {self.node_rank}")
        except Exception as exc:
            self.node.fatal(str(exc))
            return False
        return True

    async def start_ranks(self, msg: StartRanks) -> StartedRanks:
        mine = set(self.config.parallel.node_ranks(self.node_rank))
        if {r.rank for r in msg.ranks} != mine:
            return StartedRanks(error=f"this machine (node rank {self.node_rank}) runs worker ranks "
                                      f"{sorted(mine)}, not {sorted(r.rank for r in msg.ranks)}")
        await self.stop_ranks(None)               # what is left of an earlier generation
        self.node.connect(msg.engine, msg.engine_address)
        started = await asyncio.gather(*(self._start(msg, r) for r in msg.ranks), return_exceptions=True)
        failed = [x for x in started if isinstance(x, BaseException)]
        if failed:
            await self.stop_ranks(None)
            return StartedRanks(error=f"{type(failed[0]).__name__}: {failed[0]}")
        log.info("worker ranks %s of generation %d started (pids %s)", describe_ranks(range(min(mine), max(mine) + 1)),
                 msg.generation,
                 ", ".join(str(s.pid) for s in started))
        return StartedRanks(list(started))

    async def _start(self, msg: StartRanks, rank: RankToStart) -> StartedRank:
        spec = NodeSpec(rank.node, "actors.worker.actor:worker_entry", rank.config, self.ipc_dir, self.host,
                        {self.host: self.node.transport.ipc_address, msg.engine: msg.engine_address},
                        trace=msg.trace, flight_dir=msg.flight_dir, bind=f"tcp://{self.ip}:*")
        generation = msg.generation
        child, ready = await start_child(self.node, spec, ready_timeout=LOAD_TIMEOUT_S,
                                         on_exit=lambda c: self._exited(c, rank.rank, generation), env=openmp_env())
        self.ranks[rank.rank] = (generation, child)
        return StartedRank(rank.rank, rank.node, ready.address, child.pid, ready.info)

    def _exited(self, child: ChildProcess, rank: int, generation: int) -> None:
        current = self.ranks.get(rank)
        if current is None or current[1] is not child:
            return                           # stopped on purpose, or died starting (its start reports it)
        del self.ranks[rank]
        if self.stopping or self.node.closed.done():
            return
        reason = child.describe_exit()
        log.error("worker rank %d died (%s)", rank, reason)
        self.coordinator.tell(RankExited(generation, rank, reason.split(") ", 1)[-1], self.host))

    async def stop_ranks(self, generation: int | None) -> None:
        """Stop the ranks of ``generation`` and before (None: all)."""
        stopping = [(r, child) for r, (g, child) in self.ranks.items() if generation is None or g <= generation]
        for r, _ in stopping:
            del self.ranks[r]
        await asyncio.gather(*(child.stop() for _, child in stopping))


async def run_rank_host(config: EngineConfig, ready_timeout: float) -> int:
    """``troupe serve --headless --nnodes N --node-rank R``: this machine's worker ranks of an
    engine core running elsewhere."""
    return await RankHostServer(config, ready_timeout).run()
