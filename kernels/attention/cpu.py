"""The CPU attention backend (pure torch over the paged KV cache)."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention.reference import reference_paged_attention

__all__ = ["CpuAttentionBackend", "causal_prefill", "write_kv_cache", "reference_paged_attention"]


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
            return _attend(query, kv_cache, block_table, seq_lens, starts, torch.ones_like(starts),
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
                o, _ = _attend(query, kv_cache, block_table[decode_idx], seq_lens[decode_idx], tokens,
                               query_lens[decode_idx], 1, scale, sliding_window)
                out[tokens] = o
        fresh_idx = fresh.nonzero().squeeze(1)
        if fresh_idx.numel() and not (self._native_prefill(query, key, value)
                                      and causal_prefill(query, key, value, out, starts[fresh_idx],
                                                         query_lens[fresh_idx], scale)):
            for i in fresh_idx.tolist():
                a, b = int(starts[i]), int(starts[i] + query_lens[i])
                out[a:b] = _causal_self_attention(query[a:b], key[a:b], value[a:b], scale)
        rest = (~is_decode & ~fresh).nonzero().squeeze(1)  # chunks after cached context
        if sliding_window is None and rest.numel() and self._native_prefill(query, key, value):
            if _chunks_after_context(query, kv_cache, block_table[rest], seq_lens[rest], starts[rest],
                                     query_lens[rest], out, scale):
                rest = rest[:0]
        if sliding_window is None:
            for i in rest.tolist():
                a, n = int(starts[i]), int(query_lens[i])
                k_ctx, v_ctx = _gather_context(kv_cache, block_table[i], int(seq_lens[i]) - n)
                out[a:a + n] = _chunk_attention(query[a:a + n], key[a:a + n], value[a:a + n],
                                                k_ctx.to(query.dtype), v_ctx.to(query.dtype), scale)
            rest = rest[:0]
        if rest.numel():
            o, tokens = _attend(query, kv_cache, block_table[rest], seq_lens[rest], starts[rest],
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


def _causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q (L, H, D), k and v (L, KVH, D) of one request with no earlier context -> (L, H, D)."""
    L, H, D = q.shape
    KVH = k.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0)                                    # (1, H, L, D)
    k4 = k.transpose(0, 1).repeat_interleave(H // KVH, dim=0).unsqueeze(0)  # (1, H, L, D)
    v4 = v.transpose(0, 1).repeat_interleave(H // KVH, dim=0).unsqueeze(0)
    o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    return o[0].transpose(0, 1)                                             # (L, H, D)


def _gather_context(kv_cache: torch.Tensor, blocks: torch.Tensor,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached keys and values (length, KVH, D) of one request's first ``length`` positions."""
    _, num_blocks, block_size, KVH, D = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, KVH, D)
    pos = torch.arange(length)
    slots = blocks[pos // block_size].long() * block_size + pos % block_size
    return flat[0].index_select(0, slots), flat[1].index_select(0, slots)  # in the cache's dtype


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ctx: torch.Tensor,
                     v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk after cached context: q (L, H, D), its own k/v (L, KVH, D), the context's
    (C, KVH, D) -> (L, H, D). Every query sees the whole context and, causally, the chunk; the
    two softmaxes are computed apart (no mask to build, the chunk's masked half skipped) and
    merged by their log-sum-exps."""
    H, KVH = q.shape[1], k.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0)                                    # (1, H, L, D)

    def heads(t: torch.Tensor) -> torch.Tensor:                            # (N, KVH, D) -> (1, H, N, D)
        return t.transpose(0, 1).repeat_interleave(H // KVH, dim=0).unsqueeze(0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q4, heads(k_ctx), heads(v_ctx), 0.0, False, scale=scale)
    o2, lse2 = flash(q4, heads(k), heads(v), 0.0, True, scale=scale)
    m = torch.maximum(lse1, lse2)                                          # (1, H, L)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    o = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
    return o[0].transpose(0, 1)                                             # (L, H, D)


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


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            starts: torch.Tensor, query_lens: torch.Tensor, max_query_len: int, scale: float,
            sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for b requests whose queries are query[starts[i] : starts[i] + query_lens[i]],
    the last query_lens[i] of their seq_lens[i] tokens. Returns (outputs (n, H, D), their token
    indices (n,)), n = sum(query_lens).

    Keys are gathered from a window of nb blocks per request starting at first_block[i]: block 0
    without a sliding window; with one, the block of the oldest key the first query can see, so
    a decode reads about W / block_size blocks however long its context:

        positions  0 ........................ seq_len
        blocks     | 0 | 1 | 2 | 3 | 4 | 5 | 6 |
                           ^first_block    ^ queries (p - W < k <= p)
    """
    _, _, block_size, KVH, D = kv_cache.shape
    b, Q, H = block_table.shape[0], max_query_len, query.shape[1]
    G = H // KVH

    # 1) queries padded to Q per request, heads of a KV group stacked: (b, KVH, G*Q, D)
    j = torch.arange(Q)
    valid = j < query_lens[:, None]                                      # (b, Q)
    tokens = (starts[:, None] + j).masked_fill(~valid, 0)                # (b, Q)
    q = query[tokens].view(b, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(b, KVH, G * Q, D)

    # 2) keys/values of blocks first_block[i] .. + nb through the block table: (b, KVH, L, D)
    first_pos = seq_lens - query_lens                                    # (b,) position of the first query
    if sliding_window is None:
        first_block = torch.zeros_like(seq_lens)
    else:
        first_block = (first_pos - sliding_window + 1).clamp(min=0) // block_size
    nb = int(((seq_lens - 1) // block_size - first_block).max()) + 1
    L = nb * block_size
    block_idx = (first_block[:, None] + torch.arange(nb)).clamp(max=block_table.shape[1] - 1)  # (b, nb)
    blocks = block_table.gather(1, block_idx).reshape(-1).long()          # (b * nb,)
    kv = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)  # (2, b * nb, bs * KVH * D)
    k, v = kv.to(query.dtype).view(2, b, L, KVH, D).transpose(2, 3).unbind(0)  # (b, KVH, L, D) each

    # 3) causal (and window) mask at absolute positions; padded queries take the last position
    pos = torch.minimum(first_pos[:, None] + j, seq_lens[:, None] - 1)   # (b, Q)
    key_pos = first_block[:, None] * block_size + torch.arange(L)        # (b, L)
    mask = key_pos[:, None, :] <= pos[:, :, None]                        # (b, Q, L)
    if sliding_window is not None:
        mask &= key_pos[:, None, :] > pos[:, :, None] - sliding_window
    mask = mask[:, None].expand(b, G, Q, L).reshape(b, 1, G * Q, L)

    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (b, KVH, G*Q, D)
    o = o.view(b, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(b, Q, H, D)
    return o[valid], tokens[valid]

