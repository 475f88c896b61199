"""vLLM's encoder scheduling: images encoded within a step's encoder budget, their embeddings
kept in the workers' encoder cache for later steps and later requests, evicted oldest unused
first."""
from __future__ import annotations

import numpy as np
import pytest

from actors.engine.messages import EngineCoreRequest, MultiModalFeature
from actors.engine.sampling_params import SamplingParams
from actors.scheduler.encoder_cache import EncoderCache
from sched_utils import EOS, Harness


def image(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, {"pixel_values": np.zeros(1, np.float32)})


def test_unreferenced_images_stay_until_a_new_one_needs_their_room_oldest_first():
    cache = EncoderCache(10)
    a, b, c = image("A", 0, 4), image("B", 0, 4), image("C", 0, 6)
    for f, rid in ((a, "r1"), (b, "r2")):
        assert cache.can_allocate(f.num_embeds, 0)
        cache.allocate(f, rid)
    assert not cache.can_allocate(c.num_embeds, 0)      # both referenced: no room for C
    cache.release(a, "r1")
    cache.release(b, "r2")
    assert cache.reference(a, "r3")                      # A again: a hit, referenced once more
    assert cache.can_allocate(c.num_embeds, 0)          # B evicted for C; A, referenced, stays
    assert cache.take_freed() == ["B"] and cache.take_freed() == []
    cache.allocate(c, "r4")
    assert "A" in cache and "B" not in cache and cache.used == 10
    assert (cache.queries, cache.hits) == (4, 1)


def test_an_image_larger_than_the_cache_goes_alone_once_nothing_else_is_referenced():
    cache = EncoderCache(4)
    small, big = image("S", 0, 3), image("Big", 0, 9)
    cache.allocate(small, "r1")
    assert not cache.can_allocate(big.num_embeds, 0)
    cache.release(small, "r1")
    assert not cache.can_allocate(big.num_embeds, 3)    # not beside others of its step
    assert cache.can_allocate(big.num_embeds, 0)
    cache.allocate(big, "r2")
    assert cache.take_freed() == ["S"] and cache.usage() == 9 / 4
    cache.release(big, "r2")
    assert cache.can_allocate(small.num_embeds, 0) and cache.take_freed() == ["Big"]


def images_request(rid: str, prompt: list[int], features: list[MultiModalFeature]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0), 0.0, [EOS],
                             mm_features=features)


def run(h: Harness, steps: int = 12) -> list:
    """(scheduled tokens, images to encode, images dropped) of each step until nothing is left."""
    got = []
    for _ in range(steps):
        if not h.s.has_work():
            break
        so, _ = h.step()
        got.append((dict(so.num_scheduled_tokens), dict(so.scheduled_encoder_inputs), list(so.free_encoder_mm_hashes)))
    return got


def test_a_chunk_stops_before_an_image_the_steps_encoder_budget_has_no_room_for():
    h = Harness(max_num_batched_tokens=32, max_num_batched_encoder_embeds=10)
    for rid, base in (("a", 100), ("b", 200)):
        assert h.s.add_request(images_request(rid, list(range(base, base + 12)), [image(rid.upper(), 2, 8)])) is None
    steps = run(h)
    # a's image takes 8 of the 10: b's prompt stops before its image, which the next step encodes
    assert steps[0] == ({"a": 12, "b": 2}, {"a": [0]}, [])
    assert steps[1][:2] == ({"b": 10}, {"b": [0]})


def test_a_later_request_with_the_same_image_is_served_from_the_encoder_cache():
    h = Harness(max_num_batched_tokens=32, enable_prefix_caching=False)
    shared = [image("X", 3, 8)]
    assert h.s.add_request(images_request("a", list(range(100, 114)), shared)) is None
    first = run(h)
    assert first[0][1] == {"a": [0]}
    assert h.s.add_request(images_request("b", list(range(300, 314)), [image("X", 3, 8)])) is None
    again = run(h)
    assert all(not encoded for _, encoded, _ in again)          # its embeddings are still there
    stats = h.s.stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 1)


def test_an_image_the_cache_has_no_room_for_evicts_the_oldest_unused_one_and_the_workers_drop_it():
    h = Harness(max_num_batched_tokens=32, encoder_cache_size=10, max_num_batched_encoder_embeds=10)
    for rid, ident in (("a", "P"), ("b", "Q")):
        assert h.s.add_request(images_request(rid, list(range(100, 112)), [image(ident, 2, 8)])) is None
        run(h)
    steps = []
    assert h.s.add_request(images_request("c", list(range(100, 112)), [image("P", 2, 8)])) is None
    steps += run(h)
    assert steps[0][1] == {"c": [0]} and steps[0][2] == ["Q"]  # P went for Q; P back now, Q dropped


def test_a_chunk_inside_an_image_holds_its_reference_until_the_image_is_computed():
    h = Harness(max_num_batched_tokens=4, encoder_cache_size=8, max_num_batched_encoder_embeds=8)
    assert h.s.add_request(images_request("a", list(range(100, 112)), [image("A", 2, 8)])) is None
    assert h.s.add_request(images_request("b", list(range(200, 212)), [image("B", 2, 8)])) is None
    steps = run(h, 20)
    encoded = [e for _, e, _ in steps if e]
    # B waits for A's positions to be computed (the cache holds one image), then evicts it
    assert encoded == [{"a": [0]}, {"b": [0]}]
    when_b = next(i for i, (_, e, _) in enumerate(steps) if e == {"b": [0]})
    assert steps[when_b][2] == ["A"]
    assert sum(n.get("a", 0) for n, _, _ in steps[:when_b]) >= 10      # a's chunks passed its image first


def test_a_reset_makes_the_workers_drop_every_image_and_encode_again_what_is_still_needed():
    h = Harness(max_num_batched_tokens=4)
    assert h.s.add_request(images_request("a", list(range(100, 116)), [image("A", 2, 8)])) is None
    so, _ = h.step()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    h.s.reset_encoder_cache()
    so, _ = h.step()
    assert so.reset_encoder_cache and so.scheduled_encoder_inputs == {"a": [0]}   # its rest needs A again
    so, _ = h.step()
    assert not so.reset_encoder_cache and not so.scheduled_encoder_inputs


def test_the_encoder_cache_must_hold_at_least_a_steps_encoder_budget():
    from actors.engine.args import EngineArgs
    with pytest.raises(ValueError, match=r"encoder_cache_size \(8\) must be no smaller than "
                                         r"max_num_batched_encoder_embeds \(16\)"):
        EngineArgs(max_num_batched_encoder_embeds=16, encoder_cache_size=8).create_engine_config()
    config = EngineArgs(max_num_batched_tokens=512).create_engine_config()
    assert (config.scheduler.encoder_budget, config.scheduler.encoder_cache_embeds) == (512, 512)
