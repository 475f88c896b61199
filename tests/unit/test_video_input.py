"""The parts of video input that need no engine: Qwen2-VL's video processing against its image
processor, frames read from an MP4, from vLLM's video/jpeg data URLs and from the offline API's
values, video parts taken out of chat messages, placeholders paired with their own modality's
items, M-RoPE's positions of a video, and media_io_kwargs."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

from actors.engine.args import EngineArgs
from actors.engine.config import MultiModalConfig, media_io_problem
from actors.engine.messages import MultiModalFeature
from actors.tokenizer.chat import content_to_parts, content_to_text
from actors.tokenizer.multimodal import MediaError, extract_images, images_of, load_image
from actors.tokenizer.video import (VIDEO_PART, QwenVideoProcessor, Video, VideoSource, _settings, decode_jpeg_frames,
                                    decode_video, smart_resize)
from helpers import mp4
from models.mrope import mrope_positions

QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def frames(n: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), dtype=np.uint8)


def test_a_video_of_two_equal_frames_is_what_qwen2_vls_image_processor_makes_of_one():
    """An image is a video of one frame repeated over the temporal patch: the same resize,
    normalization and patch order, so the same patches and grid."""
    import transformers
    from PIL import Image
    frame = frames(1, 90, 130)[0]
    image = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)(
        images=[Image.fromarray(frame)], return_tensors="np")
    video = QwenVideoProcessor(_settings({"min_pixels": 56 * 56, "max_pixels": 112 * 112}), seconds_per_grid=False)
    text, data = video(Video(np.stack([frame, frame])))
    assert data["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 6, 10]]
    np.testing.assert_allclose(data["pixel_values_videos"], image["pixel_values"], atol=1e-5)
    assert text == "<|video_pad|>" * 15                     # 6 x 10 patches merged 2 x 2


def test_frames_pad_to_the_temporal_patch_by_repeating_the_last_and_qwen2_5_vl_gets_its_seconds():
    video = QwenVideoProcessor(_settings({"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}}), True)
    clip = frames(3, 56, 56)
    text, data = video(Video(clip, {"fps": 6.0, "total_num_frames": 12, "frames_indices": [0, 4, 8]}))
    assert data["video_grid_thw"].tolist() == [[2, 4, 4]] and text.count("<|video_pad|>") == 2 * 2 * 2
    last = data["pixel_values_videos"][16:].reshape(16, 3, 2, 14 * 14)
    np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])     # frame 3 twice
    # 3 of 12 frames at 6 fps: 1.5 frames a second, a temporal patch of 2 covers 4/3 s
    np.testing.assert_allclose(data["second_per_grid_ts"], [2 / 1.5])
    with pytest.raises(ValueError, match="Video metadata is required"):
        video(Video(clip))
    # the request's keywords: fewer pixels a frame, and transformers' own frame sampling
    small, _ = video(Video(frames(8, 56, 56), {"fps": 8.0, "total_num_frames": 8}),
                     {"max_pixels": 28 * 28, "do_sample_frames": True, "num_frames": 4})
    assert small.count("<|video_pad|>") == 2      # 4 frames -> 2 temporal patches of one merged patch


def qwen3_vl_videos(**settings) -> QwenVideoProcessor:
    return QwenVideoProcessor(_settings(settings, QwenVideoProcessor.FAMILIES["Qwen3VLProcessor"]), False,
                              timestamps=True)


def test_qwen3_vls_frames_are_sized_as_transformers_sizes_them_over_all_frames_together():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as reference
    for n, height, width in [(4, 90, 130), (32, 360, 640), (2, 20, 300), (8, 1080, 1920), (6, 33, 31)]:
        assert smart_resize(height, width, 32, 128 * 32 * 32, 768 * 32 * 32, num_frames=n) == reference(
            n, height, width, 2, 32, 128 * 32 * 32, 768 * 32 * 32)
    with pytest.raises(ValueError, match="t:1 must be larger than temporal_factor:2"):
        qwen3_vl_videos()(Video(frames(1), {"fps": 1.0}))


def test_qwen3_vls_placeholder_becomes_each_patch_of_frames_after_its_timestamp_as_transformers_writes_it():
    """The expansion is transformers' Qwen3VLProcessor.replace_video_token's for the same grid
    and frames: each temporal patch's time (the mean of its two frames', in the source's seconds)
    as text, then its own vision markers around one token per merged patch."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata
    metadata = {"fps": 10.0, "total_num_frames": 50, "frames_indices": [0, 13, 26, 37, 49]}
    text, data = qwen3_vl_videos(min_pixels=64 * 64, max_pixels=6 * 64 * 64)(Video(frames(5, 64, 64), metadata))
    assert data["video_grid_thw"].tolist() == [[3, 4, 4]]      # 5 frames padded to 6, 64 pixels in patches of 16
    hf = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                         vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                         video_token="<|video_pad|>",
                         _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    want = Qwen3VLProcessor.replace_video_token(hf, {"video_grid_thw": data["video_grid_thw"],
                                                     "video_metadata": [VideoMetadata(**metadata)]}, 0)
    assert text == want
    assert text.startswith("<0.7 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|><3.2 seconds>")
    assert text.endswith("<4.9 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>")
    with pytest.raises(ValueError, match="Video metadata is required"):
        qwen3_vl_videos()(Video(frames(4)))


def test_qwen3_vl_samples_a_video_read_whole_at_two_frames_a_second_and_keeps_one_read_sampled():
    """vLLM's rule: a reader that kept every frame asks the processor to sample (2 a second, at
    least 4); frames already sampled stay; the request's num_frames or fps sample again."""
    videos = qwen3_vl_videos(min_pixels=32 * 32, max_pixels=64 * 32 * 32)
    whole = {"fps": 10.0, "total_num_frames": 30, "frames_indices": list(range(30)), "do_sample_frames": True}
    text, data = videos(Video(frames(30, 32, 32), whole))
    assert data["video_grid_thw"].tolist() == [[3, 2, 2]]       # 3 s at 2 a second: 6 frames, 3 patches
    assert [float(t.split(" ")[0]) for t in text.split("<")[1::4]] == [0.3, 1.4, 2.6]   # frames 0,6,12,17,23,29
    kept = {**whole, "frames_indices": [0, 10, 20, 29], "do_sample_frames": False}
    assert videos(Video(frames(4, 32, 32), kept))[1]["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert videos(Video(frames(30, 32, 32), whole), {"num_frames": 8})[1]["video_grid_thw"].tolist() == [[4, 2, 2]]
    assert videos(Video(frames(30, 32, 32), whole), {"fps": 0.5})[1]["video_grid_thw"].tolist() == [[2, 2, 2]]  # 4 at least
    with pytest.raises(ValueError, match="mutually exclusive"):
        videos(Video(frames(30, 32, 32), whole), {"fps": 1, "num_frames": 4})


def test_an_mp4_decodes_into_evenly_sampled_frames_with_their_metadata():
    data = mp4([i * 12 for i in range(20)])
    video = decode_video(data, num_frames=4)
    assert video.frames.shape == (4, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.metadata["frames_indices"] == [0, 6, 12, 19] and video.metadata["total_num_frames"] == 20
    assert video.metadata["fps"] == 10.0 and not video.metadata["do_sample_frames"]
    levels = video.frames.reshape(4, -1).mean(axis=1)
    np.testing.assert_allclose(levels, [0, 72, 144, 228], atol=6)        # lossy, but those frames
    assert decode_video(data, num_frames=-1).metadata["do_sample_frames"]        # every frame kept (vLLM's)
    assert decode_video(data, num_frames=-1, fps=2).metadata["frames_indices"] == [0, 6, 12, 19]   # 2 s at 2 a second
    with pytest.raises(ValueError, match="could not be opened"):
        decode_video(b"not a video")


def test_video_jpeg_data_urls_and_the_offline_apis_values_are_videos():
    from PIL import Image
    clip = np.stack([np.full((48, 64, 3), (40 * i, 200 - 40 * i, 90), np.uint8) for i in range(3)])

    def jpeg(frame) -> str:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=95)
        return base64.b64encode(buf.getvalue()).decode()
    video = decode_jpeg_frames(",".join(jpeg(f) for f in clip), num_frames=2)
    assert video.frames.shape == (2, 48, 64, 3) and video.metadata["fps"] == 1.0
    assert np.abs(video.frames.astype(int) - clip[:2]).max() < 8       # JPEG's loss on flat colours
    with pytest.raises(ValueError, match="frame 1 of the video/jpeg data"):
        decode_jpeg_frames(jpeg(clip[0]) + ",***")
    # vLLM's readings of multi_modal_data["video"]: one array, frames, a pair, or a list of them
    pil = [Image.fromarray(f) for f in clip]
    assert [v.frames.shape for v in images_of({"video": clip})] == [(3, 48, 64, 3)]
    assert [v.frames.shape for v in images_of({"video": pil})] == [(3, 48, 64, 3)]
    assert [v.frames.shape for v in images_of({"video": [clip, clip[:2]]})] == [(3, 48, 64, 3), (2, 48, 64, 3)]
    (pair,) = images_of({"video": (clip, {"fps": 2.0})})
    assert pair.metadata == {"fps": 2.0}
    assert len(images_of({"video": np.stack([clip, clip])})) == 2
    with pytest.raises(MediaError, match="frames, height, width, 3"):
        images_of({"video": np.zeros((3, 4))})


def test_video_url_parts_leave_the_messages_as_video_parts_with_their_placeholders():
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}},
                                             {"type": "text", "text": "what happens"},
                                             {"type": "image_url", "image_url": {"url": "data:x"}}]}]
    out, sources = extract_images(messages)
    assert out[0]["content"][0] == VIDEO_PART and out[0]["content"][2]["type"] == "image"
    assert isinstance(sources[0], VideoSource) and not isinstance(sources[1], VideoSource)
    with pytest.raises(MediaError, match="a video_url part needs a non-empty url"):
        extract_images([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}])
    placeholders = {"image": "<I>", "video": "<V>"}
    parts = out[0]["content"]
    assert content_to_text(parts, placeholders) == "<I>\n<V>\nwhat happens"
    assert content_to_parts(parts, tuple(placeholders))[0] == VIDEO_PART
    with pytest.raises(ValueError, match="this model takes no videos"):
        content_to_text(parts, "<I>")


def test_embeddings_beside_their_grid_are_items_of_their_own_modality():
    """vLLM's dict form (image_embeds / video_embeds parts, multi_modal_data dicts): one item a
    part, one a row of an offline dict's grid; only with --enable-mm-embeds."""
    grid = {"video_embeds": "AAAA", "video_grid_thw": [2, 4, 4]}
    messages = [{"role": "user", "content": [{"type": "video_embeds", "video_embeds": grid},
                                             {"type": "image_embeds", "image_embeds": {"image_embeds": "AAAA"}}]}]
    out, sources = extract_images(messages)
    assert out[0]["content"] == [VIDEO_PART, {"type": "image"}]
    assert [s.modality for s in sources] == ["video", "image"] and sources[0].count is None
    with pytest.raises(MediaError, match="set `--enable-mm-embeds` to input `video_embeds`"):
        asyncio.run(load_image(sources[0], MultiModalConfig(), None))
    items = images_of({"image": {"image_embeds": np.zeros((4, 8), np.float32), "image_grid_thw": np.array(
        [[1, 2, 4], [1, 2, 2]])}, "video": {"video_embeds": np.zeros((4, 8), np.float32), "video_grid_thw": [2, 2, 4]}})
    assert [(i.modality, i.index, i.count) for i in items] == [("image", 0, 2), ("image", 1, 2), ("video", 0, 1)]
    read = asyncio.run(load_image(sources[0]._replace(
        fields={"video_embeds": np.ones((8, 4), np.float32), "video_grid_thw": [2, 4, 4]}),
        MultiModalConfig(enable_mm_embeds=True), None))
    assert read.fields["video_grid_thw"].tolist() == [2, 4, 4] and read.fields["video_embeds"].shape == (8, 4)


def test_video_urls_are_read_with_media_io_kwargs_and_refused_by_name(tmp_path):
    data = mp4([i * 12 for i in range(20)])
    (tmp_path / "a.mp4").write_bytes(data)
    config = MultiModalConfig(allowed_local_media_path=str(tmp_path), media_io_kwargs={"video": {"num_frames": 5}})
    read = lambda url, kwargs=None: asyncio.run(load_image(VideoSource(url), config, kwargs))   # noqa: E731
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert read(url).frames.shape[0] == 5
    assert read(f"file://{tmp_path}/a.mp4", {"video": {"num_frames": 2}}).frames.shape[0] == 2
    assert read(url, {"video": {"fps": 1}}).frames.shape[0] == 2          # the server's num_frames dropped
    with pytest.raises(MediaError, match="the video could not be read"):
        read("data:video/mp4;base64," + base64.b64encode(b"nothing").decode())
    with pytest.raises(MediaError, match="must be a subpath"):
        read("file:///etc/passwd")


def test_placeholders_pair_with_the_items_of_their_own_modality(tmp_path):
    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    from actors.tokenizer.multimodal import ImageProcessor
    from helpers import random_image, save_tiny_qwen2_vl
    save_tiny_qwen2_vl(tmp_path)
    tok = TextTokenizer.from_hf_dir(str(tmp_path))
    processor = ImageProcessor(str(tmp_path), 299, MultiModalConfig(limit_per_prompt={"video": 1}),
                               lambda text: tok.encode(text, add_special_tokens=False), needs_grid=True,
                               video_token_id=298)
    assert processor.placeholders == {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": QWEN_VIDEO}
    image = processor.process(random_image(1))
    video = processor.process(Video(frames(4, 56, 56)))
    assert video.modality == "video" and video.ids == [298] * 8 and video.data["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert processor.process(Video(frames(4, 56, 56))).identifier == video.identifier     # from the cache
    ids, (first, second) = processor.expand([5, 298, 6, 299, 7], [image, video])     # the video's place first
    assert (first.modality, first.offset, second.modality, second.offset) == ("video", 1, "image", 10)
    assert ids == [5] + [298] * 8 + [6] + image.ids + [7]
    with pytest.raises(MediaError, match="1 video placeholders .* for 0 videos"):
        processor.expand([5, 298, 299], [image])
    with pytest.raises(MediaError, match=r"At most 1 video\(s\)"):
        processor.check_count([Video(frames(2)), VideoSource("x")])
    no_videos = ImageProcessor(str(tmp_path), 299, MultiModalConfig(),
                               lambda text: tok.encode(text, add_special_tokens=False), needs_grid=True)
    with pytest.raises(MediaError, match="this model takes no videos"):
        no_videos.check_count([VideoSource("x")])


def test_a_videos_mrope_positions_space_its_time_by_seconds_and_text_counts_on_past_its_largest():
    def video(offset: int, t: int, h: int, w: int, seconds: float | None = None) -> MultiModalFeature:
        data = {"video_grid_thw": np.array([[t, h * 2, w * 2]])}
        if seconds is not None:
            data["second_per_grid_ts"] = np.array([seconds], np.float32)
        return MultiModalFeature("video", "v", offset, t * h * w, data)
    # Qwen2.5-VL: 2 s a temporal patch at 2 tokens a second -> times 0, 4, 8
    positions, delta = mrope_positions(2 + 12 + 1, [video(2, 3, 2, 2, 2.0)], merge_size=2, tokens_per_second=2.0)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[0, 2:14].tolist() == [2] * 4 + [6] * 4 + [10] * 4
    assert positions[1, 2:6].tolist() == [2, 2, 3, 3] and positions[2, 2:6].tolist() == [2, 3, 2, 3]
    assert positions[:, 14].tolist() == [11] * 3 and delta == 11 + 1 - 15     # past time 10, not the grid's side
    plain, _ = mrope_positions(2 + 12 + 1, [video(2, 3, 2, 2)], merge_size=2, tokens_per_second=2.0)
    assert plain[0, 2:14].tolist() == [2] * 4 + [4] * 4 + [6] * 4         # no seconds: Qwen2-VL's count
    with pytest.raises(ValueError, match="needs its grid"):
        mrope_positions(4, [MultiModalFeature("video", "v", 0, 4, {})], merge_size=2)


def test_qwen3_vls_video_places_each_patch_of_frames_as_an_image_after_its_timestamp():
    """Transformers' and vLLM's rule: each run of a video's tokens is a frame grid (1, h, w) at
    the position the text before it reached, and the text after it counts on past its longer side."""
    # t0 t1 | <ts ts> <vs> [4 video] <ve> <ts ts> <vs> [4 video] <ve> | t2
    layout = [0, 0, 0, 1, 1, 1, 1, 0] * 2
    feature = MultiModalFeature("video", "v", 2, 16, {"video_grid_thw": np.array([[2, 4, 4]])},
                                np.array(layout, dtype=bool))
    positions, delta = mrope_positions(2 + 16 + 1, [feature], merge_size=2)
    assert positions[:, :5].tolist() == [[0, 1, 2, 3, 4]] * 3          # text, the first timestamp, <vs>
    assert positions[:, 5:9].tolist() == [[5, 5, 5, 5], [5, 5, 6, 6], [5, 6, 5, 6]]
    assert positions[:, 9:13].tolist() == [[7, 8, 9, 10]] * 3           # <ve>, timestamp, <vs> past side 2
    assert positions[:, 13:17].tolist() == [[11, 11, 11, 11], [11, 11, 12, 12], [11, 12, 11, 12]]
    assert positions[:, 17:].tolist() == [[13, 14]] * 3 and delta == 14 + 1 - 19
    wrong = MultiModalFeature("video", "v", 2, 16, {"video_grid_thw": np.array([[3, 4, 4]])}, feature.is_embed)
    with pytest.raises(ValueError, match="does not match its 2 runs"):
        mrope_positions(19, [wrong], merge_size=2)


def test_media_io_kwargs_take_a_videos_frames_and_fps_only():
    assert media_io_problem({"video": {"num_frames": 8, "fps": 2}}) is None and media_io_problem(None) is None
    assert "reads images as they are" in media_io_problem({"image": {"mode": "L"}})
    assert "backend" in media_io_problem({"video": {"backend": "torchcodec"}})
    assert "must be numbers" in media_io_problem({"video": {"num_frames": "8"}})
    assert "greater than 0 or -1" in media_io_problem({"video": {"num_frames": 0}})
    assert EngineArgs(media_io_kwargs='{"video": {"num_frames": 4}}').multimodal().media_io_kwargs == {
        "video": {"num_frames": 4}}
    with pytest.raises(ValueError, match="--media-io-kwargs: .*not supported"):
        EngineArgs(media_io_kwargs={"audio": {"x": 1}}).multimodal()



def test_the_chat_repls_slash_video_attaches_a_video_file_as_a_data_url(tmp_path, capsys):
    from tools.chat import command, shown_content
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x20ftypisom")
    parts: list[dict] = []
    assert command(f"/video {tmp_path / 'clip.mp4'}", [], None, parts)
    assert parts == [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t"}}]
    assert command(f"/video {tmp_path / 'missing.mp4'}", [], None, parts) and len(parts) == 1
    assert "video 1 attached" in capsys.readouterr().err
    assert shown_content([*parts, {"type": "text", "text": "what happens"}]) == "[video] what happens"


def test_a_processor_that_is_not_qwen2_vls_leaves_videos_refused_rather_than_failing_to_start(tmp_path):
    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    from actors.tokenizer.multimodal import ImageProcessor
    from helpers import save_tiny_llava
    save_tiny_llava(tmp_path)
    tok = TextTokenizer.from_hf_dir(str(tmp_path))
    processor = ImageProcessor(str(tmp_path), 299, MultiModalConfig(),
                               lambda text: tok.encode(text, add_special_tokens=False), video_token_id=298)
    assert processor.video is None and list(processor.placeholders) == ["image"]
    with pytest.raises(MediaError, match="this model takes no videos"):
        processor.check_count([VideoSource("x")])
