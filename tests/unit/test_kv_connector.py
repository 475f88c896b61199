"""Prefill/decode disaggregation without a model: two real Schedulers (a producer and a consumer),
each with TroupeConnector's two sides and a small KV cache tensor per layer, talking over real
ZeroMQ sockets on 127.0.0.1. The producer's "forward" writes a known pattern into the blocks it
computes; the consumer must end up with the same values in its own blocks, compute only the
prompt's last token, and never free blocks a transfer may still touch."""
from __future__ import annotations

import time
from typing import Iterator

import msgspec
import pytest
import torch

from actors.engine.messages import EngineCoreRequest, ModelRunnerOutput
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.manager import KVCacheManager
from actors.kv_transfer.base import KVConnectorOutput, KVConnectorRole, KVOutputAggregator
from actors.kv_transfer.config import KVTransferConfig, kv_transfer_config
from actors.kv_transfer.factory import KVConnectorFactory
from actors.kv_transfer.troupe_connector import HandshakeError, listen_ip
from actors.runtime.ray_nodes import NODE_IP_ENV
from actors.scheduler.request import RequestStatus
from actors.scheduler.scheduler import Scheduler
from models.config import ArchConfig
from tests.e2e.server import free_ports
from tests.unit.sched_utils import engine_config

BS, NUM_BLOCKS, LAYERS, HEADS, HEAD = 4, 32, 2, 1, 8


class Instance:
    """A scheduler and its worker side: a KV cache of LAYERS tensors and the connector's worker
    part (with ``tp`` x ``pp`` ranks, one of each per rank, a stage's ranks holding its LAYERS // pp
    layers, their reports combined as the executor does)."""

    def __init__(self, role: str, port: int, block_size: int = BS, tp: int = 1, pp: int = 1,
                 rank_ips: list[str] | None = None, connector: str = "TroupeConnector", **extra) -> None:
        kv = KVTransferConfig(kv_connector=connector, kv_role=role, kv_port=port,
                              kv_connector_extra_config={"transfer_timeout_s": 2.0, **extra})
        self.config = engine_config(NUM_BLOCKS).replace(kv_transfer=kv)
        self.config = self.config.replace(cache=msgspec.structs.replace(self.config.cache, block_size=block_size,
                                                                        cache_dtype="float32"),
                                          parallel=msgspec.structs.replace(self.config.parallel, tensor_parallel_size=tp,
                                                                           pipeline_parallel_size=pp))
        if pp > 1:                      # the stages' layers come from the model's layer count
            self.config = self.config.replace(model=msgspec.structs.replace(self.config.model, arch=ArchConfig(
                "LlamaForCausalLM", 100, 16, 32, LAYERS, HEADS, HEADS, HEAD, 4096, 1e4, 1e-6, True, None, (2,))))
        self.kv = KVCacheManager(NUM_BLOCKS, block_size, True)
        self.sched = Scheduler(self.config, self.kv)
        self.rank_caches = [[torch.zeros(2, NUM_BLOCKS, block_size, HEADS, HEAD) for _ in range(LAYERS // pp)]
                            for _ in range(tp * pp)]
        self.workers = [KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, r)
                        for r in range(tp * pp)]
        for rank, (worker, caches) in enumerate(zip(self.workers, self.rank_caches)):
            if rank_ips:                # ranks on machines of their own (loopback addresses stand for them)
                worker.listen_ip = rank_ips[rank]
            worker.register_kv_caches(caches)
        if rank_ips:
            self.sched.connector.set_rank_hosts(rank_ips)
        self.worker, self.caches = self.workers[0], self.rank_caches[0]
        self.reports = KVOutputAggregator(tp * pp)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.sched.connector.shutdown()

    def step(self, forward=None) -> list:
        """One engine step: the worker side takes the metadata, ``forward(so)`` writes the KV,
        the step samples token 7 for every request whose prompt is complete."""
        so = self.sched.schedule()
        for worker in self.workers:
            worker.start_load_kv(so.kv_connector_metadata or b"")
        if forward is not None:
            forward(so)
        for worker in self.workers:
            worker.wait_for_save()
        starts = {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        starts |= dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            sampled.append([7] if starts[rid] + n >= req.num_tokens else [])
        out = ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)
        out.kv_connector_output = self.reports.aggregate([w.get_finished() for w in self.workers])
        self.last = so
        return self.sched.update_from_output(so, out)

    def until(self, done, timeout: float = 10.0) -> list:
        """Steps (polls, while only transfers are under way) until ``done()``."""
        outs: list = []
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            outs += self.step()
            time.sleep(0.01)
        return outs


def _kv_ports(instances: int = 2) -> Iterator[int]:
    """A KV side-channel port for each instance, four apart (its ranks listen on the port and the
    ones after it), below the range the kernel hands out for port 0 (so no server another test
    process starts meanwhile can take one)."""
    base = free_ports(4 * instances)
    return iter(range(base, base + 4 * instances, 4))

def pattern(layer: int, kv: int, pos: int, rank: int = 0) -> float:
    return rank * 10000 + layer * 1000 + kv * 100 + pos + 0.5


def write_prompt_kv(inst: Instance, rid: str, num_tokens: int):
    """The producer's forward: position p of the request gets pattern(layer, kv, p, rank) in every
    head of each rank."""
    def forward(_so):
        (ids,) = inst.kv.get_block_ids(rid)
        for rank, caches in enumerate(inst.rank_caches):
            for p in range(num_tokens):
                for layer, t in enumerate(caches):
                    for kv in (0, 1):
                        t[kv, ids[p // BS], p % BS] = pattern(layer, kv, p, rank)
    return forward


def add(inst: Instance, rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> None:
    extra = {"kv_transfer_params": params} if params is not None else None
    err = inst.sched.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                                extra_args=extra), 0.0, [2]))
    assert err is None


@pytest.fixture
def pair():
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), kv_lease_duration=30.0)
    consumer = Instance("kv_consumer", next(ports))
    yield producer, consumer
    producer.close()
    consumer.close()


PROMPT = list(range(100, 114))          # 14 tokens: 4 blocks of 4, the last one partial


def prefill(producer: Instance, rid: str = "p1") -> dict:
    add(producer, rid, PROMPT, 1, {"do_remote_decode": True})
    outs = producer.step(write_prompt_kv(producer, rid, len(PROMPT)))
    (out,) = outs
    assert out.finish_reason == "length" and out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_the_consumer_loads_the_producers_blocks_and_computes_only_the_last_prompt_token(pair):
    producer, consumer = pair
    params = prefill(producer)
    assert params["do_remote_prefill"] and params["remote_request_id"] == "p1"
    assert len(params["remote_block_ids"]) == 4
    assert producer.kv.num_blocks_held("p1") == 4          # held for the reader after it finished

    add(consumer, "d1", PROMPT, 3, params)
    consumer.step()                                        # admitted: blocks taken, load started
    req = consumer.sched.requests["d1"]
    assert not consumer.last.num_scheduled_tokens          # nothing computed while it loads
    # loading still, or (a fast load on a busy machine) reported done within that very step
    assert req.status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
    consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
    consumer.step()
    assert consumer.last.num_scheduled_tokens == {"d1": 1}          # the prompt's last token only
    (ids,) = consumer.kv.get_block_ids("d1")
    for p in range(len(PROMPT) - 1):
        for layer, t in enumerate(consumer.caches):
            for kv in (0, 1):
                assert t[kv, ids[p // BS], p % BS, 0, 0].item() == pattern(layer, kv, p)
    stats = consumer.sched.stats()
    assert stats.external_prefix_cache_hits == len(PROMPT) - 1
    assert stats.kv_transfer["recv_blocks"] == 4
    # the consumer released the blocks: the producer frees them at its next poll
    producer.until(lambda: producer.kv.num_blocks_held("p1") == 0)
    assert producer.kv.usage() == 0.0 and producer.sched.stats().kv_transfer["sent_blocks"] == 4
    outs = consumer.until(lambda: "d1" not in consumer.sched.requests)
    assert [o.finish_reason for o in outs if o.finish_reason] == ["length"]


@pytest.mark.parametrize("path", ["cma", "shm", "frames", "cma refused", "nixl"])
def test_each_same_machine_path_loads_the_same_values_into_other_block_ids(path, monkeypatch):
    """Straight from the producer's cache (cross-memory attach, the default), through a
    shared-memory segment, as ZeroMQ frames; where the system refuses cross-memory attach,
    through shared memory from then on; and with NIXL on both sides (vLLM's NixlConnector), its
    one-sided READs from the producer's registered cache."""
    from actors.kv_transfer import cma
    extra = {"cma": path != "shm", "shm": path != "frames"}
    if path == "cma refused":          # as under a seccomp profile or Yama's ptrace_scope
        def refuse(pid, copies):
            raise PermissionError(1, f"reading process {pid}'s memory: Operation not permitted")
        monkeypatch.setattr(cma, "read_regions", refuse)
    connector = "NixlConnector" if path == "nixl" else "TroupeConnector"
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), connector=connector, kv_lease_duration=30.0)
    consumer = Instance("kv_consumer", next(ports), connector=connector, **extra)
    try:
        params = prefill(producer)
        assert consumer.kv.allocate_slots("elsewhere", 3 * BS + 1, []) is not None   # other local block ids
        for rid in ("d1", "d2"):
            params = params if rid == "d1" else prefill(producer, "p2")
            add(consumer, rid, PROMPT, 1, params)
            consumer.step()
            req = consumer.sched.requests[rid]
            consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
            (ids,) = consumer.kv.get_block_ids(rid)
            assert set(ids).isdisjoint(consumer.kv.get_block_ids("elsewhere")[0])
            for p in range(len(PROMPT) - 1):
                for layer, t in enumerate(consumer.caches):
                    for kv in (0, 1):
                        assert t[kv, ids[p // BS], p % BS, 0, 0].item() == pattern(layer, kv, p)
            consumer.until(lambda: rid not in consumer.sched.requests)
        stats = consumer.sched.stats().kv_transfer
        assert stats.get("recv_failures", 0) == 0 and stats["recv_requests"] == 2
        assert stats.get("cma_reads", 0) == (2 if path == "cma" else 0)
        assert stats.get("shm_reads", 0) == {"cma": 0, "shm": 2, "frames": 0, "cma refused": 2, "nixl": 0}[path]
        assert stats.get("nixl_reads", 0) == (2 if path == "nixl" else 0)
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["two tensor-parallel ranks", "two pipeline stages"])
def test_with_two_ranks_each_rank_loads_its_share_from_the_rank_of_the_same_number(tp, pp):
    """Each rank's side channel listens on kv_port + rank; consumer rank r reads producer rank r's
    heads (tensor parallelism) or layers (pipeline parallelism); a request is loaded, and the
    producer's blocks freed, once both ranks are done."""
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), tp=tp, pp=pp, kv_lease_duration=30.0)
    consumer = Instance("kv_consumer", next(ports), tp=tp, pp=pp)
    try:
        params = prefill(producer)
        assert (params["tp_size"], params["pp_size"]) == (tp, pp)
        assert params["remote_port"] == producer.config.kv_transfer.kv_port
        add(consumer, "d1", PROMPT, 2, params)
        consumer.step()
        req = consumer.sched.requests["d1"]
        consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
        consumer.step()
        assert consumer.last.num_scheduled_tokens == {"d1": 1}
        (ids,) = consumer.kv.get_block_ids("d1")
        for rank, caches in enumerate(consumer.rank_caches):
            for p in range(len(PROMPT) - 1):
                for layer, t in enumerate(caches):
                    for kv in (0, 1):
                        assert t[kv, ids[p // BS], p % BS, 0, 0].item() == pattern(layer, kv, p, rank)
        stats = consumer.sched.stats().kv_transfer
        assert stats["recv_requests"] == 1 and stats["recv_blocks"] == 4      # counted once, not per rank
        assert stats["recv_bytes"] == 2 * 4 * LAYERS * tp * BS * HEADS * HEAD * 4     # every rank's share
        producer.until(lambda: producer.kv.num_blocks_held("p1") == 0)
        assert producer.sched.stats().kv_transfer["sent_requests"] == 1
    finally:
        producer.close()
        consumer.close()


def test_ranks_on_different_machines_are_named_each_and_each_consumer_rank_reads_from_its_own():
    """A producer whose ranks listen on different addresses (ranks on a cluster's machines; here
    127.0.0.1 and 127.0.0.2) names every rank's host; consumer rank 1 reads from the second."""
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), tp=2, rank_ips=["127.0.0.1", "127.0.0.2"], kv_lease_duration=30.0)
    consumer = Instance("kv_consumer", next(ports), tp=2)
    try:
        params = prefill(producer)
        assert params["remote_host"] == "127.0.0.1" and params["remote_hosts"] == ["127.0.0.1", "127.0.0.2"]
        add(consumer, "d1", PROMPT, 2, params)
        consumer.step()
        req = consumer.sched.requests["d1"]
        consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert consumer.sched.stats().kv_transfer.get("recv_failures", 0) == 0
        (ids,) = consumer.kv.get_block_ids("d1")
        assert consumer.rank_caches[1][0][0, ids[0], 0, 0, 0].item() == pattern(0, 0, 0, rank=1)
        producer.until(lambda: producer.kv.num_blocks_held("p1") == 0)     # both ranks' leases ended by release
    finally:
        producer.close()
        consumer.close()


def test_on_a_ray_machine_a_loopback_side_channel_listens_on_the_machines_cluster_address(monkeypatch):
    monkeypatch.setenv(NODE_IP_ENV, "10.1.2.3")
    assert listen_ip("127.0.0.1") == "10.1.2.3"          # the default: reachable from the other machines
    assert listen_ip("192.168.0.7") == "192.168.0.7"     # an address the user chose stays
    monkeypatch.delenv(NODE_IP_ENV)
    assert listen_ip("127.0.0.1") == "127.0.0.1"


def test_a_handshake_between_different_pipeline_splits_is_refused_naming_the_field():
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), pp=2)
    consumer = Instance("kv_consumer", next(ports))
    try:
        with pytest.raises(HandshakeError, match=r"pipeline_parallel_size 2 \(producer\) vs 1 \(consumer\)"):
            consumer.worker.handshake("127.0.0.1", producer.config.kv_transfer.kv_port)
    finally:
        producer.close()
        consumer.close()


def test_the_ranks_reports_combine_into_one_once_every_rank_reported():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([KVConnectorOutput(finished_recving=["a", "b"], finished_sending=["s"]),
                         KVConnectorOutput(failed_recving={"b": "TimeoutError: no answer"})])
    assert out.finished_recving == [] and out.failed_recving == {"b": "TimeoutError: no answer"}
    assert out.finished_sending == []                      # rank 1 still sends its share of "s"
    out = agg.aggregate([None, KVConnectorOutput(finished_recving=["a"], finished_sending=["s"])])
    assert out.finished_recving == ["a"] and out.finished_sending == ["s"] and out.failed_recving == {}
    assert agg.aggregate([None, None]) is None


def test_a_lease_nobody_renews_expires_and_frees_the_producers_blocks():
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), kv_lease_duration=0.3)
    try:
        prefill(producer)
        assert producer.kv.usage() > 0
        producer.until(lambda: producer.kv.usage() == 0.0, timeout=5.0)
        assert producer.sched.stats().kv_transfer["leases_expired"] == 1
        assert not producer.sched.kv_connector_pending()
    finally:
        producer.close()


def test_a_load_from_a_producer_that_is_gone_is_recomputed_locally(pair):
    producer, consumer = pair
    params = prefill(producer)
    producer.worker.shutdown()                             # its side channel is gone
    add(consumer, "d1", PROMPT, 2, params)
    consumer.step()
    req = consumer.sched.requests["d1"]
    consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert consumer.sched.stats().kv_transfer["recv_failures"] == 1
    consumer.step()
    assert consumer.last.num_scheduled_tokens == {"d1": len(PROMPT)}    # the whole prompt, here
    consumer.kv.check_integrity()


def test_a_nixl_read_the_producer_can_no_longer_serve_fails_and_the_prompt_is_recomputed():
    """NIXL no longer knows the producer's agent after the handshake (as when UCX lost the
    connection): the read fails, the load is reported failed, the consumer computes the whole
    prompt."""
    ports = _kv_ports()
    producer = Instance("kv_producer", next(ports), connector="NixlConnector", kv_lease_duration=30.0)
    consumer = Instance("kv_consumer", next(ports), connector="NixlConnector")
    try:
        other = [p + 50 for p in PROMPT]                     # a first load (another prompt): handshake
        add(producer, "p0", other, 1, {"do_remote_decode": True})
        (out,) = producer.step(write_prompt_kv(producer, "p0", len(other)))
        add(consumer, "d1", other, 1, out.kv_transfer_params)
        consumer.step()
        consumer.until(lambda: "d1" not in consumer.sched.requests)
        params = prefill(producer, "p2")
        (peer,) = consumer.worker._nixl._peers.values()
        consumer.worker._nixl.agent.remove_remote_agent(peer)
        add(consumer, "d2", PROMPT, 2, params)
        consumer.step()
        req = consumer.sched.requests["d2"]
        consumer.until(lambda: req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS)
        stats = consumer.sched.stats().kv_transfer
        assert stats["recv_failures"] == 1 and stats["nixl_reads"] == 1
        consumer.step()
        assert consumer.last.num_scheduled_tokens == {"d2": len(PROMPT)}    # the whole prompt, here
        consumer.kv.check_integrity()
    finally:
        producer.close()
        consumer.close()


def test_blocks_of_a_request_aborted_while_its_kv_loads_are_freed_only_when_the_load_ended(pair):
    producer, consumer = pair
    params = prefill(producer)
    add(consumer, "d1", PROMPT, 2, params)
    so = consumer.sched.schedule()                         # the load is sent to the worker ...
    consumer.worker.start_load_kv(so.kv_connector_metadata)
    consumer.sched.abort_requests(["d1"])                  # ... and the request aborted at once
    assert consumer.kv.num_blocks_held("d1") == 4          # the load may still write them
    assert consumer.sched.kv_connector_pending()
    consumer.until(lambda: consumer.kv.num_blocks_held("d1") == 0)
    consumer.kv.check_integrity()


def test_a_handshake_between_different_block_sizes_is_refused_naming_the_field(pair):
    producer, _ = pair
    other = Instance("kv_consumer", next(_kv_ports(1)), block_size=8)
    try:
        with pytest.raises(HandshakeError, match=r"block_size 4 \(producer\) vs 8 \(consumer\)"):
            other.worker.handshake("127.0.0.1", producer.config.kv_transfer.kv_port)
    finally:
        other.close()


def test_kv_transfer_config_takes_vllms_keys_and_refuses_bad_values(monkeypatch):
    cfg = kv_transfer_config('{"kv_connector": "TroupeConnector", "kv_role": "kv_consumer", "kv_rank": 1, '
                             '"kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": 15000, "kv_buffer_size": 1e9, '
                             '"engine_id": "decode-0", "kv_connector_extra_config": {"kv_lease_duration": 5}}')
    assert cfg.is_consumer and not cfg.is_producer and cfg.kv_port == 15000
    with pytest.raises(ValueError, match="kv_role"):
        kv_transfer_config({"kv_connector": "TroupeConnector", "kv_role": "prefill"})
    with pytest.raises(ValueError, match="unknown kv_connector 'P2pNcclConnector'"):
        kv_transfer_config({"kv_connector": "P2pNcclConnector"})
    assert kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"}).is_producer
    from actors.kv_transfer import nixl
    monkeypatch.setattr(nixl, "MODULES", ("no_such_nixl._api",))        # as where NIXL is not installed
    with pytest.raises(ValueError, match="NixlConnector reads through NIXL, which cannot run here: .*no_such_nixl"):
        kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="NIXL, which cannot run here"):
        kv_transfer_config({"kv_connector": "TroupeConnector", "kv_connector_extra_config": {"nixl": True}})
    with pytest.raises(ValueError, match="kv_lease_duration must be a positive number"):
        kv_transfer_config({"kv_connector": "TroupeConnector", "kv_connector_extra_config": {"kv_lease_duration": 0}})
    with pytest.raises(ValueError, match="kv_buffer_sise"):
        kv_transfer_config({"kv_connector": "TroupeConnector", "kv_buffer_sise": 1})


def test_params_of_another_prompt_are_not_loaded_the_prompt_is_computed(pair):
    producer, consumer = pair
    params = prefill(producer)
    other = [p + 1 for p in PROMPT]                        # the same length, other tokens
    add(consumer, "d1", other, 2, params)
    consumer.step()
    assert consumer.last.num_scheduled_tokens == {"d1": len(other)}


def test_a_prompt_given_as_embeddings_is_told_apart_by_its_rows_not_its_placeholders():
    """A consumer loads KV computed for the same prompt only: two prompts of embeddings with the
    same number of rows (the same placeholder token ids) are different prompts."""
    import numpy as np
    from actors.scheduler.request import Request
    from actors.kv_transfer.troupe_connector import prompt_hash
    rows = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)

    def request(embeds):
        return Request("r", [0] * 4, SamplingParams(), 0.0, prompt_embeds=embeds)
    assert prompt_hash(request(rows)) == prompt_hash(request(rows.copy()))
    assert prompt_hash(request(rows)) != prompt_hash(request(rows + 1)) != prompt_hash(request(None))
