"""Architectures whose layers differ from Llama's where the native kernels run decode through
the whole engine to transformers' greedy tokens: the one-call decode stack takes SmolLM3's NoPE
layers and Granite's residual multiplier; Gemma 2's capped attention scores take the CPU
backend's torch path."""
from __future__ import annotations

import pytest
import torch

from actors.api import LLM, SamplingParams

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False,
                                            embedding_multiplier=1.5, residual_multiplier=0.7,
                                            attention_multiplier=0.2, logits_scaling=1.25))


def _smollm3():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM(SmolLM3Config(**TINY, num_hidden_layers=4, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(**TINY, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                                          attn_logit_softcapping=0.5, final_logit_softcapping=30.0))


@pytest.mark.parametrize("build", [_granite, _smollm3, _gemma2], ids=["granite", "smollm3", "gemma2"])
def test_greedy_tokens_through_the_engine_equal_transformers(build, tmp_path):
    torch.manual_seed(0)
    hf = build()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") and build is not _gemma2 else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    hf.eval().save_pretrained(tmp_path)
    prompt = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            expected.append(int(hf(torch.tensor([expected])).logits[0, -1].argmax()))
    with LLM(str(tmp_path), multiprocess=False, skip_tokenizer_init=True) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected[len(prompt):]
