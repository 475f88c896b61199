"""State-space models (models/mamba.py) against transformers on tiny random checkpoints: prompts
whole, in chunks and token by token, requests of one step in different state slots, a slot
reused by a new request, and bfloat16 weights."""
from __future__ import annotations

import copy

import pytest
import torch

from actors.kv_manager.kv_cache_spec import create_state_views
from kernels.attention import build_attention_metadata
from models.registry import get_model_class, load_model
from models.resolve import resolve_model

VOCAB = 96


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3,
                                        conv_kernel=4, expand=2, time_step_rank=6, use_conv_bias=True,
                                        tie_word_embeddings=True, architectures=["MambaForCausalLM"]))


def _falcon_mamba():  # weightless RMSNorms of B, C and the time step; an untied head
    from transformers import FalconMambaConfig, FalconMambaForCausalLM
    return FalconMambaForCausalLM(FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=3, expand=2,
        time_step_rank=4, tie_word_embeddings=False, architectures=["FalconMambaForCausalLM"]))


def _mamba2():  # 8 heads of 8 channels in 2 groups sharing B and C
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                          num_heads=8, head_dim=8, n_groups=2, expand=2, conv_kernel=4,
                                          chunk_size=16, tie_word_embeddings=False,
                                          architectures=["Mamba2ForCausalLM"]))


HYBRID_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=2, mamba_chunk_size=16)
TINY_ATTENTION = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _granite_hybrid():  # Granite 4.0-H: attention without positions in layer 1 of 4, experts beside a shared MLP
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **TINY_ATTENTION, **HYBRID_MAMBA, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40, position_embedding_type="nope",
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=1.3,
        architectures=["GraniteMoeHybridForCausalLM"]))


def _granite_hybrid_dense():  # no experts: the shared MLP alone; a rotary in the attention layers
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **TINY_ATTENTION, **HYBRID_MAMBA, num_hidden_layers=3, layer_types=["attention", "mamba", "attention"],
        num_local_experts=0, shared_intermediate_size=40, position_embedding_type="rope",
        architectures=["GraniteMoeHybridForCausalLM"]))


def _bamba():  # attention in layer 2 of 3, a rotary over half of each head
    from transformers import BambaConfig, BambaForCausalLM
    return BambaForCausalLM(BambaConfig(**TINY_ATTENTION, **HYBRID_MAMBA, num_hidden_layers=3,
                                        attn_layer_indices=[2], architectures=["BambaForCausalLM"]))


def _jamba():  # attention in layer 1 of 4 (no positions), 4 experts top 2 in layers 1 and 3, normed dt, B and C
    from transformers import JambaConfig, JambaForCausalLM
    return JambaForCausalLM(JambaConfig(
        **TINY_ATTENTION, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=6, use_mamba_kernels=False, architectures=["JambaForCausalLM"]))


def _nemotron_h():  # Mamba-2, attention without positions, squared-ReLU MLP blocks, one mixer each
    from transformers import NemotronHConfig, NemotronHForCausalLM
    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, hybrid_override_pattern="M-*M-", ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5,
        time_step_min=1e-30, tie_word_embeddings=False, architectures=["NemotronHForCausalLM"]))


def _qwen3_next():  # Gated DeltaNet in layers 0, 1 and 3 (4 value heads over 2 key heads), gated attention in 2,
    # a partial rotary, 4 experts top 2 and a gated shared expert
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=20, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                             "rope_type": "default"},
        tie_word_embeddings=False, architectures=["Qwen3NextForCausalLM"]))


QWEN3_5_TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=256, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                    linear_num_value_heads=4, tie_word_embeddings=False,
                    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"})


def _qwen3_5():  # Qwen3.5's separate Gated DeltaNet projections, a dense MLP
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TEXT, intermediate_size=48,
                                                architectures=["Qwen3_5ForCausalLM"]))


def _qwen3_5_moe():  # and experts in every layer, saved as the published multimodal checkpoints are (text only)
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=dict(**QWEN3_5_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         shared_expert_intermediate_size=20),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        architectures=["Qwen3_5MoeForConditionalGeneration"]))


def _lfm2():  # short gated convolutions (width 3) in layers 0, 2 and 3, attention with q/k norms in layer 1
    from transformers import Lfm2Config, Lfm2ForCausalLM
    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3, block_multiple_of=16, block_ffn_dim_multiplier=1.0, tie_word_embeddings=True,
        architectures=["Lfm2ForCausalLM"]))


BUILDERS = {"Lfm2ForCausalLM": _lfm2, "Qwen3_5ForCausalLM": _qwen3_5, "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe,
            "Qwen3NextForCausalLM": _qwen3_next, "JambaForCausalLM": _jamba, "NemotronHForCausalLM": _nemotron_h, "MambaForCausalLM": _mamba, "FalconMambaForCausalLM": _falcon_mamba, "Mamba2ForCausalLM": _mamba2,
            "GraniteMoeHybridForCausalLM": _granite_hybrid, "GraniteMoeHybridForCausalLM-dense": _granite_hybrid_dense,
            "BambaForCausalLM": _bamba}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = BUILDERS[request.param]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)                   # decays of every speed, from near 1 to fast
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight") or "layernorm" in name:
                # Qwen3-Next's and Qwen3.5's norms scale by 1 + weight (their gated one by weight)
                plus_one = request.param.startswith("Qwen3") and "linear_attn" not in name
                p.normal_(0.0 if plus_one else 1.0, 0.15)
            elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
                p.uniform_(-3.0, 0.5)
            else:
                p.normal_(0.0, 0.3)
    hf.config._attn_implementation = "eager"
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, config = load_model(resolve_model(str(path)))
    arch = request.param.split("-")[0]
    assert config.architecture == arch and isinstance(model, get_model_class(arch))
    text = hf.config.get_text_config()
    assert config.mamba is not None and len(config.attention_layers) == len(
        [t for t in getattr(text, "layer_types", None) or getattr(text, "layers_block_type", ())
         if t == "full_attention"] or getattr(text, "attn_layer_indices", None) or ())
    return model, config, hf.eval(), path


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


BLOCK, SLOT_BLOCKS = 4, 64          # a slot's request writes its KV (attention layers) in blocks of its own


class Slots:
    """The engine's recurrent state slots (and a paged KV cache for a hybrid's attention layers),
    driven by hand: the test plays scheduler and batch."""

    def __init__(self, config, num_slots: int = 4, dtype: torch.dtype = torch.float32):
        states = create_state_views(config, num_slots, dtype)
        kv = (2, 1 + num_slots * SLOT_BLOCKS, BLOCK, config.num_kv_heads, config.head_size)
        self.kv_caches = [states[i] if i in states else torch.zeros(kv, dtype=dtype) for i in range(config.num_layers)]

    def step(self, model, reqs: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
        """reqs: (new tokens, tokens computed before, state slot). Each request's (q, V) logits."""
        ids = torch.tensor([t for toks, _, _ in reqs for t in toks])
        pos = torch.tensor([p for toks, start, _ in reqs for p in range(start, start + len(toks))])
        tables = [list(range(1 + slot * SLOT_BLOCKS, 1 + slot * SLOT_BLOCKS + -(-(s + len(t)) // BLOCK)))
                  for t, s, slot in reqs]
        meta = build_attention_metadata([len(t) for t, _, _ in reqs], [s + len(t) for t, s, _ in reqs], tables,
                                        BLOCK, state_slots=[slot for _, _, slot in reqs])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, self.kv_caches, meta))
        return list(logits.split([len(t) for t, _, _ in reqs]))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Gated DeltaNet: transformers computes prompts by its chunked algorithm, Troupe token by token; on
# these weights both stand about 4e-4 from a float64 run over 150 tokens
TOLERANCE = {"Qwen3NextForCausalLM": 1e-3, "Qwen3_5ForCausalLM": 1e-3, "Qwen3_5MoeForConditionalGeneration": 1e-3}


def _close(ours: torch.Tensor, expected: torch.Tensor, config=None) -> None:
    assert expected.std() > 0.5, "reference logits too flat for the comparison to mean anything"
    tol = TOLERANCE.get(config.architecture, 2e-4) if config is not None else 2e-4
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)


def test_prefill_matches_transformers(case):
    model, config, hf, _ = case
    tokens = _prompt(150, 1)             # Mamba-2: past two chunks of its scan
    (logits,) = Slots(config).step(model, [(tokens, 0, 2)])
    _close(logits, hf_logits(hf, tokens), config)


def test_decode_continues_the_prompts_state_token_by_token(case):
    model, config, hf, _ = case
    tokens = _prompt(26, 2)
    slots = Slots(config)
    outs = slots.step(model, [(tokens[:5], 0, 1)])
    for p in range(5, len(tokens)):
        outs += slots.step(model, [(tokens[p:p + 1], p, 1)])
    _close(torch.cat(outs), hf_logits(hf, tokens))


def test_chunked_prefill_carries_the_state_between_chunks(case):
    model, config, hf, _ = case
    tokens = _prompt(100, 3)
    slots, outs, start = Slots(config), [], 0
    for chunk in (7, 1, 2, 70, 20):
        outs += slots.step(model, [(tokens[start:start + chunk], start, 0)])
        start += chunk
    _close(torch.cat(outs), hf_logits(hf, tokens), config)


def test_requests_of_one_step_keep_their_own_states_and_a_reused_slot_starts_fresh(case):
    """A decodes beside B's prompt (slots 3 and 1); then C takes A's slot 3 and starts from zero
    state, in a step beside B's decode."""
    model, config, hf, _ = case
    a, b, c = _prompt(12, 4), _prompt(17, 5), _prompt(9, 6)
    slots = Slots(config)
    slots.step(model, [(a[:11], 0, 3)])
    decode_a, prompt_b = slots.step(model, [(a[11:], 11, 3), (b[:16], 0, 1)])
    _close(decode_a, hf_logits(hf, a)[11:])
    _close(prompt_b, hf_logits(hf, b)[:16])
    decode_b, prompt_c = slots.step(model, [(b[16:], 16, 1), (c, 0, 3)])
    _close(decode_b, hf_logits(hf, b)[16:])
    _close(prompt_c, hf_logits(hf, c))
    two = slots.step(model, [(c[:1], 0, 3), (c[:1], 0, 0)])      # fresh slots in a decode-shaped step
    _close(torch.cat(two), hf_logits(hf, c[:1]).repeat(2, 1))


def test_bfloat16_weights_agree_with_float32(case):
    model, config, hf, path = case
    bf16, bf16_config = load_model(resolve_model(str(path)), dtype=torch.bfloat16)
    tokens = _prompt(40, 7)
    slots = Slots(bf16_config, dtype=torch.bfloat16)
    outs = slots.step(bf16, [(tokens[:30], 0, 0)])
    for p in range(30, len(tokens)):
        outs += slots.step(bf16, [(tokens[p:p + 1], p, 0)])
    ours, expected = torch.cat(outs), hf_logits(hf, tokens)
    hf_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), tokens)       # transformers' own bfloat16 error
    ours_rows, hf_rows = ((x - expected).abs().max(-1).values for x in (ours, hf_bf16))    # (T,) each
    if config.num_experts:     # a routing choice near a tie may flip under bfloat16's rounding, for a token or two
        ours_rows, hf_rows = ours_rows.sort().values[:-2], hf_rows.sort().values[:-2]
    assert ours_rows.max() < 2 * hf_rows.max() + 1e-2
    hf_agreement = (hf_bf16.argmax(-1) == expected.argmax(-1)).float().mean()
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= min(0.9, hf_agreement - 0.05)


@pytest.mark.parametrize("arch, blocks", [("MambaForCausalLM", 0), ("Mamba2ForCausalLM", 0),
                                          ("GraniteMoeHybridForCausalLM", 5), ("NemotronHForCausalLM", 5),
                                          ("Qwen3NextForCausalLM", 5), ("Lfm2ForCausalLM", 5)])
def test_the_engine_generates_transformers_greedy_tokens(arch, blocks, tmp_path):
    """Through the scheduler (prompts in chunks of at most 16 tokens beside other requests'
    decodes, more requests than running places so that state slots are reused) and the sampler:
    greedy tokens equal transformers' forward's, and prefix caching is off (a prefix's blocks
    would not give back its state), so a repeated prompt is computed again, to the same tokens.
    The hybrid's attention layers get 5 blocks of 16 tokens: requests are preempted, and
    computed again from a fresh state."""
    from actors.api import LLM, SamplingParams
    from helpers import hf_greedy, save_tiny_tokenizer
    torch.manual_seed(1)
    hf = BUILDERS[arch]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not (name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith("A_log")
                    or "layernorm" in name):
                p.normal_(0.0, 0.3)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    prompts = [_prompt(n, 20 + n) for n in (7, 23, 12, 40, 5)]
    prompts.append(prompts[3])
    want = hf_greedy(hf.eval(), prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(tmp_path), multiprocess=False, max_num_batched_tokens=16, max_num_seqs=3 if blocks else 2,
             enable_chunked_prefill=True, num_gpu_blocks_override=blocks) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.client.stats.last
    assert [r.token_ids for r in outs] == want and len({tuple(t) for t in want}) == 5
    assert [r.num_cached_tokens for r in outs] == [0] * len(prompts)
    assert (stats.num_preemptions > 0) == bool(blocks)


def test_in_its_own_processes_with_async_scheduling_the_engine_gives_the_same_tokens(tmp_path):
    """The worker in a process of its own plans step N + 1 while it computes step N (async
    scheduling); a hybrid's states still advance once per computed token: transformers' greedy
    tokens, with prompts in chunks and more requests than running places."""
    from actors.api import LLM, SamplingParams
    from helpers import hf_greedy, save_tiny_tokenizer
    torch.manual_seed(2)
    hf = BUILDERS["GraniteMoeHybridForCausalLM-dense"]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not (name.endswith("norm.weight") or name.endswith("A_log") or "layernorm" in name):
                p.normal_(0.0, 0.3)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    prompts = [_prompt(n, 40 + n) for n in (9, 30, 4)]
    want = hf_greedy(hf.eval(), prompts, 12)
    with LLM(str(tmp_path), multiprocess=True, async_scheduling=True, max_num_batched_tokens=16,
             max_num_seqs=2) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [r.token_ids for r in outs] == want


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration"])
def test_qwen3_next_checkpoints_multi_token_prediction_layer_is_not_read(arch, tmp_path):
    """The published Qwen3-Next and Qwen3.5 checkpoints carry an MTP layer (``mtp.*``): it is
    not run, so it is not read."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    hf = BUILDERS[arch]()
    hf.save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(4, 4), "mtp.layers.0.input_layernorm.weight": torch.zeros(4)},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    again, _ = load_model(resolve_model(str(tmp_path)))
    tokens = _prompt(20, 9)
    torch.testing.assert_close(Slots(config).step(again, [(tokens, 0, 0)])[0], Slots(config).step(model, [(tokens, 0, 0)])[0])


def _state_space_arch(mamba_layers=None):
    """Mamba-130m's dimensions (24 layers of 1,536 channels, a state of 16), or a hybrid of them
    with attention layers where ``mamba_layers`` names the Mamba ones."""
    from models.config import ArchConfig, MambaDims
    dims = MambaDims(1, 1536, 16, 4, dt_rank=48)
    return ArchConfig("MambaForCausalLM", 50280, 768, 1536, 24, 12, 4, 64, 2048, 1e4, 1e-5, True, 0, (0,),
                      mamba=dims, mamba_layers=mamba_layers)


def test_a_hybrid_whose_layers_all_attend_is_an_attention_model():
    """granite-4.0-micro: GraniteMoeHybridForCausalLM with attention in every layer, served as
    any attention model (prefix caching, no state slots)."""
    from models.hf_config import hf_model_config
    raw = {**TINY_ATTENTION, **HYBRID_MAMBA, "architectures": ["GraniteMoeHybridForCausalLM"], "rms_norm_eps": 1e-6,
           "num_hidden_layers": 2, "layer_types": ["attention", "attention"], "shared_intermediate_size": 40,
           "position_embedding_type": "rope"}
    config = hf_model_config(raw)
    assert config.mamba is None and config.attention_layers == (0, 1) and config.rope_layers is None
    assert hf_model_config({**raw, "layer_types": ["mamba", "attention"]}).mamba_layers == (0,)


def test_the_kv_cache_sets_the_states_aside_and_groups_only_attention_layers():
    from actors.engine.args import EngineArgs
    from actors.kv_manager.kv_cache_spec import MambaSpec, kv_cache_groups, model_kv_cache_specs
    arch = _state_space_arch()
    per_request = 24 * (1536 * 3 * 4 + 1536 * 16 * 4)                # conv inputs and float32 states, 24 layers
    assert arch.mamba_state_bytes(4) == per_request and arch.attention_layers == ()
    c = EngineArgs(max_num_seqs=8, kv_cache_bytes=1 << 30).create_engine_config().resolve(
        cuda_available=False, cpu_count=2, arch=arch)
    assert c.cache.num_blocks == 8 * 2048 // 16 + 1                   # blocks that count tokens, no memory
    assert not c.cache.enable_prefix_caching and c.model.max_model_len == 2048
    few = EngineArgs(max_num_seqs=64, kv_cache_bytes=1 << 27).create_engine_config().resolve(
        cuda_available=False, cpu_count=2, arch=arch)
    assert few.scheduler.max_num_seqs == (1 << 27) // per_request == 47     # the states 128 MiB hold
    with pytest.raises(ValueError, match="recurrent states for 1 sequences take 2.7 MiB, more than the KV cache's 1.0"):
        EngineArgs(max_num_seqs=64, kv_cache_bytes=1 << 20).create_engine_config().resolve(
            cuda_available=False, cpu_count=2, arch=arch)
    hybrid = _state_space_arch(mamba_layers=tuple(i for i in range(24) if i % 6))   # attention at 0, 6, 12, 18
    specs = model_kv_cache_specs(hybrid, 16, 4)
    assert [i for i, s in enumerate(specs) if not isinstance(s, MambaSpec)] == [0, 6, 12, 18]
    (group,) = kv_cache_groups(specs)
    assert group.layer_ids == (0, 6, 12, 18)
    h = EngineArgs(max_num_seqs=8, kv_cache_bytes=1 << 30).create_engine_config().resolve(
        cuda_available=False, cpu_count=2, arch=hybrid)
    states = 8 * 20 * (1536 * 3 * 4 + 1536 * 16 * 4)
    assert h.cache.num_blocks == ((1 << 30) - states) // (4 * 2 * 16 * 4 * 64 * 4)
    hybrid_few = EngineArgs(max_num_seqs=256, kv_cache_bytes=1 << 30).create_engine_config().resolve(
        cuda_available=False, cpu_count=2, arch=hybrid)                  # beside KV blocks: half the memory
    assert hybrid_few.scheduler.max_num_seqs == (1 << 29) // (20 * (1536 * 3 * 4 + 1536 * 16 * 4)) == 229


@pytest.mark.parametrize("option, flag", [(dict(tensor_parallel_size=2), "--tensor-parallel-size"),
                                          (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                           "--speculative-config")])
def test_what_a_recurrent_state_cannot_follow_is_refused_by_name(option, flag):
    from actors.engine.args import EngineArgs
    with pytest.raises(ValueError, match=f"MambaForCausalLM has state-space \\(Mamba\\) layers: {flag}"):
        EngineArgs(kv_cache_bytes=1 << 30, **option).create_engine_config().resolve(
            cuda_available=False, cpu_count=2, arch=_state_space_arch())
