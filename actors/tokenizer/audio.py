"""Audio in prompts, as vLLM takes it, for a model that takes audio (Troupe's Qwen2-Audio, GLM-ASR and
Audio Flamingo 3 classes).

A chat message's ``input_audio`` parts (OpenAI's: ``{"data": base64, "format": "wav"}``) and
``audio_url`` parts (data, http(s) and file URLs, as image URLs are read), and the offline API's
``multi_modal_data={"audio": ...}`` (vLLM's forms: a ``(samples, sampling_rate)`` pair, or samples
alone, already at the model's rate; a list of either for several clips) become ``Audio`` clips:
mono float32 samples and their rate. Files are decoded by libsndfile (``soundfile``: WAV, FLAC,
OGG, MP3), within vLLM's limits (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB, VLLM_MAX_AUDIO_DECODE_DURATION_S,
VLLM_MAX_AUDIO_DECODE_BYTES), the channels averaged; the checkpoint's processor takes them at its
feature extractor's rate, to which ``resample`` brings them by band-limited sinc interpolation
(torchaudio's, vLLM's default resampler: a Hann-windowed sinc six zero crossings wide, cut off
at 0.99 of the lower rate's Nyquist frequency)."""
from __future__ import annotations

import base64
import binascii
import functools
import io
import math
from typing import Any, NamedTuple

import numpy as np

AUDIO = "audio"
AUDIO_PART = {"type": "audio"}      # a clip's place in a message, as the chat template sees it


class AudioError(ValueError):
    """An audio clip that cannot be read."""


class Audio(NamedTuple):
    """A clip: mono float32 samples at ``sampling_rate`` (None: the model's own, as vLLM takes
    samples given without their rate)."""
    samples: np.ndarray
    sampling_rate: float | None = None


class AudioSource(str):
    """A chat ``audio_url`` part's URL."""


class InputAudio(NamedTuple):
    """A chat ``input_audio`` part: the file's bytes in base64, and its format (``wav``, ``mp3``, ...)."""
    data: str
    format: str = ""


def audio_of(value: Any) -> Audio:
    """One clip of ``multi_modal_data["audio"]``: a ``(samples, sampling_rate)`` pair or samples
    alone (a 1-dimensional array or tensor, a list of numbers); several channels (channels,
    samples) are averaged."""
    rate = None
    if isinstance(value, tuple) and len(value) == 2:
        value, rate = value
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            raise AudioError(f"an audio clip's sampling rate must be a positive number, got {rate!r}")
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().float().numpy()
    try:
        samples = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise AudioError(f"an audio clip must be samples (an array of numbers), got {type(value).__name__}") from None
    if samples.ndim == 2:
        samples = samples.mean(axis=0)
    if samples.ndim != 1 or not len(samples):
        raise AudioError(f"an audio clip must be a non-empty array of samples (or channels x samples), got shape "
                         f"{samples.shape}")
    if not np.isfinite(samples).all():
        raise AudioError("an audio clip's samples must be finite numbers")
    return Audio(np.ascontiguousarray(samples), None if rate is None else float(rate))


def audios_of(value: Any) -> list[Audio]:
    """``multi_modal_data["audio"]`` as clips, by vLLM's rules: a pair or one array is one clip,
    a list of them several."""
    one = (isinstance(value, tuple) and len(value) == 2 and not hasattr(value[1], "__len__")) \
        or getattr(value, "ndim", None) == 1
    if one or (isinstance(value, list) and value and isinstance(value[0], (int, float))):
        return [audio_of(value)]
    if isinstance(value, (list, tuple)):
        return [audio_of(v) for v in value]
    return [audio_of(value)]


def input_audio_bytes(part: InputAudio, limit: int) -> bytes:
    """An ``input_audio`` part's file bytes, at most ``limit`` of them."""
    if not isinstance(part.data, str) or not part.data:
        raise AudioError("an input_audio part needs its file's bytes in base64 as `data`")
    if len(part.data) > 4 * ((limit + 2) // 3):
        raise AudioError(f"the audio is larger than {limit >> 20} MiB (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB)")
    try:
        return base64.b64decode(part.data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError("input_audio's data is not valid base64") from None


def decode_audio(data: bytes, max_seconds: int, max_decoded: int) -> Audio:
    """A file's bytes (any format libsndfile reads) as a clip, its channels averaged; AudioError
    when it does not decode or is longer (or larger decoded) than vLLM's limits allow."""
    import soundfile
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames, channels = f.samplerate, f.frames, f.channels
            if frames / rate > max_seconds:
                raise AudioError(f"Audio exceeds maximum allowed duration of {max_seconds}s (file contains "
                                 f"{frames / rate:.1f}s at {rate}Hz). Set VLLM_MAX_AUDIO_DECODE_DURATION_S to "
                                 "increase this limit.")
            if frames * channels * 4 > max_decoded:
                raise AudioError(f"Audio would allocate {frames * channels * 4 >> 20} MiB of PCM ({frames} frames x "
                                 f"{channels} channels x 4B), exceeding the {max_decoded >> 20} MiB limit. Set "
                                 "VLLM_MAX_AUDIO_DECODE_BYTES to increase this limit.")
            samples = f.read(dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(f"Invalid or unsupported audio file ({exc})") from None
    if not len(samples):
        raise AudioError("the audio file holds no samples")
    return Audio(np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32), float(rate))


@functools.lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, zeros: int = 6, rolloff: float = 0.99) -> tuple[np.ndarray, int]:
    """The resampling filters from ``orig`` to ``new`` samples (rates divided by their greatest
    common divisor): one row per output phase, over a window of input samples, and the window's
    reach either side."""
    base = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base)
    idx = np.arange(-width, width + orig, dtype=np.float64)[None] / orig
    t = (np.arange(0, -new, -1, dtype=np.float64)[:, None] / new + idx) * base
    t = np.clip(t, -zeros, zeros)
    window = np.cos(t * math.pi / zeros / 2) ** 2
    t *= math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        kernel = np.where(t == 0, 1.0, np.sin(t) / t)
    return (kernel * window * base / orig).astype(np.float32), width


def resample(samples: np.ndarray, orig_rate: float, new_rate: float) -> np.ndarray:
    """``samples`` at ``orig_rate`` brought to ``new_rate`` by band-limited sinc interpolation
    (torchaudio's ``Resample``, vLLM's default): ceil(len x new / orig) samples."""
    orig, new = int(round(orig_rate)), int(round(new_rate))
    if orig == new:
        return samples
    gcd = math.gcd(orig, new)
    orig, new = orig // gcd, new // gcd
    kernel, width = _sinc_kernel(orig, new)
    length = len(samples)
    padded = np.pad(np.asarray(samples, np.float32), (width, width + orig))
    windows = (len(padded) - kernel.shape[1]) // orig + 1
    frames = np.lib.stride_tricks.as_strided(padded, (windows, kernel.shape[1]),
                                             (orig * padded.strides[0], padded.strides[0]), writeable=False)
    out = (frames @ kernel.T).reshape(-1)
    return np.ascontiguousarray(out[:math.ceil(new * length / orig)])


# -- speech to text (/v1/audio/transcriptions, /v1/audio/translations) ---------------------------

class SpeechToText(NamedTuple):
    """How a checkpoint's processor transcribes and translates speech: the languages its model
    takes natively (ISO 639-1; None: all of Whisper's), and the instructions that ask it to
    (``{language}``: the spoken language's name, ``{to}``: the one to translate into); ``inline``:
    the user turn is one string, the audio token then the instruction (vLLM's for GLM-ASR), else
    an audio part then a text part."""
    languages: tuple[str, ...] | None
    transcribe: str
    transcribe_in: str
    translate: str
    inline: bool = False
    no_space: frozenset[str] = frozenset({"zh", "ja", "yue", "th", "lo", "my"})


SPEECH_TO_TEXT = {
    # Qwen2-Audio's speech recognition and speech translation (vLLM serves none: Troupe's words)
    "Qwen2AudioProcessor": SpeechToText(
        ("zh", "en", "yue", "fr", "it", "es", "de", "ja"), "Please transcribe this audio into text.",
        "Please transcribe this {language} audio into text.", "Please translate this audio into {to}."),
    # GLM-ASR's, as vLLM asks it
    "GlmAsrProcessor": SpeechToText(
        None, "can you transcribe the speech into a written format?",
        "can you transcribe the speech into a written format?", "translate the speech to {to}", inline=True)}
MAX_CLIP_SECONDS, OVERLAP_SECONDS, ENERGY_WINDOW = 30, 1, 1600   # vLLM's SpeechToTextConfig defaults


def split_speech(samples: np.ndarray, rate: int, max_seconds: float = MAX_CLIP_SECONDS,
                 overlap_seconds: float = OVERLAP_SECONDS, window: int = ENERGY_WINDOW) -> list[tuple[int, np.ndarray]]:
    """A clip longer than ``max_seconds`` cut into pieces of at most that long, each cut at the
    quietest ``window`` of samples (the lowest RMS) within the last ``overlap_seconds`` before the
    limit (vLLM's chunking of long audio); each piece with its first sample's index."""
    size, overlap = int(rate * max_seconds), int(rate * overlap_seconds)
    pieces, start = [], 0
    while start < len(samples):
        if start + size >= len(samples):
            pieces.append((start, samples[start:]))
            break
        cut = _quietest(samples, start + size - overlap, start + size, window)
        cut = cut if cut > start else start + size
        pieces.append((start, samples[start:cut]))
        start = cut
    return pieces


def _quietest(samples: np.ndarray, lo: int, hi: int, window: int) -> int:
    """The start of the quietest whole ``window`` of samples in [lo, hi) (``lo`` when none fits)."""
    segment = samples[lo:hi]
    count = (len(segment) - window - 1) // window + 1 if len(segment) > window else 0
    if count <= 0:
        return lo
    energy = np.sqrt(np.mean(np.square(segment[:count * window].reshape(count, window), dtype=np.float64), axis=1))
    energy[np.isnan(energy)] = np.inf
    return lo + int(np.argmin(energy)) * window
