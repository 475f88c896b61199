"""Mixture of experts beyond the architecture checks of test_architectures.py: the native fused
MoE kernel against the torch reference loop, the checkpoint and config forms, and the parallel
layouts on a tiny random Qwen3-MoE checkpoint written by transformers (5 experts, top 2): two
gloo ranks with every expert split (tensor parallelism) and with whole experts per rank and an
all-to-all dispatch and combine (expert parallelism, 3 + 2 experts) give the unsplit model's
logits and greedy tokens; and real worker processes run it with
``LLM(tensor_parallel_size=2, enable_expert_parallel=True)``."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks, run_steps, save_tiny_tokenizer
from kernels.attention import allocate_kv_caches
from kernels.cpu import native
from models.moe import FusedMoE, fused_experts_ref, select_experts
from models.registry import load_model
from models.resolve import resolve_model

VOCAB, BS = 96, 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A 3-layer Qwen3-MoE (layer 1 dense) with spread-out weights and a word-level tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=31, num_experts=5,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    return save_tiny_tokenizer(path, VOCAB)


def _experts(T: int, H: int, I: int, E: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    weights, ids = select_experts(torch.randn(T, E, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.skipif(not native.available()[0], reason="native CPU kernels unavailable")
@pytest.mark.parametrize("T,H,I,E,k,start,held", [
    (1, 64, 48, 8, 2, 0, 8),         # one decode token
    (150, 40, 24, 6, 3, 0, 6),       # prefill: more pairs per expert than one block, threaded
    (33, 64, 31, 8, 2, 3, 3),        # experts 3..5 held here (expert parallelism): the others add nothing
    (7, 24, 16, 4, 1, 0, 4),         # top-1
])
def test_the_native_fused_moe_matches_the_torch_reference_loop(T, H, I, E, k, start, held):
    from kernels.cpu import moe as cpu_moe
    x, w13, w2, weights, ids = _experts(T, H, I, E, k, seed=T)
    w13, w2 = w13[start:start + held].contiguous(), w2[start:start + held].contiguous()
    assert cpu_moe.supports(x, w13, w2)
    want = fused_experts_ref(x, w13, w2, weights, ids, start)
    got = cpu_moe.fused_experts(x, w13, w2, weights, ids, start)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available()[0], reason="native CPU kernels unavailable")
@pytest.mark.parametrize("T,start,held", [(1, 0, 6), (90, 0, 6), (33, 2, 3)])
def test_the_native_fused_moe_with_biases_and_swigluoai_matches_the_reference_loop(T, start, held):
    """gpt-oss's experts: biases on both projections, the clamped swigluoai activation (its
    limit reached: some gate and up values beyond +-limit)."""
    from kernels.cpu import moe as cpu_moe
    from models.moe import ExpertActivation
    H, I, E = 40, 24, 6
    x, w13, w2, weights, ids = _experts(T, H, I, E, 2, seed=T)
    g = torch.Generator().manual_seed(T + 1)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    w13, w2 = w13[start:start + held].contiguous() * 4, w2[start:start + held].contiguous()
    b13, b2 = b13[start:start + held].contiguous(), b2[start:start + held].contiguous()
    act = ExpertActivation("swigluoai", 1.702, 3.0)
    want = fused_experts_ref(x, w13, w2, weights, ids, start, b13, b2, act)
    got = cpu_moe.fused_experts(x, w13, w2, weights, ids, start, b13, b2, *act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = fused_experts_ref(x, w13, w2, weights, ids, start)
    assert (want - plain).abs().max() > 0.5 and (x @ w13[0, :I].T).abs().max() > 3.0


@pytest.mark.skipif(not native.available()[0], reason="native CPU kernels unavailable")
@pytest.mark.parametrize("T,start,held", [(1, 0, 8), (150, 0, 8), (33, 3, 3)])
def test_bfloat16_experts_give_the_reference_of_their_rounded_inputs(T, start, held):
    """The CPU's --dtype bfloat16: bfloat16 expert weights, the rows rounded to bfloat16 as they
    enter each product (hidden 72 and intermediate 48: the pairs' vector loop and its tail)."""
    from kernels.cpu import moe as cpu_moe
    x, w13, w2, weights, ids = _experts(T, 72, 48, 8, 2, seed=T)
    w13 = w13[start:start + held].contiguous().bfloat16()
    w2 = w2[start:start + held].contiguous().bfloat16()
    assert cpu_moe.supports(x, w13, w2)
    got = cpu_moe.fused_experts(x, w13, w2, weights, ids, start)
    want = fused_experts_ref(x.bfloat16().float(), w13.float(), w2.float(), weights, ids, start)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids, start), want, rtol=5e-2,
                               atol=5e-2 * want.abs().max().item())       # the reference takes them too


def test_the_swigluoai_reference_equals_transformers_gpt_oss_experts():
    """Our stacked layout (gate rows, then up rows; biases apart) against transformers' gpt-oss
    experts (columns interleaved gate, up, gate, ...)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from models.moe import ExpertActivation
    torch.manual_seed(3)
    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                       swiglu_limit=2.0)
    hf = GptOssExperts(cfg)
    for p in hf.parameters():
        p.data.normal_(0.0, 0.5)
    x = torch.randn(9, 32)
    weights, ids = select_experts(torch.randn(9, 4), 2, renormalize=True)
    want = hf(x, ids, weights)
    w13 = torch.cat([hf.gate_up_proj[:, :, ::2], hf.gate_up_proj[:, :, 1::2]], dim=2).transpose(1, 2)
    b13 = torch.cat([hf.gate_up_proj_bias[:, ::2], hf.gate_up_proj_bias[:, 1::2]], dim=1)
    got = fused_experts_ref(x, w13.detach(), hf.down_proj.transpose(1, 2).detach(), weights, ids, 0, b13.detach(),
                            hf.down_proj_bias.detach(), ExpertActivation("swigluoai", 1.702, 2.0))
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_routing_takes_the_top_k_softmax_probabilities_renormalized_or_not():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]] and torch.allclose(w[0], probs[[1, 2]])
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(), torch.tensor(1.0)) and torch.allclose(w[0, 0] / w[0, 1], probs[1] / probs[2])


def test_the_config_places_the_experts_and_bad_values_are_named():
    from models.hf_config import hf_model_config
    base = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24)
    cfg = hf_model_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe_layers == (1, 5) and cfg.num_experts == 16 and not cfg.norm_topk_prob   # transformers' default
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    renamed = {k: v for k, v in base.items() if k != "num_experts"} | {"num_local_experts": 8, "norm_topk_prob": True}
    cfg = hf_model_config(renamed)      # transformers 5 writes num_local_experts
    assert cfg.num_experts == 8 and cfg.moe_layers == tuple(range(6)) and cfg.norm_topk_prob
    with pytest.raises(ValueError, match="needs num_experts \\(or num_local_experts\\) >= 1, got None"):
        hf_model_config({k: v for k, v in base.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="decoder_sparse_step must be at least 1, got 0"):
        hf_model_config({**base, "decoder_sparse_step": 0})
    mixtral = hf_model_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 96, True)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in \\[1, num_experts=4\\], got 5"):
        FusedMoE(8, 4, 5, 8, True, torch.float32)


def test_stacked_expert_tensors_load_like_the_per_expert_ones(checkpoint):
    """transformers 5 keeps the experts stacked (mlp.experts.gate_up_proj, down_proj): its
    state_dict loads into the same weights as the per-expert tensors of the saved checkpoint."""
    from transformers import Qwen3MoeForCausalLM
    from models.registry import get_model_class, load_weights
    model, config = load_model(resolve_model(checkpoint))
    state = Qwen3MoeForCausalLM.from_pretrained(checkpoint).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fresh = get_model_class(config.architecture)(config, model.layers[0].self_attn.backend)
    load_weights(fresh, state.items(), fresh.hf_tensor_map)
    for (name, got), want in zip(fresh.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    assert tuple(model.layers[0].mlp.w13_weight.shape) == (5, 62, 64) and type(model.layers[1].mlp).__name__ == "GatedMLP"
    with pytest.raises(ValueError, match="expert 2's up projection has shape \\(30, 64\\), expected \\(31, 64\\)"):
        model.layers[0].mlp.load_shard("up.2", torch.zeros(30, 64), "w13_weight")


def test_the_vllm_flag_reaches_the_parallel_config_and_lora_on_experts_is_refused(checkpoint):
    from actors.engine.args import EngineArgs
    from models.hf_config import read_hf_config
    from tools import serve
    args = serve.parse_args([checkpoint, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    parallel = EngineArgs.from_cli_args(args).create_engine_config().parallel
    assert (parallel.tensor_parallel_size, parallel.enable_expert_parallel) == (2, True)
    assert not EngineArgs.from_cli_args(serve.parse_args([checkpoint, "-tp", "2"])).create_engine_config() \
        .parallel.enable_expert_parallel
    config = EngineArgs(model=checkpoint, enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match="LoRA adapters on a mixture-of-experts model \\(Qwen3MoeForCausalLM\\)"):
        config.resolve(cuda_available=False, cpu_count=2, arch=read_hf_config(checkpoint))


# -- tensor and expert parallelism over two gloo ranks ------------------------------------------

def _logits(model, config, num_kv_heads: int) -> torch.Tensor:
    """Two prompts prefilled together then three decode steps of both (2 tokens a step), and one
    prompt alone then three decode steps (1 token a step: one rank routes none)."""
    import dataclasses
    local = dataclasses.replace(config, num_kv_heads=num_kv_heads)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 5)]
    steps = [prompts] + [[torch.tensor([(5 * s + r) % VOCAB]) for r in range(2)] for s in range(3)]
    two = run_steps(model, allocate_kv_caches(local, 32, BS, torch.float32), [list(range(1, 8)), list(range(8, 16))],
                    steps, BS)
    alone = [[torch.randint(0, VOCAB, (6,), generator=g)]] + [[torch.tensor([7 + s])] for s in range(3)]
    one = run_steps(model, allocate_kv_caches(local, 32, BS, torch.float32), [list(range(1, 8))], alone, BS)
    return torch.cat([two, one])


def _rank(rank: int, world: int, checkpoint: str) -> dict:
    from models.tensor_parallel import shard_model
    from models.tp_layout import head_split
    results = {}
    for mode in ("tensor", "expert"):
        model, config = load_model(resolve_model(checkpoint))
        shard_model(model, world, rank, expert_parallel=mode == "expert")
        moe = model.layers[0].mlp
        results[f"{mode} shapes"] = (moe.expert_start, tuple(moe.w13_weight.shape), tuple(moe.w2_weight.shape))
        results[mode] = _logits(model, config, head_split(4, 2, world, rank)[3])
    return results


def test_two_ranks_with_split_or_whole_experts_give_the_unsplit_logits(checkpoint, tmp_path):
    ranks = run_ranks(_rank, 2, tmp_path, checkpoint)
    # tensor parallelism: every expert, half its intermediate size (16 + 15); expert parallelism: 3 + 2 experts
    assert [r["tensor shapes"] for r in ranks] == [(0, (5, 32, 64), (5, 64, 16)), (0, (5, 30, 64), (5, 64, 15))]
    assert [r["expert shapes"] for r in ranks] == [(0, (3, 62, 64), (3, 64, 31)), (3, (2, 62, 64), (2, 64, 31))]
    model, config = load_model(resolve_model(checkpoint))
    want = _logits(model, config, 2)
    assert want.std() > 0.5
    for mode in ("tensor", "expert"):
        for r in ranks:
            torch.testing.assert_close(r[mode], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{mode}: {m}")
            assert torch.equal(r[mode].argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_llm_with_expert_parallelism_over_two_workers_answers_as_one_worker(checkpoint):
    from actors.api import LLM, SamplingParams
    prompts = [[3, 17, 42, 8, 9], [60, 2, 2, 71], [5] * 11]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(checkpoint, multiprocess=False, kv_cache_bytes=1 << 22) as llm:
        want = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_bytes=1 << 22) as llm:
        got = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 10 for t in want) and len({tuple(t) for t in want}) == 3


# -- Granite MoE with a shared expert: both tensor namings, and two ranks --------------------------

@pytest.fixture(scope="module")
def granite_shared(tmp_path_factory):
    """A tiny GraniteMoeShared checkpoint (saved in the hub's names: router.layer, input_linear,
    output_linear) and transformers' model of it."""
    from transformers import GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM
    torch.manual_seed(4)
    hf = GraniteMoeSharedForCausalLM(GraniteMoeSharedConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2, shared_intermediate_size=40,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=1.25,
        tie_word_embeddings=False, max_position_embeddings=256))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    path = tmp_path_factory.mktemp("granite_shared")
    hf.save_pretrained(path)
    return str(path), hf.eval()


def _granite_logits(model, config, kv_heads: int) -> torch.Tensor:
    import dataclasses
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randint(0, VOCAB, (n,), generator=g) for n in (7, 4)]] + \
        [[torch.tensor([s + 3]), torch.tensor([s + 9])] for s in range(3)]
    return run_steps(model, allocate_kv_caches(dataclasses.replace(config, num_kv_heads=kv_heads), 32, BS, torch.float32),
                     [list(range(1, 8)), list(range(8, 16))], steps, BS)


def _granite_rank(rank: int, world: int, checkpoint: str) -> torch.Tensor:
    from models.tensor_parallel import shard_model
    model, config = load_model(resolve_model(checkpoint))
    shard_model(model, world, rank)
    return _granite_logits(model, config, 1)


def test_granite_moe_shared_reads_both_namings_and_splits_over_two_ranks(granite_shared, tmp_path):
    """The hub's tensor names and transformers 5's in-memory ones (router.weight,
    experts.gate_up_proj: what a trainer sends) load the same weights; the logits are
    transformers'; two ranks (each expert's columns and the shared expert's split) give them too."""
    from models.registry import get_model_class, load_weights
    path, hf = granite_shared
    model, config = load_model(resolve_model(path))
    assert type(model.layers[0].mlp).__name__ == "SharedExpertMoE"
    fresh = get_model_class(config.architecture)(config, model.layers[0].self_attn.backend)
    state = hf.state_dict()
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in state
    load_weights(fresh, state.items(), fresh.hf_tensor_map)
    for (name, got), want in zip(fresh.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    tokens = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(5))
    ours = run_steps(model, allocate_kv_caches(config, 32, BS, torch.float32), [list(range(1, 8))], [[tokens]], BS)
    with torch.inference_mode():
        want = hf(tokens[None]).logits[0]
    assert want.std() > 0.5
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    whole = _granite_logits(model, config, 2)
    for part in run_ranks(_granite_rank, 2, tmp_path, path):
        torch.testing.assert_close(part, whole, rtol=1e-4, atol=1e-4)
