"""Compile every Triton kernel for a CUDA target with Triton's real compiler, no GPU needed:
the launchers run on CPU tensors with the kernel launch intercepted, and each captured launch
becomes an ASTSource compiled to a cubin (ptxas ships with Triton). The interpreter never sees
the GPU code path (tl.dot in bfloat16, pipelined loops, register limits); this does.

Run as a script in a process where TRITON_INTERPRET is unset:
    python tests/kernels/compile_for_gpu.py [capability ...]      (default: 90)
The last line of output is one JSON object.
"""
from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_gpu.py needs TRITON_INTERPRET unset: the kernels must be JIT functions")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_launches: list[tuple[JITFunction, tuple, dict]] = []
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64"}


def _capture(self, *args, grid, warmup, **kwargs):
    _launches.append((self, args, kwargs))


def _exercise() -> None:
    """Call every launcher the way the backend and the model would."""
    import kernels.triton.paged_decode as pd
    import kernels.triton.paged_prefill as pp
    from kernels.attention import build_attention_metadata
    from kernels.triton.bitmask import apply_bitmask_
    from kernels.triton.kv_store import store_kv_cache
    from kernels.triton.rmsnorm import rms_norm
    from kernels.triton.rotary import rotary_embedding, rotary_embedding_rows
    from kernels.triton.sampling import sample
    from kernels.triton.silu_mul import silu_and_mul
    pd.dot_in_float32 = pp.dot_in_float32 = lambda dtype: False   # what the launchers pick on a GPU
    os.environ["TRITON_INTERPRET"] = "1"   # launchers now accept CPU tensors; kernels stay JIT functions
    meta = build_attention_metadata([5, 1], [35, 101], [list(range(3)), list(range(3, 10))], 16)
    # bf16 with Llama-8B heads and a window of 1 (an int Triton specialises to a constant);
    # fp32 (the "ieee" dot path) with GQA 3, head size 80 and a real window
    for dtype, (H, KVH, D), window in ((torch.bfloat16, (32, 8, 128), 1), (torch.float32, (12, 4, 80), 4096)):
        q, k = torch.randn(6, H, D, dtype=dtype), torch.randn(6, KVH, D, dtype=dtype)
        cache = torch.randn(2, 10, 16, KVH, D, dtype=dtype)
        store_kv_cache(k, k, cache, meta.slot_mapping)
        for splits in (1, 8):
            pd.paged_decode_attention(q[:2], cache, meta.block_table, meta.seq_lens, 0.1, window, splits)
        pp.paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, 5, 0.1, window)
    x = torch.randn(3, 4096, dtype=torch.bfloat16)
    rms_norm(x, torch.ones(4096, dtype=x.dtype), 1e-6, x)
    rms_norm(x, torch.ones(4096, dtype=x.dtype), 1e-6)
    rotary_embedding(torch.arange(6), torch.randn(6, 32, 128, dtype=x.dtype), torch.randn(6, 8, 128, dtype=x.dtype),
                     torch.randn(10, 128))
    qkv = torch.randn(6, 48 * 128, dtype=x.dtype)        # the layers' way: views of qkv, (T, 1, D) rows
    rotary_embedding_rows(qkv[:, :32 * 128].view(6, 32, 128), qkv[:, 32 * 128:40 * 128].view(6, 8, 128),
                          torch.randn(6, 1, 128, dtype=x.dtype), torch.randn(6, 1, 128, dtype=x.dtype))
    silu_and_mul(torch.randn(3, 2 * 11008, dtype=x.dtype))
    sample(torch.randn(2, 32000), torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
           torch.ones(2, 32000))
    apply_bitmask_(torch.randn(2, 32000), torch.zeros(2, 1000, dtype=torch.int32))


def _source(fn: JITFunction, args: tuple, kwargs: dict) -> ASTSource:
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param, name in zip(fn.params, fn.arg_names):
        v = values[name]
        # Triton's launcher specialises int arguments equal to 1 into constants; mimic that
        if param.is_constexpr or (type(v) is int and v == 1):
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TYPES[v.dtype]
        elif type(v) is int:
            signature[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    return ASTSource(fn, signature, constexprs)


def main(capabilities: list[int]) -> int:
    JITFunction.run = _capture
    _exercise()
    compiled, seen = [], set()
    for fn, args, kwargs in _launches:
        src = _source(fn, args, kwargs)
        key = src.hash()
        if key in seen:
            continue
        seen.add(key)
        for cap in capabilities:
            kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32))
            compiled.append({"kernel": fn.__name__, "sm": cap, "shared_bytes": kernel.metadata.shared})
    print(json.dumps({"compiled": len(compiled), "kernels": sorted({c["kernel"] for c in compiled}),
                      "max_shared_bytes": max(c["shared_bytes"] for c in compiled)}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main([int(c) for c in sys.argv[1:]] or [90]))
