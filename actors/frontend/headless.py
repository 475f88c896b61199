"""Engine cores on other machines: vLLM's multi-node data parallelism with the mp backend.

    machine A (the server):  troupe serve MODEL --data-parallel-size 4 --data-parallel-size-local 2 \\
                                 --data-parallel-address A_IP --data-parallel-rpc-port 13345
    machine B (headless):    troupe serve MODEL --headless --data-parallel-size 4 \\
                                 --data-parallel-size-local 2 --data-parallel-start-rank 2 \\
                                 --data-parallel-address A_IP --data-parallel-rpc-port 13345

A's frontend starts ranks 0-1 itself and listens at A_IP:13345 for the others; it serves once every
rank has joined, whichever machine started first. B runs no HTTP server: a ``headless<RANK>-...`` node
starts its engine cores (ranks 2-3) as child processes, supervises them as the frontend supervises
its own (heartbeats, a hung one killed, a dead one restarted within the restart budget), and
registers each with A's ``dp_coordinator`` (``RegisterEngine``) once it is ready. Each engine core
receives on ``tcp://B_IP:PORT`` and sends its outputs to A; the frontend's router treats it as any
other rank. The registration carries the digest of B's configuration (``compute_hash``), and A
refuses an engine core started with another model or other flags, naming both digests.

Faults: an engine core that dies on B fails its own requests on A (``RemoteEngineLost``) and joins
again once B restarted it. B beats to A every second; a B that stops beating for ``HOST_LOST_S``
(killed, or its machine gone) is down, its ranks' requests fail and the other ranks keep serving,
until a headless server runs those ranks again. A that stops answering B for ``FRONTEND_LOST_S``,
or stops (its shutdown tells B), stops B too, as vLLM's headless engines end with their server.

The frames between the machines are the engine's own (msgspec over ZeroMQ, unencrypted and
unauthenticated, as vLLM's): run them on a network only the machines of the deployment reach."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from actors import topology
from actors.engine.config import EngineConfig
from actors.runtime import Actor, Msg, Node
from actors.runtime.errors import ActorDied
from actors.runtime.process import ChildProcess, RestartBudget, start_child
from actors.runtime.headless_node import BEAT_S, FLUSH_S, HOST_LOST_S, HeadlessBeat, HeadlessNode, Registered
from actors.runtime.system import SYSTEM_ACTOR, Shutdown
from actors.runtime.ticker import Ticker

if TYPE_CHECKING:
    from actors.frontend.launch import Frontend, _Engine

log = logging.getLogger("troupe.headless")


class RegisterEngine(Msg):
    """A headless server's engine core ``rank`` is ready at ``address`` (its resolved config in
    msgpack, the digest of the config it was started with)."""
    reply_type: ClassVar[Any] = Registered
    rank: int
    node: str
    address: str
    pid: int
    config: bytes
    config_hash: str
    host: str                  # the headless server's node, and where it receives
    host_address: str


class RemoteEngineLost(Msg):
    """A headless server's engine core ``rank`` died (``reason``); the server restarts it."""
    rank: int
    reason: str
    host: str


class _CheckHosts(Msg):
    pass


class RemoteEngineHandle:
    """The frontend's handle on an engine core of a headless machine (as on its own processes)."""

    def __init__(self, node: Node, name: str, pid: int, host: str, address: str = "") -> None:
        self.node = node
        self.name = name
        self.pid = pid
        self.host = host
        self.address = address          # where its node receives (TCP)

    async def stop(self, timeout: float = 10.0) -> int:
        """Its headless server stops with the frontend (told once by ``RemoteEngines.stop_hosts``)."""
        return 0


class RemoteEngines(Actor):
    """The frontend's ``dp_coordinator``: where the headless machines' engine cores join."""
    protocol = RegisterEngine | RemoteEngineLost | HeadlessBeat | _CheckHosts

    def __init__(self, fe: Frontend, config: EngineConfig) -> None:
        self.fe = fe
        self.ranks = config.parallel.remote_ranks
        self.config_hash = config.compute_hash()
        self.address = fe.cluster_address
        loop = asyncio.get_running_loop()
        self.joined: dict[int, asyncio.Future[_Engine]] = {r: loop.create_future() for r in self.ranks}
        self.engines: dict[int, tuple[str, str, int]] = {}     # rank -> (host, address, pid) serving it
        self.beats: dict[str, float] = {}                      # headless server -> its last beat
        self.hosts: dict[str, str] = {}                        # headless server -> where it receives
        self.ticker: Ticker | None = None

    async def started(self) -> None:
        self.ticker = Ticker(self.ctx.self_ref, _CheckHosts, BEAT_S)
        self.ticker.again()

    async def stopped(self) -> None:
        if self.ticker is not None:
            self.ticker.cancel()

    async def engine(self, rank: int, timeout: float) -> _Engine:
        """Engine core ``rank`` once a headless server has registered it."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.joined[rank]), timeout)
        except TimeoutError:
            raise TimeoutError(f"engine core {rank} did not join within {timeout:g} s: start it on another machine "
                               f"with `troupe serve MODEL --headless --data-parallel-start-rank {rank} "
                               f"--data-parallel-address HOST --data-parallel-rpc-port PORT` (this server "
                               f"listens at {self.address})") from None

    async def stop_hosts(self) -> None:
        """The frontend stops: so do the headless servers (their engine cores with them)."""
        for host in self.hosts:
            try:
                self.ctx.node.ref(SYSTEM_ACTOR, host).tell(Shutdown(reason="the server stopped"))
            except ActorDied:
                pass
        if self.hosts:
            await asyncio.sleep(FLUSH_S)     # on their way before this node's sockets close

    async def receive(self, msg: Any) -> Any:
        match msg:
            case RegisterEngine():
                return self._register(msg)
            case RemoteEngineLost(rank=rank, reason=reason, host=host):
                if self.engines.get(rank, ("",))[0] == host:
                    del self.engines[rank]
                    self.fe.remote_engine_down(rank, f"on headless server {host}: {reason}")
            case HeadlessBeat(host=host, host_address=address):
                if host not in self.hosts:
                    self.ctx.node.connect(host, address)      # to answer it
                    return Registered(f"the server at {self.address} no longer counts on headless server {host} "
                                      "(it restarted, or heard no heartbeat from it for "
                                      f"{HOST_LOST_S:g} s): start this headless server again")
                self.beats[host] = time.monotonic()
                return Registered()
            case _CheckHosts():
                self.ticker.again()
                now = time.monotonic()
                for host, last in list(self.beats.items()):
                    if now - last > HOST_LOST_S:
                        self._host_lost(host, f"headless server {host} sent no heartbeat for {now - last:.0f} s")
        return None

    def _register(self, msg: RegisterEngine) -> Registered:
        node = self.ctx.node
        if msg.host not in self.hosts:
            node.connect(msg.host, msg.host_address)         # to answer it, whatever the answer
        if msg.rank not in self.ranks:
            return Registered(f"this server waits for engine cores {_ranks(self.ranks)} from headless machines, "
                              f"not {msg.rank}: check --data-parallel-start-rank and --data-parallel-size-local")
        if msg.config_hash != self.config_hash:
            return Registered(f"engine core {msg.rank} was started with another configuration than this server "
                              f"(config digest {msg.config_hash[:12]}, the server's {self.config_hash[:12]}): start "
                              "the headless server with the same model and engine flags")
        current = self.engines.get(msg.rank)
        if current == (msg.host, msg.address, msg.pid):
            return Registered()                  # a retried registration that arrived twice
        if current is not None and current[0] != msg.host and current[0] in self.beats:
            return Registered(f"engine core {msg.rank} already runs on headless server {current[0]}", retry=True)
        self.hosts[msg.host] = msg.host_address
        self.beats[msg.host] = time.monotonic()
        if current is not None:                  # its server restarted it before saying so
            self.fe.remote_engine_down(msg.rank, f"engine core {msg.rank} was replaced on {msg.host}")
        self.engines[msg.rank] = (msg.host, msg.address, msg.pid)
        node.connect(msg.node, msg.address)
        handle = RemoteEngineHandle(node, msg.node, msg.pid, msg.host, msg.address)
        self.fe.remote_engine_up(msg.rank, handle)
        joined = self.joined[msg.rank]
        if not joined.done():
            from actors.frontend.launch import engine_refs
            joined.set_result(engine_refs(node, msg.node, msgspec.msgpack.decode(msg.config, type=EngineConfig)))
        log.info("engine core %d joined from headless server %s (pid %d, %s)", msg.rank, msg.host, msg.pid,
                 msg.address)
        return Registered()

    def _host_lost(self, host: str, reason: str) -> None:
        log.error("%s: its engine cores are down until it runs them again", reason)
        self.beats.pop(host, None)
        self.hosts.pop(host, None)
        self.ctx.node.peer_down(host, reason)
        for rank, (h, _, _) in list(self.engines.items()):
            if h == host:
                del self.engines[rank]
                self.fe.remote_engine_down(rank, reason)


def _ranks(ranks: list[int] | range) -> str:
    ranks = list(ranks)
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


class HeadlessServer(HeadlessNode):
    """A headless machine's side: its engine cores, supervised and registered with the frontend."""

    def __init__(self, config: EngineConfig, ready_timeout: float) -> None:
        p = config.parallel
        super().__init__(f"headless{p.data_parallel_start_rank}", p.data_parallel_address, p.data_parallel_rpc_port,
                         ("--data-parallel-address", "--data-parallel-rpc-port"), topology.FRONTEND_NODE,
                         topology.DP_COORDINATOR, "the server", ready_timeout)
        self.config = config
        self.config_hash = config.compute_hash()
        self.engines: dict[int, ChildProcess] = {}
        self.restarts = RestartBudget(p.max_restarts * len(p.local_ranks), p.restart_window_s)
        self.stopping = False
        self.registered = asyncio.Event()

    async def run(self) -> int:
        """Start the engine cores, register them, beat until told to stop; the exit code."""
        self.stop_on_signals()
        beating = asyncio.ensure_future(self._beat())
        try:
            starting = asyncio.gather(*(self._start(rank) for rank in self.config.parallel.local_ranks))
            await asyncio.wait([starting, self.node.closed], return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                return self.node.closed.result()
            starting.result()
            ranks = _ranks(self.config.parallel.local_ranks)
            print(f"Troupe headless: engine core{'s' if len(self.engines) > 1 else ''} {ranks} joined the server "
                  f"at {self.remote}", flush=True)
            return await self.node.closed
        finally:
            beating.cancel()
            self.stopping = True
            await asyncio.gather(*(e.stop() for e in self.engines.values()))
            await self.close()

    async def _start(self, rank: int) -> None:
        from actors.frontend.launch import engine_spec
        spec = engine_spec(self.config, rank, self.ipc_dir, self.host,
                           {self.host: self.node.transport.ipc_address, topology.FRONTEND_NODE: self.remote},
                           own_ipc_dir=True, bind=f"tcp://{self.ip}:*")
        child, ready = await start_child(self.node, spec, ready_timeout=self.ready_timeout,
                                         on_exit=lambda c: self._exited(c, rank))
        self.engines[rank] = child
        await self.join(RegisterEngine(rank, spec.name, ready.address, child.pid, ready.info, self.config_hash,
                                       self.host, self.host_address), f"engine core {rank}")
        self.registered.set()

    async def _beat(self) -> None:
        """Beat from the first registration on (the frontend counts this machine's silence from
        then), and stop when the frontend is lost or no longer knows this machine."""
        await self.registered.wait()

        async def refused(error: str) -> bool:
            self.node.fatal(error)
            return False
        await self.beat("its engine cores", refused)

    def _exited(self, child: ChildProcess, rank: int) -> None:
        if self.stopping or self.node.closed.done() or rank not in self.engines:
            return                              # stopping, or died while starting (its start reports it)
        reason = child.describe_exit()
        log.error("engine core %d died (%s)", rank, reason)
        self.coordinator.tell(RemoteEngineLost(rank, reason, self.host))
        del self.engines[rank]
        if not self.restarts.spend():
            self.node.fatal(f"engine cores died {self.restarts.describe()}; giving up")
            return
        asyncio.get_running_loop().create_task(self._restart(rank))

    async def _restart(self, rank: int) -> None:
        try:
            await self._start(rank)
        except Exception as exc:
            self.node.fatal(f"could not restart engine core {rank}: {exc}")
            return
        log.info("engine core %d restarted (pid %d) and joined again", rank, self.engines[rank].pid)


async def run_headless(config: EngineConfig, ready_timeout: float) -> int:
    """``troupe serve --headless``: this machine's engine cores of a server running elsewhere."""
    from actors.frontend.launch import with_reasoning_resolved
    if config.model.reasoning is not None:     # its token ids, as the server resolves them
        from actors.tokenizer.gguf_tokenizer import TextTokenizer
        tokenizer = (None if config.model.skip_tokenizer_init
                     else TextTokenizer.from_source(config.model.tokenizer.kind, config.model.tokenizer.path))
        config = with_reasoning_resolved(config, tokenizer)
    return await HeadlessServer(config, ready_timeout).run()
