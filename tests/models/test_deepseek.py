"""DeepSeek-V2/V3 beyond the per-architecture checks of test_architectures.py: latent attention at
DeepSeek's real widths (128 heads over one 576-wide latent row) on the CPU backend, the whole
engine's greedy tokens, the multi-token-prediction layer a V3 checkpoint carries left unread,
a routing refused by name, and two tensor-parallel ranks (the heads split, the latent whole)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_greedy, run_ranks, run_steps, save_tiny_tokenizer, shuffled_paged_metadata
from kernels.attention import CpuAttentionBackend, allocate_kv_caches, reference_paged_attention

VOCAB = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3 (q bottleneck, grouped sigmoid routing with a correction bias, a dense
    first layer, shared experts) as transformers saves it, with a word-level tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, eos_token_id=None, bos_token_id=None))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("deepseek_v3")
    hf.save_pretrained(path)
    return save_tiny_tokenizer(path, VOCAB)


@pytest.mark.parametrize("reqs", [[(0, 5), (7, 1), (3, 4)], [(9, 1), (2, 1)]], ids=["mixed", "decode"])
def test_latent_rows_576_wide_over_128_heads_match_the_reference(reqs):
    """DeepSeek-V3's real widths: one key/value head 576 wide (the latent and the rotary part)
    under 128 query heads, past what the native kernels take: the torch path's results."""
    gen = torch.Generator().manual_seed(0)
    meta, blocks = shuffled_paged_metadata(reqs, 16, gen, 1)
    T = meta.num_tokens
    q, k = torch.randn(T, 128, 576, generator=gen), torch.randn(T, 1, 576, generator=gen)
    cache = torch.randn(2, blocks, 16, 1, 576, generator=gen)
    ours = CpuAttentionBackend().forward(q, k, k, cache.clone(), meta, 0.1)
    torch.testing.assert_close(ours, reference_paged_attention(q, k, k, cache.clone(), meta, 0.1), atol=2e-5,
                               rtol=1e-5)


def test_the_engine_generates_transformers_greedy_tokens(checkpoint):
    from transformers import DeepseekV3ForCausalLM
    from actors.api import LLM, SamplingParams
    hf = DeepseekV3ForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 13)]
    want = hf_greedy(hf, prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(checkpoint, multiprocess=False, kv_cache_bytes=1 << 22, max_num_batched_tokens=8,
             enable_chunked_prefill=True) as llm:
        got = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and len({tuple(t) for t in want}) == 2


def test_the_prediction_layer_past_the_models_is_left_unread_and_bad_routing_is_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    from models.registry import load_model
    from models.resolve import resolve_model
    state = load_file(f"{checkpoint}/model.safetensors")
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)         # V3's multi-token-prediction layer
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text(open(f"{checkpoint}/{name}").read())
    save_file(state, str(tmp_path / "model.safetensors"))
    load_model(resolve_model(str(tmp_path)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "topk_method": "random"}))
    with pytest.raises(ValueError, match="DeepSeek's topk_method 'random' is not supported"):
        load_model(resolve_model(str(tmp_path)))


def _logits(model, config) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 5)]] + \
        [[torch.tensor([s + 3]), torch.tensor([s + 40])] for s in range(3)]
    return run_steps(model, allocate_kv_caches(config, 32, 4, torch.float32), [list(range(1, 8)), list(range(8, 16))],
                     steps, 4)


def _rank(rank: int, world: int, checkpoint: str) -> tuple[int, torch.Tensor]:
    from models.registry import load_model
    from models.resolve import resolve_model
    from models.tensor_parallel import shard_model
    model, config = load_model(resolve_model(checkpoint))
    shard_model(model, world, rank)
    return model.layers[0].self_attn.num_heads, _logits(model, config)      # one latent head on every rank


def test_two_ranks_split_the_heads_and_give_the_unsplit_logits(checkpoint, tmp_path):
    from models.registry import load_model
    from models.resolve import resolve_model
    model, config = load_model(resolve_model(checkpoint))
    want = _logits(model, config)
    assert want.std() > 0.5
    ranks = run_ranks(_rank, 2, tmp_path, checkpoint)
    assert [heads for heads, _ in ranks] == [2, 2]
    for _, got in ranks:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
