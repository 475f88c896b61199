"""The hybrid KV cache manager on its own (no model): sliding-window groups release the blocks
that fall out of the window, prefix-cache hits are found per group and combined, the integrity
check covers every group, and freeing returns every block; the groups a model gets and the
capacity a config resolves to."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from actors.engine.messages import EngineCoreRequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.block_hash import extend_block_hashes
from actors.kv_manager.kv_cache_spec import (FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec,
                                             blocks_per_request, bytes_per_block, create_kv_cache_views,
                                             describe_groups, kv_cache_groups, model_kv_cache_specs,
                                             with_draft_layers)
from actors.kv_manager.manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler
from models.config import FULL, SLIDING, ArchConfig
from models.resolve import ModelSource

BS, W = 4, 8                                  # blocks of 4 tokens, a window of 8 tokens
FULL_GROUP = KVCacheGroupSpec((0,), FullAttentionSpec(BS, 1, 8, 4))
SLIDING_GROUP = KVCacheGroupSpec((1,), SlidingWindowSpec(BS, 1, 8, 4, sliding_window=W))


def hybrid(num_blocks: int = 64, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, (FULL_GROUP, SLIDING_GROUP))


def hashes(tokens: list[int]) -> list:
    out: list = []
    extend_block_hashes(out, tokens, BS)
    return out


def run(kv: KVCacheManager, rid: str, tokens: list[int], prompt_len: int, chunk: int = 1 << 30) -> None:
    """Allocate as the scheduler does: the prompt in chunks, then one token a step."""
    done = 0
    while done < len(tokens):
        n = min(chunk, prompt_len - done) if done < prompt_len else 1
        assert kv.allocate_slots(rid, done + n, hashes(tokens[:done + n])) is not None
        kv.check_integrity()
        done += n


def test_a_sliding_group_holds_a_window_of_blocks_and_the_full_group_all():
    kv = hybrid()
    tokens = list(range(100, 140))                                  # 40 tokens: 10 blocks
    run(kv, "a", tokens, prompt_len=20)
    full, sliding = kv.num_blocks_held_per_group("a")
    assert full == 10
    assert sliding <= -(-W // BS) + 1 == 3                          # what the last query can see
    table = kv.managers[1].req_to_blocks["a"]
    assert len(table) == 10 and table[:7] == [kv.pool.null_block] * 7   # older entries: the null block
    assert kv.num_free_blocks == 63 - full - sliding                # released blocks went back


def test_a_prompt_chunk_gets_blocks_for_the_window_before_it_and_its_own_tokens():
    kv = hybrid()
    tokens = list(range(100, 164))                                  # 64 tokens
    assert kv.allocate_slots("a", 32, hashes(tokens[:32])) is not None
    ids = kv.allocate_slots("a", 64, hashes(tokens))                # second chunk: 32 more tokens
    assert [len(g) for g in ids] == [8, 8]
    # the chunk's first query (position 32) sees positions 25.. : blocks 6 and 7 stay, 0..5 go
    assert kv.num_blocks_held_per_group("a") == (16, 2 + 8)


def test_freeing_returns_every_block_of_every_group():
    kv = hybrid(num_blocks=40)
    for i in range(3):
        run(kv, f"r{i}", list(range(1000 * i, 1000 * i + 30)), prompt_len=17, chunk=8)
    assert kv.num_free_blocks < 39
    for i in range(3):
        kv.free(f"r{i}")
        kv.check_integrity()
    assert kv.num_free_blocks == 39 and kv.req_to_blocks == {}


def test_allocation_that_does_not_fit_changes_nothing_and_a_victim_makes_room():
    kv = hybrid(num_blocks=13)                                       # 12 usable
    assert kv.allocate_slots("a", 20, hashes(list(range(20)))) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert kv.allocate_slots("b", 8, hashes(list(range(50, 58)))) is None   # 4 blocks, 2 free
    kv.check_integrity()
    kv.free("a")                                                     # preempted
    assert kv.allocate_slots("b", 8, hashes(list(range(50, 58)))) is not None
    kv.check_integrity()


def test_a_full_attention_hit_is_the_longest_prefix_of_cached_blocks():
    kv = KVCacheManager(64, BS, True, (FULL_GROUP,))
    tokens = list(range(100, 124))
    run(kv, "a", tokens, prompt_len=24)
    kv.free("a")
    assert len(kv.get_computed_blocks(hashes(tokens))) == 6
    assert len(kv.get_computed_blocks(hashes(tokens[:10] + [0] * 14))) == 2   # a different third block


def test_a_sliding_hit_needs_only_its_last_window_cached():
    kv = hybrid()
    tokens = list(range(100, 140))
    run(kv, "a", tokens, prompt_len=40)                              # one chunk: every block cached
    kv.free("a")
    for key in [k for k in kv.pool.cached if k[1] == 1][:5]:         # evict the sliding group's oldest 5
        kv.pool.cached.pop(key).block_hash = None
    hit = kv.get_computed_blocks(hashes(tokens)[:9])
    assert len(hit) == 9                                             # 36 tokens, the window after them cached
    full, sliding = hit.blocks
    assert all(b is not kv.pool.null_block for b in full)
    assert sliding[:7] == [kv.pool.null_block] * 7 and kv.pool.null_block not in sliding[7:]
    ids = kv.allocate_slots("b", 40, hashes(tokens), hit)            # the hit is taken, one block is new
    assert [len(g) for g in ids] == [10, 10] and ids[1][:7] == [0] * 7
    kv.check_integrity()


def test_the_hit_is_the_length_every_group_agrees_on():
    kv = hybrid()
    tokens = list(range(100, 140))
    run(kv, "a", tokens, prompt_len=40)
    kv.free("a")
    full_keys = [k for k in kv.pool.cached if k[1] == 0]
    kv.pool.cached.pop(full_keys[6]).block_hash = None               # full attention stops at 6 blocks
    sliding_keys = [k for k in kv.pool.cached if k[1] == 1]
    kv.pool.cached.pop(sliding_keys[4]).block_hash = None            # the window after 6 blocks lacks block 4
    hit = kv.get_computed_blocks(hashes(tokens)[:9])
    # 6 blocks: the sliding group cannot serve (needs blocks 4, 5); 5 blocks: needs 3, 4 (no);
    # 4 blocks: needs 2, 3, cached; the full group serves any shorter prefix
    assert len(hit) == 4 and [len(g) for g in hit.blocks] == [4, 4]


def test_the_integrity_check_sees_a_sliding_block_kept_out_of_its_window():
    kv = hybrid()
    tokens = list(range(100, 140))
    run(kv, "a", tokens, prompt_len=40)
    assert kv.allocate_slots("a", 41, hashes(tokens + [1])) is not None    # releases out-of-window blocks
    kv.check_integrity()
    table = kv.managers[1].req_to_blocks["a"]
    stolen = kv.pool.free_queue.popleft()
    stolen.owners = {"a"}
    table[0] = stolen                                                # a block where the null block belongs
    with pytest.raises(RuntimeError, match="out of group 1's window"):
        kv.check_integrity()


def test_the_integrity_check_sees_a_block_in_two_groups():
    kv = hybrid()
    run(kv, "a", list(range(8)), prompt_len=8)
    kv.managers[1].req_to_blocks["a"][-1] = kv.managers[0].req_to_blocks["a"][-1]
    with pytest.raises(RuntimeError, match="in groups 0 and 1"):
        kv.check_integrity()


def test_the_scheduler_runs_and_preempts_on_the_hybrid_manager_without_leaking():
    """Long prompts in chunks, decodes and preemptions in a cache too small for all of them; the
    integrity check after every step, every block back at the end."""
    config = EngineConfig(
        model=ModelConfig(source=ModelSource("hf_dir", "", "fake"), max_model_len=200),
        cache=CacheConfig(block_size=BS, num_blocks=60),
        scheduler=SchedulerConfig(max_num_batched_tokens=16))
    kv = hybrid(num_blocks=60)
    s = Scheduler(config, kv)
    for i in range(4):
        prompt = list(range(1000 * (i + 1), 1000 * (i + 1) + 40 + 7 * i))
        s.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                        0.0, [2]))
    from actors.engine.messages import ModelRunnerOutput
    for _ in range(400):
        if not s.has_work():
            break
        so = s.schedule()
        done = {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        done |= dict(zip(so.cached_reqs.req_ids, so.cached_reqs.num_computed_tokens))
        sampled = [[7] if done[rid] + n == s.requests[rid].num_tokens else []
                   for rid, n in so.num_scheduled_tokens.items()]
        s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
        kv.check_integrity()
        for rid in s.requests:
            assert kv.num_blocks_held_per_group(rid)[1] <= -(-(W - 1 + 16) // BS) + 1
    assert not s.has_work() and s.counters.num_preemptions > 0
    assert kv.num_free_blocks == 59


# -- groups and capacity -------------------------------------------------------------------------

GEMMA = ArchConfig("Gemma3ForCausalLM", 100, 64, 128, 18, 4, 1, 256, 32768, 1e6, 1e-6, True, None, (1,),
                   sliding_window=512, layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)))


def test_gemma3_layers_make_one_full_group_and_five_sliding_groups_of_three():
    groups = kv_cache_groups(model_kv_cache_specs(GEMMA, 16, 4))
    assert [g.layer_ids for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                             (14, 15, 16)]
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert describe_groups(groups) == "6 KV cache groups of 3 layers: 1 full attention, 5 sliding window 512"
    conservative = kv_cache_groups(model_kv_cache_specs(GEMMA, 16, 4), hybrid=False)
    assert [g.layer_ids for g in conservative] == [tuple(range(18))] and conservative[0].sliding_window is None


def test_a_model_without_windows_has_one_group_either_way():
    llama = ArchConfig("LlamaForCausalLM", 100, 64, 128, 4, 4, 2, 16, 4096, 1e4, 1e-6, True, None, (1,))
    specs = model_kv_cache_specs(llama, 16, 4)
    assert kv_cache_groups(specs) == kv_cache_groups(specs, hybrid=False)
    assert kv_cache_groups(specs)[0].layer_ids == (0, 1, 2, 3)


def resolved_gemma(**scheduler) -> EngineConfig:
    return EngineConfig(model=ModelConfig(source=ModelSource("gguf", "", "gemma")),
                        cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                        scheduler=SchedulerConfig(**scheduler)).resolve(cuda_available=False, cpu_count=2, arch=GEMMA)


def test_a_gib_holds_more_long_requests_with_the_hybrid_manager():
    """1 GiB of float32 KV for the Gemma 3 270m shapes, 4,000-token requests: 18 layers x 32 KiB
    a block without it (1,820 blocks, 250 a request: 7), 3 layers a block with it (10,922
    blocks; 250 + 5 sliding groups of 33 during decode: 26)."""
    plain = resolved_gemma(disable_hybrid_kv_cache_manager=True)
    hyb = resolved_gemma()
    assert (plain.cache.num_blocks, hyb.cache.num_blocks) == (1820, 10922)
    per_request = blocks_per_request(hyb.kv_cache_groups(), 4000, 1)       # decoding: one token a step
    assert per_request == 250 + 5 * 33
    assert ((plain.cache.num_blocks - 1) // 250, (hyb.cache.num_blocks - 1) // per_request) == (7, 26)
    assert plain.model.max_model_len == 1819 * 16
    assert hyb.model.max_model_len == GEMMA.max_model_len               # 32k tokens fit alone
    assert hyb.resolve(cuda_available=False, cpu_count=2, arch=GEMMA) == hyb


def test_a_cache_too_small_for_one_token_in_every_group_is_a_value_error():
    cfg = EngineConfig(model=ModelConfig(source=ModelSource("gguf", "", "gemma")),
                       cache=CacheConfig(num_blocks=4))
    with pytest.raises(ValueError, match="6 KV cache groups"):
        cfg.resolve(cuda_available=False, cpu_count=2, arch=GEMMA)


def test_a_self_draft_pairs_each_draft_layer_with_its_target_layer_and_doubles_every_group():
    """Gemma 3 drafting with its own weights: 18 more layers, draft layer i (numbered 18 + i) in the
    group of target layer i, so every group holds 6 layers of one kind and a block id stands for
    twice the bytes; the draft's sliding layers keep a window's worth of blocks like the target's."""
    specs = model_kv_cache_specs(GEMMA, 16, 4)
    groups = kv_cache_groups(specs)
    paired = with_draft_layers(groups, specs, specs)
    assert [g.layer_ids for g in paired] == [g.layer_ids + tuple(18 + i for i in g.layer_ids) for g in groups]
    assert [g.kv_cache_spec for g in paired] == [g.kv_cache_spec for g in groups]
    assert bytes_per_block(paired) == 2 * bytes_per_block(groups)
    views = create_kv_cache_views(specs + specs, 8, torch.float32, groups=paired)
    for target, draft in zip(range(18), range(18, 36)):     # own tensors, same shape
        assert views[target].shape == views[draft].shape and views[target].data_ptr() != views[draft].data_ptr()


def test_another_draft_architecture_joins_a_one_group_target_or_is_refused_with_the_reason():
    llama = ArchConfig("LlamaForCausalLM", 100, 64, 128, 4, 4, 1, 256, 4096, 1e4, 1e-6, False, None, (1,))
    small = ArchConfig("LlamaForCausalLM", 100, 32, 64, 2, 2, 1, 256, 4096, 1e4, 1e-6, False, None, (1,))
    target, draft = model_kv_cache_specs(llama, 16, 4), model_kv_cache_specs(small, 16, 4)
    (group,) = with_draft_layers(kv_cache_groups(target), target, draft)
    assert group.layer_ids == (0, 1, 2, 3, 4, 5)
    wide = ArchConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 256, 4096, 1e4, 1e-6, False, None, (1,))
    with pytest.raises(ValueError, match="must match the target's"):
        with_draft_layers(kv_cache_groups(target), target, model_kv_cache_specs(wide, 16, 4))
    gemma = model_kv_cache_specs(GEMMA, 16, 4)
    one_kv_head = model_kv_cache_specs(dataclasses.replace(small, head_size=256), 16, 4)
    with pytest.raises(ValueError, match="disable-hybrid-kv-cache-manager"):
        with_draft_layers(kv_cache_groups(gemma), gemma, one_kv_head)
    (group,) = with_draft_layers(kv_cache_groups(gemma, hybrid=False), gemma, one_kv_head)
    assert len(group.layer_ids) == 20
