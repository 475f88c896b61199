"""Writing new keys and values into the paged KV cache through ``slot_mapping`` (slot -1 is a
padding token and is skipped): the Triton kernel, its launcher and a torch reference. An fp8
cache stores fp8(key / k_scale), fp8(value / v_scale), rounded in the kernel (kernels/triton/fp8.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.fp8 import is_fp8, quantize_kv
from kernels.triton import FLOAT_DTYPES, KV_CACHE_DTYPES, check_shape, check_tensor, kv_scale_args, next_power_of_2
from kernels.triton.fp8 import float_to_fp8, fp8_format


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,             # (T, KVH, D)
    value_ptr,           # (T, KVH, D)
    cache_ptr,           # (2, num_blocks, block_size, KVH, D); uint8 bytes of an fp8 cache
    slot_ptr,            # (T,) int64: block_id * block_size + offset, -1 = padding
    k_scale_ptr,         # () float32, read when FP8
    v_scale_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    block_size, num_kv_heads, head_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)   # one program per token
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_size)
    if slot >= 0:
        block, offset = slot // block_size, slot % block_size
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = cache_ptr + block * stride_c_block + offset * stride_c_slot + h * stride_c_head + d
        if FP8:
            k_out = float_to_fp8(k.to(tl.float32) / tl.load(k_scale_ptr), FP8)
            v_out = float_to_fp8(v.to(tl.float32) / tl.load(v_scale_ptr), FP8)
        else:
            k_out = k.to(cache_ptr.dtype.element_ty)
            v_out = v.to(cache_ptr.dtype.element_ty)
        tl.store(dst, k_out, mask=mask)
        tl.store(dst + stride_c_kv, v_out, mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key/value for every slot >= 0.

    key, value: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D), written in place;
    slot_mapping: (>= T,) int64 or int32, only its first T entries are read. For an fp8 cache
    (float8_e4m3fn / float8_e5m2), k_scale / v_scale: () float32 on the cache's device (None: 1).
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    T, KVH, D = key.shape
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=key.device)
    check_shape("value", value, (T, KVH, D))
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_CACHE_DTYPES, device=key.device)
    check_shape("kv_cache", kv_cache, (2, None, None, KVH, D))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=key.device)
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    if T == 0:
        return
    fmt = fp8_format(kv_cache.dtype)
    cache = kv_cache.view(torch.uint8) if fmt else kv_cache
    k_scale, v_scale = kv_scale_args(kv_cache, k_scale, v_scale)
    _store_kv_cache_kernel[(T,)](
        key, value, cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        kv_cache.shape[2], KVH, D,
        BLOCK_H=next_power_of_2(KVH), BLOCK_D=next_power_of_2(D), FP8=fmt,
    )


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Token by token: the obvious loop the kernel must agree with (quantize_kv for fp8)."""
    block_size = kv_cache.shape[2]
    fp8 = is_fp8(kv_cache.dtype)
    store = kv_cache.view(torch.uint8) if fp8 else kv_cache
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot >= 0:
            for i, (x, s) in enumerate(((key[t], k_scale), (value[t], v_scale))):
                q = quantize_kv(x, kv_cache.dtype, s)
                store[i, slot // block_size, slot % block_size] = q.view(torch.uint8) if fp8 else q
