"""Videos in prompts (vLLM's video input) for a model that takes them (Troupe's Qwen2-VL,
Qwen2.5-VL and Qwen3-VL classes): a video read into frames, and Qwen-VL's video processing.

Reading: a video's bytes (a ``video_url`` part's data, http(s) or file URL) are decoded by OpenCV
(vLLM's default video backend) into frames sampled evenly, ``num_frames`` of them (vLLM's default
32) and at most ``fps`` a second where it is given (``--media-io-kwargs '{"video": {"num_frames": 16}}'``
or a request's ``media_io_kwargs``), with the metadata the processor reads (the source's fps and
frame count, the sampled frames' indices, and vLLM's ``do_sample_frames``: true where every frame
was kept, so that Qwen3-VL's processor samples them itself). A ``data:video/jpeg;base64,`` URL holds the frames as
JPEGs, their base64 joined by commas (vLLM's). The offline API's ``multi_modal_data={"video": ...}``
takes frames as they are: an array (frames, height, width, 3) of uint8, a list of PIL images or of
(height, width, 3) arrays, or vLLM's (frames, metadata) pair.

Processing: transformers' Qwen-VL video processors need torchvision, so their steps are here, on
numpy and PIL as the image processor's PIL path does an image: the settings of the checkpoint's
video processor (processor_config.json's ``video_processor``, else video_preprocessor_config.json,
else preprocessor_config.json, over the class's defaults: Qwen2-VL's 128 to 768 merged patches of
28 pixels a frame, Qwen3-VL's of 32 pixels for the frames together), every frame resized to one size (``smart_resize``), rescaled and normalized, the frames
padded to a multiple of the temporal patch by repeating the last, and cut into patches of
(temporal patch, patch, patch) in the order the vision tower reads them; the placeholder
``<|video_pad|>`` expands to one per merged patch. Qwen2.5-VL's ``second_per_grid_ts`` (the seconds
one temporal patch covers, from the sampled frames' rate) spaces its time positions. Qwen3-VL's
frames are sampled again at 2 a second where the reader kept them all, and each temporal patch's
positions follow its timestamp as text, ``<0.5 seconds>``, between its own vision markers (vLLM's
expansion of the placeholder), so that M-RoPE positions each patch as an image of its own.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from typing import Any, Mapping

import numpy as np

VIDEO = "video"
VIDEO_PART = {"type": "video"}       # a video's place in a message, as the chat template sees it
DEFAULT_NUM_FRAMES = 32              # vLLM's VideoMediaIO default
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class VideoError(ValueError):
    """A video that cannot be read or processed (an HTTP 400)."""


class VideoSource(str):
    """A ``video_url`` part's URL (as against an image's)."""


class Video:
    """A video's frames, (frames, height, width, 3) uint8 RGB, and its metadata (vLLM's and
    transformers' keys: ``fps`` of the source, ``total_num_frames``, ``frames_indices`` of the
    frames kept, ``duration``); None where the frames came without it."""

    def __init__(self, frames: np.ndarray, metadata: dict[str, Any] | None = None) -> None:
        self.frames, self.metadata = frames, metadata

    @property
    def sampled_fps(self) -> float | None:
        """The kept frames' rate (transformers' VideoMetadata.sampled_fps); None without metadata."""
        m = self.metadata
        if not m or not m.get("fps"):
            return None
        indices, total = m.get("frames_indices"), m.get("total_num_frames")
        if not indices or not total:
            return float(m["fps"])
        return len(indices) / total * float(m["fps"])


# -- frames out of bytes and values ------------------------------------------------------------

def sample_indices(total: int, fps: float, num_frames: int, want_fps: float) -> list[int]:
    """vLLM's frame choice: ``num_frames`` (-1: all) spread evenly over ``total``, fewer where
    ``want_fps`` (> 0) a second of the video's length gives fewer; at least one."""
    n = total if num_frames <= 0 else min(num_frames, total)
    if want_fps > 0 and fps > 0:
        n = min(n, math.floor(total / fps * want_fps))
    n = max(1, n)
    if n == total:
        return list(range(total))
    return np.linspace(0, total - 1, n, dtype=int).tolist()


def decode_video(data: bytes, num_frames: int = DEFAULT_NUM_FRAMES, fps: float = -1) -> Video:
    """A video file's bytes (any container and codec OpenCV's FFmpeg reads) -> its sampled frames
    (``sample_indices``) and metadata."""
    try:
        import cv2
    except ImportError:
        raise VideoError("reading a video needs OpenCV (pip install opencv-python-headless)") from None
    if num_frames == 0:
        raise VideoError("num_frames must be greater than 0 or -1")
    stream = io.BytesIO(data)        # held until the capture is released: OpenCV reads it, without a reference
    cap = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])
    try:
        if not cap.isOpened():
            raise VideoError("the video could not be opened (no container or codec OpenCV reads)")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        source_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        if total <= 0:
            raise VideoError("the video holds no frames")
        wanted = sample_indices(total, source_fps, num_frames, fps)
        chosen, frames, last = set(wanted), [], max(wanted)
        kept = []
        for index in range(last + 1):
            if not cap.grab():
                break
            if index in chosen:
                ok, frame = cap.retrieve()
                if ok:
                    frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                    kept.append(index)
    finally:
        cap.release()
        del stream
    if not frames:
        raise VideoError("no frame of the video could be decoded")
    return Video(np.stack(frames), {"total_num_frames": total, "fps": source_fps,
                                    "duration": total / source_fps if source_fps > 0 else 0.0,
                                    "frames_indices": kept, "video_backend": "opencv",
                                    "do_sample_frames": len(kept) == total})


def decode_jpeg_frames(data: str, num_frames: int = DEFAULT_NUM_FRAMES, fps: float = 1.0) -> Video:
    """vLLM's ``data:video/jpeg;base64,`` payload: each frame's JPEG in base64, joined by commas
    (the first ``num_frames``; -1: all), at ``fps`` frames a second (default 1)."""
    from PIL import Image, UnidentifiedImageError
    parts = data.split(",") if num_frames < 0 else data.split(",", num_frames)[:num_frames]
    frames = []
    for i, part in enumerate(parts):
        try:
            image = Image.open(io.BytesIO(base64.b64decode(part, validate=True)))
            frames.append(np.asarray(image.convert("RGB")))
        except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
            raise VideoError(f"frame {i} of the video/jpeg data is not a base64 JPEG ({exc})") from None
    if len({f.shape for f in frames}) > 1:
        raise VideoError("the video/jpeg frames differ in size")
    return Video(np.stack(frames), {"total_num_frames": len(frames), "fps": float(fps),
                                    "duration": len(frames) / float(fps), "frames_indices": list(range(len(frames))),
                                    "video_backend": "jpeg", "do_sample_frames": False})


def video_of(value: Any) -> Video:
    """The offline API's video: an array (frames, height, width, 3), a list of frames (PIL
    images or (height, width, 3) arrays), or a (frames, metadata) pair; uint8 RGB frames."""
    metadata = None
    if isinstance(value, Video):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        value, metadata = value[0], dict(value[1])
    if isinstance(value, (list, tuple)):
        if not value:
            raise VideoError("a video needs at least one frame")
        frames = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in value]
        if len({f.shape for f in frames}) > 1:
            raise VideoError("a video's frames must all have one size")
        value = np.stack(frames)
    if type(value).__module__.startswith("torch"):
        value = value.numpy()
    if not isinstance(value, np.ndarray) or value.ndim != 4 or value.shape[-1] != 3 or not len(value):
        raise VideoError("a video is an array (frames, height, width, 3), a list of frames or (frames, "
                         f"metadata), got {type(value).__name__} of shape {getattr(value, 'shape', None)}")
    if value.dtype != np.uint8:
        value = np.clip(value, 0, 255).astype(np.uint8)
    return Video(np.ascontiguousarray(value), metadata)


# -- Qwen-VL's video processing ----------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 num_frames: int | None = None, temporal_factor: int = 2) -> tuple[int, int]:
    """Qwen2-VL's: the size nearest (height, width) whose sides are multiples of ``factor``, its
    pixels between ``min_pixels`` and ``max_pixels``, the aspect ratio about kept. Qwen3-VL's
    (``num_frames`` given): the bounds hold for the frames' pixels together (the frame count
    rounded to the temporal patch), and a side shorter than ``factor`` is scaled up first."""
    if num_frames is not None:
        if num_frames < temporal_factor:
            raise VideoError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    frames = 1 if num_frames is None else num_frames
    t = 1 if num_frames is None else round(num_frames / temporal_factor) * temporal_factor
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


# transformers' Qwen2VLVideoProcessor's defaults
_QWEN2_VL_VIDEO = {"min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768, "patch_size": 14,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": OPENAI_CLIP_MEAN,
                   "image_std": OPENAI_CLIP_STD, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                   "do_normalize": True, "resample": 3, "do_sample_frames": False, "fps": None, "num_frames": None,
                   "min_frames": 4, "max_frames": 768}
# transformers' Qwen3VLVideoProcessor's
_QWEN3_VL_VIDEO = {**_QWEN2_VL_VIDEO, "min_pixels": 128 * 32 * 32, "max_pixels": 32 * 32 * 768, "patch_size": 16,
                   "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "do_sample_frames": True, "fps": 2,
                   "cap_pixels_per_frame": False, "max_video_tokens": 768}
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def _settings(found: Mapping[str, Any], defaults: Mapping[str, Any] = _QWEN2_VL_VIDEO) -> dict[str, Any]:
    """A video processor config's keys over the defaults (``size`` as min and max pixels)."""
    out = dict(defaults)
    size = found.get("size")
    if isinstance(size, Mapping):
        if size.get("shortest_edge"):
            out["min_pixels"] = int(size["shortest_edge"])
        if size.get("longest_edge"):
            out["max_pixels"] = int(size["longest_edge"])
    for key in defaults:
        if found.get(key) is not None:
            out[key] = found[key]
    return out


class QwenVideoProcessor:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's video processing, as transformers' video
    processors of those models do it (see the module's doc): ``__call__`` gives a video's
    placeholder expansion and its inputs (``pixel_values_videos``, ``video_grid_thw``, and for
    Qwen2.5-VL ``second_per_grid_ts``). Qwen3-VL's expansion is vLLM's: each temporal patch of
    frames its timestamp as text (``<1.5 seconds>``, the middle of its frames' times) before its
    own vision markers around its positions."""

    placeholder = "<|video_pad|>"
    FAMILIES = {"Qwen2VLProcessor": _QWEN2_VL_VIDEO, "Qwen2_5_VLProcessor": _QWEN2_VL_VIDEO,
                "Qwen3VLProcessor": _QWEN3_VL_VIDEO}

    def __init__(self, settings: Mapping[str, Any], seconds_per_grid: bool, timestamps: bool = False) -> None:
        self.settings, self.seconds_per_grid, self.timestamps = dict(settings), seconds_per_grid, timestamps

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, processor_name: str) -> QwenVideoProcessor:
        found: dict[str, Any] = {}
        nested = os.path.join(checkpoint_dir, "processor_config.json")
        if os.path.isfile(nested):
            with open(nested) as f:
                found = json.load(f).get("video_processor") or {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = os.path.join(checkpoint_dir, name)
            if not found and os.path.isfile(path):
                with open(path) as f:
                    found = json.load(f)
        return cls(_settings(found, cls.FAMILIES[processor_name]), seconds_per_grid=processor_name == "Qwen2_5_VLProcessor",
                   timestamps=processor_name == "Qwen3VLProcessor")

    def __call__(self, video: Video, kwargs: Mapping[str, Any] | None = None) -> tuple[str, dict[str, np.ndarray]]:
        kwargs = dict(kwargs or {})
        s = dict(self.settings)
        for key, value in kwargs.items():      # the request's and the server's processor keywords
            if key == "size" and isinstance(value, Mapping):
                s.update({k: v for k, v in _settings(value, s).items() if k in ("min_pixels", "max_pixels")})
            elif key in s:
                s[key] = value
        if (self.seconds_per_grid or self.timestamps) and not video.metadata:
            raise VideoError("Video metadata is required but not found in mm input. Please check your video input "
                             "in `multi_modal_data`")
        patch, merge, temporal = int(s["patch_size"]), int(s["merge_size"]), int(s["temporal_patch_size"])
        if self.timestamps:
            frames, times = self._sampled_with_times(video, s, kwargs)
        else:
            frames, times = self._sampled(video.frames, video.metadata, s), None
        height, width = frames.shape[1:3]
        if s["do_resize"]:
            height, width = smart_resize(height, width, patch * merge, *self._pixel_bounds(s, len(frames), patch * merge),
                                         num_frames=len(frames) if self.timestamps else None, temporal_factor=temporal)
        pixels = self._pixels(frames, s, height, width)               # (T, C, H, W) float32
        if pad := -len(pixels) % temporal:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        t, c = pixels.shape[:2]
        gt, gh, gw = t // temporal, height // patch, width // patch
        patches = pixels.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        data = {"pixel_values_videos": np.ascontiguousarray(patches.reshape(gt * gh * gw, c * temporal * patch * patch)),
                "video_grid_thw": np.array([[gt, gh, gw]], dtype=np.int64)}
        if self.seconds_per_grid:
            fps = video.sampled_fps or 24.0       # transformers' assumption where the rate is unknown
            data["second_per_grid_ts"] = np.array([temporal / fps], dtype=np.float32)
        return self.expansion(gt, gh * gw // merge ** 2, times), data

    def expansion(self, patches: int, per_patch: int, times: list[float] | None = None) -> str:
        """What a video's placeholder becomes: one ``<|video_pad|>`` per merged patch of its
        ``patches`` temporal patches of ``per_patch`` each; Qwen3-VL's, each temporal patch after
        its time (``times``, seconds) as text, between its own vision markers."""
        if not self.timestamps:
            return self.placeholder * (patches * per_patch)
        if times is None or len(times) != patches:
            raise VideoError(f"Qwen3-VL's video needs a timestamp per temporal patch ({patches}), got "
                             f"{None if times is None else len(times)}")
        return "".join(f"<{float(time):.1f} seconds>{VISION_START}{self.placeholder * per_patch}{VISION_END}"
                       for time in times)

    def _pixel_bounds(self, s: Mapping[str, Any], num_frames: int, factor: int) -> tuple[int, int]:
        """(min, max) pixels; Qwen3-VL's ``cap_pixels_per_frame`` caps a frame's share of the
        maximum (qwen-vl-utils' rule: at most ``max_video_tokens`` merged patches a frame)."""
        low, high = int(s["min_pixels"]), int(s["max_pixels"])
        if self.timestamps and s.get("cap_pixels_per_frame"):
            frame = max(min(int(s["max_video_tokens"]) * factor * factor, high // num_frames), int(low * 1.05))
            high = frame * num_frames
        return low, high

    @staticmethod
    def _sampled_with_times(video: Video, s: Mapping[str, Any], kwargs: Mapping[str, Any]) -> tuple[np.ndarray, list[float]]:
        """Qwen3-VL's frames and their temporal patches' times, as vLLM has them: frames already
        sampled stay as they are unless ``do_sample_frames`` (the processor keywords', else the
        metadata's: a reader that kept every frame of the video asks for it), which takes
        ``num_frames`` of them, or ``fps`` a second (the checkpoint's 2 by default; 4 to 768 frames),
        evenly; a patch's time is the mean of its first and last frames' in seconds (the source's
        frame indices over its fps), the last frame repeated to fill a patch."""
        frames, metadata = video.frames, video.metadata or {}
        fps = float(metadata.get("fps") or 24.0)            # transformers' assumption where it is unknown
        indices = list(metadata.get("frames_indices") or range(len(frames)))
        if len(indices) != len(frames):
            raise VideoError(f"the video's metadata lists {len(indices)} frames_indices for {len(frames)} frames")
        if kwargs.get("do_sample_frames", metadata.get("do_sample_frames", False)):
            if kwargs.get("num_frames") is not None and kwargs.get("fps") is not None:
                raise VideoError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
            total = int(metadata.get("total_num_frames") or len(frames))
            if kwargs.get("num_frames") is not None:
                n = int(kwargs["num_frames"])
            else:
                n = int(total / fps * float(kwargs.get("fps") or s["fps"]))
                n = min(max(n, int(s["min_frames"])), int(s["max_frames"]), total)
            if n <= 0:
                raise VideoError(f"Video can't be sampled: num_frames={n}")
            chosen = np.linspace(0, total - 1, n).round().astype(np.int64)
            if chosen.max() >= len(frames):
                raise VideoError(f"sampling frames of a video of {total} frames (its metadata) from the {len(frames)} given")
            frames, indices = frames[chosen], chosen.tolist()
        temporal = int(s["temporal_patch_size"])
        indices = indices + [indices[-1]] * (-len(indices) % temporal)
        seconds = [i / fps for i in indices]
        return frames, [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]

    @staticmethod
    def _sampled(frames: np.ndarray, metadata: Mapping[str, Any] | None, s: Mapping[str, Any]) -> np.ndarray:
        """transformers' Qwen2-VL sample_frames where ``do_sample_frames`` asks for it
        (``num_frames``, or ``fps`` frames a second by the metadata), over the frames given."""
        if not s.get("do_sample_frames") or (s.get("num_frames") is None and s.get("fps") is None):
            return frames
        temporal, total = int(s["temporal_patch_size"]), len(frames)
        if s.get("num_frames") is not None and s.get("fps") is not None:
            raise VideoError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
        if s.get("num_frames") is not None:
            n = round(int(s["num_frames"]) / temporal) * temporal
        else:
            fps = (metadata or {}).get("fps")
            if not fps:
                raise VideoError("sampling `fps` frames a second needs the video's metadata (its fps)")
            top = math.floor(min(int(s["max_frames"]), total) / temporal) * temporal
            n = min(max(total / float(fps) * float(s["fps"]), int(s["min_frames"])), top, total)
            n = math.floor(n / temporal) * temporal
        if n > total or n <= 0:
            raise VideoError(f"Video can't be sampled. The inferred `num_frames={n}` exceeds `total_num_frames={total}`."
                             " Decrease `num_frames` or `fps` for sampling.")
        return frames[np.arange(0, total, total / n).astype(np.int64)]

    @staticmethod
    def _pixels(frames: np.ndarray, s: Mapping[str, Any], height: int, width: int) -> np.ndarray:
        """Every frame resized to (height, width) (bicubic, by PIL), rescaled and normalized:
        (frames, channels, height, width) float32, each channel one multiply-add over all frames."""
        from PIL import Image
        if frames.shape[1:3] != (height, width):
            frames = np.stack([np.asarray(Image.fromarray(frame).resize((width, height), resample=int(s["resample"])))
                               for frame in frames])
        scale = np.full(3, np.float32(s["rescale_factor"]) if s["do_rescale"] else 1.0, np.float32)
        shift = np.zeros(3, np.float32)
        if s["do_normalize"]:
            std = np.asarray(s["image_std"], np.float32)
            scale, shift = scale / std, -np.asarray(s["image_mean"], np.float32) / std
        out = np.empty((len(frames), 3, height, width), dtype=np.float32)
        for c in range(3):
            np.multiply(frames[..., c], scale[c], out=out[:, c], dtype=np.float32)
            out[:, c] += shift[c]
        return out
