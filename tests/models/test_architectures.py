"""Every architecture against transformers on tiny random weights saved as safetensors and read
back by our loader: plain prefill, step-by-step decode through the paged cache, chunked prefill,
a prefix-cache hit mixed with another request's decode, decode-vs-prefill log-probs, bfloat16."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention import allocate_kv_caches, build_attention_metadata
from models.registry import get_model_class, load_model
from models.resolve import resolve_model

BLOCK_SIZE = 4
VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
SLIDING, FULL = "sliding_attention", "full_attention"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2, rope_theta=5000.0, tie_word_embeddings=False))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**TINY, num_hidden_layers=2, rope_theta=20000.0, tie_word_embeddings=False))


def _qwen3():  # q/k norm, tied embeddings, sliding window on layers >= 1
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**TINY, num_hidden_layers=3, tie_word_embeddings=True,
                                        use_sliding_window=True, sliding_window=5, max_window_layers=1))


def _mistral():  # one window for every layer
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**TINY, num_hidden_layers=2, sliding_window=6, tie_word_embeddings=False))


def _gemma3():  # local layers with W = 4 and their own rope base, linear-scaled global rope, softcap
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    rope = {FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 500.0}}
    return Gemma3ForCausalLM(Gemma3TextConfig(**TINY, num_hidden_layers=4, sliding_window=4,
                                              layer_types=[SLIDING, FULL, SLIDING, SLIDING], query_pre_attn_scalar=24,
                                              final_logit_softcapping=30.0, rope_parameters=rope))


def _phi3():  # q|k|v and gate|up fused in the checkpoint, one window for every layer
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**TINY, num_hidden_layers=2, sliding_window=6, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _qwen3_moe():  # 8 experts, top 2 renormalized; layer 1 dense (mlp_only_layers)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, "intermediate_size": 80}, num_hidden_layers=4,
                                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                                              tie_word_embeddings=False))


def _mixtral():  # every layer 4 experts of intermediate_size, top 2
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**{**TINY, "intermediate_size": 48}, num_hidden_layers=2,
                                            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))


def _gemma2():  # even layers sliding (W = 4), capped attention scores and logits
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(**TINY, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=24,
                                          attn_logit_softcapping=0.5, final_logit_softcapping=30.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _granite():  # the four multipliers away from 1
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False,
                                            embedding_multiplier=1.5, residual_multiplier=0.7,
                                            attention_multiplier=0.2, logits_scaling=1.25))


def _smollm3():  # layer 3 of 4 without rope (NoPE), tied embeddings
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM(SmolLM3Config(**TINY, num_hidden_layers=4, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _olmo2():  # norms after attention and the MLP, q/k norms over the whole projections
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(Olmo2Config(**TINY, num_hidden_layers=2, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _olmo3():  # OLMo 2's layers, three sliding (W = 5) and a global one with linear-scaled rope
    from transformers import Olmo3Config, Olmo3ForCausalLM
    return Olmo3ForCausalLM(Olmo3Config(**TINY, num_hidden_layers=4, tie_word_embeddings=False, sliding_window=5,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=5000.0))


def _olmoe():  # pre-norm layers with whole-projection q/k norms, 8 experts top 2, not renormalized
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(**{**TINY, "intermediate_size": 32}, num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _glm():  # interleaved rotary over half of each head, q/k/v biases, gate|up in one tensor
    from transformers import GlmConfig, GlmForCausalLM
    return GlmForCausalLM(GlmConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False, partial_rotary_factor=0.5,
                                    attention_bias=True, pad_token_id=0, eos_token_id=[1], bos_token_id=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _glm4():  # GLM's layers with a norm after attention and one after the MLP
    from transformers import Glm4Config, Glm4ForCausalLM
    return Glm4ForCausalLM(Glm4Config(**TINY, num_hidden_layers=2, tie_word_embeddings=False, partial_rotary_factor=0.5,
                                      attention_bias=True, pad_token_id=0, eos_token_id=[1], bos_token_id=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _gemma():  # the first Gemma: scaled embeddings, (1 + weight) norms before the sublayers only
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(**TINY, num_hidden_layers=2, hidden_act="gelu",
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _cohere():  # a parallel block after one LayerNorm, an interleaved rotary, logits scaled, a tied head
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(**TINY, num_hidden_layers=2, logit_scale=2.5, layer_norm_eps=1e-5,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _cohere2():  # Command R7B: three sliding layers (W = 5) with rotary, a global one without (NoPE)
    from transformers import Cohere2Config, Cohere2ForCausalLM
    return Cohere2ForCausalLM(Cohere2Config(**TINY, num_hidden_layers=4, logit_scale=2.5, layer_norm_eps=1e-5,
                                            sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _starcoder2():  # LayerNorms with biases, an ungated GELU MLP, biases throughout, one window (W = 6)
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return Starcoder2ForCausalLM(Starcoder2Config(**TINY, num_hidden_layers=2, sliding_window=6, use_bias=True,
                                                  norm_epsilon=1e-5, tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _phi():  # Phi-2: a parallel block, rotary over 40% of each head (6 of 16 dims), an LM head with a bias
    from transformers import PhiConfig, PhiForCausalLM
    return PhiForCausalLM(PhiConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2,
                                    partial_rotary_factor=0.4, layer_norm_eps=1e-5,
                                    rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _gpt_neox(parallel: bool = True):  # Pythia: q|k|v rows head by head, rotary over a quarter of each head
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                            max_position_embeddings=256, num_hidden_layers=2, layer_norm_eps=1e-5,
                                            use_parallel_residual=parallel, tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                             "partial_rotary_factor": 0.25}))


def _gpt2():  # learned positions, no rotary, Conv1D (transposed) projections, a tied head
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=256,
                                      n_inner=96))


def _helium():  # an interleaved rotary, q/k/v biases
    from transformers import HeliumConfig, HeliumForCausalLM
    return HeliumForCausalLM(HeliumConfig(**TINY, num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _ernie4_5():  # an interleaved rotary over the whole head
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM
    return Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, num_hidden_layers=2, tie_word_embeddings=False, use_bias=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _seed_oss():  # q/k/v biases and an output one
    from transformers import SeedOssConfig, SeedOssForCausalLM
    return SeedOssForCausalLM(SeedOssConfig(**TINY, num_hidden_layers=2, attention_bias=True, attention_out_bias=True,
                                            tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _ministral():  # sliding layers (W = 5) beside a global one
    from transformers import MinistralConfig, MinistralForCausalLM
    return MinistralForCausalLM(MinistralConfig(**TINY, num_hidden_layers=3, sliding_window=5,
                                                layer_types=[SLIDING, FULL, SLIDING], tie_word_embeddings=False,
                                                rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _gpt_oss():  # sinks, alternating sliding (W = 5) and full layers, YaRN, 4 experts top 2 with biases, clamped
    from transformers import GptOssConfig, GptOssForCausalLM
    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 5000.0,
            "original_max_position_embeddings": 64, "truncate": False}
    return GptOssForCausalLM(GptOssConfig(**{**TINY, "intermediate_size": 32}, num_hidden_layers=3, sliding_window=5,
                                          num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
                                          rope_parameters=rope, tie_word_embeddings=False))


def _opt():  # learned positions offset by 2, ReLU MLPs, norms before the sublayers, a tied head
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2))


def _opt_350m():  # OPT-350m's shape: norms after the adds, no final norm, embeddings projected in and out
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                    do_layer_norm_before=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _granitemoe():  # Granite's four multipliers around 4 experts top 2
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    return GraniteMoeForCausalLM(GraniteMoeConfig(**{**TINY, "intermediate_size": 32}, num_hidden_layers=2,
                                                  num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                                  embedding_multiplier=1.5, residual_multiplier=0.7,
                                                  attention_multiplier=0.2, logits_scaling=1.25))


def _granitemoeshared():  # and a shared expert beside the routed ones
    from transformers import GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM
    return GraniteMoeSharedForCausalLM(GraniteMoeSharedConfig(
        **{**TINY, "intermediate_size": 32}, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, tie_word_embeddings=False, embedding_multiplier=1.5, residual_multiplier=0.7,
        attention_multiplier=0.2, logits_scaling=1.25))


def _exaone4():  # norms after the sublayers, per-head q/k norms, three sliding layers (W = 5), a global one without rotary
    from transformers import Exaone4Config, Exaone4ForCausalLM
    return Exaone4ForCausalLM(Exaone4Config(**TINY, num_hidden_layers=4, sliding_window=5, sliding_window_pattern=4,
                                            tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _stablelm():  # LayerNorms around a SiLU-gated MLP, q/k/v biases, a quarter of each head turning
    from transformers import StableLmConfig, StableLmForCausalLM
    return StableLmForCausalLM(StableLmConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2,
                                              use_qkv_bias=True, tie_word_embeddings=False, layer_norm_eps=1e-5))


def _stablelm_parallel():  # attention and the MLP of one norm, added together
    from transformers import StableLmConfig, StableLmForCausalLM
    return StableLmForCausalLM(StableLmConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2,
                                              use_parallel_residual=True, tie_word_embeddings=False))


def _bloom():  # ALiBi, normalized embeddings, q|k|v head by head, 6 heads (4 + 2 of ALiBi's slopes)
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6))


def _mpt():  # ALiBi over 6 heads, no biases, q|k|v fused, exact GELU, its own softmax scale (transformers reads
    # no alibi_bias_max but 8, which every MPT checkpoint has; Troupe reads the config's, as vLLM)
    from transformers import MptConfig, MptForCausalLM
    return MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=96, n_layers=2, n_heads=6, max_seq_len=256,
                                    attn_config={"alibi": True, "alibi_bias_max": 8, "softmax_scale": 0.3}))


def _qwen2_moe():  # 4 experts top 2 and a gated shared expert; layer 1 dense (mlp_only_layers)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**TINY, "intermediate_size": 48}, num_hidden_layers=3,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                              num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                              tie_word_embeddings=False))


def _gpt_bigcode():  # GPT-2's model with one key/value head (multi-query), plain linear projections
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                  bos_token_id=1, eos_token_id=2))


def _gpt_bigcode_mha():  # without multi_query: q|k|v per head in the fused projection
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                  multi_query=False, bos_token_id=1, eos_token_id=2))


def _falcon():  # Falcon-7b's shape: one key/value head, attention and the MLP in parallel on one norm
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=256, rope_theta=5000.0, bos_token_id=1,
                                          eos_token_id=2))


def _falcon_40b():  # the new decoder architecture: 2 key/value groups, q|k|v group by group, a norm for each side
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=256,
                                          bias=True, rope_theta=5000.0, bos_token_id=1, eos_token_id=2))


def _falcon_sequential():  # no parallel attention, every head its own key (q|k|v head by head)
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=False, parallel_attn=False, max_position_embeddings=256,
                                          rope_theta=5000.0, bos_token_id=1, eos_token_id=2))


def _gptj():  # a parallel block on one norm, an interleaved rotary over 8 of each head's 16 dimensions
    from transformers import GPTJConfig, GPTJForCausalLM
    return GPTJForCausalLM(GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8,
                                      bos_token_id=1, eos_token_id=2))


MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
MLA_TINY = {**{k: v for k, v in TINY.items() if k != "head_dim"}, "num_key_value_heads": 4}   # (head_dim: the rotary's)


def _deepseek_v2():  # latent attention, a dense first layer, 4 experts top 2 within the best 2 of 2 groups by their
    # best expert, a shared expert, the routing weights scaled
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    return DeepseekV2ForCausalLM(DeepseekV2Config(
        **MLA_TINY, **MLA, q_lora_rank=None, moe_intermediate_size=32, num_hidden_layers=3,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False))


def _deepseek_v3():  # q through a bottleneck, sigmoid routing with a correction bias in groups, YaRN with mscale
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **MLA_TINY, **MLA, q_lora_rank=24, moe_intermediate_size=32, num_hidden_layers=3,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, rope_parameters=rope, tie_word_embeddings=False))


def _deepseek_v3_half_split():  # rope_interleave off: the rotary's pairs half-split, as the kernels turn them
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **MLA_TINY, **MLA, q_lora_rank=None, moe_intermediate_size=32, num_hidden_layers=2,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
        topk_group=1, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=False))


def _glm4_moe():  # per-head q/k norms, a half-split rotary over half of each head, DeepSeek-V3's experts in groups
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    return Glm4MoeForCausalLM(Glm4MoeConfig(
        **TINY, num_hidden_layers=3, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.8,
        use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}))


def _ernie4_5_moe():  # ERNIE 4.5's layers, a dense first layer, 4 experts chosen with a correction bias, a shared one
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    return Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(
        **TINY, num_hidden_layers=3, moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
        moe_layer_start_index=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


BUILDERS = {"LlamaForCausalLM": _llama, "Qwen2ForCausalLM": _qwen2, "Qwen3ForCausalLM": _qwen3,
            "MistralForCausalLM": _mistral, "Gemma3ForCausalLM": _gemma3, "Phi3ForCausalLM": _phi3,
            "Qwen3MoeForCausalLM": _qwen3_moe, "MixtralForCausalLM": _mixtral,
            "GraniteForCausalLM": _granite, "SmolLM3ForCausalLM": _smollm3, "Gemma2ForCausalLM": _gemma2,
            "Olmo2ForCausalLM": _olmo2, "Olmo3ForCausalLM": _olmo3, "OlmoeForCausalLM": _olmoe,
            "GlmForCausalLM": _glm, "Glm4ForCausalLM": _glm4, "GemmaForCausalLM": _gemma,
            "CohereForCausalLM": _cohere, "Cohere2ForCausalLM": _cohere2, "Starcoder2ForCausalLM": _starcoder2,
            "PhiForCausalLM": _phi, "GPTNeoXForCausalLM": _gpt_neox, "GPT2LMHeadModel": _gpt2,
            "HeliumForCausalLM": _helium, "Ernie4_5ForCausalLM": _ernie4_5, "SeedOssForCausalLM": _seed_oss,
            "MinistralForCausalLM": _ministral, "GptOssForCausalLM": _gpt_oss,
            "OPTForCausalLM": _opt, "OPTForCausalLM-350m": _opt_350m,
            "GraniteMoeForCausalLM": _granitemoe, "Exaone4ForCausalLM": _exaone4, "Qwen2MoeForCausalLM": _qwen2_moe,
            "DeepseekV2ForCausalLM": _deepseek_v2, "Glm4MoeForCausalLM": _glm4_moe, "Ernie4_5_MoeForCausalLM": _ernie4_5_moe, "DeepseekV3ForCausalLM": _deepseek_v3,
            "DeepseekV3ForCausalLM-half-split": _deepseek_v3_half_split,
            "StableLmForCausalLM": _stablelm, "BloomForCausalLM": _bloom, "MptForCausalLM": _mpt,
            "GPTBigCodeForCausalLM": _gpt_bigcode, "FalconForCausalLM": _falcon, "GPTJForCausalLM": _gptj,
            "FalconForCausalLM-40b": _falcon_40b, "FalconForCausalLM-sequential": _falcon_sequential, "GPTBigCodeForCausalLM-mha": _gpt_bigcode_mha, "StableLmForCausalLM-parallel": _stablelm_parallel, "GraniteMoeSharedForCausalLM": _granitemoeshared}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory):
    """(our model, config, transformers model, checkpoint dir) for one architecture."""
    torch.manual_seed(0)
    hf = BUILDERS[request.param]()
    with torch.no_grad():  # weights large enough that logits spread out: a wrong detail shows
        for name, p in hf.named_parameters():
            is_norm = name.endswith("norm.weight") or (
                (".ln_" in name or ".norm_" in name) and name.endswith(".weight"))        # GPT-2's ln_1, MPT's norm_1
            p.normal_(1.0 if is_norm and "Gemma" not in request.param else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="40KB" if request.param == "LlamaForCausalLM" else "50GB")
    model, config = load_model(resolve_model(str(path)))
    arch = request.param.split("-")[0]          # "-350m": another shape of the same architecture
    assert config.architecture == arch and isinstance(model, get_model_class(arch))
    return model, config, hf.eval(), path


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # (T, V)
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


class Paged:
    """A hand-driven paged KV cache: the test plays scheduler and block manager."""

    def __init__(self, config, num_blocks: int = 64, dtype: torch.dtype = torch.float32):
        self.kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, dtype)
        self.free = list(range(num_blocks - 1, 0, -1))   # block 0 stays free: padding points at it

    def blocks_for(self, table: list[int], num_tokens: int) -> list[int]:
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())
        return table

    def step(self, model, reqs: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """reqs: (new tokens, num_computed_tokens, block table). Returns each request's (q, V) logits."""
        ids = torch.tensor([t for toks, _, _ in reqs for t in toks])
        pos = torch.tensor([p for toks, start, _ in reqs for p in range(start, start + len(toks))])
        meta = build_attention_metadata([len(t) for t, _, _ in reqs], [s + len(t) for t, s, _ in reqs],
                                        [table for _, _, table in reqs], BLOCK_SIZE)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, self.kv_caches, meta))   # (T, V)
        return list(logits.split([len(t) for t, _, _ in reqs]))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert expected.std() > 0.5, "reference logits too flat for the comparison to mean anything"
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_prefill(case):
    model, config, hf, _ = case
    tokens = _prompt(29, 1)
    paged = Paged(config)
    (logits,) = paged.step(model, [(tokens, 0, paged.blocks_for([], 29))])
    _close(logits, hf_logits(hf, tokens))


def test_sliding_window_matters(case):
    model, config, hf, path = case
    if config.max_sliding_window is None:
        pytest.skip("no sliding window in this configuration")
    full_config = dataclasses.replace(config, sliding_window=None)
    full = get_model_class(config.architecture)(full_config, model.layers[0].self_attn.backend)
    full.load_state_dict(model.state_dict())
    tokens = _prompt(29, 1)
    paged, paged_full = Paged(config), Paged(config)
    (windowed,) = paged.step(model, [(tokens, 0, paged.blocks_for([], 29))])
    (unwindowed,) = paged_full.step(full.eval(), [(tokens, 0, paged_full.blocks_for([], 29))])
    assert (windowed - unwindowed)[8:].abs().max() > 1e-2


def test_decode_step_by_step(case):
    model, config, hf, _ = case
    tokens = _prompt(26, 2)
    paged, table = Paged(config), []
    outs = paged.step(model, [(tokens[:5], 0, paged.blocks_for(table, 5))])
    for p in range(5, len(tokens)):
        outs += paged.step(model, [(tokens[p:p + 1], p, paged.blocks_for(table, p + 1))])
    _close(torch.cat(outs), hf_logits(hf, tokens))


def test_chunked_prefill(case):
    model, config, hf, _ = case
    tokens = _prompt(31, 3)
    paged, table, outs, start = Paged(config), [], [], 0
    for chunk in (7, 1, 9, 14):
        outs += paged.step(model, [(tokens[start:start + chunk], start, paged.blocks_for(table, start + chunk))])
        start += chunk
    _close(torch.cat(outs), hf_logits(hf, tokens))


def test_prefix_cache_hit_mixed_with_decode(case):
    """Request B's first 3 blocks are request A's (same 12 tokens, already cached): only B's suffix
    is computed, in the same step as A's next decode."""
    model, config, hf, _ = case
    a = _prompt(21, 4)
    b = a[:12] + _prompt(9, 5)
    paged, table_a = Paged(config), []
    paged.step(model, [(a, 0, paged.blocks_for(table_a, 21))])
    a_next = a + [7]
    table_b = paged.blocks_for(table_a[:3], 21)
    decode_a, suffix_b = paged.step(model, [(a_next[21:], 21, paged.blocks_for(table_a, 22)), (b[12:], 12, table_b)])
    _close(decode_a, hf_logits(hf, a_next)[21:])
    _close(suffix_b, hf_logits(hf, b)[12:])


def test_decode_logprobs_match_one_prefill(case):
    model, config, _, _ = case
    prompt = _prompt(11, 6)
    paged, table, tokens, logprobs = Paged(config), [], list(prompt), []
    (logits,) = paged.step(model, [(prompt, 0, paged.blocks_for(table, len(prompt)))])
    for _ in range(16):
        lp = logits[-1].log_softmax(-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]])
        (logits,) = paged.step(model, [(tokens[-1:], len(tokens) - 1, paged.blocks_for(table, len(tokens)))])
    fresh = Paged(config)
    (full,) = fresh.step(model, [(tokens[:-1], 0, fresh.blocks_for([], len(tokens) - 1))])
    expected = full[len(prompt) - 1:].log_softmax(-1).gather(1, torch.tensor(tokens[len(prompt):])[:, None])[:, 0]
    torch.testing.assert_close(torch.stack(logprobs), expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_weights(case):
    """bfloat16 weights and cache: our error against float32 is of the size of transformers' own
    bfloat16 error (a mixture of experts' two worst positions aside), and our greedy choices agree
    with float32's at least as often as its do (or on 90% of the positions)."""
    import copy
    model, config, hf, path = case
    bf16, bf16_config = load_model(resolve_model(str(path)), dtype=torch.bfloat16)
    assert {p.dtype for n, p in bf16.named_parameters()
            if not n.endswith("e_score_correction_bias")} == {torch.bfloat16}    # (DeepSeek V3's stays float32)
    tokens = _prompt(29, 1)
    paged = Paged(bf16_config, dtype=torch.bfloat16)
    (logits,) = paged.step(bf16, [(tokens, 0, paged.blocks_for([], 29))])
    expected = hf_logits(hf, tokens)
    hf_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), tokens)
    ours_rows, hf_rows = ((x - expected).abs().max(-1).values for x in (logits, hf_bf16))    # (T,) each
    if config.num_experts:     # a routing choice near a tie may flip under bfloat16's rounding, for a token or two
        ours_rows, hf_rows = ours_rows.sort().values[:-2], hf_rows.sort().values[:-2]
    assert ours_rows.max() < 2 * hf_rows.max() + 1e-2
    hf_agreement = (hf_bf16.argmax(-1) == expected.argmax(-1)).float().mean()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= min(0.9, hf_agreement - 0.05)


def test_no_backend_for_the_requirements(case):
    _, _, _, path = case
    with pytest.raises(ValueError, match="no attention backend supports this model") as info:
        load_model(resolve_model(str(path)), dtype=torch.float64)
    assert "cpu: dtype torch.float64 not supported" in str(info.value)


def test_exaone4_reads_its_string_pattern_and_without_a_window_turns_every_layer():
    from models.hf_config import hf_model_config
    base = dict(architectures=["Exaone4ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
    hybrid = hf_model_config({**base, "sliding_window": 8, "sliding_window_pattern": "LLLG"})
    assert hybrid.layer_types == (SLIDING, SLIDING, SLIDING, FULL) and hybrid.rope_layers == (True, True, True, False)
    plain = hf_model_config(base)
    assert plain.max_sliding_window is None and all(map(plain.layer_uses_rope, range(4)))


def test_hf_config_defaults_and_errors():
    from models.hf_config import hf_model_config
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=64, rms_norm_eps=1e-5)
    mistral = hf_model_config({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_window == 4096 and mistral.head_size == 16 and mistral.num_kv_heads == 4
    assert hf_model_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_window is None
    gemma = hf_model_config({**base, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
                             "rope_local_base_freq": 500.0, "eos_token_id": [1, 106]})
    assert (gemma.head_size, gemma.rope_theta, gemma.rope_local_theta, gemma.tie_word_embeddings) == (256, 1e6, 500.0, True)
    assert [gemma.layer_sliding_window(i) for i in (0, 5, 11)] == [4096, None, None] and gemma.eos_token_ids == (1, 106)
    qwen2 = hf_model_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.max_sliding_window is None   # use_sliding_window is off
    with pytest.raises(ValueError, match="rope type 'deepseek_yarn' is not supported"):
        hf_model_config({**base, "architectures": ["LlamaForCausalLM"],
                         "rope_scaling": {"rope_type": "deepseek_yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="architectures \\['RwkvForCausalLM'\\] is not supported"):
        hf_model_config({**base, "architectures": ["RwkvForCausalLM"]})


def test_phi3_reads_one_window_and_a_partial_rotary():
    """Phi-3's config: one window for every layer; a partial rotary read from the 4.x or 5.x key
    (longrope and partial rotary models: tests/models/test_rope_scaling.py)."""
    from models.hf_config import hf_model_config
    base = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5)
    phi3 = hf_model_config({**base, "sliding_window": 2047})
    assert [phi3.layer_sliding_window(i) for i in range(2)] == [2047, 2047] and not phi3.qkv_bias
    assert hf_model_config(base).max_sliding_window is None
    assert hf_model_config({**base, "partial_rotary_factor": 0.75}).rotary_dim == 12
    assert hf_model_config({**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
                           ).rotary_dim == 8
    with pytest.raises(ValueError, match="rotary over 5 of 16 head dimensions is not supported"):
        hf_model_config({**base, "partial_rotary_factor": 0.3125})


def test_the_registry_is_the_only_list_of_architectures():
    """The readers name no architecture; the GGUF names come from the classes; an unknown name
    is refused with the supported ones listed."""
    import inspect
    from models import gguf_loader, hf_config
    from models.registry import GGUF_ARCHITECTURES, MODEL_REGISTRY, hf_architecture_of_gguf
    for reader in (hf_config, gguf_loader):
        source = inspect.getsource(reader)
        assert not [name for name in MODEL_REGISTRY if name in source], reader.__name__
    assert GGUF_ARCHITECTURES == {g: name for name, cls in MODEL_REGISTRY.items() for g in cls.gguf_architectures}
    assert GGUF_ARCHITECTURES["llama"] == "LlamaForCausalLM" and "MistralForCausalLM" not in GGUF_ARCHITECTURES.values()
    with pytest.raises(ValueError, match="GGUF architecture 'rwkv6' is not supported; supported: .*'gemma3'"):
        hf_architecture_of_gguf("rwkv6")
    with pytest.raises(ValueError, match="supported: .*Gemma3ForCausalLM.*LlamaForCausalLM"):
        get_model_class("RwkvForCausalLM")


def test_a_fused_parameter_loads_whole():
    """A checkpoint may hold q|k|v or gate|up already fused (Phi-3): the one tensor fills every
    shard; a fused parameter left out is still reported."""
    from kernels.attention import CpuAttentionBackend
    from models.config import ArchConfig
    from models.registry import load_weights
    config = ArchConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_size=16, max_model_len=64, rope_theta=1e4,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(),
                        qkv_bias=True)
    cls = get_model_class(config.architecture)
    state = {name: torch.randn(p.shape) for name, p in cls(config, CpuAttentionBackend()).named_parameters()}
    identity = {name: (name, None) for name in state}      # fused names, whole tensors
    fresh = cls(config, CpuAttentionBackend())
    load_weights(fresh, state.items(), identity)
    assert all(torch.equal(p, state[name]) for name, p in fresh.named_parameters())
    with pytest.raises(ValueError, match=r"unloaded: \['layers.1.self_attn.qkv_proj.bias\[k\]'"):
        load_weights(fresh, [(n, t) for n, t in state.items() if n != "layers.1.self_attn.qkv_proj.bias"], identity)


def test_tied_head_copy_in_checkpoint_is_skipped(case):
    """A checkpoint may carry lm_head.weight beside the embedding it is tied to (state_dict does)."""
    from models.registry import load_weights
    model, config, hf, _ = case
    if not config.tie_word_embeddings:
        pytest.skip("untied head")
    state = hf.state_dict()
    assert "lm_head.weight" in state
    fresh = get_model_class(config.architecture)(config, model.layers[0].self_attn.backend)
    load_weights(fresh, fresh.hf_weights(state.items()), fresh.hf_tensor_map)     # as the loader reads a checkpoint
    assert fresh.lm_head.weight is fresh.embed_tokens.weight
    torch.testing.assert_close(fresh.embed_tokens.weight, model.embed_tokens.weight, atol=0, rtol=0)


def test_gpt_neox_without_the_parallel_residual_adds_its_sublayers_in_llamas_order(tmp_path):
    """``use_parallel_residual: false`` (some GPT-NeoX checkpoints): attention added, then the MLP of
    the sum's norm; the prompt's logits equal transformers'."""
    torch.manual_seed(0)
    hf = _gpt_neox(parallel=False)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)))
    assert not config.parallel_residual
    tokens = _prompt(29, 1)
    paged = Paged(config)
    (logits,) = paged.step(model, [(tokens, 0, paged.blocks_for([], 29))])
    _close(logits, hf_logits(hf.eval(), tokens))
