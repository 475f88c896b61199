"""The CPU attention backend (pure torch over the paged KV cache)."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention.cpu_torch import attend, causal_self_attention, chunk_attention, gather_context
from kernels.attention.reference import reference_paged_attention

__all__ = ["CpuAttentionBackend", "causal_prefill", "write_kv_cache", "reference_paged_attention"]

_causal_self_attention = causal_self_attention  # its name before cpu_torch.py: tests import it from here


class CpuAttentionBackend(AttentionBackend):
    """Gathers each request's K/V through the block table and runs SDPA on (request, kv head)
    batches, with the query heads of one KV group stacked along the query axis, so grouped-query
    attention never repeats K/V.

    Pure decode in float32 reads the cache in place with the native kernel of kernels/cpu
    (no gather copy; a float16 or bfloat16 cache, ``--kv-cache-dtype``, is widened as it is
    read, halving the bytes a long context costs); otherwise it is one batched call. Fresh
    prompts (a first chunk with no cached context) in float32 are attended all together by one
    native causal flash-attention call reading the step's q/k/v in place (``causal_prefill``),
    and chunks after cached context by another, on their keys gathered from the cache
    (``_chunks_after_context``); without the native kernels, per request by SDPA. Mixed batches
    on the torch path are two batched calls, decode rows (one query) and prefill rows (padded to
    their longest query), so one long chunk does not pad every decode.
    With a sliding window only the blocks a request's queries can see are gathered.
    """

    name = "cpu"
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supports_sliding_window = True

    def __init__(self, native: bool = True) -> None:
        self.native = native      # decode through kernels/cpu's in-place paged attention

    def _native_decode(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        if (not self.native or query.dtype != torch.float32
                or kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
            return False
        from kernels.cpu.native import available
        self.native = available()[0]
        return self.native

    def _native_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        if not self.native or not query.dtype == key.dtype == value.dtype == torch.float32:
            return False
        from kernels.cpu.native import available
        self.native = available()[0]
        return self.native

    def forward(
        self,
        query: torch.Tensor,     # (T, H, D)
        key: torch.Tensor,       # (T, KVH, D)
        value: torch.Tensor,     # (T, KVH, D)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:           # (T, H, D); rows of padding tokens are zero
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        B, T = meta.num_reqs, query.shape[0]
        seq_lens = meta.seq_lens[:B].long()
        block_table = meta.block_table[:B]
        if meta.is_pure_decode and T == B:  # no padding: request i owns token i
            if self._native_decode(query, kv_cache):
                from kernels.cpu.native import paged_decode
                return paged_decode(query, kv_cache, block_table, meta.seq_lens[:B], scale, sliding_window)
            starts = torch.arange(B)
            return attend(query, kv_cache, block_table, seq_lens, starts, torch.ones_like(starts),
                           1, scale, sliding_window)[0]
        out = query.new_zeros(query.shape)
        qsl = meta.query_start_loc[:B + 1].long()
        starts, query_lens = qsl[:-1], qsl[1:] - qsl[:-1]  # (B,) each
        is_decode = query_lens == 1
        # A prompt's first chunk attends only to its own keys, which are the step's k/v: causal
        # attention on them directly, without reading the cache (and skipping the masked half).
        fresh = (query_lens == seq_lens) & ~is_decode if sliding_window is None else is_decode & False
        decode_idx = is_decode.nonzero().squeeze(1)
        if decode_idx.numel():
            tokens = starts[decode_idx]
            if self._native_decode(query, kv_cache):
                from kernels.cpu.native import paged_decode
                out[tokens] = paged_decode(query[tokens], kv_cache, block_table[decode_idx],
                                           seq_lens[decode_idx], scale, sliding_window)
            else:
                o, _ = attend(query, kv_cache, block_table[decode_idx], seq_lens[decode_idx], tokens,
                               query_lens[decode_idx], 1, scale, sliding_window)
                out[tokens] = o
        fresh_idx = fresh.nonzero().squeeze(1)
        if fresh_idx.numel() and not (self._native_prefill(query, key, value)
                                      and causal_prefill(query, key, value, out, starts[fresh_idx],
                                                         query_lens[fresh_idx], scale)):
            for i in fresh_idx.tolist():
                a, b = int(starts[i]), int(starts[i] + query_lens[i])
                out[a:b] = causal_self_attention(query[a:b], key[a:b], value[a:b], scale)
        rest = (~is_decode & ~fresh).nonzero().squeeze(1)  # chunks after cached context
        if sliding_window is None and rest.numel() and self._native_prefill(query, key, value):
            if _chunks_after_context(query, kv_cache, block_table[rest], seq_lens[rest], starts[rest],
                                     query_lens[rest], out, scale):
                rest = rest[:0]
        if sliding_window is None:
            for i in rest.tolist():
                a, n = int(starts[i]), int(query_lens[i])
                k_ctx, v_ctx = gather_context(kv_cache, block_table[i], int(seq_lens[i]) - n)
                out[a:a + n] = chunk_attention(query[a:a + n], key[a:a + n], value[a:a + n],
                                                k_ctx.to(query.dtype), v_ctx.to(query.dtype), scale)
            rest = rest[:0]
        if rest.numel():
            o, tokens = attend(query, kv_cache, block_table[rest], seq_lens[rest], starts[rest],
                                query_lens[rest], meta.max_query_len, scale, sliding_window)
            out[tokens] = o
        return out


def causal_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                   starts: torch.Tensor, lens: torch.Tensor, scale: float,
                   kstarts: torch.Tensor | None = None, ctx: torch.Tensor | None = None) -> bool:
    """Causal attention of prompt chunks in one native call (causal_prefill_f32 of
    kernels/cpu/paged_attention.c). Request i's queries are the rows starts[i] .. starts[i] +
    lens[i] of query (T, H, D); its keys and values the rows kstarts[i] .. kstarts[i] + ctx[i] +
    lens[i] of key, value (S, KVH, D): ctx[i] of cached context, then the chunk's own (without
    ``kstarts``/``ctx``: fresh prompts whose keys are the query's rows). All float32 with unit
    stride along D (strided rows and heads, e.g. views into a fused qkv, are read in place); the
    requests' rows of out (T, H, D) are written. False, with nothing written, when the kernel
    cannot take these tensors (the caller falls back to torch)."""
    T, H, D = query.shape
    KVH = key.shape[1]
    tensors = (query, key, value, out)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(2) != 1 for t in tensors)
            or key.shape != value.shape or (kstarts is None and key.shape[0] != T) or key.shape[2] != D
            or out.shape != query.shape or KVH < 1 or H % KVH):
        return False
    from kernels.cpu.native import declare
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = declare("causal_prefill_f32", [ptr] * 8 + [i64] * 12 + [ctypes.c_float], i64)
    st = starts.to(torch.int64).contiguous()
    ks = st if kstarts is None else kstarts.to(torch.int64).contiguous()
    ln = lens.to(torch.int64).contiguous()
    cx = torch.zeros_like(st) if ctx is None else ctx.to(torch.int64).contiguous()
    return fn(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), st.data_ptr(), ks.data_ptr(),
              ln.data_ptr(), cx.data_ptr(), st.numel(), H, KVH, D, query.stride(0), query.stride(1),
              key.stride(0), key.stride(1), value.stride(0), value.stride(1), out.stride(0), out.stride(1),
              scale) == 0


def _chunks_after_context(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
                          out: torch.Tensor, scale: float) -> bool:
    """Prompt chunks after cached context (b requests, their queries query[starts[i] :
    starts[i] + query_lens[i]], the last of seq_lens[i] positions) through the native kernel:
    every position's keys and values, the chunk's own included (written before), gathered from
    the cache in one pass as float32, then one causal_prefill call. False when it cannot."""
    _, num_blocks, bs, KVH, D = kv_cache.shape
    total = int(seq_lens.sum())
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)          # (total,)
    kstarts = torch.cumsum(seq_lens, 0) - seq_lens                                 # (b,)
    pos = torch.arange(total) - kstarts[req]
    slots = block_table[req, pos // bs].long() * bs + pos % bs
    flat = kv_cache.view(2, num_blocks * bs, KVH, D)
    k = flat[0].index_select(0, slots).to(torch.float32)
    v = flat[1].index_select(0, slots).to(torch.float32)
    return causal_prefill(query, k, v, out, starts, query_lens, scale, kstarts, seq_lens - query_lens)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key/value for every slot >= 0."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous to be written through slot_mapping")
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping[: key.shape[0]]
    if _kv_store_native(key, value, kv_cache, slots):
        return
    if bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


@lru_cache(maxsize=1)
def _kv_store_kernel():
    from kernels.cpu import native
    if not native.available()[0]:
        return None
    return native.declare("kv_store", [ctypes.c_void_p, ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3, ctypes.c_int64)


def _kv_store_native(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     slots: torch.Tensor) -> bool:
    """write_kv_cache through kernels/cpu (one pass, no masks or syncs) when the layouts allow;
    False when they do not (nothing written)."""
    from kernels.cpu.native import KV_TYPES
    D = kv_cache.shape[-1]
    if not (key.dtype == value.dtype == torch.float32 and kv_cache.dtype in KV_TYPES and kv_cache.is_cpu
            and slots.dtype == torch.int64 and slots.is_contiguous() and key.dim() == 3
            and key.stride(2) == value.stride(2) == 1 and key.stride(1) == value.stride(1) == D):
        return False
    fn = _kv_store_kernel()
    if fn is None:
        return False
    _, num_blocks, block_size, kvh, _ = kv_cache.shape
    bad = fn(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(),
             key.shape[0], kv_cache.data_ptr(), KV_TYPES[kv_cache.dtype], num_blocks * block_size, kvh * D)
    if bad >= 0:
        raise IndexError(f"slot {int(slots[bad])} of token {bad} is past the KV cache's "
                         f"{num_blocks * block_size} slots")
    return True
