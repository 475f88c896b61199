"""Image input, as vLLM takes it, on a tiny random LLaVA checkpoint (a CLIP vision tower, a
projector, a Llama: Troupe's own LLaVA class, and the transformers backend serving it whole)
written with its processor by transformers: offline (``multi_modal_data``, ``image_pil`` chat parts) and over
HTTP (chat ``image_url`` parts as data, http and file URLs), the greedy tokens are those of
transformers' own ``generate`` over the same images, in prefill chunks that split an image; the
prefix cache serves an image's blocks to the same image only; unreadable, disallowed and
surplus images are refused by name."""
from __future__ import annotations

import base64
import io
import json
import re
import urllib.error
import urllib.request

import pytest

from helpers import http_folder, random_image, save_tiny_llava
from server import Server

pytestmark = pytest.mark.slow

PROMPT = "t5 t9 <image> t7 t8 t11"              # the image's 16 positions start at 2
LONG = "t5 t9 <image> " + " ".join(f"t{i}" for i in range(20, 44))   # 2 + 16 + 24 = 42 positions
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    hf, processor = save_tiny_llava(path)
    return str(path), hf, processor


def hf_answer(llava, text: str, images: list, **kwargs) -> list[int]:
    """transformers' greedy tokens for ``text`` (its placeholders) with ``images`` (``kwargs``:
    the processor's keywords)."""
    import torch
    _, hf, processor = llava
    inputs = processor(images=images, text=text, return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# -- offline ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(llava):
    from actors.api import LLM
    engine = LLM(model=llava[0], max_model_len=256, max_num_batched_tokens=8, limit_mm_per_prompt={"image": 2},
                 enable_mm_embeds=True)
    try:
        yield engine
    finally:
        engine.close()


def greedy():
    from actors.api import SamplingParams
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_images_answer_as_transformers_llava_does_in_prefill_chunks_that_split_them(llm, llava, impl):
    """Troupe's own LLaVA class (``auto``: its Llama, transformers' CLIP tower and LLaVA's
    projector) and the whole checkpoint through --model-impl transformers."""
    from actors.api import LLM
    a, b = random_image(1), random_image(2, 30, 64)
    two = "t5 <image> t6 <image> t7"
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": a}},
               {"prompt": PROMPT, "multi_modal_data": {"image": [b]}},
               {"prompt": two, "multi_modal_data": {"image": [a, b]}}]
    want = [hf_answer(llava, PROMPT, [a]), hf_answer(llava, PROMPT, [b]), hf_answer(llava, two, [a, b])]
    assert want[0] != want[1]                   # the image decides the answer
    if impl == "auto":
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, greedy())] == want
        assert [len(r.prompt_token_ids) for r in llm.generate(prompts[:1], greedy())] == [len(PROMPT.split()) + 15]
        return
    with LLM(model=llava[0], model_impl="transformers", max_model_len=256, max_num_batched_tokens=8,
             limit_mm_per_prompt={"image": 2}) as whole:
        assert [r.outputs[0].token_ids for r in whole.generate(prompts, greedy())] == want


def test_a_chat_with_an_image_pil_part_renders_the_templates_image_token(llm, llava):
    image = random_image(3)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "t5 t6"}]}]
    got = llm.chat(messages, greedy())[0].outputs[0].token_ids
    assert got == hf_answer(llava, "t1 <image> t5 t6 t3", [image])


def test_the_prefix_cache_serves_an_images_blocks_to_that_image_only(llm, llava):
    a, b = random_image(4), random_image(5)
    first, again = (llm.generate({"prompt": LONG, "multi_modal_data": {"image": a}}, greedy())[0] for _ in range(2))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_answer(llava, LONG, [a])
    assert again.num_cached_tokens == 32            # both full blocks of 42 positions
    other = llm.generate({"prompt": LONG, "multi_modal_data": {"image": b}}, greedy())[0]
    assert other.num_cached_tokens == 0             # the same tokens, another image from block 0 on
    assert other.outputs[0].token_ids == hf_answer(llava, LONG, [b])


def image_features(llava, image):
    """transformers' embeddings of ``image`` (its positions, hidden): what its tower and projector make."""
    import torch
    _, hf, processor = llava
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=processor(images=[image], text="<image>",
                                                                 return_tensors="pt")["pixel_values"],
                                          return_dict=True).pooler_output
    return (out[0] if isinstance(out, (list, tuple)) else out.reshape(-1, out.shape[-1])).clone()


def test_an_image_given_as_its_embeddings_answers_as_the_image_does(llm, llava):
    a, b = random_image(11), random_image(12)
    want = [hf_answer(llava, "t5 <image> t6 <image> t7", [a, b])]
    rows = [image_features(llava, a), image_features(llava, b)]
    import torch
    for data in ([rows[0], rows[1]], torch.stack(rows)):          # a list of (16, 64), or (2, 16, 64)
        got = llm.generate({"prompt": "t5 <image> t6 <image> t7", "multi_modal_data": {"image": data}}, greedy())
        assert [got[0].outputs[0].token_ids] == want
    mixed = llm.generate({"prompt": "t5 <image> t6 <image> t7", "multi_modal_data": {"image": [rows[0], b]}},
                         greedy())
    assert [mixed[0].outputs[0].token_ids] == want
    with pytest.raises(ValueError, match="hidden_size 8 does not match"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(16, 8)}}, greedy())


def test_the_processor_cache_serves_an_image_again_until_reset(llm):
    def hits() -> int:
        return next(m.value for m in llm.get_metrics() if m.name == "vllm:mm_cache_hits")
    image, before = random_image(10), hits()
    for _ in range(2):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy())
    assert hits() == before + 1
    llm.reset_mm_cache()
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy())
    assert hits() == before + 1


def test_placeholders_and_images_must_pair_up_within_the_limit(llm):
    image = random_image(6)
    cases = [({"prompt": "t5 t6", "multi_modal_data": {"image": image}}, "0 image placeholders"),
             ({"prompt": "t5 <image> <image>", "multi_modal_data": {"image": image}}, "2 image placeholders"),
             ({"prompt": "t5 <image> <image> <image>", "multi_modal_data": {"image": [image] * 3}},
              r"At most 2 image\(s\) may be provided in one prompt"),
             ({"prompt": PROMPT, "multi_modal_data": {"audio": ([0.0] * 1600, 16000)}},
              r"this model takes no audio \(LlavaProcessor takes images\)"),
             ({"prompt": PROMPT, "multi_modal_data": {"sound": image}}, r"multi_modal_data \['sound'\]"),
             ({"prompt": PROMPT, "multi_modal_data": {"image": "not an image"}}, "HTTP, data or file URL")]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, greedy())


@pytest.mark.parametrize("parallel", [{}, {"pipeline_parallel_size": 2}])
def test_an_image_its_encoder_fails_on_fails_its_own_request_only(llava, parallel):
    """Processed at twice the tower's resolution (a request's mm_processor_kwargs), an image
    that the vision tower refuses: its request ends with an error naming the encoder (reported
    by the first pipeline stage, which reads the images), the other request of the same step
    gets its tokens, none of the blocks the failed step computed is served from the prefix cache
    (the same request fails again rather than reading them), and the engine goes on."""
    from actors.api import LLM
    good, bad = random_image(15), random_image(16)
    big = {"size": {"shortest_edge": 112}, "crop_size": {"height": 112, "width": 112}}
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": good}},        # 90 positions in one step:
               {"prompt": LONG, "multi_modal_data": {"image": bad}, "mm_processor_kwargs": big}]   # 5 blocks
    with LLM(model=llava[0], max_model_len=256, max_num_batched_tokens=256, **parallel) as engine:
        for _ in range(2):
            ok, failed = engine.generate(prompts, greedy())
            assert ok.outputs[0].token_ids == hf_answer(llava, PROMPT, [good])
            assert failed.outputs[0].finish_reason == "error" and "the image encoder failed" in failed.error
        again = engine.generate({"prompt": LONG, "multi_modal_data": {"image": bad}}, greedy())[0]
        assert again.outputs[0].token_ids == hf_answer(llava, LONG, [bad])


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}])
def test_tensor_and_pipeline_parallel_ranks_take_images_too(llava, parallel):
    """The first pipeline stage alone reads the image (the later one starts from its hidden
    states); each tensor-parallel rank encodes it whole."""
    from actors.api import LLM
    image = random_image(9)
    with LLM(model=llava[0], max_model_len=256, max_num_batched_tokens=8, **parallel) as engine:
        got = engine.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy())
    assert got[0].outputs[0].token_ids == hf_answer(llava, PROMPT, [image])


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_gemma3s_images_attend_to_themselves_both_ways_as_transformers_has_it(tmp_path, impl):
    """Gemma 3 (Troupe's own class, and transformers' through --model-impl transformers): an
    image's 16 positions attend to each other both ways (its sliding layers' window of 8 still
    bounding what they see behind), the rest causally, as transformers' masks have it; a step
    never ends inside an image (at a budget of 24 tokens the second prompt's first chunk stops
    after it), the prefix cache serves an image's blocks again, and an image longer than a
    step's budget is refused."""
    import torch

    from actors.api import LLM
    from helpers import save_tiny_gemma3_vision
    hf, processor = save_tiny_gemma3_vision(tmp_path)
    cases = [(random_image(13), "t5 t9 <start_of_image> t7 t8"),
             (random_image(14), "t5 <start_of_image> " + " ".join(f"t{i}" for i in range(20, 32)))]
    want, causal = [], []
    for image, prompt in cases:
        inputs = processor(images=[image], text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            plain = hf.generate(**{k: v for k, v in inputs.items() if k != "token_type_ids"},
                                max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        n = inputs["input_ids"].shape[1]
        want.append(out[0, n:].tolist())
        causal.append(plain[0, n:].tolist())
    assert want != causal                            # the images' two-way attention decides the answers
    prompts = [{"prompt": p, "multi_modal_data": {"image": i}} for i, p in cases]
    with LLM(model=str(tmp_path), model_impl=impl, max_model_len=256, max_num_batched_tokens=24) as engine:
        assert [r.outputs[0].token_ids for r in engine.generate(prompts, greedy())] == want
        again = engine.generate(prompts[1], greedy())[0]
        assert again.outputs[0].token_ids == want[1] and again.num_cached_tokens == 16
    with LLM(model=str(tmp_path), model_impl=impl, max_model_len=256, max_num_batched_tokens=16) as engine:
        with pytest.raises(ValueError, match="an image takes 18 positions, which are computed in one step"):
            engine.generate(prompts[0], greedy())


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def qwen_answer(inputs, hf, prompt: str, images: list) -> list[int]:
    """transformers' greedy tokens for a Qwen2-VL prompt (``QWEN_IMAGE`` per image)."""
    import torch
    given = inputs(prompt.replace(QWEN_IMAGE, "<|vision_start|> <|image_pad|> <|vision_end|>"), images)
    with torch.no_grad():
        out = hf.generate(**given, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, given["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen2_vls_images_take_mrope_positions_as_transformers_gives_them(tmp_path, family):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (Troupe's own classes, their vision towers by
    transformers, the processor rebuilt from its image processor where transformers cannot build
    it whole): an image's tokens take M-RoPE's (time, height, width) positions (Qwen3-VL's
    interleaved) and the text after it counts on from the image's longer side, Qwen3-VL's
    DeepStack features join its first layers' outputs, as transformers' generate has it, in
    prefill chunks of 8 that split the images; the chat template of
    chat_template.json renders an image part; the prefix cache serves an image's blocks again
    with the same positions; embeddings without the image's grid are refused, and vLLM's dict of
    the tower's rows beside the grids answers as the images do."""
    import torch

    from actors.api import LLM
    from helpers import save_tiny_qwen2_vl
    hf, inputs = save_tiny_qwen2_vl(tmp_path, family)
    a, b = random_image(1), random_image(2, 30, 64)
    one = f"t5 t9 {QWEN_IMAGE} " + " ".join(f"t{i}" for i in range(20, 34))
    cases = [(one, [a]), (one, [b]), (f"t5 {QWEN_IMAGE} t6 {QWEN_IMAGE} t7", [a, b])]
    want = [qwen_answer(inputs, hf, prompt, images) for prompt, images in cases]
    assert want[0] != want[1]
    prompts = [{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases]
    with LLM(model=str(tmp_path), max_model_len=256, max_num_batched_tokens=8, limit_mm_per_prompt={"image": 2},
             enable_mm_embeds=True) as llm:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, greedy())] == want
        again = llm.generate(prompts[0], greedy())[0]
        assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens == 16
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": b},
                                                 {"type": "text", "text": "t7"}]}]
        assert llm.chat(messages, greedy())[0].outputs[0].token_ids == qwen_answer(
            inputs, hf, f"t1 {QWEN_IMAGE} t7 t3", [b])
        with pytest.raises(ValueError, match="image_embeds alone do not give"):
            llm.generate({"prompt": one, "multi_modal_data": {"image": torch.zeros(6, 64)}}, greedy())
        # vLLM's dict: the tower's rows (Qwen3-VL's with their DeepStack features) beside the grid
        pixels = [inputs("<|image_pad|>", [image]) for image in (a, b)]
        rows = torch.cat([tower_rows(hf, p["pixel_values"], p["image_grid_thw"]) for p in pixels])
        grids = torch.cat([p["image_grid_thw"] for p in pixels])
        both = {"image_embeds": rows, "image_grid_thw": grids}
        got = llm.generate({"prompt": cases[2][0], "multi_modal_data": {"image": both}}, greedy())[0]
        assert got.outputs[0].token_ids == want[2]
        with pytest.raises(ValueError, match=r"has \d+ rows, and its grid `image_grid_thw` .* takes"):
            llm.generate({"prompt": one, "multi_modal_data": {"image": {"image_embeds": rows,
                                                                       "image_grid_thw": grids[:1]}}}, greedy())
        if family == "qwen3_vl":      # its rows carry the DeepStack features: 64 x 3 wide
            with pytest.raises(ValueError, match="rows are 64 wide, and this model's are 192: its hidden_size 64 and beside it 2 DeepStack"):
                llm.generate({"prompt": one, "multi_modal_data": {"image": {
                    "image_embeds": rows[:, :64], "image_grid_thw": grids}}}, greedy())


def tower_rows(hf, pixels, grid):
    """transformers' vision tower's rows for patches of one or more images or videos (Qwen3-VL's
    with their DeepStack features beside them), as vLLM's image_embeds and video_embeds take them."""
    import torch
    with torch.no_grad():
        out = hf.model.visual(torch.as_tensor(pixels), grid_thw=torch.as_tensor(grid), return_dict=True)
    return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)


def test_a_later_pipeline_stage_turns_qwen2_vls_image_positions_too(tmp_path):
    """The later stage computes the image's M-RoPE positions itself; Qwen3-VL's DeepStack
    features, which reach the first stage alone, refuse a first stage shorter than they feed."""
    from actors.api import LLM
    from actors.runtime.errors import ChildStartError
    from helpers import save_tiny_qwen2_vl
    hf, inputs = save_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    prompt, image = f"t5 {QWEN_IMAGE} t6 t7", random_image(4, 64, 64)
    with LLM(model=str(tmp_path / "qwen2_vl"), max_model_len=256, max_num_batched_tokens=8,
             pipeline_parallel_size=2) as engine:
        got = engine.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, greedy())
    assert got[0].outputs[0].token_ids == qwen_answer(inputs, hf, prompt, [image])
    save_tiny_qwen2_vl(tmp_path / "qwen3_vl", "qwen3_vl")
    with pytest.raises(ChildStartError, match="its first 2 layers, and the first pipeline stage holds 1"):
        LLM(model=str(tmp_path / "qwen3_vl"), max_model_len=256, pipeline_parallel_size=2)


QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def qwen_generate(hf, prompt: str, items: list[dict], path=None) -> list[int]:
    """transformers' greedy tokens for a Qwen2-VL prompt of words, ``QWEN_IMAGE`` and
    ``QWEN_VIDEO``, each item's processed inputs given in order (the placeholder expanded to one
    token per merged patch, as Qwen2-VL's processor does; a Qwen3-VL video's to its "expansion",
    the text transformers' Qwen3VLProcessor writes, read by the checkpoint's tokenizer at ``path``)."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    vocab = hf.config.text_config.vocab_size
    ids, types, given, item = [], [], {}, iter(items)
    for word in prompt.replace(QWEN_IMAGE, " [I] ").replace(QWEN_VIDEO, " [V] ").split():
        if word not in ("[I]", "[V]"):
            ids.append(int(word[1:]))
            types.append(0)
            continue
        video, data = word == "[V]", dict(next(item))
        grid = data["video_grid_thw" if video else "image_grid_thw"]
        n = int(np.prod(grid[0])) // 4
        inner = [vocab - 2 if video else vocab - 1] * n
        if "expansion" in data:
            inner = Tokenizer.from_file(str(path / "tokenizer.json")).encode(data.pop("expansion"),
                                                                            add_special_tokens=False).ids
        ids += [vocab - 4] + inner + [vocab - 3]
        types += [0] + [2 if t == vocab - 2 else 1 if t == vocab - 1 else 0 for t in inner] + [0]
        for key, value in data.items():
            given.setdefault(key, []).append(value)
    ids_t = torch.tensor([ids])
    inputs = {key: torch.from_numpy(np.concatenate(values)) for key, values in given.items()}
    with torch.no_grad():
        out = hf.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), mm_token_type_ids=torch.tensor([types]),
                          **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen2_vls_videos_answer_as_transformers_does(tmp_path, family):
    """A video to Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's own classes: its frames processed into
    patches of two frames, encoded by the vision tower, its positions M-RoPE's (Qwen2.5-VL's time
    spaced by the seconds a patch of frames covers; Qwen3-VL's patches each after its timestamp's
    text, placed as images, with their DeepStack features), answer as transformers' generate does
    with the same inputs, alone and beside an image, in prefill chunks of 8 that split them; a
    chat's video_url part (an MP4 data URL, its frames decoded by OpenCV, as many as
    --media-io-kwargs says) answers as those frames given offline; Qwen3-VL samples a video read
    whole at 2 frames a second."""
    import numpy as np
    import transformers

    from actors.api import LLM
    from actors.tokenizer.video import QwenVideoProcessor, Video, decode_video
    from helpers import mp4, save_tiny_qwen2_vl
    hf, _ = save_tiny_qwen2_vl(tmp_path, family)
    rng = np.random.default_rng(7)
    clip = rng.integers(0, 256, (4, 84, 84, 3), dtype=np.uint8)
    metadata = {"fps": 4.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3], "duration": 1.0}
    videos = QwenVideoProcessor.from_checkpoint(str(tmp_path), QWEN_PROCESSORS[family])

    def processed(video: Video) -> dict:
        text, data = videos(video)
        return {**data, "expansion": text} if family == "qwen3_vl" else data
    video_inputs = processed(Video(clip, metadata))
    image = random_image(3, 60, 40)
    image_inputs = dict(transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)(
        images=[image], return_tensors="np"))
    one = f"t5 t9 {QWEN_VIDEO} " + " ".join(f"t{i}" for i in range(20, 30))
    both = f"t5 {QWEN_IMAGE} t6 {QWEN_VIDEO} t7"
    want = [qwen_generate(hf, one, [video_inputs], tmp_path),
            qwen_generate(hf, both, [image_inputs, video_inputs], tmp_path)]
    movie = mp4([i * 12 for i in range(20)])
    url = "data:video/mp4;base64," + base64.b64encode(movie).decode()
    with LLM(model=str(tmp_path), max_model_len=256, max_num_batched_tokens=8,
             media_io_kwargs={"video": {"num_frames": 4}}, enable_mm_embeds=True) as llm:
        got = llm.generate([{"prompt": one, "multi_modal_data": {"video": (clip, metadata)}},
                            {"prompt": both, "multi_modal_data": {"image": image, "video": (clip, metadata)}}],
                           greedy())
        assert [r.outputs[0].token_ids for r in got] == want
        # vLLM's video_embeds with the grid (Qwen3-VL's with the patches' timestamps; Qwen2.5-VL's
        # positions then take a second a patch, as vLLM's: as the frames at 2 a second do)
        fields = {"video_embeds": tower_rows(hf, video_inputs["pixel_values_videos"], video_inputs["video_grid_thw"]),
                  "video_grid_thw": video_inputs["video_grid_thw"]}
        if family == "qwen3_vl":
            fields["timestamps"] = [0.125, 0.625]         # frames 0-1 and 2-3 at 4 a second
        embedded = llm.generate({"prompt": one, "multi_modal_data": {"video": fields}}, greedy())[0]
        assert embedded.outputs[0].token_ids == (want[0] if family != "qwen2_5_vl" else llm.generate(
            {"prompt": one, "multi_modal_data": {"video": (clip, {**metadata, "fps": 2.0})}},
            greedy())[0].outputs[0].token_ids)
        if family == "qwen3_vl":
            with pytest.raises(ValueError, match=r"missing \['timestamps'\]"):
                llm.generate({"prompt": one, "multi_modal_data": {"video": {
                    k: v for k, v in fields.items() if k != "timestamps"}}}, greedy())
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "t7"}]}]
        chat = llm.chat(messages, greedy())[0]
        decoded = decode_video(movie, num_frames=4)
        offline = llm.generate({"prompt": f"t1 {QWEN_VIDEO} t7 t3",
                                "multi_modal_data": {"video": (decoded.frames, decoded.metadata)}}, greedy())[0]
        assert chat.outputs[0].token_ids == offline.outputs[0].token_ids
        assert chat.prompt_token_ids == offline.prompt_token_ids
        if family != "qwen2_5_vl":   # 2 patches of frames: transformers' positions agree with vLLM's rule here
            assert chat.outputs[0].token_ids == qwen_generate(hf, f"t1 {QWEN_VIDEO} t7 t3",
                                                              [processed(decoded)], tmp_path)
        if family == "qwen3_vl":     # all 20 frames (2 s) read: sampled again, 4 frames, 2 patches of 4 positions
            whole = decode_video(movie, num_frames=-1)
            got = llm.generate({"prompt": one, "multi_modal_data": {"video": (whole.frames, whole.metadata)}},
                               greedy())[0]
            assert got.prompt_token_ids.count(hf.config.video_token_id) == 8
            assert got.outputs[0].token_ids == qwen_generate(hf, one, [processed(whole)], tmp_path)


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_mistral3s_images_answer_as_transformers_does_without_torchvision(tmp_path, impl):
    """Mistral 3 (Troupe's own class with transformers' Pixtral tower and projector, and the
    whole checkpoint through --model-impl transformers), Pixtral's processor rebuilt from its
    image processor where transformers cannot build it whole: an image's rows of [IMG] between
    [IMG_BREAK]s and its [IMG_END] take their places, the markers plain tokens, in prefill chunks
    of 8 that split them; the chat template renders an image part; the prefix cache serves an
    image's blocks again."""
    import torch

    from actors.api import LLM
    from helpers import save_tiny_mistral3
    hf, inputs = save_tiny_mistral3(tmp_path)
    a, b = random_image(1, 100, 80), random_image(2, 200, 60)
    cases = [("t5 t9 [IMG] t7 t8 " + " ".join(f"t{i}" for i in range(20, 34)), [a]),
             ("t5 [IMG] t6 [IMG] t7", [a, b])]
    want = []
    for prompt, images in cases:
        given = inputs(prompt, images)
        with torch.no_grad():
            out = hf.generate(**given, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        want.append(out[0, given["input_ids"].shape[1]:].tolist())
    prompts = [{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases]
    with LLM(model=str(tmp_path), model_impl=impl, max_model_len=256, max_num_batched_tokens=8,
             limit_mm_per_prompt={"image": 2}) as llm:
        got = llm.generate(prompts, greedy())
        assert [r.outputs[0].token_ids for r in got] == want
        assert len(got[0].prompt_token_ids) == 2 + 15 + 16          # 3 rows of 4 [IMG], 2 breaks, the end
        again = llm.generate(prompts[0], greedy())[0]
        assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens == 32
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": b},
                                                 {"type": "text", "text": "t7"}]}]
        given = inputs("t1 [IMG] t7 t3", [b])
        with torch.no_grad():
            out = hf.generate(**given, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert llm.chat(messages, greedy())[0].outputs[0].token_ids == out[0, given["input_ids"].shape[1]:].tolist()


# -- over HTTP -------------------------------------------------------------------------------

def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of images, served over HTTP on 127.0.0.1 too."""
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(random_image(7)))
    (root / "b.png").write_bytes(png(random_image(8)))
    (root / "notes.txt").write_text("not an image")
    with http_folder(root) as base:
        yield root, base


@pytest.fixture(scope="module")
def server(llava, media, tmp_path_factory):
    allowed = media[0]
    s = Server("--model", llava[0], "--threads", "1", "--max-model-len", "256", "--allowed-local-media-path",
               str(allowed), "--limit-mm-per-prompt", '{"image": 2}', "--enable-mm-embeds",
               env={"VLLM_SERVER_DEV_MODE": "1"})                 # /reset_encoder_cache
    try:
        yield s
    finally:
        s.stop()


def post(server, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict | str]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if not body.get("stream") else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def chat(server, url: str, text: str = "t5 t6", **extra) -> tuple[int, dict | str]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                         "temperature": 0, "return_token_ids": True, **extra})


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_chat_takes_an_image_as_a_data_url_an_http_url_or_an_allowed_file(server, media, llava):
    from PIL import Image
    root, base = media
    want = hf_answer(llava, "t1 <image> t5 t6 t3", [Image.open(root / "a.png").convert("RGB")])
    for url in (data_url(root / "a.png"), f"{base}/a.png", f"file://{root / 'a.png'}"):
        status, body = chat(server, url)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want, url
    other = chat(server, f"{base}/b.png")[1]
    assert other["choices"][0]["token_ids"] != want
    shown = chat(server, f"{base}/a.png", return_prompt_text=True)[1]
    assert shown["prompt_text"] == "t1 <image> t5 t6 t3" and shown["choices"][0]["token_ids"] == want
    raw = chat(server, f"{base}/a.png", mm_processor_kwargs={"do_normalize": False})[1]     # other pixels
    image = Image.open(root / "a.png").convert("RGB")
    assert raw["choices"][0]["token_ids"] == hf_answer(llava, "t1 <image> t5 t6 t3", [image], do_normalize=False)
    status, streamed = chat(server, f"{base}/a.png", stream=True)
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []] == want


def test_chat_takes_an_image_as_image_embeds(server, media, llava):
    import io as _io

    import torch
    from PIL import Image
    root, base = media
    want = chat(server, f"{base}/a.png")[1]["choices"][0]["token_ids"]
    buf = _io.BytesIO()
    torch.save(image_features(llava, Image.open(root / "a.png").convert("RGB")), buf)
    content = [{"type": "image_embeds", "image_embeds": base64.b64encode(buf.getvalue()).decode()},
               {"type": "text", "text": "t5 t6"}]
    status, body = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                                 "temperature": 0, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == want, body
    content[0]["image_embeds"] = "not base64!"
    status, body = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert status == 400 and "`image_embeds` is not valid base64" in body["error"]["message"]


def test_a_repeated_image_is_served_from_the_prefix_cache(server, media):
    words = " ".join(f"t{i}" for i in range(20, 50))
    url = f"{media[1]}/b.png"
    first, again = (chat(server, url, text=words)[1] for _ in range(2))
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] == 1 + 16 + 30 + 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    queries = int(float(re.search(r"^vllm:mm_cache_queries_total\{[^}]*\} (\S+)", metrics, re.M).group(1)))
    hits = int(float(re.search(r"^vllm:mm_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M).group(1)))
    assert queries >= 2 and hits >= 1                # the second request's picture came from the processor cache


def encoder_cache_counts(server) -> tuple[int, int]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    return tuple(int(float(re.search(rf"^troupe:encoder_cache_{name}_total\{{[^}}]*\}} (\S+)", metrics, re.M).group(1)))
                 for name in ("queries", "hits"))


def reset_encoder_cache(server) -> int:
    req = urllib.request.Request(server.url + "/reset_encoder_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def test_an_image_is_encoded_once_for_requests_that_differ_before_it_until_the_encoder_cache_is_reset(
        server, media, llava):
    from PIL import Image
    root, base = media
    image = Image.open(root / "b.png").convert("RGB")
    assert reset_encoder_cache(server) == 200

    def ask(lead: str) -> None:            # text before the image: no prefix cache hit on its positions
        content = [{"type": "text", "text": lead}, {"type": "image_url", "image_url": {"url": f"{base}/b.png"}},
                   {"type": "text", "text": "t5 t6"}]
        status, body = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "return_token_ids": True, "return_prompt_text": True})
        assert status == 200, body
        assert body["prompt_text"].split("<image>")[0].endswith(f"{lead} ")
        assert body["choices"][0]["token_ids"] == hf_answer(llava, body["prompt_text"], [image])
    before = encoder_cache_counts(server)
    ask("t40")
    ask("t41")                             # its embeddings from the encoder cache
    after = encoder_cache_counts(server)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)
    assert reset_encoder_cache(server) == 200
    ask("t42")                             # encoded again
    last = encoder_cache_counts(server)
    assert (last[0] - after[0], last[1] - after[1]) == (1, 0)


def test_images_that_cannot_or_may_not_be_read_are_400s_saying_why(server, media, tmp_path):
    """And a video to LLaVA, which takes none."""
    root, base = media
    outside = tmp_path / "c.png"
    outside.write_bytes((root / "a.png").read_bytes())
    cases = [("data:image/png;base64,@@@", "not valid base64"),
             ("data:image/png," + "abc", "Only base64 data URLs"),
             (data_url(root / "notes.txt"), "does not hold an image"),
             (f"{base}/missing.png", "HTTP 404"),
             (f"file://{outside}", "must be a subpath of `--allowed-local-media-path"),
             ("ftp://example.com/a.png", "HTTP, data or file URL")]
    for url, message in cases:
        status, body = chat(server, url)
        assert status == 400 and message in body["error"]["message"], (url, body)
    three = [{"type": "image_url", "image_url": {"url": f"{base}/a.png"}}] * 3
    status, body = post(server, {"messages": [{"role": "user", "content": three}], "max_tokens": 2})
    assert status == 400 and "At most 2 image(s)" in body["error"]["message"]
    video = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
    status, body = post(server, {"messages": [{"role": "user", "content": video}], "max_tokens": 2})
    assert status == 400 and "this model takes no videos" in body["error"]["message"], body


def test_tokenize_expands_a_chats_images_and_beam_search_refuses_them(server, media):
    content = [{"type": "image_url", "image_url": {"url": f"{media[1]}/a.png"}}, {"type": "text", "text": "t5"}]
    req = urllib.request.Request(server.url + "/tokenize", json.dumps(
        {"messages": [{"role": "user", "content": content}]}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        tokens = json.loads(r.read())["tokens"]
    assert tokens == [1] + [299] * 16 + [5, 3]
    status, body = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                 "use_beam_search": True, "n": 2})
    assert status == 400 and "beam search is not supported with image, video or audio input" in body["error"]["message"]


def test_the_responses_and_messages_apis_take_images_as_chat_does(server, media, llava):
    root, base = media
    want = chat(server, f"{base}/a.png")[1]["choices"][0]["message"]["content"]
    status, answer = post(server, {"model": llava[0], "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": f"{base}/a.png"},
                                     {"type": "input_text", "text": "t5 t6"}]}]}, "/v1/responses")
    assert status == 200 and answer["output"][-1]["content"][0]["text"] == want, answer
    data = base64.b64encode((root / "a.png").read_bytes()).decode()
    status, message = post(server, {"model": llava[0], "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": data}},
                                     {"type": "text", "text": "t5 t6"}]}]}, "/v1/messages")
    assert status == 200 and message["content"][0]["text"] == want, message


def test_the_chat_repl_attaches_a_picture_with_slash_image(server, media):
    import subprocess
    import sys
    root, base = media
    want = chat(server, f"{base}/a.png")[1]["choices"][0]["message"]["content"]
    lines = f"/image {root / 'missing.png'}\n/image {root / 'a.png'}\nt5 t6\n/history\n"
    out = subprocess.run([sys.executable, "-m", "tools.chat", "--url", server.url, "--temperature", "0",
                          "--max-tokens", str(MAX_TOKENS)], input=lines, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cannot read" in out.stderr and "image 1 attached" in out.stderr
    assert out.stdout.splitlines()[0].strip() == want.strip()
    assert "user: [image] t5 t6" in out.stdout


def test_a_served_qwen2_vl_reads_a_video_url_with_the_requests_media_io_kwargs(tmp_path):
    """Over HTTP: a chat's video_url (an MP4 data URL) is decoded into as many frames as the
    request's media_io_kwargs say, over the server's --media-io-kwargs (4 frames of 64x48, resized
    to 56x56: 2 patches of two frames, 4 merged patches each, 8 video positions; 8 frames: 16), and
    the answer is the one the same frames get offline; a video_embeds part (vLLM's dict of base64
    torch.save'd rows and a JSON grid, with --enable-mm-embeds) answers as the video does."""
    import torch

    from actors.tokenizer.video import QwenVideoProcessor, decode_video
    from helpers import mp4, save_tiny_qwen2_vl
    hf, _ = save_tiny_qwen2_vl(tmp_path)
    url = "data:video/mp4;base64," + base64.b64encode(mp4([i * 12 for i in range(20)])).decode()
    decoded = decode_video(mp4([i * 12 for i in range(20)]), num_frames=4)
    processed = QwenVideoProcessor.from_checkpoint(str(tmp_path), "Qwen2VLProcessor")(decoded)[1]

    def saved(tensor) -> str:
        buf = io.BytesIO()
        torch.save(tensor, buf)
        return base64.b64encode(buf.getvalue()).decode()
    embeds = {"video_embeds": saved(tower_rows(hf, processed["pixel_values_videos"], processed["video_grid_thw"])),
              "video_grid_thw": processed["video_grid_thw"].tolist()}
    s = Server("--model", str(tmp_path), "--threads", "1", "--max-model-len", "256",
               "--media-io-kwargs", '{"video": {"num_frames": 4}}', "--enable-mm-embeds")
    try:
        def ask(part: dict | None = None, **extra) -> dict:
            content = [part or {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "t7"}]
            status, body = post(s, {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                                    "temperature": 0, **extra})
            assert status == 200, body
            return body
        four, eight = ask(), ask(media_io_kwargs={"video": {"num_frames": 8}})
        assert eight["usage"]["prompt_tokens"] - four["usage"]["prompt_tokens"] == 8
        given = ask({"type": "video_embeds", "video_embeds": embeds})
        assert given["choices"][0]["message"]["content"] == four["choices"][0]["message"]["content"]
        assert given["usage"]["prompt_tokens"] == four["usage"]["prompt_tokens"]
        status, body = post(s, {"messages": [{"role": "user", "content": [{"type": "video_embeds", "video_embeds": {
            "video_embeds": embeds["video_embeds"]}}]}], "max_tokens": 2})
        assert status == 400 and "missing ['video_grid_thw']" in body["error"]["message"], body
    finally:
        s.stop()
    from actors.api import LLM
    with LLM(model=str(tmp_path), max_model_len=256) as llm:
        offline = llm.generate({"prompt": f"t1 {QWEN_VIDEO} t7 t3",
                                "multi_modal_data": {"video": (decoded.frames, decoded.metadata)}}, greedy())[0]
    assert four["choices"][0]["message"]["content"] == offline.outputs[0].text
