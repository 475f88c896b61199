"""Writing new keys and values into the paged KV cache through ``slot_mapping`` (slot -1 is a
padding token and is skipped): the Triton kernel, its launcher and a torch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,             # (T, KVH, D)
    value_ptr,           # (T, KVH, D)
    cache_ptr,           # (2, num_blocks, block_size, KVH, D)
    slot_ptr,            # (T,) int64: block_id * block_size + offset, -1 = padding
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    block_size, num_kv_heads, head_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key/value for every slot >= 0.

    key, value: (T, KVH, D); kv_cache: (2, num_blocks, block_size, KVH, D), written in place;
    slot_mapping: (>= T,) int64 or int32, only its first T entries are read.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    T, KVH, D = key.shape
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=key.device)
    check_shape("value", value, (T, KVH, D))
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES, device=key.device)
    check_shape("kv_cache", kv_cache, (2, None, None, KVH, D))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=key.device)
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    if T == 0:
        return
    _store_kv_cache_kernel[(T,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2], KVH, D,
        BLOCK_H=next_power_of_2(KVH), BLOCK_D=next_power_of_2(D),
    )


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Token by token: the obvious loop the kernel must agree with."""
    block_size = kv_cache.shape[2]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot >= 0:
            kv_cache[0, slot // block_size, slot % block_size] = key[t]
            kv_cache[1, slot // block_size, slot % block_size] = value[t]
