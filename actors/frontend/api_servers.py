"""Several API servers (vLLM's ``--api-server-count N``): N processes accept HTTP connections on
one listening socket, so the HTTP work, the tokenizing and the detokenizing of a busy server run
on N event loops.

The frontend node (the process ``troupe serve`` runs) is API server 0: it starts the engine cores,
then API servers 1 .. N-1 as its child nodes ("api1", ...). Each is handed the listening sockets
(inherited file descriptors, as vLLM hands its API servers theirs), the resolved config and the
server's command line, and builds its own tokenizer, detokenizer (with data parallelism its own
router) and EngineClient (``client_actors``) and HTTP server. Its requests carry its index
(``client_index``), and each engine core sends their outputs to its detokenizer: API server 0
connects every engine core to it (``ConnectClient``) before it accepts a connection (``Serve``).

What the API servers share goes through API server 0's ``ApiPeer``:
  - /metrics, on any of them: the engine cores' metrics (each API server receives them all) with
    every API server's request counters and histograms added up;
  - LoRA adapters loaded or unloaded at run time: applied by API server 0 (one numbering of
    adapter ids), whose registry then goes to every API server;
  - stored Responses (``store``): kept by API server 0, read and deleted from any.
An engine core that dies or comes back is told to every API server (``EngineState``); an API
server that dies has its requests aborted in the engine cores (``ClientGone``) and is started
again, within the restart budget. A drain (SIGTERM) drains every API server.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from aiohttp import web

from actors import topology
from actors.engine.config import EngineConfig
from actors.engine.lora import LoRARequest
from actors.frontend.dp_router import EngineDown, EngineUp
from actors.frontend.errors import ApiError
from actors.frontend.launch import (READY_TIMEOUT_S, RESTART_RETRY_AFTER_S, client_actors, engine_refs,
                                    engine_sample, load_tokenizer)
from actors.frontend.lora import apply_lora_change
from actors.frontend.responses import Stored
from actors.frontend.stats import RequestStats
from actors.frontend.telemetry import Telemetry, TelemetryActor, TelemetryWindow
from actors.runtime import Actor, ActorDied, AskTimeout, Msg, Node, RemoteError
from actors.runtime.process import ChildProcess, NodeSpec, RestartBudget, decode_info, start_child
from actors.scheduler.actor import ClientGone, ConnectClient
from transport.zmq_channel import endpoint

if TYPE_CHECKING:
    import ssl

    from actors.frontend.app import OpenAIServer
    from actors.frontend.launch import Frontend
    from actors.frontend.tls import TlsFiles

log = logging.getLogger("troupe.api_servers")

ASK_TIMEOUT_S = 30.0
STATS_TIMEOUT_S = 5.0         # an API server that does not answer in time is left out of /metrics


class ApiServerReady(msgspec.Struct):
    """An API server's start: where engine cores on other machines reach it ("": none to)."""
    tcp_address: str = ""


class ApiServerSpec(msgspec.Struct):
    """What API server ``index`` starts from (its node's entry payload)."""
    index: int
    argv: list[str]                    # the server's command line, parsed there again
    config: EngineConfig               # resolved by the engine cores
    fds: list[int]                     # the listening sockets, inherited under these numbers (--uds)
    engines: dict[int, str]            # served data-parallel rank -> its engine node
    host: str = ""                     # else the host and port to listen on too, with SO_REUSEPORT
    port: int = 0
    tcp_host: str = ""                 # where engine cores of other machines reach it ("": none)


# -- API server 0 -> the others ----------------------------------------------------------------
class ControlState(Msg):
    """Generation is paused (``pause_mode``; None: not) and the engine asleep (``sleep_level``;
    None: awake), as set through an API server's /pause, /resume, /sleep or /wake_up."""
    pause_mode: str | None
    sleep_level: int | None


class Serve(Msg):
    """The engine cores send your outputs to you now: accept connections. ``loras``: the adapters
    served; ``down``: the engine cores being restarted; ``control``: the pause and sleep state."""
    reply_type: ClassVar[Any] = bool
    loras: list[LoRARequest]
    down: list[int]
    control: ControlState


class EngineState(Msg):
    """Engine core ``dp_rank`` is down (``reason``), or up again as node ``node`` at ``address``."""
    lane: ClassVar[str] = "system"
    dp_rank: int
    up: bool
    reason: str = ""
    node: str = ""
    address: str = ""


class GetRequestStats(Msg):
    reply_type: ClassVar[Any] = RequestStats


class LoRARegistry(Msg):
    """The adapters served now (after a load or an unload on any API server)."""
    loras: list[LoRARequest]


class AbortOpen(Msg):
    """Abort the open requests named by ``request_ids`` (None: all), on every API server but
    ``exclude``; replies with how many were aborted."""
    reply_type: ClassVar[Any] = int
    request_ids: list[str] | None
    exclude: int = -1


class DrainServer(Msg):
    """Take no new request; let the running ones finish for up to ``timeout`` seconds (then fail
    them); replies with how many did not finish."""
    reply_type: ClassVar[Any] = int
    reason: str
    timeout: float


# -- the others -> API server 0 ----------------------------------------------------------------
class OthersRequestStats(Msg):
    """Every API server's request stats but API server ``exclude``'s."""
    reply_type: ClassVar[Any] = list[RequestStats]
    exclude: int


class LoRAAnswer(msgspec.Struct):
    """API server 0's HTTP answer to a ChangeLoRA, and the adapters served after it."""
    status: int
    body: bytes
    content_type: str
    loras: list[LoRARequest]


class ChangeLoRA(Msg):
    """A /v1/load_lora_adapter (``load``) or /v1/unload_lora_adapter body, applied by API server 0."""
    reply_type: ClassVar[Any] = LoRAAnswer
    load: bool
    body: bytes


class KeepResponse(Msg):
    response_id: str
    stored: Stored


class FetchResponse(Msg):
    reply_type: ClassVar[Any] = Stored | None
    response_id: str


class ForgetResponse(Msg):
    reply_type: ClassVar[Any] = bool
    response_id: str


ApiPeerProtocol = (Serve | ControlState | EngineState | GetRequestStats | LoRARegistry | AbortOpen | DrainServer | OthersRequestStats
                   | ChangeLoRA | KeepResponse | FetchResponse | ForgetResponse)


class SharedState:
    """An API server's side of what the API servers share (``OpenAIServer.shared``)."""

    def __init__(self, node: Node, index: int, hub: ApiServers | None = None) -> None:
        self.node = node
        self.index = index
        self.hub = hub                                 # on API server 0
        self.root = node.ref(topology.API_PEER, topology.FRONTEND_NODE) if index else None

    @property
    def remote(self) -> bool:
        """Whether the shared state is another process's (API server 0's)."""
        return self.root is not None

    async def others_request_stats(self) -> list[RequestStats]:
        if self.root is not None:
            try:
                return await self.root.ask(OthersRequestStats(self.index), timeout=STATS_TIMEOUT_S * 2)
            except (ActorDied, AskTimeout, RemoteError) as exc:
                log.warning("/metrics: the other API servers' request stats are missing (%s)", exc)
                return []
        return await self.hub.request_stats(exclude=0)

    async def change_lora(self, load: bool, body: bytes, server: OpenAIServer) -> web.Response:
        answer: LoRAAnswer = await self.root.ask(ChangeLoRA(load, body), timeout=ASK_TIMEOUT_S)
        set_loras(server, answer.loras)
        return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)

    async def lora_changed(self, server: OpenAIServer) -> None:
        """On API server 0: the registry changed; every API server serves the new one (once it
        returns)."""
        if self.hub is not None:
            await self.hub.ask_all(LoRARegistry(list(server.engine().lora_requests.values())))

    async def control_state(self, pause_mode: str | None, sleep_level: int | None) -> None:
        """This API server's pause or sleep state changed: every API server has taken it once
        this returns."""
        msg = ControlState(pause_mode, sleep_level)
        if self.hub is not None:
            await self.hub.ask_all(msg)
            return
        try:
            await self.root.ask(msg, timeout=ASK_TIMEOUT_S * 2)
        except (ActorDied, AskTimeout, RemoteError) as exc:
            log.warning("the other API servers did not learn the pause or sleep state: %s", exc)

    async def abort_open(self, ids: list[str] | None) -> int:
        """The other API servers' open requests named by ``ids`` (None: all) aborted; how many."""
        if self.hub is not None:
            return await self.hub.abort_open(ids, exclude=0)
        try:
            return await self.root.ask(AbortOpen(ids, self.index), timeout=ASK_TIMEOUT_S * 2)
        except (ActorDied, AskTimeout, RemoteError) as exc:
            log.warning("the other API servers' requests were not aborted: %s", exc)
            return 0

    async def keep_response(self, rid: str, stored: Stored) -> None:
        try:
            await self.root.ask(KeepResponse(rid, stored), timeout=ASK_TIMEOUT_S)
        except (ActorDied, AskTimeout, RemoteError) as exc:
            log.warning("response %s not stored: %s", rid, exc)

    async def fetch_response(self, rid: str) -> Stored | None:
        return await self.root.ask(FetchResponse(rid), timeout=ASK_TIMEOUT_S)

    async def forget_response(self, rid: str) -> bool:
        return await self.root.ask(ForgetResponse(rid), timeout=ASK_TIMEOUT_S)


def set_loras(server: OpenAIServer, loras: list[LoRARequest]) -> None:
    server.engine().lora_requests = {r.lora_name: r for r in loras}


def set_control(server: OpenAIServer, state: ControlState) -> None:
    client = server.engine()
    client.pause_mode = state.pause_mode
    client.sleep_level = client.stats.sleep_level = state.sleep_level


class ApiPeer(Actor):
    """What an API server's node answers about it to the others (see the module docstring)."""
    protocol = ApiPeerProtocol
    concurrent = True              # a drain waits; engine news and stats go on meanwhile

    def __init__(self, server: OpenAIServer, hub: ApiServers | None = None, start_http: Any = None,
                 engines: dict[int, str] | None = None) -> None:
        """``hub``: API server 0's record of the others; ``start_http``: on another API server,
        what starts its HTTP server (on ``Serve``); ``engines``: there, its engine nodes by rank."""
        self.server = server
        self.hub = hub
        self.start_http = start_http
        self.engines = engines or {}
        self.down: set[int] = set()

    async def receive(self, msg: ApiPeerProtocol) -> Any:
        server = self.server
        match msg:
            case Serve(loras=loras, down=down, control=control):
                set_loras(server, loras)
                set_control(server, control)
                for rank in down:
                    self._engine_down(rank, "the engine core is being restarted")
                await self.start_http()
                return True
            case ControlState():
                set_control(server, msg)
                if self.hub is not None:                # from another API server: to the rest too
                    await self.hub.ask_all(msg)
            case EngineState(dp_rank=rank, up=False, reason=reason):
                self._engine_down(rank, reason)
            case EngineState(dp_rank=rank, node=name, address=address):
                self.ctx.node.connect(name, address)
                self.down.discard(rank)
                client = server.engine()
                if len(self.engines) > 1:
                    client.engine.tell(EngineUp(rank))
                client.mark_alive()
            case GetRequestStats():
                client = server.engine()
                return client.stats.request_stats(client.num_open)
            case LoRARegistry(loras=loras):
                set_loras(server, loras)
            case AbortOpen(request_ids=ids, exclude=exclude):
                if self.hub is None:                    # API server 0 asks each of the others
                    return server.abort_here(ids)
                return server.abort_here(ids) + await self.hub.abort_open(ids, exclude)
            case DrainServer(reason=reason, timeout=timeout):
                return await drain_client(server.engine(), reason, timeout)
            case OthersRequestStats(exclude=exclude):
                return await self.hub.request_stats(exclude)
            case ChangeLoRA(load=load, body=body):
                try:
                    response = apply_lora_change(server.engine(), load, body)
                except ApiError as exc:
                    response = exc.response
                loras = list(server.engine().lora_requests.values())
                if response.status == 200:
                    await self.hub.ask_all(LoRARegistry(loras))
                return LoRAAnswer(response.status, bytes(response.body), response.content_type, loras)
            case KeepResponse(response_id=rid, stored=stored):
                server.responses.put(rid, stored)
            case FetchResponse(response_id=rid):
                return server.responses.get(rid)
            case ForgetResponse(response_id=rid):
                return server.responses.delete(rid)

    def _engine_down(self, rank: int, reason: str) -> None:
        client = self.server.engine()
        name = self.engines.get(rank)
        if name is not None:
            self.ctx.node.peer_down(name, reason)
        self.down.add(rank)
        client.stats.engine_down(rank)
        if len(self.engines) <= 1:
            client.mark_dead(reason, RESTART_RETRY_AFTER_S)
            return
        client.engine.tell(EngineDown(rank, reason))
        if len(self.down) == len(self.engines):
            client.mark_dead(f"every engine core is down ({reason})", RESTART_RETRY_AFTER_S)


async def drain_client(client: Any, reason: str, timeout: float) -> int:
    """Take no new request, let the running ones finish for up to ``timeout`` seconds, fail the
    rest; returns how many did not finish."""
    client.drain(reason)
    deadline = time.monotonic() + timeout
    while client.num_open and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = client.num_open
    if left:
        client.mark_dead(f"the server shut down before the request finished (--shutdown-timeout {timeout:g})")
        await asyncio.sleep(1.0)            # let their errors reach their clients
    return left


class ApiServers:
    """API server 0's record of the others: starts them once the engine cores are up, connects
    the engine cores to each, restarts one that dies, tells them the engine cores' news, drains
    and stops them."""

    def __init__(self, fe: Frontend, server: OpenAIServer, count: int, argv: list[str],
                 sockets: list[Any], host: str = "", port: int = 0) -> None:
        """``host`` and ``port``: the others listen there too (SO_REUSEPORT, as this one does);
        else (a Unix socket) they accept on ``sockets``, this one's listening sockets."""
        self.fe = fe
        self.server = server
        self.count = count
        self.argv = argv
        self.host, self.port = host, port
        self.fds = [] if port else [s.fileno() for s in sockets]
        self.children: dict[int, ChildProcess] = {}
        self.tcp: dict[int, str] = {}          # where headless machines' engine cores reach each
        config = fe.client.config
        self.restarts = RestartBudget(config.parallel.max_restarts * (count - 1), config.parallel.restart_window_s)
        self.stopping = False
        server.shared = SharedState(fe.node, 0, self)
        fe.node.spawn(topology.API_PEER, lambda: ApiPeer(server, hub=self))
        fe.api_servers = self

    async def start(self, ready_timeout: float) -> None:
        await asyncio.gather(*(self._start(i, ready_timeout) for i in range(1, self.count)))

    def _engine_nodes(self) -> dict[int, tuple[str, str]]:
        """Each served rank's engine node and address (a headless machine's: over TCP)."""
        return {rank: (p.name, getattr(p, "address", "") or p.spec.bind) for rank, p in self.fe.engine_processes.items()}

    async def _start(self, i: int, ready_timeout: float) -> None:
        fe, name = self.fe, topology.api_node(i)
        config = fe.client.config
        engines = self._engine_nodes()
        peers = {topology.FRONTEND_NODE: endpoint(fe.ipc_dir, topology.FRONTEND_NODE),
                 **{node: address for node, address in engines.values()}}
        payload = msgspec.msgpack.encode(ApiServerSpec(i, self.argv, config, self.fds,
                                                       {rank: node for rank, (node, _) in engines.items()},
                                                       self.host, self.port, self._tcp_host()))
        obs = config.observability
        spec = NodeSpec(name, "tools.serve:api_server_entry", payload, fe.ipc_dir, topology.FRONTEND_NODE, peers,
                        trace=obs.trace, flight_dir=obs.flight_recorder_dir)

        def exited(child: ChildProcess) -> None:
            self._exited(i, child)
        child, ready = await start_child(fe.node, spec, ready_timeout=ready_timeout, on_exit=exited,
                                         fds=tuple(self.fds))
        self.children[i] = child
        self.tcp[i] = decode_info(ready, ApiServerReady).tcp_address
        for rank, (node, address) in self._engine_nodes().items():   # restarted while it started
            if engines.get(rank) != (node, address) and rank not in fe._down:
                fe.node.ref(topology.API_PEER, name).tell(EngineState(rank, True, node=node, address=address))
        up = [rank for rank in engines if rank not in fe._down]
        await asyncio.gather(*(self._connect(i, rank) for rank in up))
        client = fe.client
        await fe.node.ref(topology.API_PEER, name).ask(
            Serve(list(client.lora_requests.values()), sorted(fe._down),
                  ControlState(client.pause_mode, client.sleep_level)), timeout=ASK_TIMEOUT_S)
        log.info("API server %d serving (pid %d)", i, child.pid)

    def _tcp_ranks(self) -> set[int]:
        """The engine cores of other machines (headless ones, or all on a Ray cluster)."""
        p = self.fe.client.config.parallel
        return set(p.served_ranks) if p.data_parallel_backend == "ray" else set(p.remote_ranks)

    def _tcp_host(self) -> str:
        """Where the API servers listen for engine cores of other machines: this machine's
        address on the Ray cluster, or --data-parallel-address ("": none to listen for)."""
        if not self._tcp_ranks():
            return ""
        p = self.fe.client.config.parallel
        if p.data_parallel_backend == "ray":
            return self.fe.cluster_address.removeprefix("tcp://").rsplit(":", 1)[0]
        return p.data_parallel_address

    async def _connect(self, i: int, rank: int) -> None:
        """Engine core ``rank`` sends API server ``i``'s outputs to it from now on."""
        child, parallel = self.children[i], self.fe.client.config.parallel
        scheduler = self.fe.engines[parallel.served_ranks.index(rank)].scheduler
        address = self.tcp[i] if rank in self._tcp_ranks() else child.spec.bind
        await scheduler.ask(ConnectClient(i, child.spec.name, address), timeout=ASK_TIMEOUT_S)

    def _exited(self, i: int, child: ChildProcess) -> None:
        if self.stopping or self.fe.stopping or self.fe.node.closed.done():
            return
        reason = child.describe_exit()
        log.error("API server %d died (%s)", i, reason)
        self.children.pop(i, None)
        for e in self.fe.engines:
            try:
                e.scheduler.tell(ClientGone(i, reason))
            except ActorDied:
                pass
        if not self.restarts.spend():
            self.fe.node.fatal(f"API server {i} died ({reason}); API servers died {self.restarts.describe()}, "
                               "giving up", code=1)
            return
        asyncio.get_running_loop().create_task(self._restart(i))

    async def _restart(self, i: int) -> None:
        try:
            await self._start(i, READY_TIMEOUT_S)
        except Exception as exc:
            if not self.stopping:
                self.fe.node.fatal(f"could not restart API server {i}: {exc}", code=1)

    def engine_down(self, rank: int, reason: str) -> None:
        self.tell_all(EngineState(rank, False, reason))

    async def engine_up(self, rank: int) -> None:
        """Engine core ``rank`` was restarted: it learns where the API servers are, then they
        learn where it is."""
        await asyncio.gather(*(self._connect(i, rank) for i in list(self.children)), return_exceptions=True)
        node, address = self._engine_nodes()[rank]
        self.tell_all(EngineState(rank, True, node=node, address=address))

    def tell_all(self, msg: Msg) -> None:
        for child in list(self.children.values()):
            try:
                self.fe.node.ref(topology.API_PEER, child.spec.name).tell(msg)
            except ActorDied:
                pass

    async def ask_all(self, msg: Msg) -> None:
        """``msg`` to every other API server, returning once each has taken it (or failed to)."""
        async def one(child: ChildProcess) -> None:
            try:
                await self.fe.node.ref(topology.API_PEER, child.spec.name).ask(msg, timeout=ASK_TIMEOUT_S)
            except (ActorDied, AskTimeout, RemoteError) as exc:
                log.warning("API server %s did not take %s: %s", child.spec.name, type(msg).__name__, exc)
        await asyncio.gather(*(one(c) for c in list(self.children.values())))

    async def abort_open(self, ids: list[str] | None, exclude: int) -> int:
        """``AbortOpen`` on every other API server but ``exclude``; how many they aborted."""
        async def one(child: ChildProcess) -> int:
            try:
                return await self.fe.node.ref(topology.API_PEER, child.spec.name).ask(AbortOpen(ids),
                                                                                     timeout=ASK_TIMEOUT_S)
            except (ActorDied, AskTimeout, RemoteError) as exc:
                log.warning("API server %s did not abort its requests: %s", child.spec.name, exc)
                return 0
        return sum(await asyncio.gather(*(one(c) for i, c in list(self.children.items()) if i != exclude)))

    async def request_stats(self, exclude: int) -> list[RequestStats]:
        """The request stats of every API server but ``exclude`` (those that answer in time)."""
        async def ask(child: ChildProcess) -> RequestStats | None:
            try:
                return await self.fe.node.ref(topology.API_PEER, child.spec.name).ask(
                    GetRequestStats(), timeout=STATS_TIMEOUT_S)
            except (ActorDied, AskTimeout, RemoteError) as exc:
                log.warning("/metrics: API server %s left out (%s)", child.spec.name, exc)
                return None
        others = await asyncio.gather(*(ask(c) for i, c in sorted(self.children.items()) if i != exclude))
        client = self.server.engine()
        own = [client.stats.request_stats(client.num_open)] if exclude != 0 else []
        return own + [s for s in others if s is not None]

    async def drain(self, reason: str, timeout: float) -> None:
        async def one(child: ChildProcess) -> None:
            try:
                await self.fe.node.ref(topology.API_PEER, child.spec.name).ask(
                    DrainServer(reason, timeout), timeout=timeout + 10.0)
            except (ActorDied, AskTimeout, RemoteError):
                pass
        await asyncio.gather(*(one(c) for c in list(self.children.values())))

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*(c.stop() for c in list(self.children.values())))


async def start_api_server(node: Node, spec: ApiServerSpec, server: OpenAIServer,
                           ssl_context: ssl.SSLContext | None, refresh_from: TlsFiles | None) -> ApiServerReady:
    """API server ``spec.index``'s node (its entry, once its command line is parsed): the client
    side of the engine cores, the shared state through API server 0, and the HTTP server on the
    inherited sockets once API server 0 says ``Serve``."""
    from actors.frontend.actor import HttpFrontend
    from actors.runtime.otel import RequestTracer
    config = spec.config
    served = config.parallel.served_ranks
    engines = [engine_refs(node, spec.engines[rank], config) for rank in served]
    obs = config.observability
    tracer = (RequestTracer(obs.otlp_traces_endpoint, config.model.served_model_name, obs.collect_model_forward_time,
                            obs.collect_model_execute_time) if obs.otlp_traces_endpoint is not None else None)
    client, _ = client_actors(node, config, load_tokenizer(config), engines, tracer, spec.index)
    server.attach(client)
    server.shared = SharedState(node, spec.index)
    # the dashboard's data: every process's, collected through the frontend node as there
    telemetry = Telemetry(node.spawn(topology.TELEMETRY, lambda: TelemetryActor(
        TelemetryWindow(), lambda: engine_sample(client.stats), source=topology.FRONTEND_NODE)))
    server.telemetry = lambda: telemetry
    sockets = [socket.socket(fileno=fd) for fd in spec.fds] if not spec.port else None

    async def start_http() -> None:
        await node.start(topology.HTTP, lambda: HttpFrontend(server, spec.host, spec.port, ssl_context, refresh_from,
                                                             sockets=sockets, reuse_port=True))
    node.spawn(topology.API_PEER, lambda: ApiPeer(server, start_http=start_http, engines=dict(spec.engines)))
    if not spec.tcp_host:
        return ApiServerReady()
    where = f"tcp://{spec.tcp_host}:*"              # for the engine cores of other machines
    try:
        return ApiServerReady(node.transport.bind(where))
    except Exception as exc:
        raise ValueError(f"API server {spec.index} cannot listen at {where} for the engine cores of "
                         f"other machines: {exc}") from None
