"""The native CPU kernels (every ``*.c`` file of this folder): compiled together with the system
C compiler on first use into a per-user cache, loaded with ctypes (no torch headers, so the build
takes a second or two).

``available()`` says whether they can run here and, if not, why. Other modules declare the
ctypes signatures of their own kernels with ``declare`` and reach the library through ``library``.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join(HERE, "*.c")))
HEADERS = sorted(glob.glob(os.path.join(HERE, "*.h")))     # included by the sources: part of the cache key
# -march=native: the library is built on the machine that runs it (the cache key has its CPU).
FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def _cache_dir() -> str:
    root = os.environ.get("TROUPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "troupe")
    path = os.path.join(root, "native")
    os.makedirs(path, exist_ok=True)
    return path


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc or gcc) on PATH"
    h = hashlib.sha256(" ".join(FLAGS + sorted(_cpu_flags())).encode())
    for src in SOURCES + HEADERS:
        with open(src, "rb") as f:
            h.update(f.read())
    path = os.path.join(_cache_dir(), f"troupe-native-{h.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        proc = subprocess.run([cc, *FLAGS, *SOURCES, "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            return None, f"compiling {', '.join(SOURCES)} failed: {proc.stderr.strip()[:500]}"
        os.replace(tmp, path)      # atomic: concurrent processes never load a partial file
    lib = ctypes.CDLL(path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode.restype = None
    lib.paged_decode.argtypes = [ptr, ptr, i64] + [ptr] * 3 + [i64] * 7 + [ctypes.c_float, i64, ptr, ptr]
    lib.paged_decode_lse.restype = None
    lib.paged_decode_lse.argtypes = lib.paged_decode.argtypes + [ptr, ctypes.c_float]
    return lib, ""


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError naming the reason when the kernels cannot run here."""
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are unavailable: {reason}")
    return lib


def declare(name: str, argtypes: list, restype=None) -> ctypes._CFuncPtr:
    """The kernel ``name`` with its ctypes signature set (idempotent)."""
    fn = getattr(library(), name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def available() -> tuple[bool, str]:
    lib, reason = _library()
    return lib is not None, reason


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D float32 CPU tensor with unit stride along the rows,
    through sampling.c when the kernels are built here, torch otherwise."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1
            or not x.shape[0] or not x.shape[1] or _library()[0] is None):
        return x.argmax(dim=-1)
    fn = _library()[0].argmax_rows_f32
    if fn.argtypes is None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def apply_bitmask_(x: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """In place: -inf on x's (B, V) float32 logits whose bit in the (B, W) int32 bitmask is clear,
    through sampling.c. False, with nothing written, when the kernels cannot take these tensors."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1
            or bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu"
            or bitmask.shape[0] != x.shape[0] or _library()[0] is None):
        return False
    fn = declare("apply_bitmask_f32", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64])
    fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), bitmask.data_ptr(), bitmask.shape[1])
    return True


# The KV cache element types the native kernels read and write (paged_attention.c's PA_*).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def scale_tensor(scale: torch.Tensor | float | None) -> torch.Tensor | None:
    """A KV scale as the kernels take it: one float32 on the CPU, whose address they are given
    (``ptr``) and read at the call; None stays None (NULL: 1.0)."""
    if scale is None:
        return None
    if not isinstance(scale, torch.Tensor):
        return torch.tensor(float(scale), dtype=torch.float32)
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device.type != "cpu":
        raise ValueError(f"a KV scale must be one float32 on the CPU, got {tuple(scale.shape)} {scale.dtype} "
                         f"on {scale.device}")
    return scale


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
                 lse: torch.Tensor | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention read in place through the block table (see paged_attention.c).
    query (B, H, D) float32, kv_cache (2, num_blocks, BS, KVH, D) float32, float16, bfloat16,
    float8_e4m3fn or float8_e5m2 (narrower rows are widened as they are read; 8-bit ones read as
    value * k_scale / v_scale, None: 1), block_table (B, M) int32, seq_lens (B,) int32
    -> (B, H, D) float32. ``lse`` (B, H) float32 contiguous, when given, receives each row's
    log-sum-exp of its scaled scores (-inf for seq_len 0). ``logits_soft_cap`` C: each scaled
    score s is C * tanh(s / C) (Gemma 2's; the kernel's portable tile)."""
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernels are unavailable: {reason}")
    B, H, D = query.shape
    _, num_blocks, BS, KVH, Dk = kv_cache.shape
    if (query.dtype != torch.float32 or kv_cache.dtype not in KV_TYPES or Dk != D or H % KVH
            or H > 64 or D > 256 or not kv_cache.is_contiguous()):
        raise ValueError(f"native decode attention takes a float32 query (B, H, D) and a contiguous "
                         f"float32, float16, bfloat16 or fp8 cache (2, N, BS, KVH, D) with H % KVH == 0, "
                         f"H <= 64, D <= 256; got {tuple(query.shape)} {query.dtype}, "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    q = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    ks, vs = scale_tensor(k_scale), scale_tensor(v_scale)      # alive through the call
    args = (q.data_ptr(), kv_cache.data_ptr(), KV_TYPES[kv_cache.dtype], table.data_ptr(), lens.data_ptr(),
            out.data_ptr(), B, H, KVH, D, BS, num_blocks, table.shape[1], scale, sliding_window or 0, ptr(ks),
            ptr(vs))
    if lse is None and not logits_soft_cap:
        lib.paged_decode(*args)
        return out
    if lse is not None and (lse.shape != (B, H) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous float32 ({B}, {H}), got {tuple(lse.shape)} {lse.dtype}")
    lib.paged_decode_lse(*args, ptr(lse), float(logits_soft_cap or 0.0))
    return out
