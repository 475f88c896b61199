"""Multimodal checkpoints' language models: tiny random Gemma 3, Mistral 3, Qwen2.5-VL and
Qwen3-VL checkpoints with a vision tower, written by transformers, give transformers' text-only
logits (Qwen's M-RoPE included), in the hub's tensor layout and in transformers 5's, with the
vision tensors never read by the language model's loader (their vision towers, read beside,
embed an image as transformers does); the hub's sparse Gemma 3 text_config
takes transformers' defaults, an older Qwen2.5-VL config its top-level keys."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.hf_config import hf_model_config
from models.registry import load_model
from models.resolve import resolve_model
from models.safetensors_loader import iter_safetensors_weights
from test_architectures import Paged, hf_logits

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def _gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = dict(TEXT, num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       image_token_index=299, boi_token_index=297,
                                                       eoi_token_index=298))


def _mistral3():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    text = dict(TEXT, model_type="mistral", num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision, image_token_index=299,
                                                           spatial_merge_size=1, tie_word_embeddings=False))


QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2)


def _qwen2_5_vl():  # M-RoPE over sections of 2, 3 and 3 frequencies
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    text = dict({k: v for k, v in TEXT.items() if k != "head_dim"}, num_hidden_layers=2, rope_theta=5000.0,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(QWEN_VISION, fullatt_block_indexes=[0], window_size=56),
        image_token_id=299, video_token_id=298, vision_start_token_id=297))


def _qwen3_vl():  # interleaved M-RoPE, q/k norms
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    text = dict(TEXT, num_hidden_layers=2, rope_theta=5000.0, bos_token_id=1, eos_token_id=2,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=299,
                                                         video_token_id=298, vision_start_token_id=297))


BUILDERS = {"Gemma3ForConditionalGeneration": _gemma3, "Mistral3ForConditionalGeneration": _mistral3,
            "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl, "Qwen3VLForConditionalGeneration": _qwen3_vl}
# the hub's layout (what transformers writes) -> transformers 5's in-memory one
RENAMES = {"Qwen": (("model.", "model.language_model."), ("visual.", "model.visual.")),
           "other": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))}


def _relayout(path, architecture: str) -> None:
    """The checkpoint's tensors renamed from the hub's layout to transformers 5's in-memory one
    (model.language_model.*, model.vision_tower.* or model.visual.*, lm_head.*), as a 5.x save
    without the conversion back writes them."""
    renames = RENAMES["Qwen" if architecture.startswith("Qwen") else "other"]
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        renamed = {}
        for name, tensor in tensors.items():
            for old, new in renames:
                if name.startswith(tuple(n for _, n in renames)):      # Qwen3-VL's hub layout is 5's
                    break
                if name.startswith(old):
                    name = new + name.removeprefix(old)
                    break
            renamed[name] = tensor.contiguous()
        save_file(renamed, file, metadata={"format": "pt"})


def _saved(architecture: str, layout: str, path):
    """A tiny random checkpoint of ``architecture`` written at ``path`` in ``layout`` ("hub" or
    "transformers5") -> transformers' model of it."""
    torch.manual_seed(0)
    hf = BUILDERS[architecture]()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") and "Gemma" not in architecture else 0.0, 0.15)
    hf.config.get_text_config()._attn_implementation = "eager"
    hf.config._attn_implementation = "eager"
    hf.eval().save_pretrained(path)
    if layout == "transformers5":
        _relayout(path, architecture)
    return hf


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
@pytest.mark.parametrize("architecture", sorted(BUILDERS))
def test_the_language_model_of_a_multimodal_checkpoint_matches_transformers(architecture, layout, tmp_path):
    hf = _saved(architecture, layout, tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)))
    skipped = type(model).hf_skipped_prefixes
    names = [n for f in glob.glob(os.path.join(tmp_path, "*.safetensors")) for n in safe_open(f, "pt").keys()]
    assert any(n.startswith(skipped) for n in names)
    assert config.architecture == architecture and config.vocab_size == 300 and config.num_layers == len(model.layers)
    read = [name for name, _ in iter_safetensors_weights(str(tmp_path), skipped)]
    assert read and not any(n.startswith(skipped) for n in read)
    assert type(model).takes_images     # its vision tower read beside, by load_vision (either layout)
    qwen = architecture.startswith("Qwen")
    assert config.image_token_id == 299 and config.mm_prefix_lm == architecture.startswith("Gemma3")
    assert config.mrope_section == ((2, 3, 3) if qwen else ()) and config.image_merge_size == (2 if qwen else 1)
    assert config.mrope_interleaved == architecture.startswith("Qwen3")
    pixels = torch.randn(*((16, 3 * 2 * 14 * 14) if qwen else (1, 3, 28, 28)),
                         generator=torch.Generator().manual_seed(2))
    data = {"pixel_values": pixels, **({"image_grid_thw": torch.tensor([[1, 4, 4]])} if qwen else {}),
            **({"image_sizes": torch.tensor([[28, 28]])} if architecture.startswith("Mistral3") else {})}
    with torch.no_grad():
        out = hf.model.get_image_features(**data, return_dict=True)
        got = model.embed_multimodal("image", {k: v.numpy() for k, v in data.items()})
    joined = lambda t: torch.cat(t) if isinstance(t, (tuple, list)) else t    # noqa: E731 (split per image)
    want = joined(out.pooler_output)
    want = want.reshape(-1, want.shape[-1])
    # Qwen3-VL's DeepStack features beside the embeddings, one slice per layer they feed
    want = torch.cat([want, *map(joined, getattr(out, "deepstack_features", None) or [])], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tokens = torch.randint(3, 290, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    paged = Paged(config)
    (ours,) = paged.step(model, [(tokens, 0, paged.blocks_for([], 29))])
    expected = hf_logits(hf, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
@pytest.mark.parametrize("architecture", ["Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration"])
def test_through_the_transformers_backend_the_language_model_matches_too(architecture, layout, tmp_path):
    """--model-impl transformers: the checkpoint whole (its vision tower too: it takes images;
    Gemma 3's image positions attend to each other both ways), and, with --language-model-only,
    transformers' own causal LM of the text config alone, reading the language model's tensors of
    either layout, the vision tower never built. Either way the logits on text are transformers'."""
    import dataclasses
    hf = _saved(architecture, layout, tmp_path)
    source = dataclasses.replace(resolve_model(str(tmp_path)), model_impl="transformers")
    tokens = torch.randint(3, 290, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    for text_only in (False, True):
        model, config = load_model(dataclasses.replace(source, language_model_only=text_only))
        assert config.architecture == "TransformersForCausalLM"
        assert (config.image_token_id == 299) == (not text_only)
        assert config.mm_prefix_lm == (architecture.startswith("Gemma3") and not text_only)
        assert type(model.hf).__name__.endswith("ForConditionalGeneration") == (not text_only)
        paged = Paged(config)
        (ours,) = paged.step(model, [(tokens, 0, paged.blocks_for([], 29))])
        torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_the_hubs_sparse_gemma3_text_config_takes_transformers_defaults():
    """gemma-3-4b-it's config.json states a handful of text keys (the rest are Gemma3TextConfig's
    defaults) beside top-level eos ids and a vision config."""
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    c = hf_model_config(raw)
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_size) == \
        (262_208, 2560, 34, 8, 4, 256)
    assert (c.max_model_len, c.sliding_window, c.rope_scaling.rope_type, c.rope_scaling.factor) == \
        (131_072, 1024, "linear", 8.0)
    assert c.eos_token_ids == (1, 106) and c.tie_word_embeddings and c.rope_local_theta == 10_000.0
    assert [c.layer_sliding_window(i) for i in (0, 5)] == [1024, None]
    with pytest.raises(ValueError, match="has no text_config object"):
        hf_model_config({**raw, "text_config": None})


def test_an_older_qwen2_5_vl_config_keeps_its_language_models_keys_at_the_top():
    """The hub's Qwen2.5-VL config.json: no text_config, its M-RoPE as rope_scaling type mrope."""
    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
           "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "vision_config": {"depth": 32},
           "image_token_id": 299}
    c = hf_model_config(raw)
    assert (c.num_layers, c.hidden_size, c.rope_theta, c.rope_scaling.is_default, c.qkv_bias) == (2, 64, 1e6, True, True)
    assert (c.mrope_section, c.image_token_id, c.image_merge_size) == ((2, 3, 3), 299, 1)


def test_a_multimodal_checkpoint_is_named_by_its_architecture_in_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaNextForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="LlavaNextForConditionalGeneration.*is not supported"):
        hf_model_config(json.loads((tmp_path / "config.json").read_text()))


def test_qwen2_audios_checkpoint_takes_audio_unless_served_as_its_language_model():
    """Qwen2-Audio's config.json: its language model's keys from text_config (Qwen2's, biases on
    q/k/v), the audio token from audio_token_index; --language-model-only serves it on text."""
    from transformers import Qwen2AudioConfig
    raw = Qwen2AudioConfig(text_config=dict(TEXT, num_hidden_layers=2), audio_token_index=299,
                           audio_config=dict(d_model=32, encoder_layers=1)).to_dict()
    raw["architectures"] = ["Qwen2AudioForConditionalGeneration"]
    config = hf_model_config(raw)
    assert config.audio_token_id == 299 and config.image_token_id is None and config.qkv_bias
    assert config.hidden_size == 64 and config.num_layers == 2 and config.vocab_size == 300
    assert hf_model_config(raw, language_model_only=True).audio_token_id is None


def test_the_hubs_sparse_qwen2_audio_text_config_takes_transformers_defaults():
    """Qwen2-Audio-7B-Instruct's config.json states a handful of text keys (the rest are
    Qwen2Config's defaults: a 4096-wide, 32-layer Qwen2 with as many KV heads as heads)."""
    raw = {"architectures": ["Qwen2AudioForConditionalGeneration"], "audio_token_index": 151_646,
           "model_type": "qwen2_audio", "vocab_size": 156_032,
           "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 1280, "encoder_layers": 32},
           "text_config": {"bos_token_id": 151_643, "eos_token_id": 151_645, "intermediate_size": 11_008,
                           "max_position_embeddings": 8192, "model_type": "qwen2", "rms_norm_eps": 1e-05,
                           "torch_dtype": "bfloat16", "use_mrope": False, "vocab_size": 156_032}}
    c = hf_model_config(raw)
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_size) == \
        (156_032, 4096, 32, 32, 32, 128)
    assert (c.max_model_len, c.intermediate_size, c.rope_theta, c.eos_token_ids) == (8192, 11_008, 10_000.0, (151_645,))
    assert c.audio_token_id == 151_646 and c.qkv_bias and not c.tie_word_embeddings
