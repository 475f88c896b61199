"""Rope scaling (models/rope.py) and partial rotaries against transformers: each type's
frequencies and cos/sin multiplier equal transformers' rope init functions; tiny random models
of each type give transformers' logits read from config.json, and Llama 3.1's and Phi-3's
scalings read from a GGUF file as llama.cpp's converter writes them; longrope and dynamic
scaling follow the context the engine serves; the derived context lengths are vLLM's; a
Phi-4-mini-shaped model (partial rotary and longrope) through the whole engine."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.hf_config import hf_model_config
from models.registry import load_model
from models.resolve import ModelSource, resolve_model
from models.rope import RopeScaling, inv_freq_and_scale, rope_scaling_from
from test_architectures import Paged, hf_logits
from test_gguf_architectures import convert_to_gguf

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
THETA = 500.0     # a small base: most of a 16-wide head's frequencies rotate within a few dozen tokens
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
SHORT = [1.0 + 0.1 * i for i in range(8)]
LONG = [1.5 + 0.5 * i for i in range(8)]
PHI3 = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Phi-4-mini's shape: longrope over half of each 16-wide head (4 frequencies)
PHI4_ROPE = {"rope_type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG[:4], "partial_rotary_factor": 0.5}


def _hf(architecture: str, rope: dict, max_positions: int, layers: int = 2, **extra):
    import transformers
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[architecture]
    config = getattr(transformers, config_cls)(**TINY, num_hidden_layers=layers, max_position_embeddings=max_positions,
                                               rope_parameters={"rope_theta": THETA, **rope}, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    hf.config._attn_implementation = "eager"
    return hf.eval()


def _ours(path, max_model_len: int = 0):
    return load_model(resolve_model(str(path)), max_model_len=max_model_len)


def _prefill(model, config, tokens: list[int]) -> torch.Tensor:
    paged = Paged(config, num_blocks=len(tokens) // 4 + 2)
    (logits,) = paged.step(model, [(tokens, 0, paged.blocks_for([], len(tokens)))])
    return logits


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plain_logits(path, tokens: list[int]) -> torch.Tensor:
    """The same weights with plain rope: what a scaling that did nothing would give."""
    import json
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    raw.pop("original_max_position_embeddings", None)
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)
    model, config = _ours(path)
    return _prefill(model, config, tokens)


# ---- the tables ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope, max_positions, seq_len", [
    ({"rope_type": "linear", "factor": 2.0}, 64, None),
    (LLAMA3, 256, None),
    (YARN, 128, None),
    ({**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 128, None),
    ({**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, 128, None),     # DeepSeek's form: the factors cancel
    ({**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}, 128, None),
    ({**YARN, "attention_factor": 1.3}, 128, None),
    ({"rope_type": "dynamic", "factor": 2.0}, 64, 100),
    ({"rope_type": "dynamic", "factor": 2.0}, 64, 64),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32},
     128, 16),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32},
     128, 48),
])
def test_frequencies_and_scale_equal_transformers(rope, max_positions, seq_len):
    """For an engine serving ``seq_len`` tokens, the frequencies and cos/sin multiplier are those
    transformers computes for a sequence that long (longrope: the long factors past the
    original context; dynamic: the NTK base at that length)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_config = LlamaConfig(**TINY, num_hidden_layers=1, max_position_embeddings=max_positions,
                            rope_parameters={"rope_theta": THETA, **rope})
    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu", seq_len=seq_len)
    scaling = rope_scaling_from(rope, max_positions)
    inv_freq, scale = inv_freq_and_scale(16, THETA, scaling, seq_len or max_positions)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-6)


def test_config_json_reads_each_type_with_vllms_context_lengths():
    """Linear and dynamic scaling stretch max_position_embeddings by the factor (vLLM's derived
    max_model_len), the others do not; longrope serves its original context unless told more
    (vLLM's default), as does dynamic (its base is transformers' own there); Phi-3's top-level
    original_max_position_embeddings wins over the parameters'; 4.x's ``type`` and ``su`` read."""
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5)
    lengths = {}
    for kind, scaling in (("default", None), ("linear", {"type": "linear", "factor": 4.0}),
                          ("dynamic", {"rope_type": "dynamic", "factor": 2.0}), ("llama3", LLAMA3), ("yarn", YARN),
                          ("longrope", {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                                        "original_max_position_embeddings": 64})):
        config = hf_model_config({**base, "rope_scaling": scaling})
        assert config.rope_scaling.rope_type == kind
        lengths[kind] = (config.max_model_len, config.default_max_model_len)
    assert lengths == {"default": (256, 256), "linear": (1024, 1024), "dynamic": (512, 256), "llama3": (256, 256),
                       "yarn": (256, 256), "longrope": (256, 64)}
    phi3 = hf_model_config({**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 32,
                            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                             "original_max_position_embeddings": 64}})
    assert phi3.rope_scaling.original_max_position_embeddings == 32 and phi3.default_max_model_len == 32
    with pytest.raises(ValueError, match="rope type 'deepseek_yarn' is not supported; supported: 'default', 'linear'"):
        hf_model_config({**base, "rope_scaling": {"rope_type": "deepseek_yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="llama3 rope scaling needs low_freq_factor and high_freq_factor"):
        hf_model_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="longrope rope scaling needs short_factor and long_factor"):
        hf_model_config({**base, "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT}})


def test_fixed_and_mixed_ntk_scale_the_frequencies_as_vllms_ntk_rope():
    """GTE's ``ntk`` rope (vLLM's NTKScalingRotaryEmbedding, as its authors' code computes it):
    fixed NTK takes the base times the factor and divides each frequency by factor ** (2 / d);
    the mixed form divides frequency i (from 1) by exp(a i ** b), a = ln(factor) / (d / 2) ** b;
    both stretch the context by the factor (vLLM's derived length) and write back as read."""
    d, theta, factor = 16, 500000.0, 2.0
    plain = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    fixed, _ = inv_freq_and_scale(d, theta, rope_scaling_from({"type": "ntk", "factor": factor}, 128), 256)
    expected = 1.0 / (theta * factor) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d) / factor ** (2 / d)
    torch.testing.assert_close(fixed, expected, rtol=1e-6, atol=0)
    assert (fixed < plain).all()
    mixed_scaling = rope_scaling_from({"rope_type": "ntk", "factor": factor, "mixed_b": 0.7}, 128)
    mixed, _ = inv_freq_and_scale(d, theta, mixed_scaling, 256)
    a = math.log(factor) / (d / 2) ** 0.7
    torch.testing.assert_close(mixed, plain / torch.exp(a * torch.arange(1, d // 2 + 1).float() ** 0.7),
                               rtol=1e-6, atol=0)
    assert rope_scaling_from(mixed_scaling.to_hf(), 128) == mixed_scaling
    assert mixed_scaling.stretched_len(128) == 256


def test_a_scaling_writes_back_the_config_json_it_was_read_from():
    for rope in (LLAMA3, YARN, {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
                 {"rope_type": "linear", "factor": 2.0},
                 {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 32}):
        scaling = rope_scaling_from(rope, 128)
        assert rope_scaling_from(scaling.to_hf(), 128) == scaling
    assert RopeScaling().to_hf() is None


# ---- models ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("architecture, rope", [("llama", LLAMA3), ("qwen2", YARN),
                                                ("llama", {"rope_type": "linear", "factor": 4.0})])
def test_scaled_models_match_transformers(architecture, rope, tmp_path):
    """Prefill logits of a 48-token prompt (past the original 32-token context) equal
    transformers', and differ from the same weights with plain rope."""
    hf = _hf(architecture, rope, 128)
    hf.save_pretrained(tmp_path)
    model, config = _ours(tmp_path)
    assert config.rope_scaling.rope_type == rope["rope_type"]
    tokens = _tokens(48)
    ours, expected = _prefill(model, config, tokens), hf_logits(hf, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert (ours - _plain_logits(tmp_path, tokens)).abs().max() > 1e-2


def test_longrope_takes_its_long_factors_when_the_engine_serves_past_the_original_context(tmp_path):
    """Phi-3's longrope: served within the original context (the default) the short factors,
    as transformers uses for a sequence that short; served longer, the long factors, as
    transformers uses for a sequence longer than the original context."""
    hf = _hf("phi3", {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}, 128,
             original_max_position_embeddings=32, **PHI3)
    hf.save_pretrained(tmp_path)
    short_model, short_config = _ours(tmp_path)
    assert (short_config.serving_len, short_config.max_model_len) == (32, 128)
    tokens = _tokens(24)
    torch.testing.assert_close(_prefill(short_model, short_config, tokens), hf_logits(hf, tokens),
                               atol=1e-4, rtol=1e-4)
    long_model, long_config = _ours(tmp_path, max_model_len=128)
    tokens = _tokens(48, 2)
    long_logits = _prefill(long_model, long_config, tokens)
    torch.testing.assert_close(long_logits, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    short = tokens[:24]                  # the short factors' model serves 32 positions: the two on those
    assert (_prefill(long_model, long_config, short) - _prefill(short_model, short_config, short)).abs().max() > 1e-2


def test_dynamic_ntk_stretches_its_base_for_the_context_served(tmp_path):
    """Dynamic NTK: within max_position_embeddings (the default) plain rope, as transformers;
    an engine serving 96 tokens of a 64-position model stretches the base as transformers does
    for a 96-token sequence, and gives its logits for one."""
    hf = _hf("llama", {"rope_type": "dynamic", "factor": 2.0}, 64)
    hf.save_pretrained(tmp_path)
    model, config = _ours(tmp_path)
    tokens = _tokens(40)
    torch.testing.assert_close(_prefill(model, config, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    stretched, stretched_config = _ours(tmp_path, max_model_len=96)
    tokens = _tokens(96, 3)
    torch.testing.assert_close(_prefill(stretched, stretched_config, tokens), hf_logits(hf, tokens),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture, rope", [("phi3", {"rope_type": "default", "partial_rotary_factor": 0.75}),
                                                ("phi3", PHI4_ROPE)])
def test_partial_rotary_models_match_transformers(architecture, rope, tmp_path):
    """A partial rotary (Phi-4-mini's): the leading dims of each head turn, the rest pass; prefill
    and step-by-step decode through the paged cache give transformers' logits."""
    hf = _hf(architecture, rope, 128, original_max_position_embeddings=32,
             **(PHI3 if architecture == "phi3" else {}))
    hf.save_pretrained(tmp_path)
    model, config = _ours(tmp_path, max_model_len=128)
    assert config.rotary_dim == int(16 * rope["partial_rotary_factor"])
    tokens = _tokens(40, 5)
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(_prefill(model, config, tokens), expected, atol=1e-4, rtol=1e-4)
    paged, table = Paged(config, num_blocks=16), []
    outs = paged.step(model, [(tokens[:33], 0, paged.blocks_for(table, 33))])
    for p in range(33, len(tokens)):
        outs += paged.step(model, [(tokens[p:p + 1], p, paged.blocks_for(table, p + 1))])
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-4, rtol=1e-4)


# ---- GGUF ----------------------------------------------------------------------------------------------

def _llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3.1's scaling: a divisor per frequency."""
    freqs = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_gguf_rope_freqs_match_transformers(tmp_path):
    """A Llama 3.1-style GGUF: the scaling travels as the rope_freqs tensor, which is read into
    the rotary tables (never loaded as a weight); logits equal transformers' on config.json's."""
    hf = _hf("llama", LLAMA3, 128)
    path = str(tmp_path / "llama3.gguf")
    convert_to_gguf(hf, "llama", path, extra=lambda w: w.add_tensor("rope_freqs.weight",
                                                                     _llama_cpp_rope_freqs(LLAMA3, 16)))
    model, config = load_model(ModelSource("gguf", path, "llama3"))
    assert len(config.rope_scaling.freq_factors) == 8
    tokens = _tokens(48)
    torch.testing.assert_close(_prefill(model, config, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_phi3_gguf_longrope_factors_match_transformers(tmp_path):
    """A Phi-4-mini-style GGUF (rope_factors_short/long tensors, the attention factor and the
    original context in the header, the rotary's width as rope.dimension_count), served past
    its original context: the long factors over the partial rotary."""
    hf = _hf("phi3", PHI4_ROPE, 128, original_max_position_embeddings=32, **PHI3)

    def longrope(writer):
        writer.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(128 / 32) / math.log(32)))
        writer.add_uint32("phi3.rope.scaling.original_context_length", 32)
        writer.add_tensor("rope_factors_short.weight", np.array(PHI4_ROPE["short_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(PHI4_ROPE["long_factor"], dtype=np.float32))

    path = str(tmp_path / "phi3.gguf")
    convert_to_gguf(hf, "phi3", path, extra=longrope)
    model, config = load_model(ModelSource("gguf", path, "phi3"), max_model_len=128)
    assert config.rope_scaling.rope_type == "longrope" and config.default_max_model_len == 32
    assert config.rotary_dim == 8
    tokens = _tokens(48, 2)
    torch.testing.assert_close(_prefill(model, config, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


# ---- the engine ----------------------------------------------------------------------------------------

def _greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_the_engine_serves_longrope_past_its_original_context_as_asked(tmp_path):
    """Through the whole engine, a Phi-4-mini-shaped model (longrope over a partial rotary): by
    default it serves its original context (a longer prompt is refused); with --max-model-len
    past it, greedy tokens of a prompt longer than the original context are transformers' (the
    long factors, from the first token on), the decode steps included."""
    from actors.api import LLM, SamplingParams
    hf = _hf("phi3", PHI4_ROPE, 128, original_max_position_embeddings=32, **PHI3)
    hf.save_pretrained(tmp_path)
    prompt, params = _tokens(40, 4), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path), multiprocess=False, skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    with LLM(str(tmp_path), multiprocess=False, skip_tokenizer_init=True, max_model_len=128) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == _greedy_hf(hf, prompt, 8)


def test_a_context_allowed_past_the_models_own_rotates_every_position(tmp_path):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN's case: an engine serving 200 tokens of a 64-position model
    has rotary tables for all 200 (transformers rotates any position), not an index error."""
    hf = _hf("llama", {"rope_type": "default"}, 64)
    hf.save_pretrained(tmp_path)
    model, config = _ours(tmp_path, max_model_len=200)
    assert (config.max_model_len, config.rope_positions) == (64, 200)
    assert _ours(tmp_path, max_model_len=32)[1].rope_positions == 32          # the tables cover what is served
    tokens = _tokens(150, 6)
    torch.testing.assert_close(_prefill(model, config, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
