"""Tensor parallelism on tiny random models of each architecture: two real ranks (processes in a
gloo group), each holding its share of the heads (even and uneven splits, KV heads replicated
when fewer than the ranks; OLMo 2's q/k norms over all heads), of the MLP columns and of the vocabulary (embedding and LM head,
tied or not), give the logits of the unsplit model within float32 rounding, over a prompt step
and decode steps of a paged KV cache; with a LoRA adapter on every projection too."""
from __future__ import annotations

import dataclasses
import os
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kernels.attention import CpuAttentionBackend, allocate_kv_caches
from models.config import FULL, SLIDING, ArchConfig
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.lora_layers import LoRAMapping, wrap_lora_modules
from models.mistral import MistralForCausalLM
from models.olmo2 import Olmo2ForCausalLM, OlmoeForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.tensor_parallel import RowParallel, shard_model
from models.tp_layout import head_split, max_local_kv_heads, split
from helpers import run_steps

BS = 4
CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
           "MistralForCausalLM": MistralForCausalLM, "Gemma3ForCausalLM": Gemma3ForCausalLM,
           "Olmo2ForCausalLM": Olmo2ForCausalLM, "OlmoeForCausalLM": OlmoeForCausalLM}


def _arch(name: str, heads: int, kv_heads: int, **more) -> ArchConfig:
    extra = {}
    if name == "MistralForCausalLM":
        extra = dict(sliding_window=6, qkv_bias=True, o_bias=True)
    if name == "Gemma3ForCausalLM":
        extra = dict(sliding_window=6, layer_types=(SLIDING, FULL, SLIDING), hidden_act="gelu_pytorch_tanh",
                     query_pre_attn_scalar=16.0, rope_local_theta=10000.0)
    if name == "OlmoeForCausalLM":
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, moe_layers=(0, 1, 2),
                     norm_topk_prob=False)
    fields = dict(architecture=name, vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=heads, num_kv_heads=kv_heads, head_size=16, max_model_len=256, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=())
    return ArchConfig(**{**fields, **extra, **more})


def _model(arch: ArchConfig) -> torch.nn.Module:
    model = CLASSES[arch.architecture](arch, CpuAttentionBackend()).eval()
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15, generator=g)
    return model


def _logits(model: torch.nn.Module, arch: ArchConfig, num_kv_heads: int) -> torch.Tensor:
    """Logits of two prompts prefilled together, then four decode steps of both."""
    local = dataclasses.replace(arch, num_kv_heads=num_kv_heads)
    caches = allocate_kv_caches(local, 32, BS, torch.float32)
    g, V = torch.Generator().manual_seed(2), arch.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (9, 5)]
    steps = [prompts] + [[torch.tensor([(5 * s + r) % V]) for r in range(2)] for s in range(4)]
    return run_steps(model, caches, [list(range(1, 12)), list(range(12, 24))], steps, BS)


CASES = [
    ("LlamaForCausalLM", 4, 2),          # one KV head each
    ("LlamaForCausalLM", 6, 3),          # uneven: 2 + 1 KV heads, 4 + 2 query heads
    ("LlamaForCausalLM", 4, 1),          # one KV head, replicated; its query heads split
    ("Qwen3ForCausalLM", 4, 2),          # per-head q/k norms
    ("MistralForCausalLM", 4, 2),        # sliding window, q/k/v and output biases
    ("Gemma3ForCausalLM", 4, 2),         # sliding and full layers, its own norms
    ("Olmo2ForCausalLM", 6, 3),          # q/k norms over all heads: each rank's features, the ranks' sums
    ("Olmo2ForCausalLM", 4, 1),          # ... with the one KV head replicated on both ranks
    ("OlmoeForCausalLM", 4, 2),          # those norms before the experts, each expert's columns split
    ("LlamaForCausalLM", 4, 2, {"tie_word_embeddings": True, "vocab_size": 97}),   # a tied head, 49 + 48 rows
]


LORA_CASE = ("LlamaForCausalLM", 6, 3)     # uneven heads: each rank's share of q, k and v differs


def _lora_weights(arch: ArchConfig) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A rank-4 adapter on every projection of the unsplit model, by wrapped module name: per slice,
    (A (4, in), s B (rows, 4)), whole, as an adapter's files give them."""
    cpu = torch.device("cpu")
    probe = wrap_lora_modules(_model(arch), 1, 4, LoRAMapping(cpu), cpu)
    g = torch.Generator().manual_seed(3)
    return {name: {s: (torch.randn(4, layer.in_features, generator=g) * 0.3,
                       torch.randn(layer.offsets_list[j + 1] - layer.offsets_list[j], 4, generator=g) * 0.3)
                   for j, s in enumerate(layer.slice_names)}
            for name, layer in probe.items()}


def _with_lora(model: torch.nn.Module, weights) -> torch.nn.Module:
    """``model`` with the adapter ``weights`` in its one slot, applied to every token."""
    cpu = torch.device("cpu")
    mapping = LoRAMapping(cpu)
    for name, layer in wrap_lora_modules(model, 1, 4, mapping, cpu).items():
        layer.set_lora(0, weights[name])
    model.register_forward_pre_hook(lambda m, args: mapping.set(np.zeros(len(args[0]), dtype=np.int64)))
    return model


def _rank(rank: int, world: int, init: str, out: str) -> None:
    """One rank of the group: every case's logits (rank 0 saves them)."""
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        results = []
        for name, heads, kv_heads, *more in CASES:
            arch = _arch(name, heads, kv_heads, **(more[0] if more else {}))
            model = shard_model(_model(arch), world, rank)
            results.append(_logits(model, arch, head_split(heads, kv_heads, world, rank)[3]))
        name, heads, kv_heads = LORA_CASE
        arch = _arch(name, heads, kv_heads)
        model = _with_lora(shard_model(_model(arch), world, rank), _lora_weights(arch))
        lora = _logits(model, arch, head_split(heads, kv_heads, world, rank)[3])
        if rank == 0:
            torch.save({"cases": results, "lora": lora}, out)
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def test_two_ranks_together_give_the_unsplit_models_logits(tmp_path):
    out = str(tmp_path / "logits.pt")
    mp.start_processes(_rank, args=(2, f"file://{tmp_path}/init", out), nprocs=2, start_method="spawn", join=True)
    saved = torch.load(out)
    for (name, heads, kv_heads, *more), got in zip(CASES, saved["cases"], strict=True):
        arch = _arch(name, heads, kv_heads, **(more[0] if more else {}))
        want = _logits(_model(arch), arch, kv_heads)
        assert want.std() > 0.3
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {heads}/{kv_heads}: {m}")
    # a LoRA adapter given whole to each rank: each keeps its share of B's rows (q|k|v, gate|up) and
    # of A's columns (o, down), and the logits are those of the unsplit model with the adapter
    name, heads, kv_heads = LORA_CASE
    arch = _arch(name, heads, kv_heads)
    want = _logits(_with_lora(_model(arch), _lora_weights(arch)), arch, kv_heads)
    assert (want - _logits(_model(arch), arch, kv_heads)).abs().max() > 0.5       # the adapter matters
    torch.testing.assert_close(saved["lora"], want, rtol=1e-4, atol=1e-4)


def test_heads_and_columns_split_as_evenly_as_they_go():
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [head_split(9, 3, 2, r) for r in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]     # SmolLM2 on 2 ranks
    assert [head_split(8, 2, 4, r) for r in range(4)] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    assert max_local_kv_heads(9, 3, 2) == 2 and max_local_kv_heads(8, 2, 4) == 1
    with pytest.raises(ValueError, match="cannot be shared by 4 ranks"):
        head_split(9, 3, 4, 0)


def test_a_split_model_keeps_the_row_parallel_bias_on_rank_zero_only():
    arch = _arch("MistralForCausalLM", 4, 2)
    zero, one = shard_model(_model(arch), 2, 0), shard_model(_model(arch), 2, 1)
    o0, o1 = zero.layers[0].self_attn.o_proj, one.layers[0].self_attn.o_proj
    assert isinstance(o0, RowParallel) and o0.linear.bias is not None and o1.linear.bias is None
    assert zero.layers[0].self_attn.num_heads == 2 and tuple(o0.linear.weight.shape) == (64, 32)
    assert tuple(zero.embed_tokens.weight.shape) == (48, 64) and tuple(one.lm_head.linear.weight.shape) == (48, 64)
    assert os.environ.get("WORLD_SIZE") is None      # nothing joined a process group in this process


def test_a_gguf_layers_blocks_split_by_output_rows_and_by_whole_blocks_of_inputs():
    """A rank's part of a GGUF-quantized layer, taken before the blocks are packed: its output rows
    (column-parallel), or its run of inputs as whole blocks of 32 (row-parallel)."""
    from models.quantization.gguf import GGUFLinearMethod
    raw = torch.arange(4 * 2 * 34, dtype=torch.int32).to(torch.uint8).reshape(4, 68)    # Q8_0: 34 bytes a block
    method = GGUFLinearMethod({None: ("Q8_0", raw)}, int8_activations=False)
    method.in_features = 64
    rows = method.part(rows={None: (1, 2)})
    assert torch.equal(rows.shards[None][1], raw[1:3]) and rows.in_features == 64
    cols = method.part(cols=(32, 32))
    assert torch.equal(cols.shards[None][1], raw[:, 34:]) and cols.in_features == 32
    with pytest.raises(ValueError, match="whole blocks of 32 inputs only"):
        method.part(cols=(16, 32))
