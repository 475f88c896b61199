"""vLLM's environment variables that a deployment sets, read as vLLM reads them, so a vLLM
service's environment works unchanged:

  VLLM_CPU_KVCACHE_SPACE=40         the CPU's KV cache in GiB (over --kv-cache-gib, as vLLM's legacy
                                    setting is over --kv-cache-memory-bytes; 0 or empty: unset)
  VLLM_CPU_OMP_THREADS_BIND=0-7|8-15   each CPU worker's cores ("|" between tensor / pipeline ranks,
                                    then data-parallel engines): the worker is pinned to them and
                                    computes on that many threads; "auto" (default), "nobind": not pinned
  VLLM_CPU_NUM_OF_RESERVED_CPU=1    cores left to the server's other processes when the workers'
                                    threads are counted from the machine's cores
  VLLM_ALLOW_LONG_MAX_MODEL_LEN=1   --max-model-len may exceed the model's context length
  VLLM_HTTP_TIMEOUT_KEEP_ALIVE=5    seconds an idle HTTP connection is kept open
  VLLM_IMAGE_FETCH_TIMEOUT=5        seconds an http(s) image URL may take to fetch
  VLLM_VIDEO_FETCH_TIMEOUT=30       seconds an http(s) video URL may take to fetch
  VLLM_AUDIO_FETCH_TIMEOUT=10       seconds an http(s) audio URL may take to fetch
  VLLM_MAX_AUDIO_CLIP_FILESIZE_MB=25   the most an audio file's bytes may be
  VLLM_MAX_AUDIO_DECODE_DURATION_S=600 the longest an audio clip may play
  VLLM_MAX_AUDIO_DECODE_BYTES=268435456  the most a clip's decoded samples may take (float32, all channels)
  VLLM_MEDIA_URL_ALLOW_REDIRECTS=1  an image URL's redirects are followed (0: refused)
  VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH, VLLM_CONFIGURE_LOGGING (actors/runtime/logs.py)

A value that does not parse is a ValueError naming the variable."""
from __future__ import annotations

import os

GIB = 1 << 30


def _int(name: str, minimum: int = 0) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def cpu_kv_cache_bytes() -> int | None:
    """VLLM_CPU_KVCACHE_SPACE in bytes (None: not set, or 0)."""
    gib = _int("VLLM_CPU_KVCACHE_SPACE")
    return gib * GIB if gib else None


def reserved_cpus() -> int:
    return _int("VLLM_CPU_NUM_OF_RESERVED_CPU") or 0


def allow_long_max_model_len() -> bool:
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def http_keep_alive_s() -> float | None:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE (None: not set: the server's own default)."""
    text = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a number of seconds, got {text!r}") from None
    if value < 0:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be at least 0, got {value:g}")
    return value


def bound_cores(rank: int) -> list[int] | None:
    """The cores VLLM_CPU_OMP_THREADS_BIND gives worker ``rank`` (its place among every worker of
    the server: data-parallel engine, then pipeline stage, then tensor rank), or None when the
    workers are not bound ("auto", "nobind", unset)."""
    text = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if text in ("", "auto", "nobind"):
        return None
    lists = text.split("|")
    if rank >= len(lists):
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={text!r} names the cores of {len(lists)} worker(s) "
                         f"('|' between them); worker {rank} has none")
    return parse_cores(lists[rank], text)


def check() -> None:
    """Every variable above parsed (a server checks them before it starts anything)."""
    cpu_kv_cache_bytes(), reserved_cpus(), http_keep_alive_s()
    text = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if text not in ("", "auto", "nobind"):
        usable = os.sched_getaffinity(0)
        for spec in text.split("|"):
            missing = sorted(set(parse_cores(spec, text)) - usable)
            if missing:
                raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={text!r} names core(s) {missing} this machine does not "
                                 f"let the server run on (it may use {sorted(usable)})")


def parse_cores(spec: str, whole: str | None = None) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; ValueError naming the variable for anything else."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cores += range(first, last + 1)
    except ValueError:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={whole or spec!r}: cores are given as 0-3,6 "
                         f"('|' between workers), got {spec!r}") from None
    return sorted(set(cores))


def image_fetch_timeout_s() -> int:
    """VLLM_IMAGE_FETCH_TIMEOUT (vLLM's default: 5 s)."""
    value = _int("VLLM_IMAGE_FETCH_TIMEOUT", minimum=1)
    return 5 if value is None else value


def video_fetch_timeout_s() -> int:
    """VLLM_VIDEO_FETCH_TIMEOUT (vLLM's default: 30 s)."""
    value = _int("VLLM_VIDEO_FETCH_TIMEOUT", minimum=1)
    return 30 if value is None else value


def audio_fetch_timeout_s() -> int:
    """VLLM_AUDIO_FETCH_TIMEOUT (vLLM's default: 10 s)."""
    value = _int("VLLM_AUDIO_FETCH_TIMEOUT", minimum=1)
    return 10 if value is None else value


def audio_limits() -> tuple[int, int, int]:
    """(VLLM_MAX_AUDIO_CLIP_FILESIZE_MB in bytes, VLLM_MAX_AUDIO_DECODE_DURATION_S,
    VLLM_MAX_AUDIO_DECODE_BYTES); vLLM's defaults 25 MiB, 600 s, 256 MiB."""
    size = _int("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", minimum=1)
    seconds = _int("VLLM_MAX_AUDIO_DECODE_DURATION_S", minimum=1)
    decoded = _int("VLLM_MAX_AUDIO_DECODE_BYTES", minimum=1)
    return ((25 if size is None else size) << 20, 600 if seconds is None else seconds,
            268_435_456 if decoded is None else decoded)


def media_url_allow_redirects() -> bool:
    """VLLM_MEDIA_URL_ALLOW_REDIRECTS (vLLM's default: 1, followed)."""
    return os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in ("0", "false")
