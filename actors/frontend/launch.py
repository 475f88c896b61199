"""Starting Troupe: the frontend's actors around an engine core that runs either in its own
process (with the worker in a third) or in this event loop (offline use and tests)."""
from __future__ import annotations

import logging
import shutil
import tempfile
from typing import NamedTuple

import msgspec

from actors.detokenizer.actor import DetokenizerActor
from actors.engine_core import EngineConfig, EngineCore
from actors.frontend.client import EngineClient
from actors.frontend.stats import EngineStats
from actors.frontend.streams import OutputStreams
from actors.runtime import ActorRef, Node
from actors.runtime.process import ChildProcess, NodeSpec, decode_info, start_child, system_actor
from actors.runtime.system import SYSTEM_ACTOR, GetTrace
from actors.scheduler.actor import SchedulerProtocol
from actors.tokenizer.actor import TokenizerActor
from actors.tokenizer.gguf_tokenizer import TextTokenizer
from models.resolve import resolve_model
from transport.messages import EngineInfo
from transport.zmq_channel import ZmqTransport, endpoint

log = logging.getLogger("troupe.launch")

FRONTEND_NODE = "frontend"
ENGINE_NODE = "engine"


class Frontend:
    """A running Troupe: the frontend node, its EngineClient, and the engine it talks to."""

    def __init__(self, node: Node, ipc_dir: str | None = None) -> None:
        self.node = node
        self.ipc_dir = ipc_dir
        self.client: EngineClient | None = None
        self.engine_process: ChildProcess | None = None
        self.engine_core: EngineCore | None = None
        self.stopping = False

    def engine_exited(self, child: ChildProcess) -> None:
        """The engine process is gone: fail what is in flight and stop with a clear message."""
        if self.stopping or self.node.closed.done():
            return
        reason = f"the engine core died ({child.describe_exit()})"
        if self.client is not None:
            self.client.mark_dead(reason)
        self.node.fatal(reason, code=1)

    async def trace(self, limit: int = 20000) -> list:
        """The newest trace records of every process (at most ``limit`` each)."""
        chunk = await self.node.ref(SYSTEM_ACTOR).ask(GetTrace(0, limit, recursive=True), timeout=10)
        return chunk.all_records()

    async def start(self, cfg: EngineConfig, ready_timeout: float = 600.0) -> EngineClient:
        """Load the model (engine and worker processes), then start the tokenizer and
        detokenizer actors; sets ``client``."""
        source = resolve_model(cfg.model)   # fails fast, with the install command, if missing
        tokenizer = TextTokenizer.from_source(source.kind, source.path)
        info, engine = await _start_engine(self, cfg, ready_timeout)
        streams = OutputStreams()
        stats = EngineStats(model=info.model.served_name)
        detok = self.node.spawn("detokenizer", lambda: DetokenizerActor(tokenizer, streams, stats, engine))

        def count_prompt_tokens(n: int) -> None:
            stats.prompt_tokens += n

        tok = self.node.spawn("tokenizer", lambda: TokenizerActor(
            tokenizer, info.model.max_model_len, info.model.eos_token_ids, detok, engine,
            count_prompt_tokens))
        self.client = EngineClient(info, tokenizer, tok, detok, engine, streams, stats)
        return self.client

    async def shutdown(self) -> None:
        self.stopping = True
        if self.engine_process is not None:
            await self.engine_process.stop()
        if self.engine_core is not None:
            await self.engine_core.stop()
        await self.node.stop()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


async def start_frontend(cfg: EngineConfig, *, multiprocess: bool = True,
                         ready_timeout: float = 600.0) -> Frontend:
    """Start the engine and the frontend actors; returns once the model is loaded."""
    fe = create_frontend(multiprocess)
    try:
        await fe.start(cfg, ready_timeout=ready_timeout)
    except BaseException:
        await fe.node.stop()
        if fe.ipc_dir:
            shutil.rmtree(fe.ipc_dir, ignore_errors=True)
        raise
    return fe


def create_frontend(multiprocess: bool = True) -> Frontend:
    """The frontend node alone (no engine yet): a server can listen, and answer 503, while
    ``Frontend.start`` loads the model."""
    if multiprocess:
        ipc_dir = tempfile.mkdtemp(prefix="troupe-")
        node = Node(FRONTEND_NODE, ZmqTransport(endpoint(ipc_dir, FRONTEND_NODE)))
        system_actor(node)
        return Frontend(node, ipc_dir)
    node = Node(FRONTEND_NODE)
    system_actor(node)
    return Frontend(node)


class _Engine(NamedTuple):
    info: EngineInfo
    scheduler: ActorRef


async def _start_engine(fe: Frontend, cfg: EngineConfig, ready_timeout: float) -> _Engine:
    """The engine core in its own process (multiprocess) or in this event loop."""
    if fe.ipc_dir is not None:
        cfg = msgspec.structs.replace(cfg, ipc_dir=fe.ipc_dir, worker_process=True,
                                      output_node=FRONTEND_NODE, output_actor="detokenizer")
        spec = NodeSpec(ENGINE_NODE, "actors.engine_core:engine_entry", msgspec.msgpack.encode(cfg),
                        fe.ipc_dir, FRONTEND_NODE, {FRONTEND_NODE: endpoint(fe.ipc_dir, FRONTEND_NODE)})
        fe.engine_process, ready = await start_child(fe.node, spec, ready_timeout=ready_timeout,
                                                     on_exit=fe.engine_exited)
        scheduler = fe.node.ref("scheduler", ENGINE_NODE, SchedulerProtocol)
        return _Engine(decode_info(ready, EngineInfo), scheduler)
    cfg = msgspec.structs.replace(cfg, worker_process=False, output_node=FRONTEND_NODE,
                                  output_actor="detokenizer")
    fe.engine_core = EngineCore(fe.node, cfg)
    info = await fe.engine_core.start()
    return _Engine(info, fe.engine_core.scheduler)
