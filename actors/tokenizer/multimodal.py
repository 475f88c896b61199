"""Images in prompts (vLLM's multimodal inputs), for a model whose ArchConfig has an
``image_token_id`` (a multimodal checkpoint the transformers backend serves whole, or one of
Troupe's own classes that take images).

A chat message's ``image_url`` parts (``data:`` base64 URLs, ``http(s)://`` URLs fetched with
VLLM_IMAGE_FETCH_TIMEOUT from --allowed-media-domains' hosts, ``file://`` URLs under
--allowed-local-media-path) and the offline API's ``image_pil`` parts and
``multi_modal_data={"image": ...}`` become PIL images; the chat template renders an image part as
the processor's placeholder (``{"type": "image"}`` parts in vLLM's "openai" content format, the
placeholder text before the message's text in its "string" format). The checkpoint's own
processor (transformers' ``AutoProcessor``) makes each image's inputs (``pixel_values`` and the
like) and says what its placeholder expands to; each placeholder in the prompt's token ids is
replaced by that expansion, and the image goes to the engine as a ``MultiModalFeature`` over
those positions (its identifier, a digest of its pixels and the processing, keys the prefix
cache: the same text with another image shares no block past the image).

A model that takes videos (Troupe's Qwen2-VL, Qwen2.5-VL and Qwen3-VL classes) takes a message's
``video_url`` parts and the offline API's ``multi_modal_data={"video": ...}`` the same way,
read and processed by ``actors/tokenizer/video.py``; each placeholder pairs with the item of its
own modality, in order.

A model that takes audio (Troupe's Qwen2-Audio, GLM-ASR and Audio Flamingo 3 classes) takes a
message's ``input_audio``, ``audio_url`` and (with --enable-mm-embeds) ``audio_embeds`` parts and
``multi_modal_data={"audio": ...}``, read by ``actors/tokenizer/audio.py``
and resampled to its feature extractor's rate; its processor (transformers') makes each clip's
log-mel features and says what its placeholder expands to."""
from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import hashlib
import io
import json
import logging
import os
import threading
import urllib.parse
import urllib.request
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from actors.engine import vllm_env
from actors.engine.config import MultiModalConfig
from actors.engine.messages import MultiModalFeature
from actors.tokenizer.audio import (AUDIO, AUDIO_PART, Audio, AudioError, AudioSource, InputAudio, audios_of,
                                    decode_audio, input_audio_bytes, resample)
from actors.tokenizer.prompt_embeds import check_hidden_size, decode_prompt_embeds, decode_tensor, embeds_array
from actors.tokenizer.video import DEFAULT_NUM_FRAMES as DEFAULT_VIDEO_FRAMES
from actors.tokenizer.video import (VIDEO, VIDEO_PART, QwenVideoProcessor, Video, VideoError, VideoSource,
                                    decode_jpeg_frames, decode_video, video_of)

log = logging.getLogger("troupe.tokenizer")

IMAGE = "image"
IMAGE_PART = {"type": "image"}      # an image's place in a message, as the chat template sees it
MAX_IMAGE_BYTES = 64 << 20          # the most an image URL's or data URL's bytes may be
MAX_VIDEO_BYTES = 512 << 20         # a video's
_NOT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "text_replacement_offsets")


class MediaError(ValueError):
    """An image, video or audio clip that cannot be read, or may not be (an HTTP 400)."""


class Processed(NamedTuple):
    """One item as the processor made it: the token ids its placeholder expands to, its inputs
    for the model (a batch of one), its identifier and its modality."""
    ids: list[int]
    data: dict[str, np.ndarray]
    identifier: str
    modality: str = IMAGE


class EmbedsPayload(str):
    """A chat ``image_embeds`` part's data: the base64 of a torch.save'd (positions, hidden) tensor."""


class AudioEmbedsPayload(str):
    """A chat ``audio_embeds`` part's data, as ``EmbedsPayload``'s."""


class ClipEmbeds(NamedTuple):
    """An audio clip given as its embeddings (--enable-mm-embeds): the offline API's tensor as
    given, then, read, its (positions, hidden) float32 rows."""
    rows: Any


class GridEmbeds(NamedTuple):
    """An image or video given as its embeddings beside the grid of patches they came from
    (vLLM's dict form for Qwen-VL, with --enable-mm-embeds: ``{"image_embeds": rows,
    "image_grid_thw": grid}``, ``{"video_embeds": rows, "video_grid_thw": grid}`` and Qwen3-VL's
    ``"timestamps"``; offline tensors, over HTTP base64 torch.save'd tensors or JSON lists).
    ``index``: which of the dict's items (its grid's rows, their embeddings one after another)
    this is; ``count``: how many the dict holds (None: a chat part's, which holds one)."""
    modality: str
    fields: Mapping[str, Any]
    index: int = 0
    count: int | None = None


MM_EMBEDS_OFF = "You must set `--enable-mm-embeds` to input `image_embeds`"


# -- images out of messages -------------------------------------------------------------------

def extract_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages with each image part (``image_url`` with its ``url``, the offline API's
    ``image_pil``, ``image_embeds`` with --enable-mm-embeds) as ``{"type": "image"}``, each
    ``video_url`` part as ``{"type": "video"}`` and each ``input_audio`` and ``audio_url`` part as
    ``{"type": "audio"}``, and the items' sources in order (URLs, PIL images, embeddings'
    payloads; a video's URL as a ``VideoSource``, a clip's as an ``AudioSource`` or
    ``InputAudio``). Messages without such parts come back as they are."""
    out, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or not any(_image_source(p) is not None for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            source = _image_source(part)
            if source is None:
                parts.append(part)
                continue
            if isinstance(source, str) and not source:
                kind = part.get("type")
                raise MediaError(f"messages[{i}]: {'a' if kind == 'video_url' else 'an'} {kind} part needs a "
                                 "non-empty url")
            sources.append(source)
            parts.append({VIDEO: VIDEO_PART, AUDIO: AUDIO_PART}.get(modality_of(source), IMAGE_PART))
        out.append({**message, "content": parts})
    return out, sources


def modality_of(source: Any) -> str:
    """An item's modality: a video's (a ``Video``, its URL, its embeddings), an audio clip's (an
    ``Audio``, its URL or ``input_audio``) or an image's."""
    if isinstance(source, GridEmbeds):
        return source.modality
    if isinstance(source, (Audio, AudioSource, InputAudio, AudioEmbedsPayload, ClipEmbeds)):
        return AUDIO
    return VIDEO if isinstance(source, (Video, VideoSource)) else IMAGE


def has_images(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether any message holds an image, video or audio part."""
    return any(isinstance(m.get("content"), list) and any(_image_source(p) is not None for p in m["content"])
               for m in messages or () if isinstance(m, Mapping))


def _image_source(part: Any) -> Any:
    """An image part's URL or PIL image, a video part's URL (a ``VideoSource``), an audio part's
    (an ``AudioSource`` URL or an ``InputAudio``); None for any other part."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in ("image_url", "video_url", "audio_url"):
        url = part.get(kind)
        url = url.get("url") if isinstance(url, Mapping) else url
        url = url if isinstance(url, str) else ""
        return {"video_url": VideoSource, "audio_url": AudioSource}.get(kind, str)(url)
    if kind == "audio_embeds":
        data = part.get(kind)
        return AudioEmbedsPayload(data) if isinstance(data, str) else ""
    if kind == "input_audio":
        given = part.get("input_audio")
        given = given if isinstance(given, Mapping) else {}
        return InputAudio(given.get("data") or "", str(given.get("format") or ""))
    if kind == "image_pil":
        return part.get("image_pil")
    if kind in ("image_embeds", "video_embeds"):
        data = part.get(kind)
        modality = IMAGE if kind == "image_embeds" else VIDEO
        if isinstance(data, Mapping):
            return GridEmbeds(modality, data)
        if kind == "video_embeds" and isinstance(data, str) and data:
            return GridEmbeds(VIDEO, {"video_embeds": data})
        return EmbedsPayload(data) if isinstance(data, str) else ""
    return None


def images_of(data: Mapping[str, Any] | None) -> list[Any]:
    """The offline API's ``multi_modal_data``: ``{"image": image or [images]}`` -> the images
    (an image as its embeddings, with --enable-mm-embeds: a (positions, hidden) tensor, or a
    (images, positions, hidden) one for several), then ``{"video": video or [videos]}``'s videos
    (``Video``; vLLM's reading: an array (frames, height, width, 3), a list of frames or a
    (frames, metadata) pair is one video; a list of those, or a 5-dimensional array, several),
    then ``{"audio": clip or [clips]}``'s clips (``Audio``: a (samples, sampling_rate) pair, or
    samples at the model's rate; with --enable-mm-embeds, vLLM's embeddings: a (clips, positions,
    hidden) tensor, or a list of (positions, hidden) tensors)."""
    if not data:
        return []
    unknown = sorted(set(data) - {IMAGE, VIDEO, AUDIO})
    if unknown:
        raise MediaError(f"multi_modal_data {unknown} is not supported: Troupe's models take images "
                         "({'image': PIL image or a list of them}), videos ({'video': frames or a list of them}) "
                         "and audio ({'audio': (samples, sampling_rate) or a list of them})")
    out: list[Any] = []
    images = data.get(IMAGE)
    if isinstance(images, Mapping):                 # embeddings beside their grids (Qwen-VL's)
        out += _grid_items(IMAGE, images)
    elif images is not None:
        if type(images).__module__.startswith("torch") and getattr(images, "dim", lambda: 0)() == 3:
            out += list(images)                     # (images, positions, hidden) embeddings
        else:
            out += list(images) if isinstance(images, (list, tuple)) else [images]
    videos = data.get(VIDEO)
    if isinstance(videos, Mapping):
        out += _grid_items(VIDEO, videos)
    elif videos is not None:
        try:
            out += [video_of(v) for v in _videos(videos)]
        except VideoError as exc:
            raise MediaError(str(exc)) from None
    clips = data.get(AUDIO)
    if (_is_torch(clips) and clips.dim() == 3) or (isinstance(clips, list) and clips and all(
            _is_torch(c) and c.dim() == 2 for c in clips)):
        out += [ClipEmbeds(c) for c in clips]
    elif clips is not None:
        try:
            out += audios_of(clips)
        except AudioError as exc:
            raise MediaError(str(exc)) from None
    return out


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _grid_items(modality: str, fields: Mapping[str, Any]) -> list[GridEmbeds]:
    """A ``multi_modal_data`` dict of embeddings and grids: one item per row of its grid."""
    grid = fields.get(f"{modality}_grid_thw")
    shape = getattr(grid, "shape", None) or np.shape(grid if grid is not None else [])
    count = shape[0] if len(shape) == 2 else 1
    return [GridEmbeds(modality, fields, i, count) for i in range(count)]


def _videos(value: Any) -> list[Any]:
    """``multi_modal_data["video"]`` as a list of videos, by vLLM's rules."""
    dims = getattr(value, "ndim", None)
    if dims == 4 or (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping)):
        return [value]
    if dims == 5:
        return list(value)
    if isinstance(value, (list, tuple)) and value and (hasattr(value[0], "convert") or getattr(value[0], "ndim", 0) == 3):
        return [value]                              # one video's frames
    return list(value) if isinstance(value, (list, tuple)) else [value]


# -- reading an image ---------------------------------------------------------------------------

async def load_image(source: Any, config: MultiModalConfig, io_kwargs: Mapping[str, Any] | None = None) -> Any:
    """A source (a PIL image, or a data, http(s) or file URL) as an RGB PIL image; a video's
    (a ``VideoSource`` URL, or a ``Video``) as a ``Video`` of its sampled frames (``io_kwargs``:
    the request's media_io_kwargs over --media-io-kwargs); an audio clip's (an ``AudioSource``
    URL, an ``InputAudio``, an ``Audio``) as an ``Audio``. MediaError saying why not."""
    from PIL import Image
    if isinstance(source, (Video, Audio)):
        return source
    if isinstance(source, (AudioSource, InputAudio)):
        return await _load_audio(source, config)
    if isinstance(source, VideoSource):
        return await _load_video(source, config, io_kwargs)
    if isinstance(source, Image.Image):
        return _rgb(source)
    if isinstance(source, EmbedsPayload):
        return _embeds(lambda: decode_prompt_embeds(source, "image_embeds"), config)
    if isinstance(source, AudioEmbedsPayload):
        return _embeds(lambda: ClipEmbeds(decode_prompt_embeds(source, "audio_embeds")), config, AUDIO)
    if isinstance(source, ClipEmbeds):
        return _embeds(lambda: ClipEmbeds(embeds_array(source.rows, "audio_embeds")), config, AUDIO)
    if isinstance(source, GridEmbeds):
        return _embeds(lambda: source._replace(fields={k: _field(v, k) for k, v in source.fields.items()}), config,
                       source.modality)
    if type(source).__module__.startswith("torch"):      # the offline API's embeddings
        return _embeds(lambda: embeds_array(source, "image_embeds"), config)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a URL or a PIL image, got {type(source).__name__}")
    return _decode(await read_url(source, config), "the data URL" if source[:5].lower() == "data:" else source)


async def read_url(url: str, config: MultiModalConfig, kind: str = IMAGE, limit: int = MAX_IMAGE_BYTES) -> bytes:
    """A data, http(s) or file URL's bytes, at most ``limit`` of them (MediaError saying why not)."""
    if url[:5].lower() == "data:":
        return _data_url_bytes(url, kind, limit)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return await _fetch(url, config, kind, limit)
    if scheme == "file":
        return await asyncio.to_thread(_local_bytes, url, config, kind, limit)
    raise MediaError("The URL must be either a HTTP, data or file URL.")


async def _load_video(url: str, config: MultiModalConfig, io_kwargs: Mapping[str, Any] | None) -> Video:
    """A video URL's frames (``actors/tokenizer/video.py``), decoded in a thread."""
    settings = {**config.media_io_kwargs.get(VIDEO, {}), **((io_kwargs or {}).get(VIDEO) or {})}
    if io_kwargs and VIDEO in io_kwargs:     # vLLM's: a request's num_frames or fps drops the server's other
        asked = io_kwargs[VIDEO] or {}
        if "num_frames" in asked and "fps" not in asked:
            settings.pop("fps", None)
        elif "fps" in asked and "num_frames" not in asked:
            settings.pop("num_frames", None)
    try:
        num_frames = int(settings.get("num_frames", DEFAULT_VIDEO_FRAMES))
        fps = float(settings.get("fps", -1))
    except (TypeError, ValueError):
        raise MediaError(f"media_io_kwargs' video num_frames and fps must be numbers, got {settings}") from None
    try:
        if url[:5].lower() == "data:":
            spec = url[5:].partition(",")[0].partition(";")[0].lower()
            if spec == "video/jpeg":
                payload = url.partition(",")[2]
                return await asyncio.to_thread(decode_jpeg_frames, payload, num_frames, fps if fps > 0 else 1.0)
        data = await read_url(url, config, VIDEO, MAX_VIDEO_BYTES)
        return await asyncio.to_thread(decode_video, data, num_frames, fps)
    except VideoError as exc:
        raise MediaError(f"the video could not be read: {exc}") from None


async def _load_audio(source: AudioSource | InputAudio, config: MultiModalConfig) -> Audio:
    """An audio URL's or ``input_audio`` part's clip (``actors/tokenizer/audio.py``), decoded in a
    thread, within vLLM's limits."""
    limit, seconds, decoded = vllm_env.audio_limits()
    try:
        data = (input_audio_bytes(source, limit) if isinstance(source, InputAudio)
                else await read_url(source, config, AUDIO, limit))
        return await asyncio.to_thread(decode_audio, data, seconds, decoded)
    except AudioError as exc:
        raise MediaError(f"the audio could not be read: {exc}") from None


def _embeds(read: Callable[[], Any], config: MultiModalConfig, modality: str = IMAGE) -> Any:
    if not config.enable_mm_embeds:
        raise MediaError(MM_EMBEDS_OFF.replace("image_embeds", f"{modality}_embeds"))
    try:
        return read()
    except ValueError as exc:
        raise MediaError(str(exc)) from None


def _field(value: Any, name: str) -> np.ndarray:
    """One field of a dict of embeddings as an array: a tensor, a base64 torch.save'd one, or
    numbers (a JSON list)."""
    if isinstance(value, (str, bytes)):
        value = decode_tensor(value, name)
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        value = value.float().numpy() if value.is_floating_point() else value.numpy()
    try:
        return np.asarray(value)
    except (ValueError, TypeError):
        raise ValueError(f"`{name}` must be a tensor or a list of numbers") from None


def _data_url_bytes(url: str, kind: str = IMAGE, limit: int = MAX_IMAGE_BYTES) -> bytes:
    """RFC 2397's data:[<mediatype>][;base64],<data>, base64 only (as vLLM)."""
    spec, sep, data = url[5:].partition(",")
    if not sep:
        raise MediaError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    if spec.rpartition(";")[2] != "base64":
        raise MediaError("Only base64 data URLs are supported for now.")
    if len(data) > limit * 4 // 3 + 4:
        raise MediaError(f"the data URL's {kind} is larger than {limit >> 20} MiB")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's data is not valid base64") from None


async def _fetch(url: str, config: MultiModalConfig, kind: str = IMAGE, limit: int = MAX_IMAGE_BYTES) -> bytes:
    import aiohttp
    host = urllib.parse.urlsplit(url).hostname
    if config.allowed_media_domains and host not in config.allowed_media_domains:
        raise MediaError(f"The URL must be from one of the allowed domains: {list(config.allowed_media_domains)}. "
                         f"Input URL domain: {host}")
    timeout, variable = {VIDEO: (vllm_env.video_fetch_timeout_s(), "VLLM_VIDEO_FETCH_TIMEOUT"),
                         AUDIO: (vllm_env.audio_fetch_timeout_s(), "VLLM_AUDIO_FETCH_TIMEOUT")}.get(
        kind, (vllm_env.image_fetch_timeout_s(), "VLLM_IMAGE_FETCH_TIMEOUT"))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url, allow_redirects=vllm_env.media_url_allow_redirects()) as response:
                if response.status != 200:
                    raise MediaError(f"fetching the {kind} at {url} answered HTTP {response.status}")
                chunks, size = [], 0          # read(n) may answer fewer bytes than the body has: read to its end
                async for chunk in response.content.iter_chunked(1 << 20):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        break
                data = b"".join(chunks)
    except TimeoutError:
        raise MediaError(f"fetching the {kind} at {url} took longer than {timeout} s ({variable})") from None
    except aiohttp.ClientError as exc:
        raise MediaError(f"could not fetch the {kind} at {url}: {exc}") from None
    if len(data) > limit:
        raise MediaError(f"the {kind} at {url} is larger than {limit >> 20} MiB")
    return data


def _local_bytes(url: str, config: MultiModalConfig, kind: str = IMAGE, limit: int = MAX_IMAGE_BYTES) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        raise MediaError("Cannot load local files without `--allowed-local-media-path`.")
    parts = urllib.parse.urlsplit(url)
    path = os.path.realpath(urllib.request.url2pathname(parts.netloc + parts.path))
    if os.path.commonpath([root, path]) != root or path == root:
        raise MediaError(f"The file path {path} must be a subpath of `--allowed-local-media-path {root}`.")
    try:
        if os.path.getsize(path) > limit:
            raise MediaError(f"the {kind} {path} is larger than {limit >> 20} MiB")
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise MediaError(f"could not read the {kind} {path}: {exc.strerror or exc}") from None


def _decode(data: bytes, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where} does not hold an image Pillow can read ({exc})") from None
    return _rgb(image)


def _rgb(image: Any) -> Any:
    """As vLLM's image loader converts: RGB (an alpha channel composed over white)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        from PIL import Image
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.split()[3])
        return background
    return image.convert("RGB")


# -- the checkpoint's processor ------------------------------------------------------------------

Expansion = Callable[[Mapping[str, Any], Any, Mapping[str, np.ndarray]], str]


def _qwen2_vl_expansion(settings: Mapping[str, Any], image_processor: Any, out: Mapping[str, np.ndarray]) -> str:
    """Qwen2-VL's processor's rule: an image's placeholder becomes one per merged patch."""
    return "<|image_pad|>" * (int(np.prod(out["image_grid_thw"][0])) // int(image_processor.merge_size) ** 2)


def _pixtral_expansion(settings: Mapping[str, Any], image_processor: Any, out: Mapping[str, np.ndarray]) -> str:
    """Pixtral's processor's rule (Mistral 3's): a row of image tokens per row of merged
    patches of the resized image, each row but the last ended by a break token, the last by the
    end token (``settings``: processor_config.json's patch size, merge and tokens)."""
    height, width = (int(v) for v in out["image_sizes"][0])
    step = int(settings.get("patch_size", 16)) * int(settings.get("spatial_merge_size", 1))
    image, row_break = settings.get("image_token", "[IMG]"), settings.get("image_break_token", "[IMG_BREAK]")
    rows = [image * (width // step)] * (height // step)
    return row_break.join(rows) + settings.get("image_end_token", "[IMG_END]")


# processors whose image side can be rebuilt from the image processor alone: their placeholder,
# and what it expands to (from processor_config.json's settings and the image processor's outputs)
_IMAGES_ONLY: dict[str, tuple[str, Expansion]] = {
    "Qwen2VLProcessor": ("<|image_pad|>", _qwen2_vl_expansion),
    "Qwen2_5_VLProcessor": ("<|image_pad|>", _qwen2_vl_expansion),
    "Qwen3VLProcessor": ("<|image_pad|>", _qwen2_vl_expansion),
    "PixtralProcessor": ("[IMG]", _pixtral_expansion),
}


# where a prompt writes an image as more than its placeholder token (vLLM's placeholder strings)
_PROMPT_PLACEHOLDERS = {"Qwen2VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
                        "Qwen2_5_VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
                        "Qwen3VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>"}
# processors whose videos Troupe processes (actors/tokenizer/video.py): what a prompt writes for a video
VIDEO_PROCESSORS = {"Qwen2VLProcessor": "<|vision_start|><|video_pad|><|vision_end|>",
                    "Qwen2_5_VLProcessor": "<|vision_start|><|video_pad|><|vision_end|>",
                    "Qwen3VLProcessor": "<|vision_start|><|video_pad|><|vision_end|>"}
# what a prompt writes for an audio clip beside its audio token (vLLM's placeholder strings)
AUDIO_PROCESSORS = {"Qwen2AudioProcessor": "<|audio_bos|><|AUDIO|><|audio_eos|>",
                    "GlmAsrProcessor": "<|begin_of_audio|><|pad|><|end_of_audio|>"}
# processors that answer torch tensors only (their inputs are turned into arrays here)
_TORCH_OUTPUTS = ("GlmAsrProcessor", "AudioFlamingo3Processor")


class ImagesOnlyProcessor:
    """A checkpoint's processor rebuilt from its image processor, where transformers cannot
    build the whole one here (Qwen-VL's video processor and Pixtral's processor need
    torchvision): the image processor's inputs, and the placeholder expanded by the processor's
    own rule."""

    def __init__(self, name: str, image_processor: Any, image_token: str, expansion: Expansion,
                 settings: Mapping[str, Any]) -> None:
        self.name, self.image_processor, self.image_token = name, image_processor, image_token
        self._expansion, self._settings = expansion, settings

    def __call__(self, text: str, images: list[Any], return_text_replacement_offsets: bool = True,
                 add_special_tokens: bool = False, return_tensors: str = "np", **kwargs: Any) -> dict[str, Any]:
        if text != self.image_token or len(images) != 1:
            raise ValueError(f"{self.name} (its images alone) processes one image for its placeholder")
        out = dict(self.image_processor(images=images, return_tensors=return_tensors, **kwargs))
        out["text_replacement_offsets"] = [[{"replacement": self._expansion(self._settings, self.image_processor, out)}]]
        return out


def images_only_processor(checkpoint_dir: str) -> ImagesOnlyProcessor | None:
    """The checkpoint's processor rebuilt from its image processor (``ImagesOnlyProcessor``),
    where its class is one ``_IMAGES_ONLY`` knows; None otherwise."""
    name, settings = None, {}
    for config in ("processor_config.json", "preprocessor_config.json"):
        path = os.path.join(checkpoint_dir, config)
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f)
            settings = {**found, **settings}
            name = name or found.get("processor_class")
    if name not in _IMAGES_ONLY:
        return None
    from transformers import AutoImageProcessor
    placeholder, expansion = _IMAGES_ONLY[name]
    return ImagesOnlyProcessor(name, AutoImageProcessor.from_pretrained(checkpoint_dir),
                               settings.get("image_token", placeholder), expansion, settings)


def _checkpoint_config(checkpoint_dir: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} where it has none or it is not a dict)."""
    try:
        with open(os.path.join(checkpoint_dir, "config.json")) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


class ImageProcessor:
    """The checkpoint's processor (transformers' ``AutoProcessor``) for one model: each image's
    (video's, audio clip's) inputs, and the expansion of its placeholder in the prompt."""

    def __init__(self, checkpoint_dir: str, image_token_id: int | None, config: MultiModalConfig,
                 encode: Callable[[str], list[int]], counts: Any = None, hidden_size: int = 0,
                 whole_item_budget: int | None = None, needs_grid: bool = False,
                 video_token_id: int | None = None, audio_token_id: int | None = None) -> None:
        """``encode``: the served tokenizer's text -> token ids, no special tokens added;
        ``counts``: what counts the processor cache's lookups (``mm_cache_queries`` and
        ``mm_cache_hits`` attributes: the server's stats; None: itself); ``hidden_size``: the
        rows image embeddings must have (--enable-mm-embeds); ``whole_item_budget``: where an
        image is computed in one step (--disable-chunked-mm-input, a prefix LM), the step's token
        budget, which an image may not exceed; ``needs_grid``: an image's positions come from its
        grid of patches (M-RoPE's), which embeddings given alone do not say; ``video_token_id``: a
        model that takes videos, the token whose positions take a video's embeddings (its
        processor one ``VIDEO_PROCESSORS`` names); ``image_token_id`` None: a model that takes no
        images; ``audio_token_id``: a model that takes audio, the token whose positions take a
        clip's embeddings (its processor has a feature extractor and an audio token)."""
        self.whole_item_budget = whole_item_budget
        self.needs_grid = needs_grid
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()       # its notes on the image processor's backend it falls back to
        try:
            try:
                self.processor = AutoProcessor.from_pretrained(checkpoint_dir)
            except ImportError:               # a part this environment cannot build (a video processor)
                self.processor = images_only_processor(checkpoint_dir)
                if self.processor is None:
                    raise
        except (OSError, ValueError, ImportError) as exc:
            raise ValueError(f"{checkpoint_dir}: the checkpoint's processor (processor_config.json, "
                             f"preprocessor_config.json) could not be built, so its media cannot be served ("
                             f"{str(exc).strip()}); --language-model-only serves the model on text") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        self.name = getattr(self.processor, "name", type(self.processor).__name__)
        self.placeholder = self.placeholder_id = self.prompt_placeholder = None
        if image_token_id is not None:
            self.placeholder = getattr(self.processor, "image_token", None)
            if not isinstance(self.placeholder, str) or not hasattr(self.processor, "image_processor"):
                raise ValueError(f"{self.name} has no image processor and image token, so images cannot be served")
            # what a prompt writes for an image (vLLM's placeholder string): the image token, or with
            # the markers the model's template puts around it
            self.prompt_placeholder = _PROMPT_PLACEHOLDERS.get(self.name, self.placeholder)
            self.placeholder_id = self._one_token(encode, self.placeholder, IMAGE)
        self.image_token_id = image_token_id
        self.video: QwenVideoProcessor | None = None            # set below, for a model that takes them
        self.audio_placeholder = self.audio_placeholder_id = self.sampling_rate = None
        self.config = config
        self.encode = encode
        # vLLM's processor cache (--mm-processor-cache-gb): processed images by identifier, newest last
        self._cache: collections.OrderedDict[str, tuple[list[int], dict[str, np.ndarray]]] = collections.OrderedDict()
        self._cache_bytes, self._cache_limit = 0, int(config.processor_cache_gb * (1 << 30))
        self._lock = threading.Lock()         # images are processed in threads
        self.counts = self
        self.mm_cache_queries = self.mm_cache_hits = 0
        self.hidden_size = hidden_size
        # the rows an item's embeddings have: the hidden size, Qwen3-VL's with its DeepStack
        # features beside (the vision tower's outputs), and the side of the patches merged into one
        vision = _checkpoint_config(checkpoint_dir).get("vision_config") or {}
        self.embeds_width = hidden_size * (1 + len(vision.get("deepstack_visual_indexes") or ()))
        self.merge_size = int(getattr(getattr(self.processor, "image_processor", None), "merge_size", None)
                              or vision.get("spatial_merge_size") or 1)
        # whether an image's placeholder expands to image tokens alone (LLaVA's), so that one given
        # as embeddings expands to as many as it has rows
        self.plain_expansion = False
        if config.enable_mm_embeds and image_token_id is not None:
            from PIL import Image
            ids = self._processed(Image.new("RGB", (64, 64)))[0]
            self.plain_expansion = all(t == image_token_id for t in ids)
            self.clear()
        self.mm_cache_queries = self.mm_cache_hits = 0
        self.counts = counts if counts is not None else self
        self.video_token_id = video_token_id
        if video_token_id is not None:
            self._take_videos(checkpoint_dir, encode)
        self.audio_token_id = audio_token_id
        if audio_token_id is not None:
            self._take_audio(encode)

    def _one_token(self, encode: Callable[[str], list[int]], text: str, modality: str) -> int:
        ids = encode(text)
        if len(ids) != 1:
            raise ValueError(f"the {modality} placeholder {text!r} is {len(ids)} tokens to the served tokenizer, "
                             "not one")
        return ids[0]

    def _take_audio(self, encode: Callable[[str], list[int]]) -> None:
        """Audio by the processor's feature extractor (its sampling rate), its audio token the placeholder."""
        extractor = getattr(self.processor, "feature_extractor", None)
        token = getattr(self.processor, "audio_token", None)
        if extractor is None or not isinstance(token, str):
            raise ValueError(f"{self.name} has no feature extractor and audio token, so audio cannot be served")
        self.audio_placeholder = token
        self.audio_placeholder_id = self._one_token(encode, token, AUDIO)
        self.prompt_audio_placeholder = AUDIO_PROCESSORS.get(self.name, token)
        self.sampling_rate = int(extractor.sampling_rate)
        # the longest clip the model hears at once: its processor's bound (GLM-ASR's cuts windows up to
        # it), else its feature extractor's window
        self.audio_window_s = float(getattr(self.processor, "max_audio_len", None)
                                    or getattr(extractor, "chunk_length", None) or 30)

    def _take_videos(self, checkpoint_dir: str, encode: Callable[[str], list[int]]) -> None:
        """Videos by Qwen-VL's video processing, where the checkpoint's processor is Qwen2-VL's,
        Qwen2.5-VL's or Qwen3-VL's and its tokenizer has the video token; otherwise videos are
        refused (the log says why)."""
        ids = encode(QwenVideoProcessor.placeholder)
        if self.name not in VIDEO_PROCESSORS or len(ids) != 1:
            log.warning("videos are not taken: %s", f"{self.name} is not Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's processor"
                        if self.name not in VIDEO_PROCESSORS else
                        f"the video placeholder is {len(ids)} tokens to the served tokenizer, not one")
            return
        self.video = QwenVideoProcessor.from_checkpoint(checkpoint_dir, self.name)
        self.video_placeholder_id = ids[0]
        self.prompt_video_placeholder = VIDEO_PROCESSORS[self.name]

    @property
    def placeholders(self) -> dict[str, str]:
        """What a prompt writes for each modality the model takes (vLLM's placeholder strings)."""
        out = {IMAGE: self.prompt_placeholder} if self.placeholder is not None else {}
        if self.video is not None:
            out[VIDEO] = self.prompt_video_placeholder
        if self.audio_placeholder is not None:
            out[AUDIO] = self.prompt_audio_placeholder
        return out

    def takes(self, modality: str) -> bool:
        """Whether the model takes items of ``modality``."""
        return {IMAGE: self.placeholder, VIDEO: self.video, AUDIO: self.audio_placeholder}.get(modality) is not None

    def _refusal(self, modality: str) -> str:
        plural = {IMAGE: "images", VIDEO: "videos", AUDIO: "audio"}
        takes = [plural[m] for m in (IMAGE, VIDEO, AUDIO) if self.takes(m)]
        return f"this model takes no {plural[modality]} ({self.name} takes {' and '.join(takes)})"

    def process(self, image: Any, kwargs: Mapping[str, Any] | None = None) -> Processed:
        """One image (a PIL image, or its embeddings' rows) or video (a ``Video``) -> the token
        ids its placeholder expands to, its inputs for the model (a batch of one), its identifier
        and modality."""
        if isinstance(image, Video):
            return self._processed_video(image, kwargs)
        if isinstance(image, Audio):
            return self._processed_audio(image, kwargs)
        if isinstance(image, ClipEmbeds):
            return self._embedded_audio(image.rows)
        if isinstance(image, GridEmbeds):
            return self._grid_embedded(image)
        if isinstance(image, np.ndarray):
            return self._embedded(image)
        return self._processed(image, kwargs)

    def _processed_video(self, video: Video, kwargs: Mapping[str, Any] | None) -> Processed:
        """A video by the model's video processor; its identifier a digest of its frames, their
        metadata and the processor's keywords (the processor cache keeps it as an image's)."""
        if self.video is None:
            raise MediaError(self._refusal(VIDEO))
        kwargs = {**self.config.mm_processor_kwargs, **(kwargs or {})}
        h = hashlib.blake2b(digest_size=16)
        h.update(f"video:{video.frames.shape}:{json.dumps(video.metadata, sort_keys=True, default=str)}:"
                 f"{json.dumps(kwargs, sort_keys=True, default=str)}".encode())
        h.update(video.frames.tobytes())
        identifier = h.hexdigest()
        cached = self._cached(identifier, VIDEO)
        if cached is not None:
            return cached
        try:
            text, data = self.video(video, kwargs)
        except (VideoError, ValueError, TypeError) as exc:
            raise MediaError(f"{self.name} could not process the video: {exc}") from None
        ids = self.encode(text)
        self._keep(identifier, ids, data)
        return Processed(ids, data, identifier, VIDEO)

    def _grid_embedded(self, item: GridEmbeds) -> Processed:
        """An image or video given as its embeddings beside its grid (``GridEmbeds``, read):
        its rows of the dict's, as many of its tokens (a Qwen3-VL video's expansion with its
        timestamps); the rows as wide as the vision tower's outputs (Qwen3-VL's with their
        DeepStack features)."""
        modality, fields = item.modality, item.fields
        embeds, grid_key = f"{modality}_embeds", f"{modality}_grid_thw"
        if not self.needs_grid:
            raise MediaError(f"this model takes {modality} embeddings as a tensor of rows, not a dict with a grid")
        if not self.takes(modality):
            raise MediaError(self._refusal(modality))
        timestamps = modality == VIDEO and self.video.timestamps
        allowed = {embeds, grid_key} | ({"timestamps"} if timestamps else set())
        missing, unknown = sorted(allowed - set(fields)), sorted(set(fields) - allowed)
        if missing or unknown:
            raise MediaError(f"{modality} embeddings for this model are a dict of {sorted(allowed)}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else ""))
        import torch
        try:
            rows = embeds_array(torch.as_tensor(fields[embeds]), embeds)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise MediaError(str(exc)) from None
        if rows.shape[1] != self.embeds_width:
            layers = self.embeds_width // max(self.hidden_size, 1) - 1
            raise MediaError(f"`{embeds}` rows are {rows.shape[1]} wide, and this model's are {self.embeds_width}: its "
                             f"hidden_size {self.hidden_size}" + (f" and beside it {layers} DeepStack features of that "
                                                                 "size (the vision tower's outputs)" if layers else ""))
        grids = np.asarray(fields[grid_key])
        if grids.dtype.kind not in "iu" or grids.size % 3 or (grids < 1).any():
            raise MediaError(f"`{grid_key}` must be positive integers (t, h, w) per {modality}, got {grids.tolist()}")
        grids = grids.reshape(-1, 3).astype(np.int64)
        if item.count is None and len(grids) != 1:
            raise MediaError(f"one {modality}_embeds part holds one {modality}'s embeddings; this one's grid holds "
                             f"{len(grids)}")
        merge = self.merge_size
        if (grids[:, 1:] % merge).any():
            raise MediaError(f"`{grid_key}` {grids.tolist()}: the height and width in patches must be multiples "
                             f"of the merge size {merge}")
        sizes = grids.prod(axis=1) // merge ** 2
        if int(sizes.sum()) != len(rows):
            raise MediaError(f"`{embeds}` has {len(rows)} rows, and its grid `{grid_key}` {grids.tolist()} takes "
                             f"{int(sizes.sum())} (one per {merge}x{merge} merged patches)")
        lo = int(sizes[:item.index].sum())
        rows, grid = rows[lo:lo + int(sizes[item.index])], grids[item.index:item.index + 1]
        data = {embeds: rows, grid_key: grid}
        h = hashlib.blake2b(rows.tobytes(), digest_size=16)
        h.update(grid.tobytes())
        if modality == IMAGE:
            ids = [self.image_token_id] * len(rows)
        else:
            times = None
            if timestamps:
                times = np.asarray(fields["timestamps"], np.float64)
                times = (times[item.index] if times.ndim == 2 else times).reshape(-1).tolist()
                h.update(np.asarray(times).tobytes())
            try:
                ids = self.encode(self.video.expansion(int(grid[0, 0]), int(sizes[item.index]) // int(grid[0, 0]), times))
            except VideoError as exc:
                raise MediaError(str(exc)) from None
        return Processed(ids, data, "embeds-" + h.hexdigest(), modality)

    def _embedded(self, rows: np.ndarray) -> Processed:
        """An image given as its embeddings (positions, hidden): as many image tokens."""
        if not self.takes(IMAGE):
            raise MediaError(self._refusal(IMAGE))
        if self.needs_grid:
            raise MediaError("this model's image positions (M-RoPE's) come from an image's grid of patches, which "
                             "image_embeds alone do not give: send the image, or a dict of its image_embeds and "
                             "image_grid_thw")
        if not self.plain_expansion:
            raise MediaError(f"{self.name} expands an image's placeholder into more than image "
                             "tokens, so image_embeds cannot say where their rows go: send the image")
        try:
            check_hidden_size(rows, self.hidden_size, "image_embeds")
        except ValueError as exc:
            raise MediaError(str(exc)) from None
        identifier = "embeds-" + hashlib.blake2b(rows.tobytes(), digest_size=16).hexdigest()
        return Processed([self.image_token_id] * len(rows), {"image_embeds": rows}, identifier)

    def _embedded_audio(self, rows: np.ndarray) -> Processed:
        """An audio clip given as its embeddings (positions, hidden): as many audio tokens (its
        processor's expansion of the audio placeholder)."""
        if not self.takes(AUDIO):
            raise MediaError(self._refusal(AUDIO))
        try:
            check_hidden_size(rows, self.hidden_size, "audio_embeds")
        except ValueError as exc:
            raise MediaError(str(exc)) from None
        identifier = "embeds-" + hashlib.blake2b(rows.tobytes(), digest_size=16).hexdigest()
        return Processed([self.audio_token_id] * len(rows), {"audio_embeds": rows}, identifier, AUDIO)

    def _processed(self, image: Any, kwargs: Mapping[str, Any] | None = None) -> Processed:
        """A PIL image by the checkpoint's processor; its identifier a digest of its pixels and
        the processor's keywords (the server's --mm-processor-kwargs under the request's
        ``kwargs``). An image processed before with the same keywords comes from the processor
        cache."""
        if not self.takes(IMAGE):
            raise MediaError(self._refusal(IMAGE))
        kwargs = {**self.config.mm_processor_kwargs, **(kwargs or {})}
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{image.mode}:{image.size}:{json.dumps(kwargs, sort_keys=True, default=str)}".encode())
        h.update(image.tobytes())
        return self._by_processor(h.hexdigest(), IMAGE, self.placeholder, images=[image], **kwargs)

    def _processed_audio(self, audio: Audio, kwargs: Mapping[str, Any] | None = None) -> Processed:
        """An audio clip by the checkpoint's processor (its feature extractor's log-mel features),
        brought to the extractor's sampling rate first; its identifier a digest of its samples, their
        rate and the processor's keywords."""
        if not self.takes(AUDIO):
            raise MediaError(self._refusal(AUDIO))
        kwargs = {**self.config.mm_processor_kwargs, **(kwargs or {})}
        samples, rate = audio.samples, self.sampling_rate
        if audio.sampling_rate is not None:
            samples = resample(samples, audio.sampling_rate, rate)
        h = hashlib.blake2b(digest_size=16)
        h.update(f"audio:{rate}:{len(samples)}:{json.dumps(kwargs, sort_keys=True, default=str)}".encode())
        h.update(samples.tobytes())
        return self._by_processor(h.hexdigest(), AUDIO, self.audio_placeholder, audio=[samples], sampling_rate=rate,
                                  **kwargs)

    def _by_processor(self, identifier: str, modality: str, placeholder: str, **inputs: Any) -> Processed:
        """One item through the checkpoint's processor (``inputs``: the item, the keywords), or
        from the processor cache: the token ids its placeholder became, and its inputs."""
        cached = self._cached(identifier, modality)
        if cached is not None:
            return cached
        torch_outputs = self.name in _TORCH_OUTPUTS
        try:
            out = self.processor(text=placeholder, return_text_replacement_offsets=True, add_special_tokens=False,
                                 return_tensors="pt" if torch_outputs else "np", **inputs)
        except (ValueError, TypeError, KeyError) as exc:
            raise MediaError(f"{self.name} could not process the {modality}: {exc}") from None
        if torch_outputs:
            out = {k: v.numpy() if type(v).__module__.startswith("torch") else v for k, v in out.items()}
        if "text_replacement_offsets" in out:       # what the placeholder became, as text (vLLM's way)
            replacements = out["text_replacement_offsets"][0]
            if len(replacements) != 1:
                raise MediaError(f"{self.name} expanded one {modality} into {len(replacements)} places")
            ids = self.encode(replacements[0]["replacement"])
        else:                                       # a transformers without them: the expansion's token ids
            ids = [int(t) for t in out["input_ids"][0]]
        data = {key: np.ascontiguousarray(value) for key, value in out.items() if key not in _NOT_INPUTS
                and isinstance(value, np.ndarray)}
        self._keep(identifier, ids, data)
        return Processed(ids, data, identifier, modality)

    def _cached(self, identifier: str, modality: str) -> Processed | None:
        """An item processed before (the processor cache), counted as a lookup."""
        with self._lock:
            self.counts.mm_cache_queries += 1
            cached = self._cache.get(identifier)
            if cached is None:
                return None
            self.counts.mm_cache_hits += 1
            self._cache.move_to_end(identifier)
            return Processed(cached[0], cached[1], identifier, modality)

    def clear(self) -> None:
        """Forget every processed image and video (vLLM's /reset_mm_cache)."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    def _keep(self, identifier: str, ids: list[int], data: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in data.values()) + 8 * len(ids)
        if size > self._cache_limit:
            return
        with self._lock:
            if identifier in self._cache:
                return
            self._cache[identifier] = (ids, data)
            self._cache_bytes += size
            while self._cache_bytes > self._cache_limit:
                _, (old_ids, old) = self._cache.popitem(last=False)
                self._cache_bytes -= sum(a.nbytes for a in old.values()) + 8 * len(old_ids)

    def expand(self, ids: list[int], items: Sequence[tuple[Any, ...]]) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's token ids with the i-th placeholder of each modality replaced by the
        i-th item of that modality's expansion, and the items as features over those positions."""
        items = [item if isinstance(item, Processed) else Processed(*item) for item in items]
        slots: list[tuple[int, Processed]] = []
        for modality, token, name in ((IMAGE, self.placeholder_id, self.placeholder),
                                      (VIDEO, getattr(self, "video_placeholder_id", None), "<|video_pad|>"),
                                      (AUDIO, self.audio_placeholder_id, self.audio_placeholder)):
            mine = [item for item in items if item.modality == modality]
            at = [i for i, t in enumerate(ids) if t == token] if token is not None else []
            if len(at) != len(mine):
                raise MediaError(f"the prompt has {len(at)} {modality} placeholders ({name!r}) for {len(mine)} "
                                 f"{modality}s: each {modality} needs one")
            slots += zip(at, mine)
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for position, (expansion, data, identifier, modality) in sorted(slots, key=lambda slot: slot[0]):
            out.extend(ids[previous:position])
            token = {IMAGE: self.image_token_id, VIDEO: self.video_token_id, AUDIO: self.audio_token_id}[modality]
            is_embed = np.asarray(expansion) == token
            if not is_embed.any():
                raise MediaError(f"the {modality}'s expansion holds no {modality} token ({token})")
            if self.whole_item_budget is not None and len(expansion) > self.whole_item_budget:
                raise MediaError(f"an {'audio clip' if modality == AUDIO else modality} takes {len(expansion)} positions, "
                                 "which are computed in one step, and a "
                                 f"step takes at most {self.whole_item_budget} tokens (--max-num-batched-tokens)")
            features.append(MultiModalFeature(modality, identifier, len(out), len(expansion), data,
                                              None if is_embed.all() else is_embed))
            out.extend(expansion)
            previous = position + 1
        out.extend(ids[previous:])
        return out, features

    def check_count(self, sources: Sequence[Any]) -> None:
        """At most --limit-mm-per-prompt items of each modality, of the modalities the model takes."""
        counts = collections.Counter(modality_of(s) for s in sources)
        for modality, n in counts.items():
            if not self.takes(modality):
                raise MediaError(self._refusal(modality))
            limit = self.config.limit(modality)
            if n > limit:
                raise MediaError(f"At most {limit} {modality}(s) may be provided in one prompt. Set "
                                 "`--limit-mm-per-prompt` to increase this limit.")
