"""The KV manager's decode fast path (a running request whose blocks already hold its next
tokens changes nothing) against the full allocation path, over random admissions with prefix
hits, decode and prompt-chunk steps with lookahead slots, frees and watermarks: the same blocks
returned, the same pool, the same cached prefixes, step by step."""
from __future__ import annotations

import random

from actors.kv_manager.block_hash import extend_block_hashes
from actors.kv_manager.manager import KVCacheManager

BS = 4


def _state(kv: KVCacheManager) -> tuple:
    return (kv.pool.num_free_blocks, sorted((b.block_id, h) for (h, _), b in kv.pool.cached.items()),
            {r: [b.block_id for b in bs] for r, bs in kv.managers[0].req_to_blocks.items()},
            dict(kv.managers[0].num_registered))


def test_the_decode_fast_path_changes_nothing_the_full_path_would_not():
    rng = random.Random(7)
    fast, slow = KVCacheManager(48, BS), KVCacheManager(48, BS)
    slow._keeps_all_blocks = False                      # every call through the full path
    assert fast._keeps_all_blocks
    taken = []                                          # the fast path's verdicts
    holds = fast._holds_already
    fast._holds_already = lambda *a: taken.append(holds(*a)) or taken[-1]
    prefixes = [[rng.randrange(50) for _ in range(10)] for _ in range(3)]
    running: dict[str, tuple[list[int], list, int]] = {}     # tokens, hashes, computed
    for i in range(600):
        op = rng.random()
        if op < 0.15 and len(running) < 6:                  # admit, maybe on a shared prefix
            rid = f"r{i}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            hashes: list = []
            extend_block_hashes(hashes, tokens, BS)
            hit_f, hit_s = fast.get_computed_blocks(hashes[:(len(tokens) - 1) // BS]), \
                slow.get_computed_blocks(hashes[:(len(tokens) - 1) // BS])
            n = rng.randrange(1, len(tokens) + 1)
            computed = len(hit_f.blocks[0]) * BS
            watermark = rng.choice([0, 0, 2, 40])
            got = [kv.allocate_slots(rid, max(n, computed + 1), hashes, h, watermark)
                   for kv, h in ((fast, hit_f), (slow, hit_s))]
            assert got[0] == got[1]
            if got[0] is not None:
                running[rid] = (tokens, hashes, max(n, computed + 1))
        elif op < 0.25 and running:                         # finish
            rid = rng.choice(sorted(running))
            del running[rid]
            fast.free(rid)
            slow.free(rid)
        elif running:                                       # a step: decode or a prompt chunk
            rid = rng.choice(sorted(running))
            tokens, hashes, computed = running[rid]
            if computed >= len(tokens):
                tokens.append(rng.randrange(50))
                extend_block_hashes(hashes, tokens, BS)
            n = min(rng.choice([1, 1, 1, 3]), len(tokens) - computed) or 1
            lookahead = rng.choice([0, 0, 2])
            got = [kv.allocate_slots(rid, computed + n, hashes, num_computed_tokens=computed,
                                     num_lookahead_tokens=lookahead) for kv in (fast, slow)]
            assert got[0] == got[1]
            if got[0] is not None:
                running[rid] = (tokens, hashes, computed + n)
        assert _state(fast) == _state(slow)
        fast.check_integrity()
    assert sum(taken) > 100 and not all(taken)              # taken often, and not always
