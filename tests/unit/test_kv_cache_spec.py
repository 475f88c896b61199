"""KV cache specs: page sizes, the start-up check (a subclass of a known kind is served like it,
an unknown kind is a clear error), and the per-layer views of one buffer."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from actors.kv_manager.kv_cache_spec import (FullAttentionSpec, KVCacheSpec, SlidingWindowSpec,
                                             check_kv_cache_specs, create_kv_cache_views,
                                             num_blocks_for)


def test_page_size_counts_keys_and_values():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype_bytes=4)
    assert spec.page_size_bytes == 2 * 16 * 3 * 64 * 4


def test_specs_are_frozen():
    spec = FullAttentionSpec(16, 3, 64, 4)
    with pytest.raises(Exception):
        spec.block_size = 32


def test_subclass_of_a_known_spec_is_served_like_it():
    @dataclass(frozen=True, slots=True)
    class CustomFullSpec(FullAttentionSpec):
        pass
    check_kv_cache_specs([CustomFullSpec(16, 3, 64, 4), SlidingWindowSpec(16, 3, 64, 4, sliding_window=512)])


def test_unknown_spec_fails_at_start_up_with_a_value_error():
    @dataclass(frozen=True, slots=True)
    class MambaLikeSpec(KVCacheSpec):
        pass
    with pytest.raises(ValueError, match="MambaLikeSpec"):
        check_kv_cache_specs([FullAttentionSpec(16, 3, 64, 4), MambaLikeSpec(16, 3, 64, 4)])


def test_layer_views_share_one_buffer_and_do_not_overlap():
    specs = [FullAttentionSpec(4, 2, 8, 4) for _ in range(3)]
    views = create_kv_cache_views(specs, num_blocks=5, dtype=torch.float32)
    assert all(v.shape == (2, 5, 4, 2, 8) for v in views)
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)
    views[1].fill_(1.0)
    assert views[0].sum() == 0 and views[2].sum() == 0


def rss_mib() -> float:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_cpu_kv_cache_takes_memory_only_for_the_blocks_written():
    specs = [FullAttentionSpec(16, 4, 64, 4) for _ in range(8)]     # 512 blocks: 128 MiB in all
    before = rss_mib()
    views = create_kv_cache_views(specs, num_blocks=512, dtype=torch.float32)
    assert rss_mib() - before < 32
    assert not any(bool(v.any()) for v in views[:2])                  # reads as zeros
    views[3][:, :64].fill_(1.0)                                       # 2 MiB of one layer
    assert 1.5 < rss_mib() - before < 40
    assert float(views[3].sum()) == 2 * 64 * 16 * 4 * 64


def test_a_token_written_into_scattered_cpu_kv_blocks_takes_a_small_page_each():
    specs = [FullAttentionSpec(16, 4, 64, 4) for _ in range(4)]     # 16 KiB of keys a block
    views = create_kv_cache_views(specs, num_blocks=4096, dtype=torch.float32)
    before = rss_mib()
    for b in range(0, 4096, 64):                                      # 64 blocks, 1 MiB apart
        views[0][0, b, 0].fill_(1.0)                                  # one token's keys: 1 KiB
    grown = rss_mib() - before
    assert grown < 4, f"{grown:.1f} MiB for 64 KiB written: the 2 MiB huge page around each"
    assert float(views[0].sum()) == 64 * 4 * 64


def test_num_blocks_for_a_memory_budget():
    specs = [FullAttentionSpec(16, 3, 64, 4)] * 30
    per_block = 30 * specs[0].page_size_bytes
    assert num_blocks_for(specs, 10 * per_block + 5) == 10


def test_model_specs_follow_each_layers_window():
    from models.config import FULL, SLIDING, ArchConfig
    from actors.kv_manager.kv_cache_spec import model_kv_cache_specs
    cfg = ArchConfig("Gemma3ForCausalLM", 100, 64, 128, 3, 4, 2, 16, 512, 1e4, 1e-6, True, None, (1,),
                      sliding_window=8, layer_types=(SLIDING, SLIDING, FULL))
    specs = model_kv_cache_specs(cfg, 16, 4)
    assert [type(s).__name__ for s in specs] == ["SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"]
    assert specs[0].sliding_window == 8
    check_kv_cache_specs(specs)


def test_a_tensor_parallel_ranks_views_hold_its_own_kv_heads():
    """Blocks are sized for the most KV heads any rank holds (the groups' spec); each rank's views
    take the shape of its own layers' specs (3 KV heads over 2 ranks: 2 and 1)."""
    from actors.kv_manager.kv_cache_spec import kv_cache_groups
    groups = kv_cache_groups([FullAttentionSpec(16, 2, 64, 4)] * 3)
    views = create_kv_cache_views([FullAttentionSpec(16, 1, 64, 4)] * 3, num_blocks=5, dtype=torch.float32,
                                  groups=groups)
    assert [tuple(v.shape) for v in views] == [(2, 5, 16, 1, 64)] * 3
