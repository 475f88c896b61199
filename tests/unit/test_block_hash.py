"""The prefix cache's block hashes are vLLM's (--prefix-caching-hash-algo): for the same tokens,
adapter and salt each algorithm gives exactly the digests vLLM 0.32 computes (the values below
were computed by vLLM 0.32's own hash_block_tokens), so Troupe's KV events carry the hashes a
KV-aware router computes for vLLM."""
from __future__ import annotations

import pytest

from actors.engine.args import EngineArgs
from actors.engine.lora import LoRARequest
from actors.kv_manager.block_hash import BlockHasher, extend_block_hashes
from actors.kv_manager.kv_events import external_hash

TOKENS = list(range(100, 132))             # two blocks of 16
LORA = LoRARequest("ad", 1, "/p/ad")

# per algorithm: [block 0 with the adapter and salt "s", block 1 with the adapter, block 0 plain]
VLLM_0_32 = {
    "sha256": ["0bb56f5db5ca04ed5891fb51f2af555b5501a4999cd7b23c40a6a084cd264fc3",
               "f998a215a1678e5f4e2ea58c41b1b06e4f200f9d35c31dbd71de1a59ef1f68e7",
               "605fd9e311c0890137f4c7df65be59449fb378632eecf434d1ecdf87c874fd55"],
    "sha256_cbor": ["ee168d18364fdcec601e752496f86cf1e4e3d6d38034699ad6cd2b922f0365e3",
                    "b607967af5f1f5f968ad26204d23ff0c7a253c5e49f38cd5b62ff576830b97c0",
                    "c78a554a1b648c084577886fa29e20b89d606beb26cafd7f90ba7482f31901bc"],
}
# with PYTHONHASHSEED=0 (without it xxhash's seed is random per process, as vLLM's)
VLLM_0_32_SEED_0 = {
    "sha256": ["68380ac2fda8761888eba7575e6fc546c06ea39a82b91d3c103450f71b6d782b",
               "33179cfc3db449df046c38b3446da5f2b2f6b6458ad9501e806abfda380ee9c5",
               "3e333711c2a7b6810fc3053131adb41ae6f863bdfa562bdca49d1a371975611d"],
    "xxhash": ["1af1cc18fa21c901fd2da91643769e02", "c51a1290f24778ad1526bdc387748c15",
               "2d6d44d4c8320b45ad8bae4cf295d6ba"],
    "xxhash_cbor": ["35a9c6c52f4c823dd2a530ac5a732db8", "63d63caf555f4a3a3a13d2d7a90cfb9a",
                    "44a6e932beab462055ecfc98f7017242"],
}


def _hashes(hasher: BlockHasher) -> list[str]:
    with_keys, plain = [], []
    extend_block_hashes(with_keys, TOKENS, 16, LORA, "s", hasher)
    extend_block_hashes(plain, TOKENS[:16], 16, None, None, hasher)
    return [h.hex() for h in with_keys + plain]


@pytest.mark.parametrize("algo", sorted(VLLM_0_32))
def test_each_algorithm_gives_vllms_digests(monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert _hashes(BlockHasher(algo)) == VLLM_0_32[algo]


@pytest.mark.parametrize("algo", sorted(VLLM_0_32_SEED_0))
def test_pythonhashseed_seeds_the_first_parent_as_in_vllm(monkeypatch, algo):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert _hashes(BlockHasher(algo)) == VLLM_0_32_SEED_0[algo]


def test_xxhash_without_a_seed_differs_per_process_and_the_default_is_sha256(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert _hashes(BlockHasher("xxhash")) != _hashes(BlockHasher("xxhash"))
    config = EngineArgs().create_engine_config()
    assert config.cache.prefix_caching_hash_algo == "sha256"
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineArgs(prefix_caching_hash_algo="md5").create_engine_config()
    # a KV event's block hash: the digest's low 64 bits, as vLLM's
    assert external_hash(bytes.fromhex(VLLM_0_32["sha256"][2])) == int(VLLM_0_32["sha256"][2][-16:], 16)


# vLLM 0.32's hashes (its generate_block_hash_extra_keys and hash_block_tokens, sha256) of a prompt
# given as 40 rows of embeddings, np.arange(320).reshape(40, 8) / 7 in float32, then 8 tokens
VLLM_0_32_PROMPT_EMBEDS = ["f6099229365e2eecbdfac9bfd9f74f68096d5716dcd7597a17fc4590e22b597b",
                           "75722c358a39d5fd621138396f1dac1e0e153e3eb9882e5142f9851d1e6f2f8a",
                           "ae97bc85aa72b4a63eb65885c0406715a1ebfa2e31475261157bc2ef8c53d016"]


def test_a_prompt_given_as_embeddings_hashes_its_rows_as_vllm_does(monkeypatch):
    import numpy as np
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rows = (np.arange(40 * 8, dtype=np.float32).reshape(40, 8) / 7).astype(np.float32)
    tokens = [0] * 40 + list(range(5, 13))           # the prompt's placeholders, then generated tokens
    hashes: list = []
    extend_block_hashes(hashes, tokens, 16, hasher=BlockHasher("sha256"), prompt_embeds=rows)
    assert [bytes(h).hex() for h in hashes] == VLLM_0_32_PROMPT_EMBEDS
    other: list = []                                  # other rows, the same placeholders: other blocks
    extend_block_hashes(other, tokens, 16, hasher=BlockHasher("sha256"), prompt_embeds=rows + 1)
    assert not set(other) & set(hashes)
