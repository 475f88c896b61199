"""The parts of image input that need no engine: image parts taken out of chat messages and
rendered as the model's placeholder, images read from data and file URLs (and refused by
name), a placeholder expanded by the checkpoint's processor (or one rebuilt from its image
processor), the prefix cache's extra keys (vLLM's), the worker's rows of an image across prefill
chunks, M-RoPE's positions, and the flags."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from actors.engine.args import EngineArgs
from actors.engine.config import MultiModalConfig
from actors.engine.messages import MultiModalFeature, NewRequestData
from actors.engine.sampling_params import SamplingParams
from actors.kv_manager.block_hash import block_extra_keys, event_extra_keys
from actors.tokenizer.chat import content_to_parts, content_to_text, normalize_messages
from actors.tokenizer.multimodal import IMAGE_PART, MediaError, extract_images, images_of, load_image
from actors.worker.input_batch import InputBatch
from helpers import random_image, save_tiny_llava


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_image_parts_leave_the_messages_in_order_as_the_templates_image_parts():
    image = random_image(0)
    messages = [{"role": "system", "content": "t1"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:a"}},
                                             {"type": "text", "text": "t2"},
                                             {"type": "image_pil", "image_pil": image}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": "http://h/b.png"}]}]
    out, sources = extract_images(messages)
    assert sources == ["data:a", image, "http://h/b.png"]
    assert out[0] is messages[0]
    assert out[1]["content"] == [IMAGE_PART, {"type": "text", "text": "t2"}, IMAGE_PART]
    with pytest.raises(MediaError, match="non-empty url"):
        extract_images([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert images_of({"image": image}) == [image] and images_of({"image": [image, image]}) == [image, image]
    with pytest.raises(MediaError, match="audio"):
        images_of({"audio": b""})


def test_the_string_format_puts_missing_placeholders_before_the_text_as_vllm_does():
    parts = [IMAGE_PART, {"type": "text", "text": "what is it"}, IMAGE_PART]
    assert content_to_text(parts, "<image>") == "<image>\n<image>\nwhat is it"
    assert content_to_text([IMAGE_PART, {"type": "text", "text": "a <image> b"}], "<image>") == "a <image> b"
    assert content_to_parts(parts, images=True) == [IMAGE_PART, {"type": "text", "text": "what is it"}, IMAGE_PART]
    assert normalize_messages([{"role": "user", "content": parts}], "openai", "<image>")[0]["content"][0] == IMAGE_PART
    with pytest.raises(ValueError, match="takes no images"):
        content_to_text([{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match="'image'"):
        content_to_parts(parts)                 # a model without images


def test_images_are_read_from_data_and_allowed_file_urls_and_refused_by_name(tmp_path):
    image = random_image(1, 20, 10)
    data = png(image)
    config = MultiModalConfig(allowed_local_media_path=str(tmp_path))
    (tmp_path / "a.png").write_bytes(data)
    rgba = random_image(2).convert("RGBA")
    read = lambda source, c=config: asyncio.run(load_image(source, c))     # noqa: E731
    got = read("data:image/png;base64," + base64.b64encode(data).decode())
    assert got.size == (20, 10) and got.mode == "RGB" and got.tobytes() == image.tobytes()
    assert read(f"file://{tmp_path}/a.png").tobytes() == image.tobytes()
    assert read(rgba).mode == "RGB"
    cases = [("data:image/png;base64,***", "not valid base64"), ("data:image/png,abc", "Only base64"),
             ("data:image/png;base64," + base64.b64encode(b"text").decode(), "does not hold an image"),
             ("data:nocomma", "missing ','"), ("ftp://x/a.png", "HTTP, data or file URL"),
             (f"file://{tmp_path}/missing.png", "could not read"), ("file:///etc/passwd", "must be a subpath"),
             (f"file://{tmp_path}/../{tmp_path.name}/../x.png", "must be a subpath"), (3, "URL or a PIL image")]
    for source, message in cases:
        with pytest.raises(MediaError, match=message):
            read(source)
    with pytest.raises(MediaError, match="without `--allowed-local-media-path`"):
        read(f"file://{tmp_path}/a.png", MultiModalConfig())
    with pytest.raises(MediaError, match="--enable-mm-embeds"):
        read(torch.zeros(4, 8))
    assert read(torch.ones(4, 8), MultiModalConfig(enable_mm_embeds=True)).shape == (4, 8)
    with pytest.raises(MediaError, match="allowed domains"):
        read("http://example.com/a.png", MultiModalConfig(allowed_media_domains=("127.0.0.1",)))


def test_the_processor_expands_each_placeholder_into_its_images_positions(tmp_path):
    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    from actors.tokenizer.multimodal import ImageProcessor
    save_tiny_llava(tmp_path)
    tok = TextTokenizer.from_hf_dir(str(tmp_path))
    processor = ImageProcessor(str(tmp_path), 299, MultiModalConfig(limit_per_prompt={"image": 1}),
                               lambda text: tok.encode(text, add_special_tokens=False))
    assert processor.placeholder == "<image>" and processor.placeholder_id == 299
    a, b = processor.process(random_image(3)), processor.process(random_image(4))
    assert a[0] == [299] * 16 and a[1]["pixel_values"].shape == (1, 3, 56, 56) and a[2] != b[2]
    assert processor.process(random_image(3))[2] == a[2]        # the identifier is the image's
    ids, features = processor.expand([5, 299, 6, 299], [a, b])
    assert ids == [5] + [299] * 16 + [6] + [299] * 16
    assert [(f.offset, f.length, f.identifier, f.is_embed) for f in features] == [(1, 16, a[2], None),
                                                                                 (18, 16, b[2], None)]
    with pytest.raises(MediaError, match="1 image placeholders"):
        processor.expand([5, 299], [a, b])
    # the processor cache: the same image and keywords processed once; other keywords, another entry
    assert (processor.mm_cache_hits, processor.mm_cache_queries) == (1, 3)
    raw = processor.process(random_image(3), {"do_normalize": False})
    assert raw[2] != a[2] and not np.allclose(raw[1]["pixel_values"], a[1]["pixel_values"])
    uncached = ImageProcessor(str(tmp_path), 299, MultiModalConfig(processor_cache_gb=0),
                              lambda text: tok.encode(text, add_special_tokens=False))
    for _ in range(2):
        assert uncached.process(random_image(3))[2] == a[2]
    assert uncached.mm_cache_hits == 0
    with pytest.raises(MediaError, match=r"At most 1 image\(s\)"):
        processor.check_count([random_image(3), random_image(4)])


def test_qwen2_vls_and_pixtrals_processors_are_rebuilt_from_their_image_processors(tmp_path, monkeypatch):
    """Where transformers cannot build either processor whole (without torchvision; made so
    here on any machine), each is its image processor with the processor's rule: Qwen2-VL's one
    <|image_pad|> per merged patch (a 100x80 picture resized to 112x84: 8x6 patches, 4x3 merged),
    written in a prompt between its vision markers; Pixtral's (processor_config.json's patch of 14 merged 2x2) three rows of four [IMG],
    [IMG_BREAK] between them, [IMG_END] last, its markers plain tokens."""
    import transformers

    from actors.tokenizer.gguf_tokenizer import TextTokenizer

    def needs_torchvision(*args, **kwargs):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library")
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", needs_torchvision)
    from actors.tokenizer.multimodal import ImageProcessor
    from helpers import save_tiny_mistral3, save_tiny_qwen2_vl
    image = random_image(5, 100, 80)
    save_tiny_qwen2_vl(tmp_path / "qwen")
    tok = TextTokenizer.from_hf_dir(str(tmp_path / "qwen"))
    qwen = ImageProcessor(str(tmp_path / "qwen"), 299, MultiModalConfig(),
                          lambda text: tok.encode(text, add_special_tokens=False), needs_grid=True)
    assert (qwen.name, qwen.placeholder, qwen.placeholder_id) == ("Qwen2VLProcessor", "<|image_pad|>", 299)
    assert qwen.prompt_placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    ids, data, *_ = qwen.process(image)
    assert ids == [299] * 12 and data["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert data["pixel_values"].shape == (48, 3 * 2 * 14 * 14)
    with pytest.raises(MediaError, match="image_embeds alone do not give"):
        qwen.process(np.zeros((12, 64), np.float32))
    save_tiny_mistral3(tmp_path / "mistral")
    tok = TextTokenizer.from_hf_dir(str(tmp_path / "mistral"))
    pixtral = ImageProcessor(str(tmp_path / "mistral"), 299, MultiModalConfig(),
                             lambda text: tok.encode(text, add_special_tokens=False))
    assert (pixtral.name, pixtral.prompt_placeholder) == ("PixtralProcessor", "[IMG]")
    ids, data, *_ = pixtral.process(image)
    assert ids == ([299] * 4 + [297]) * 2 + [299] * 4 + [298] and data["image_sizes"].tolist() == [[84, 112]]
    _, (item,) = pixtral.expand([5, 299, 6], [(ids, data, "x")])
    assert item.num_embeds == 12 and item.embed_span == (1, 15)


def feature(identifier: str, offset: int, length: int, is_embed=None) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, {"pixel_values": np.zeros(1, np.float32)},
                             None if is_embed is None else np.asarray(is_embed))


def test_a_blocks_extra_keys_name_each_image_it_holds_with_its_offset_as_vllm_does():
    from actors.engine.lora import LoRARequest
    features = [feature("A", 5, 20), feature("B", 30, 2)]
    keys = [block_extra_keys(i, None, None, None, 16, features) for i in range(3)]
    assert keys == [(("mm", "A", 5),), (("mm", "A", -11), ("mm", "B", 14)), None]
    lora = LoRARequest("ad", 1, "/p")
    assert block_extra_keys(0, lora, "salt", None, 16, features) == (("lora", "ad", "/p"), ("mm", "A", 5),
                                                                     ("cache_salt", "salt"))
    assert event_extra_keys(keys[1]) == (("A", -11), ("B", 14))


def test_each_pass_asks_for_the_images_it_reaches_and_takes_their_rows_across_chunks():
    batch = InputBatch(4, 64, 16, 100)
    mask = np.array([False] + [True] * 6 + [False])              # start and end markers around 6 rows
    feats = [feature("A", 2, 8, mask), feature("B", 12, 3)]
    batch.add(NewRequestData("r", list(range(20)), [], SamplingParams(max_tokens=1), ([1, 2],), 0, mm_features=feats))
    calls = []

    def encode(f):
        calls.append(f.identifier)
        return torch.arange(f.num_embeds, dtype=torch.float32)[:, None] + (100 if f.identifier == "B" else 0)

    slots = np.array([0])
    chunks = []
    for start, n in ((0, 5), (5, 9), (14, 6)):
        got = batch.embeds_inputs(slots, np.array([start]), np.array([n]), encode)
        chunks.append(None if got is None else (got[0].tolist(), torch.cat(got[1])[:, 0].tolist()))
    assert calls == ["A", "A", "B", "B"]          # the runner's encoder cache answers (one encoding each)
    # A's rows go to positions 3..8 (its markers at 2 and 9 keep their tokens), B's to 12..14
    assert chunks == [([3, 4], [0.0, 1.0]), ([0, 1, 2, 3, 7, 8], [2.0, 3.0, 4.0, 5.0, 100.0, 101.0]),
                      ([0], [102.0])]
    assert batch.embeds_inputs(slots, np.array([0]), np.array([20])) is None     # a later pipeline stage reads none
    batch.remove("r")
    assert batch.num_with_embeds == 0


def test_the_multimodal_flags_are_checked_and_every_limit_zero_serves_text(tmp_path):
    mm = EngineArgs(limit_mm_per_prompt='{"image": 3, "video": {"count": 0}}', mm_processor_kwargs='{"a": 1}',
                    allowed_local_media_path=str(tmp_path), allowed_media_domains=["h"],
                    mm_processor_cache_gb=0.5).multimodal()
    assert mm.processor_cache_gb == 0.5
    assert mm.limit("image") == 3 and mm.limit("video") == 0 and mm.limit("audio") == 999
    assert mm.mm_processor_kwargs == {"a": 1} and mm.allowed_media_domains == ("h",)
    assert mm.allowed_local_media_path == str(tmp_path.resolve())
    for bad, message in ((dict(limit_mm_per_prompt='{"smell": 1}'), "not a modality"),
                         (dict(limit_mm_per_prompt='{"image": -1}'), "at least 0"),
                         (dict(limit_mm_per_prompt="[1]"), "JSON objects"),
                         (dict(allowed_local_media_path=str(tmp_path / "nope")), "not a folder"),
                         (dict(mm_processor_cache_gb=-1), "at least 0")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(**bad).multimodal()
    assert EngineArgs(limit_mm_per_prompt={"image": 0}).create_engine_config().model.source.language_model_only
    assert not EngineArgs().create_engine_config().model.source.language_model_only


def test_with_disable_chunked_mm_input_no_step_ends_inside_an_image():
    """vLLM's --disable-chunked-mm-input (always on for a prefix LM): a prompt chunk that would end
    inside an image stops before it, and the image comes whole in the next step; without it the
    chunks are the budget's. Images also key the blocks they touch."""
    from actors.engine.messages import EngineCoreRequest
    from sched_utils import EOS, Harness

    def chunks(**cfg) -> list[int]:
        h = Harness(max_num_batched_tokens=10, **cfg)
        req = EngineCoreRequest("r", list(range(100, 130)), SamplingParams(max_tokens=1, temperature=0), 0.0, [EOS],
                                mm_features=[feature("A", 6, 8), feature("B", 20, 6)])
        assert h.s.add_request(req) is None
        got = []
        for _ in range(8):
            so, _ = h.step()
            if "r" not in so.num_scheduled_tokens:
                break
            got.append(so.num_scheduled_tokens["r"])
        return got
    assert chunks() == [10, 10, 10]
    assert chunks(disable_chunked_mm_input=True) == [6, 10, 10, 4]       # 0-6, then A (6-14) whole, B (20-26) whole


def test_requests_of_one_pass_with_the_same_image_share_one_encoding():
    batch = InputBatch(4, 64, 16, 100)
    for rid in ("a", "b"):                      # a request's two choices, say
        batch.add(NewRequestData(rid, list(range(12)), [], SamplingParams(max_tokens=1), ([1],), 0,
                                 mm_features=[feature("A", 2, 4)]))
    calls = []
    got = batch.embeds_inputs(np.array([0, 1]), np.array([0, 0]), np.array([12, 12]),
                              lambda f: calls.append(f.identifier) or torch.ones(4, 3))
    assert calls == ["A"] and got[0].tolist() == [2, 3, 4, 5, 14, 15, 16, 17]


def test_mrope_positions_are_transformers_rope_index_and_a_pass_without_images_keeps_one_row():
    """Qwen2-VL's M-RoPE positions of a prompt with two images (grids of 2x3 and 2x2 merged
    patches, the 2x2 merge of 14-pixel patches) as transformers' get_rope_index gives them, with
    the delta of the tokens past the prompt; the worker's pass over a request's image positions
    has three rows, a pass over its later text one row (the rows agree)."""
    import types

    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    from models.mrope import mrope_positions
    grids = [np.array([[1, 4, 6]]), np.array([[1, 4, 4]])]
    # t0 t1 [6 image] t2 t3 t4 [4 image] t5
    features = [MultiModalFeature("image", "a", 2, 6, {"image_grid_thw": grids[0]}),
                MultiModalFeature("image", "b", 11, 4, {"image_grid_thw": grids[1]})]
    types_ = torch.tensor([[0, 0] + [1] * 6 + [0] * 3 + [1] * 4 + [0]])
    vision = types.SimpleNamespace(spatial_merge_size=2)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision),
                                 get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k))
    want, delta = Qwen2VLModel.get_rope_index(fake, torch.zeros_like(types_), types_,
                                              image_grid_thw=torch.from_numpy(np.concatenate(grids)))
    got, got_delta = mrope_positions(16, features, 2)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert got_delta == int(delta) == -5
    batch = InputBatch(2, 64, 16, 300, mrope_merge_size=2)
    batch.add(NewRequestData("r", list(range(16)), [], SamplingParams(max_tokens=4), ([1],), 0, mm_features=features))
    slots, cu = np.array([0]), np.array([0, 4])
    assert batch.rope_positions(slots, np.arange(4), cu).shape == (3, 4)        # image a's first positions
    np.testing.assert_array_equal(batch.rope_positions(slots, np.arange(15, 19), cu), [10, 11, 12, 13])


def test_a_llava_of_a_llama_is_troupes_own_class_and_of_another_language_model_transformers():
    from models.hf_config import model_implementation
    raw = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
           "text_config": {"model_type": "llama"}, "vision_config": {"model_type": "clip_vision_model"}}
    assert model_implementation(raw) == model_implementation(raw, "vllm") == "vllm"
    assert model_implementation(raw, "transformers") == "transformers"
    qwen = {**raw, "text_config": {"model_type": "qwen2"}}
    assert model_implementation(qwen) == "transformers"
    with pytest.raises(ValueError, match="serves a Llama language model, not 'qwen2': --model-impl transformers"):
        model_implementation(qwen, "vllm")
