"""gpt-oss beyond the per-architecture checks of test_architectures.py: its MXFP4 checkpoints (the
form OpenAI publishes) against transformers' dequantization, tensor and expert parallelism over
two gloo ranks (the sinks and the experts' biases split with their heads and experts), and the
whole engine's greedy tokens against transformers' ``generate``."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import hf_greedy, run_ranks, run_steps, save_tiny_tokenizer
from kernels.attention import allocate_kv_caches
from models.registry import load_model
from models.resolve import resolve_model

VOCAB, BS = 96, 4
E, H, I = 4, 64, 64          # experts, hidden, intermediate (MXFP4 blocks: 32 values a row each)


def _config(**kw):
    from transformers import GptOssConfig
    return GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        sliding_window=5, num_local_experts=E, num_experts_per_tok=2, swiglu_limit=1.5,
                        tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "rope_theta": 5000.0, "original_max_position_embeddings": 64,
                                         "truncate": False}, **kw)


def _spread(hf) -> None:
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)          # sinks that matter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A float checkpoint as transformers saves gpt-oss (experts stacked, gate and up interleaved)."""
    from transformers import GptOssForCausalLM
    torch.manual_seed(0)
    hf = GptOssForCausalLM(_config())
    _spread(hf)
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path)
    return save_tiny_tokenizer(path, VOCAB)


def _random_mxfp4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, rows, cols / 32, 16) codes and (E, rows, cols / 32) exponents around 2^-4."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 125, (E, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """An MXFP4 checkpoint (experts as blocks and scales, quant_method mxfp4) and the float model
    transformers makes of the same numbers (its own dequantization)."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(1)
    hf = GptOssForCausalLM(_config())
    _spread(hf)
    g = torch.Generator().manual_seed(7)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for i, layer in enumerate(hf.model.layers):
        prefix = f"model.layers.{i}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks, scales = _random_mxfp4(rows, cols, g)
            with torch.no_grad():   # transformers' dequantization: (E, cols, rows), its float layout
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del state[prefix + proj]
            state[prefix + proj + "_blocks"], state[prefix + proj + "_scales"] = blocks, scales
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    return str(path), hf.eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from models.quantization.mxfp4 import dequantize_mxfp4
    blocks, scales = _random_mxfp4(8, 96, torch.Generator().manual_seed(3))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)       # (E, 96, 8)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2), atol=0, rtol=0)
    with pytest.raises(ValueError, match="MXFP4 blocks .* and scales .* do not match"):
        dequantize_mxfp4(blocks, scales[..., :2])


def test_an_mxfp4_checkpoint_gives_transformers_logits_of_its_dequantized_experts(mxfp4_checkpoint):
    path, hf = mxfp4_checkpoint
    model, config = load_model(resolve_model(path))
    tokens = _prompt(21, 4)
    steps = [[torch.tensor(tokens[:13])]] + [[torch.tensor([t])] for t in tokens[13:]]
    ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(1, 8))], steps, BS)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    assert want.std() > 0.5
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_mxfp4_is_refused_for_other_models_and_half_pairs(mxfp4_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    path, _ = mxfp4_checkpoint
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MXFP4 checkpoints are read for gpt-oss .*not LlamaForCausalLM"):
        load_model(resolve_model(str(tmp_path / "llama")))
    half = tmp_path / "half"
    half.mkdir()
    for name in os.listdir(path):
        if name.endswith(".json"):
            (half / name).write_text(open(os.path.join(path, name)).read())
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(half / "model.safetensors"))
    with pytest.raises(ValueError, match="without their other half.*layers.1.mlp.experts.down_proj_blocks"):
        load_model(resolve_model(str(half)))


# -- tensor and expert parallelism over two gloo ranks ------------------------------------------

def _logits(model, config, num_kv_heads: int) -> torch.Tensor:
    import dataclasses
    local = dataclasses.replace(config, num_kv_heads=num_kv_heads)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 6)]
    steps = [prompts] + [[torch.tensor([(5 * s + r) % VOCAB]) for r in range(2)] for s in range(3)]
    return run_steps(model, allocate_kv_caches(local, 32, BS, torch.float32), [list(range(1, 8)), list(range(8, 16))],
                     steps, BS)


def _rank(rank: int, world: int, checkpoint: str) -> dict:
    from models.tensor_parallel import shard_model
    results = {}
    for mode in ("tensor", "expert"):
        model, config = load_model(resolve_model(checkpoint))
        shard_model(model, world, rank, expert_parallel=mode == "expert")
        attn, moe = model.layers[0].self_attn, model.layers[0].mlp
        results[f"{mode} parts"] = (tuple(attn.sinks.shape), moe.expert_start, tuple(moe.w13_bias.shape),
                                    float(moe.w2_bias.abs().sum()) > 0)
        results[mode] = _logits(model, config, 1)
    return results


def test_two_ranks_with_split_or_whole_experts_give_the_unsplit_logits(checkpoint, tmp_path):
    ranks = run_ranks(_rank, 2, tmp_path, checkpoint)
    # tensor: two heads' sinks a rank, every expert's half of the gate|up biases, the down bias on rank 0 only;
    # expert: two whole experts a rank with their biases
    assert [r["tensor parts"] for r in ranks] == [((2,), 0, (E, I), True), ((2,), 0, (E, I), False)]
    assert [r["expert parts"] for r in ranks] == [((2,), 0, (2, 2 * I), True), ((2,), 2, (2, 2 * I), True)]
    model, config = load_model(resolve_model(checkpoint))
    want = _logits(model, config, 2)
    assert want.std() > 0.5
    for mode in ("tensor", "expert"):
        for r in ranks:
            torch.testing.assert_close(r[mode], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{mode}: {m}")


def test_the_engine_generates_transformers_greedy_tokens(checkpoint):
    """Through the scheduler, the hybrid KV cache (sliding and full layers in their own block
    groups), chunked prefill and the sampler: greedy tokens equal transformers' forward, one
    whole-sequence forward a token (its ``generate`` caches sliding layers its own way, and on
    these weights its logits drift from its forward's by 0.2)."""
    from transformers import GptOssForCausalLM
    from actors.api import LLM, SamplingParams
    hf = GptOssForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    prompts = [_prompt(n, 10 + n) for n in (7, 12, 19)]
    want = hf_greedy(hf, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(checkpoint, multiprocess=False, kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
             enable_chunked_prefill=True) as llm:
        got = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and len({tuple(t) for t in want}) == 3
