"""Weights in panels of 32 output features for the native matrix multiply of ``gemm.c``:
float32 or bfloat16 (repacked from a weight matrix; bfloat16 ones multiply activations rounded
to bfloat16 with AVX512-BF16 dot products, float32 sums) or the GGUF Q4_1 / Q8_0 blocks of a checkpoint
(repacked from the file's bytes, same values once dequantized), or either GGUF format laid out
for integer dot products with int8 activations in two parts (``int8_activations=True``,
AVX512-VNNI, or AVX2's two-instruction form).

``PanelWeight.pack_f32`` / ``pack_bf16`` / ``pack_gguf`` build one at load time; ``matmul(x, w)``
computes x W^T for any number of rows, with a bias and an activation (kernels/cpu/fused.py's) applied
to each tile as it is written; ``gated_matmul`` act(x Wg^T) * (x Wu^T) for a gate|up weight. ``torch.ops.troupe.cpu_panel_matmul`` is the same product as
a custom op (with a fake implementation), which the packed linear layers call inside
torch.compile's graphs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from kernels.cpu import fused, native

NR = 32                       # output features per panel
QK = 32                       # weights per GGUF block
KINDS = {"F32": 0, "Q4_1": 1, "Q8_0": 2, "BF16": 3}          # "Q4_1_I8X2" has its own kernel
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class PanelWeight:
    kind: str                  # "F32" | "BF16" | "Q4_1" | "Q8_0" | "Q4_1_I8X2" | "Q8_0_I8X2"
    out_features: int
    in_features: int
    codes: torch.Tensor        # F32 (P, K, 32) float32; BF16 (P, ceil(K / 2), 32, 2) bfloat16; Q4_1 (P, K, 16) uint8; Q8_0 (P, K, 32) int8;
                               # Q4_1_I8X2 (P, K / 4, 64) uint8; Q8_0_I8X2 (P, K / 4, 128) int8
    d: torch.Tensor | None     # quantized: (P, K / 32, 32) float16 scales (the checkpoint's)
    m: torch.Tensor | None     # Q4_1: (P, K / 32, 32) float16 minimums; Q8_0_I8X2: block sums of the codes, int16

    @cached_property
    def call(self) -> tuple:
        """(kernel, its leading arguments): the ctypes function for this kind and the weight's
        fixed arguments, bound once (a decode step calls every weight, so per-call set-up
        shows)."""
        fn = _i8x2_gemm() if self.kind.endswith("_I8X2") else _panel_gemm()
        kind = KINDS[self.kind.removesuffix("_I8X2")]
        ptr = lambda t: None if t is None else t.data_ptr()      # noqa: E731
        return fn, (kind, ptr(self.codes), ptr(self.d), ptr(self.m), self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    @classmethod
    def pack_f32(cls, weight: torch.Tensor) -> "PanelWeight":
        """weight (N, K) float32 -> panels, zero-padded to a multiple of 32 rows."""
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"pack_f32 takes a 2-D float32 weight, got {tuple(weight.shape)} {weight.dtype}")
        n, k = weight.shape
        w = weight.detach().contiguous()
        codes = torch.empty(_panels(n), k, NR, dtype=torch.float32)
        _pack_f32()(w.data_ptr(), n, k, codes.data_ptr())
        return cls("F32", n, k, codes, None, None)

    @classmethod
    def pack_bf16(cls, weight: torch.Tensor) -> "PanelWeight":
        """weight (N, K) float32 or bfloat16 -> bfloat16 panels (float32 rounded to nearest even),
        pairs of input features side by side, zero-padded to a multiple of 32 rows and 2 columns."""
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"pack_bf16 takes a 2-D float32 or bfloat16 weight, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        n, k = weight.shape
        k2 = (k + 1) // 2
        w = torch.zeros(_panels(n) * NR, 2 * k2, dtype=torch.bfloat16)
        w[:n, :k] = weight.detach()
        codes = w.reshape(-1, NR, k2, 2).permute(0, 2, 1, 3).contiguous()          # (P, K2, 32, 2)
        return cls("BF16", n, k, codes, None, None)

    @classmethod
    def pack_gguf(cls, qtype: str, rows: np.ndarray | torch.Tensor, n: int, k: int,
                  int8_activations: bool = False) -> "PanelWeight":
        """The GGUF blocks of an (n, k) weight, one row of k / 32 blocks per output feature, as
        ``(n, row_bytes)`` or flat uint8 -> panels. ``int8_activations``: multiplied by int8
        activations in two parts (see gemm.c)."""
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"no native kernel for {qtype}; supported: {sorted(BLOCK_BYTES)}")
        if int8_activations and not int8_available():
            raise ValueError("int8 activations need a CPU with AVX2 (or AVX512-VNNI)")
        nb = k // QK
        raw = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows)
        if k % QK or raw.dtype != np.uint8 or raw.size != n * nb * BLOCK_BYTES[qtype]:
            raise ValueError(f"{qtype} weight of ({n}, {k}) needs {n * nb * BLOCK_BYTES[qtype]} uint8 "
                             f"bytes in blocks of {QK}, got {raw.size} {raw.dtype}")
        blocks = raw.reshape(n, nb, BLOCK_BYTES[qtype])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                             # (n, nb)
        if qtype == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
            nibbles = blocks[..., 4:20]
            q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)  # 0..15
            qp = _to_panels(q)                                                          # (P, K, 32)
            if int8_activations:           # (P, K/4, j, i, half) -> byte 4 j + i of group K/4
                g = qp.reshape(qp.shape[0], k // 4, 4, 2, 16).transpose(0, 1, 4, 2, 3)
                codes = np.ascontiguousarray(g[..., 0] | (g[..., 1] << 4)).reshape(-1, k // 4, 64)
                return cls("Q4_1_I8X2", n, k, torch.from_numpy(codes), _scales(d), _scales(m))
            codes = np.ascontiguousarray(qp[..., :16] | (qp[..., 16:] << 4))            # (P, K, 16)
            return cls(qtype, n, k, torch.from_numpy(codes), _scales(d), _scales(m))
        q = blocks[..., 2:34].copy().view(np.int8).reshape(n, k)
        qp = _to_panels(q)                                                              # (P, K, 32)
        if int8_activations:           # (P, K/4, half, j, i): 64 bytes per half of the panel
            g = qp.reshape(qp.shape[0], k // 4, 4, 2, 16).transpose(0, 1, 3, 4, 2)
            codes = np.ascontiguousarray(g).reshape(-1, k // 4, 128)
            sums = q.reshape(n, nb, QK).sum(-1, dtype=np.int16)             # (n, nb), |sum| <= 4096
            return cls("Q8_0_I8X2", n, k, torch.from_numpy(codes), _scales(d),
                       torch.from_numpy(_to_panels(sums)))
        return cls(qtype, n, k, torch.from_numpy(qp), _scales(d), None)


@lru_cache(maxsize=1)
def _pack_f32():
    return native.declare("pack_f32_panels", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p])


@lru_cache(maxsize=1)
def _panel_gemm():
    return native.declare("panel_gemm", [ctypes.c_int] + [ctypes.c_void_p] * 3
                          + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)


@lru_cache(maxsize=1)
def _panel_gemm_act():
    return native.declare("panel_gemm_act", [ctypes.c_int] + [ctypes.c_void_p] * 3
                          + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                          + [ctypes.c_int], ctypes.c_int)


def _panels(n: int) -> int:
    return (n + NR - 1) // NR


def _to_panels(a: np.ndarray) -> np.ndarray:
    """(n, k) -> (P, k, 32): column j of panel p is row 32 p + j (zeros past n)."""
    n, k = a.shape
    padded = np.zeros((_panels(n) * NR, k), a.dtype)
    padded[:n] = a
    return np.ascontiguousarray(padded.reshape(-1, NR, k).transpose(0, 2, 1))


def _scales(s: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(_to_panels(s))          # (n, nb) -> (P, nb, 32)


@lru_cache(maxsize=1)
def _i8x2_gemm():
    return native.declare("i8x2_gemm", [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                          + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)


@lru_cache(maxsize=1)
def int8_available() -> bool:
    """Whether the int8-activation kernel was built here (AVX512-VNNI or AVX2)."""
    return native.available()[0] and bool(native.declare("i8x2_available", [], ctypes.c_int)())


@lru_cache(maxsize=1)
def bf16_available() -> bool:
    """Whether the bfloat16 kernel was built with AVX512-BF16 dot products here (without them it
    widens the same bfloat16 values to float32)."""
    return native.available()[0] and bool(native.declare("bf16_available", [], ctypes.c_int)())


@lru_cache(maxsize=1)
def _bf16_gemm_io():
    return native.declare("bf16_gemm_io", [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                          + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2, ctypes.c_int)


def _bf16_io(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None, act: str | None, out_bf16: bool,
             gated: bool, residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """The bfloat16 panels' product taking bfloat16 rows as they are and / or writing a bfloat16
    result (bf16_gemm_io); None where it does not apply (another kind, float32 in and out, odd
    widths), for the caller's float32 path."""
    width = w.out_features // 2 if gated else w.out_features
    bf16_in = x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and w.in_features % 2 == 0
    out_bf16 = out_bf16 and residual is None
    if w.kind != "BF16" or not (bf16_in or out_bf16) or (out_bf16 and width % 2) \
            or x.dim() != 2 or x.shape[1] != w.in_features:
        return None
    xf = None if bf16_in else x.to(torch.float32).contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, width, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if rows:
        ptr = lambda t: None if t is None else t.data_ptr()      # noqa: E731
        ok = _bf16_gemm_io()(w.codes.data_ptr(), w.out_features, w.in_features, ptr(xf),
                             x.data_ptr() if bf16_in else None, rows, None if out_bf16 else y.data_ptr(),
                             y.data_ptr() if out_bf16 else None, ptr(bias), ptr(residual),
                             0 if act is None else fused.ACTIVATIONS[act], int(gated))
        if not ok:
            raise MemoryError(f"the native {w.kind} matmul could not allocate its buffer")
    return y


def _rows_of(x: torch.Tensor, w: PanelWeight) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be (T, {w.in_features}), got {tuple(x.shape)}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    return x


def matmul(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None, act: str | None = None,
           residual: torch.Tensor | None = None, out_bf16: bool = False) -> torch.Tensor:
    """x (T, K) float32 -> act(x W^T (+ bias, N float32 values) (+ residual, (T, N) float32)) (T, N)
    float32, ``act`` one of kernels/cpu/fused.py's ACTIVATIONS or None; the bias, the residual and
    the activation are applied by the kernel to each tile it writes (the same bits as the adds and
    ``fused.activation`` afterwards), or afterwards for the int8 kernels. bfloat16 panels take x in
    bfloat16 as it is (the rounding they would do) and, with ``out_bf16`` (no residual), write the
    result rounded to bfloat16 as the next bfloat16 product would round it; other kinds ignore it."""
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (w.out_features,)):
        raise ValueError(f"the bias must be {w.out_features} contiguous float32 values, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                 or residual.shape != (x.shape[0], w.out_features)):
        raise ValueError(f"the residual must be a contiguous float32 {(x.shape[0], w.out_features)} matrix, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if w.kind == "BF16":                  # bfloat16 in or out: its own entry point
        y = _bf16_io(x, w, bias, act, out_bf16, gated=False, residual=residual)
        if y is not None:
            return y
    x = _rows_of(x, w)
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32)
    if rows == 0:
        return y
    fn, args = w.call
    code = 0 if act is None else fused.ACTIVATIONS[act]
    in_kernel = not w.kind.endswith("_I8X2")
    if in_kernel and (bias is not None or residual is not None or code):
        ptr = lambda t: None if t is None else t.data_ptr()      # noqa: E731
        ok = _panel_gemm_act()(*args, x.data_ptr(), rows, y.data_ptr(), ptr(bias), ptr(residual), code)
    else:
        ok = fn(*args, x.data_ptr(), rows, y.data_ptr())
    if not ok:
        raise MemoryError(f"the native {w.kind} matmul could not allocate its buffer")
    if not in_kernel:
        if bias is not None:
            y.add_(bias)
        if residual is not None:
            y.add_(residual)
        if code:
            y = fused.activation(y, act)
    return y


@lru_cache(maxsize=2)
def _gated_gemm(name: str):
    return native.declare(name, [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                          + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)


@lru_cache(maxsize=1)
def _gated_act_gemm():
    return native.declare("panel_gated_act_gemm", [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
                          + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)


def gated_matmul(x: torch.Tensor, w: PanelWeight, act: str = "silu", out_bf16: bool = False) -> torch.Tensor | None:
    """act(x Wg^T) * (x Wu^T) (T, N / 2) for a gate|up weight W (N, K) = gate rows then up rows,
    in one pass that never stores the (T, N) product: bit for bit ``fused.gated_activation`` of
    ``matmul(x, w)``. None when this weight has no such kernel (N not a multiple of 64, or an
    int8 kernel with another activation than SiLU). ``out_bf16``: as ``matmul``'s."""
    int8 = w.kind.endswith("_I8X2")
    if w.out_features % (2 * NR) or (int8 and act != "silu"):
        return None
    y = _bf16_io(x, w, None, act, out_bf16, gated=True) if w.kind == "BF16" else None
    if y is not None:
        return y
    x = _rows_of(x, w)
    rows = x.shape[0]
    out = torch.empty(rows, w.out_features // 2, dtype=torch.float32)
    if rows:
        ok = (_gated_gemm("i8x2_gated_gemm")(*w.call[1], x.data_ptr(), rows, out.data_ptr()) if int8 else
              _gated_act_gemm()(fused.ACTIVATIONS[act], *w.call[1], x.data_ptr(), rows, out.data_ptr()))
        if not ok:
            raise MemoryError(f"the native {w.kind} matmul could not allocate its buffer")
    return out


# The product as a custom op for torch.compile (models/packed.py calls it while compiling; outside
# compiled code the ctypes call above is cheaper). Schema: the panels' tensors and their kind.
_LIB = torch.library.Library("troupe", "FRAGMENT")
_LIB.define("cpu_panel_matmul(Tensor x, Tensor codes, Tensor? d, Tensor? m, str kind, int out_features, "
            "int in_features) -> Tensor")


def _panel_matmul_op(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
                     kind: str, out_features: int, in_features: int) -> torch.Tensor:
    return matmul(x, PanelWeight(kind, out_features, in_features, codes, d, m))


def _panel_matmul_fake(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
                       kind: str, out_features: int, in_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


_LIB.impl("cpu_panel_matmul", _panel_matmul_op, "CPU")
torch.library.register_fake("troupe::cpu_panel_matmul", _panel_matmul_fake, lib=_LIB)
