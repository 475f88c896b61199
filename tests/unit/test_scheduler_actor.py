"""The scheduler actor with the real KV manager actor on one node: a step takes its blocks
through the runtime's co-located fast path (no message to the KV manager, whatever the batch),
while other actors still reach the KV manager by message."""
from __future__ import annotations

import asyncio

import pytest

from actors import topology
from actors.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.actor import KVManager, ResetPrefixCache
from actors.runtime import Actor, ActorError, Node
from actors.scheduler.actor import AddRequest, SchedulerActor
from actors.scheduler.scheduler import Scheduler
from helpers import run_async
from sched_utils import FakeWorker, engine_config


class FakeExecutor(Actor):
    protocol = SchedulerOutput

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker

    async def receive(self, msg: SchedulerOutput):
        return self.worker.run(msg, token=7)


class Outputs(Actor):
    protocol = EngineCoreOutputs

    def __init__(self, done: asyncio.Future, expected: int) -> None:
        self.done, self.expected, self.finished = done, expected, set()

    async def receive(self, msg: EngineCoreOutputs) -> None:
        self.finished |= {o.request_id for o in msg.outputs if o.finish_reason}
        if len(self.finished) == self.expected and not self.done.done():
            self.done.set_result(msg.stats)


def test_steps_take_blocks_without_messages_to_the_kv_manager():
    config = engine_config(512, max_num_seqs=64, max_num_batched_tokens=4096)

    async def main():
        node = Node(topology.FRONTEND_NODE)
        kv = node.spawn(topology.KV_MANAGER, lambda: KVManager(config))
        done = asyncio.get_running_loop().create_future()
        outputs = node.spawn(topology.DETOKENIZER, lambda: Outputs(done, 48))
        executor = node.spawn(topology.EXECUTOR, lambda: FakeExecutor(FakeWorker(512, 4)))
        core = Scheduler(config, kv.colocated())
        sched = node.spawn(topology.SCHEDULER, lambda: SchedulerActor(core, executor, outputs))
        for i in range(48):
            sched.tell(AddRequest(EngineCoreRequest(
                f"r{i}", list(range(1000 + 50 * i, 1020 + 50 * i + i % 7)),
                SamplingParams(max_tokens=5 + i % 4, temperature=0), 0.0, [2])))
        stats = await asyncio.wait_for(done, 30)
        kv_handled = node.cells[topology.KV_MANAGER].handled
        reset = await kv.ask(ResetPrefixCache(), timeout=5)
        await node.stop()
        return stats, kv_handled, reset, core
    stats, kv_handled, reset, core = run_async(main())
    assert stats.step > 5 and stats.num_running == 0
    assert kv_handled == 0                       # every step reached the KV manager directly
    assert reset is True and stats.kv_cache_usage == 0.0
    assert core.kv.num_blocks_held("r0") == 0


def test_only_actors_of_the_same_node_that_offer_it_are_called_directly():
    class Restarting(Actor):
        protocol = ResetPrefixCache
        on_failure = "restart"

        def colocated(self):
            return self

    async def main():
        node = Node("n")
        plain = node.spawn("plain", lambda: FakeExecutor(FakeWorker(4, 4)))
        restarting = node.spawn("restarting", Restarting)
        remote = node.ref(topology.KV_MANAGER, "elsewhere")
        errors = []
        for ref, kind in ((plain, TypeError), (restarting, ActorError), (remote, ActorError)):
            with pytest.raises(kind) as err:
                ref.colocated()
            errors.append(str(err.value))
        await node.stop()
        return errors
    offers_none, restarts, other_node = run_async(main())
    assert "offers no co-located interface" in offers_none
    assert "restarts on failure" in restarts
    assert "node 'elsewhere'" in other_node


class Collected(Actor):
    protocol = EngineCoreOutputs

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.finished: set[str] = set()
        self.stats = 0

    async def receive(self, msg: EngineCoreOutputs) -> None:
        self.ids |= {o.request_id for o in msg.outputs}
        self.finished |= {o.request_id for o in msg.outputs if o.finish_reason}
        self.stats += msg.stats is not None


def test_outputs_go_to_the_api_server_of_each_request_and_a_gone_one_has_its_requests_aborted(tmp_path):
    """--api-server-count: the scheduler sends each request's outputs to the detokenizer of the
    API server that sent it (ConnectClient: another node, over ZeroMQ) and the stats to every
    API server; ClientGone aborts that server's requests and drops their outputs."""
    from actors.scheduler.actor import ClientGone, ConnectClient
    from transport.zmq_channel import ZmqTransport, endpoint
    config = engine_config(512, max_num_seqs=64, max_num_batched_tokens=4096)

    async def main():
        nodes = {name: Node(name, ZmqTransport(endpoint(str(tmp_path), name))) for name in ("engine", "api1")}
        engine, api = nodes["engine"], nodes["api1"]
        kv = engine.spawn(topology.KV_MANAGER, lambda: KVManager(config))
        mine, theirs = Collected(), Collected()
        own = engine.spawn(topology.DETOKENIZER, lambda: mine)          # API server 0's, here
        api.spawn(topology.DETOKENIZER, lambda: theirs)
        executor = engine.spawn(topology.EXECUTOR, lambda: FakeExecutor(FakeWorker(512, 4)))
        core = Scheduler(config, kv.colocated())
        sched = engine.spawn(topology.SCHEDULER, lambda: SchedulerActor(core, executor, own))
        await sched.ask(ConnectClient(1, "api1", api.transport.address), timeout=5)

        def add(rid: str, client: int, tokens: int) -> None:
            sched.tell(AddRequest(EngineCoreRequest(rid, list(range(100, 120)), SamplingParams(
                max_tokens=tokens, temperature=0, ignore_eos=True), 0.0, [2], client_index=client)))
        for i in range(4):
            add(f"a{i}", 0, 4)
            add(f"b{i}", 1, 4)
        for _ in range(300):
            if len(mine.finished) + len(theirs.finished) == 8:
                break
            await asyncio.sleep(0.01)
        add("long", 1, 100_000)
        for _ in range(300):
            if "long" in theirs.ids:
                break
            await asyncio.sleep(0.01)
        sched.tell(ClientGone(1, "its process died"))
        for _ in range(300):
            if not core.has_request("long"):
                break
            await asyncio.sleep(0.01)
        gone = not core.has_request("long")
        add("late", 1, 4)                       # from a server no longer connected: dropped
        await asyncio.sleep(0.2)
        results = (mine, theirs, gone, core.has_request("late"))
        for node in nodes.values():
            await node.stop()
        return results
    mine, theirs, gone, late = run_async(main())
    assert mine.finished == {f"a{i}" for i in range(4)} and mine.ids == mine.finished
    assert theirs.finished == {f"b{i}" for i in range(4)} and theirs.ids == theirs.finished | {"long"}
    assert mine.stats and theirs.stats                   # the stats reach both
    assert gone and not late
