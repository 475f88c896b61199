"""The newer model shapes on a GPU (``-m gpu``, skipped without CUDA): Granite's multipliers,
SmolLM3's NoPE layers, a Phi-4-mini-shaped model (longrope over a partial rotary, served past its
original context), Llama 3.1's rope scaling, Gemma 2's capped scores, gpt-oss's attention sinks
and biased swigluoai experts, BLOOM's ALiBi (in the Triton kernels), Mamba-2's and Qwen3-Next's
recurrent states (eager: no graphs for them), and architectures served by the transformers backend
(Apertus; VaultGemma's sliding layers) give transformers' greedy tokens through a CUDA engine, and so do
images (LLaVA; Gemma 3, its image rows attended both ways)."""
from __future__ import annotations

import pytest
import torch

from actors.api import LLM, SamplingParams
from helpers import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHORT, LONG = [1.0, 1.1, 1.2, 1.3], [1.5, 2.0, 2.5, 3.0]


def _model(name: str):
    import transformers as t
    if name == "granite":
        return t.GraniteForCausalLM(t.GraniteConfig(**TINY, head_dim=16, num_hidden_layers=2, embedding_multiplier=1.5,
                                                    residual_multiplier=0.7, attention_multiplier=0.2,
                                                    logits_scaling=1.25, tie_word_embeddings=False))
    if name == "smollm3":
        return t.SmolLM3ForCausalLM(t.SmolLM3Config(**TINY, head_dim=16, num_hidden_layers=4,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    if name == "phi4_mini":      # longrope over half of each 16-wide head, its original context 32
        rope = {"rope_type": "longrope", "rope_theta": 500.0, "short_factor": SHORT, "long_factor": LONG,
                "partial_rotary_factor": 0.5}
        return t.Phi3ForCausalLM(t.Phi3Config(**TINY, num_hidden_layers=2, original_max_position_embeddings=32,
                                              rope_parameters=rope, tie_word_embeddings=False))
    if name == "llama3_rope":
        rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return t.LlamaForCausalLM(t.LlamaConfig(**TINY, head_dim=16, num_hidden_layers=2, rope_parameters=rope,
                                                tie_word_embeddings=False))
    if name == "gpt_oss":
        return t.GptOssForCausalLM(t.GptOssConfig(**{**TINY, "intermediate_size": 32}, head_dim=16, num_hidden_layers=2,
                                                  sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                                  swiglu_limit=1.0, tie_word_embeddings=False,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    if name == "mamba2":          # state-space layers only: their recurrent states in the worker's slots, eager
        return t.Mamba2ForCausalLM(t.Mamba2Config(vocab_size=128, hidden_size=64, state_size=16, num_hidden_layers=2,
                                                  num_heads=8, head_dim=16, n_groups=2, expand=2, conv_kernel=4,
                                                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    if name == "qwen3_next":      # Gated DeltaNet beside gated attention, experts
        return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
            **{**TINY, "intermediate_size": 48}, head_dim=16, num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=20, tie_word_embeddings=False))
    if name == "apertus":         # no Troupe class: the transformers backend (auto), its attention in Triton
        return t.ApertusForCausalLM(t.ApertusConfig(**TINY, head_dim=16, num_hidden_layers=2, tie_word_embeddings=False))
    if name == "vaultgemma":      # the same, with sliding layers
        return t.VaultGemmaForCausalLM(t.VaultGemmaConfig(**TINY, head_dim=16, num_hidden_layers=3, sliding_window=8,
                                                          layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"]))
    if name == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(vocab_size=128, hidden_size=96, n_layer=2, n_head=6,
                                                bos_token_id=1, eos_token_id=2))
    return t.Gemma2ForCausalLM(t.Gemma2Config(**TINY, head_dim=16, num_hidden_layers=3, sliding_window=8,
                                              query_pre_attn_scalar=24, attn_logit_softcapping=0.5))


def _saved(name: str, path) -> tuple[object, str]:
    torch.manual_seed(0)
    hf = _model(name)
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            is_norm = param_name.endswith(("norm.weight", "layernorm.weight", "ln_f.weight", "norm_f.weight"))
            plus_one = name in ("gemma2", "qwen3_next", "vaultgemma") and "linear_attn" not in param_name   # (1 + weight) norms
            p.normal_(1.0 if is_norm and not plus_one else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    hf.eval().save_pretrained(path)
    return hf, str(path)


def check_greedy_tokens(name: str, path, device: str) -> None:
    """The engine's greedy tokens on ``device`` against transformers' (on the CPU) for a prompt
    of 40 tokens (past the Phi-4-mini shape's original 32)."""
    hf, path = _saved(name, path)
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with LLM(path, device=device, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
             kv_cache_bytes=256 << 20) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, [prompt], 8)[0]


@pytest.mark.parametrize("name", ["granite", "smollm3", "phi4_mini", "llama3_rope", "gemma2", "gpt_oss", "bloom",
                                  "mamba2", "qwen3_next", "apertus", "vaultgemma"])
def test_greedy_tokens_on_cuda_equal_transformers(name, tmp_path):
    check_greedy_tokens(name, tmp_path, "cuda")


@pytest.mark.parametrize(("family", "impl"), [("llava", "auto"), ("llava", "transformers"), ("gemma3", "auto"),
                                             ("gemma3", "transformers")])
def test_images_on_cuda_answer_as_transformers_does(family, impl, tmp_path):
    """Image input on a GPU (LLaVA and Gemma 3 through Troupe's own classes and through the
    transformers backend): the vision tower's embeddings in the worker, Gemma 3's image rows
    attended both ways over the Triton backend's cache; greedy tokens as transformers' generate
    (float32)."""
    from helpers import random_image, save_tiny_gemma3_vision, save_tiny_llava
    hf, processor = (save_tiny_llava if family == "llava" else save_tiny_gemma3_vision)(tmp_path)
    image = random_image(21)
    prompt = "t5 t9 <image> t7 t8" if family == "llava" else "t5 t9 <start_of_image> t7 t8"
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    with LLM(model=str(tmp_path), model_impl=impl, device="cuda", dtype="float32", max_model_len=128,
             kv_cache_bytes=256 << 20) as llm:
        (got,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                              SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert list(got.outputs[0].token_ids) == want


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen2_vls_images_on_cuda_take_mrope_positions(family, tmp_path):
    """Qwen2-VL and Qwen3-VL on a GPU: the image's M-RoPE rows (and Qwen3-VL's DeepStack
    features) in the eager prefill, the decode's positions shifted past the image replayed by the
    CUDA graphs; greedy tokens as transformers' generate (float32; a 56-pixel square image, which
    no processor backend resizes)."""
    from helpers import random_image, save_tiny_qwen2_vl
    hf, inputs = save_tiny_qwen2_vl(tmp_path, family)
    image = random_image(21, 56, 56)
    given = inputs("t5 t9 <|vision_start|> <|image_pad|> <|vision_end|> t7 t8", [image])
    with torch.no_grad():
        out = hf.generate(**given, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = out[0, given["input_ids"].shape[1]:].tolist()
    with LLM(model=str(tmp_path), device="cuda", dtype="float32", max_model_len=128, kv_cache_bytes=256 << 20) as llm:
        (got,) = llm.generate({"prompt": "t5 t9 <|vision_start|><|image_pad|><|vision_end|> t7 t8",
                               "multi_modal_data": {"image": image}},
                              SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert list(got.outputs[0].token_ids) == want
