"""The GGUF path of each architecture: a tiny random transformers model converted to a float32
GGUF the way llama.cpp's convert_hf_to_gguf does (names from gguf's own tensor-name map, llama's
q/k rows permuted, Gemma's norms stored as 1 + weight, Phi-3's fused tensors kept fused,
hyper-parameters as llama.cpp keys; what llama.cpp hard-codes for gemma3 left out), loaded by
our loader, logits against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

from kernels.attention import allocate_kv_caches, build_attention_metadata
from models.registry import load_model
from models.resolve import ModelSource

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2, rope_theta=5000.0, tie_word_embeddings=False))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**TINY, num_hidden_layers=2, rope_theta=20000.0, tie_word_embeddings=True))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**TINY, num_hidden_layers=2, rope_theta=30000.0, tie_word_embeddings=False))


def _gemma3():  # what llama.cpp assumes: every 6th layer global, local rope base 10000, scale 1/sqrt(head_dim)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return Gemma3ForCausalLM(Gemma3TextConfig(**TINY, num_hidden_layers=7, sliding_window=4, query_pre_attn_scalar=16,
                                              rope_parameters=rope))


def _phi3():  # attn_qkv and ffn_up (gate | up) fused; its window in the header
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**TINY, num_hidden_layers=2, sliding_window=6, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gemma2():  # what llama.cpp assumes: even layers sliding, scale 1/sqrt(head_dim); both caps in the header
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(**TINY, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=16,
                                          attn_logit_softcapping=0.5, final_logit_softcapping=30.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _granite():  # its multipliers as header keys
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False,
                                            embedding_multiplier=1.5, residual_multiplier=0.7,
                                            attention_multiplier=0.2, logits_scaling=1.25))


def _smollm3():  # llama.cpp's fixed NoPE interval of 4
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM(SmolLM3Config(**TINY, num_hidden_layers=4, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2))


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3, "phi3": _phi3, "granite": _granite,
            "smollm3": _smollm3, "gemma2": _gemma2,
            "qwen2vl": _qwen2}   # Qwen2(.5)-VL's language model: Qwen2's tensors, M-RoPE sections in the header
PERMUTED_QK = ("llama", "granite", "smollm3")     # llama.cpp's LlamaModel and its subclasses


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: interleave the two rotary halves of each head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_to_gguf(hf, arch: str, path: str, extra=None) -> None:
    """``extra(writer)``: more keys or tensors (what a converter writes for a rope scaling)."""
    c = hf.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if getattr(c, "sliding_window", None) is not None:
        writer.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_dimension_count(int(c.head_dim * rope.get("partial_rotary_factor", 1.0)))
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, c.num_hidden_layers)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if arch in PERMUTED_QK and base.endswith("q_proj"):
            tensor = _permute(tensor, c.num_attention_heads)
        if arch in PERMUTED_QK and base.endswith("k_proj"):
            tensor = _permute(tensor, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            tensor = tensor + 1.0
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy().astype(np.float32))
    if arch == "qwen2vl":                # M-RoPE's sections: on text, plain rope
        writer.add_rope_dimension_sections([2, 3, 3, 0])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_gguf_logits_match_transformers(arch, tmp_path):
    torch.manual_seed(0)
    hf = BUILDERS[arch]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") and arch != "gemma3" else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    path = str(tmp_path / f"{arch}.gguf")
    convert_to_gguf(hf.eval(), arch, path)
    model, config = load_model(ModelSource("gguf", path, arch))
    if arch == "gemma3":
        assert config.layer_sliding_window(0) == 4 and config.layer_sliding_window(5) is None
    if arch == "phi3":
        assert config.layer_sliding_window(0) == config.layer_sliding_window(1) == 6
    tokens = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(1))
    kv_caches = allocate_kv_caches(config, 9, 4)
    meta = build_attention_metadata([29], [29], [list(range(1, 9))], 4)
    with torch.inference_mode():
        ours = model.compute_logits(model(tokens, torch.arange(29), kv_caches, meta))
        expected = hf(tokens[None]).logits[0]
    assert expected.std() > 0.5
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key, value, error", [("rope.dimension_count", 7, "rotary over 7 of 16 head dimensions is not")])
def test_phi3_gguf_refuses_what_we_do_not_implement(key, value, error, tmp_path):
    from models.gguf_loader import gguf_model_config, read_gguf
    path = str(tmp_path / "phi3.gguf")
    writer = GGUFWriter(path, "phi3")
    for name, v in (("block_count", 2), ("context_length", 64), ("embedding_length", 64), ("feed_forward_length", 96),
                    ("attention.head_count", 4), ("vocab_size", 128)):
        writer.add_uint32(f"phi3.{name}", v)
    writer.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-5)
    (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"phi3.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=error):
        gguf_model_config(read_gguf(path))
