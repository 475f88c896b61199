"""The CPU attention backend: each step's requests routed to kernels/cpu's native kernels, or to torch."""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import NamedTuple

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention.cascade import gather_prefix, merge_attn_states, prefix_attention, suffix_view
from kernels.attention.cpu_torch import attend, causal_self_attention, chunk_attention, gather_context
from kernels.attention.fp8 import dequantize_kv, is_fp8, quantize_kv, store_rows_
from kernels.cpu.native import KV_TYPES, available, declare, paged_decode, ptr, scale_tensor

__all__ = ["CpuAttentionBackend", "causal_prefill", "write_kv_cache"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU. A step's requests take one of three paths, native when the
    kernels run here and take the tensors (float32 queries; float32 keys too for the prompts):

        decode (one query)          native: paged_decode reads the cache in place (a float16,
                                    bfloat16 or fp8 cache, ``--kv-cache-dtype``, widened as it is read)
                                    torch:  one batched ``attend``
        fresh prompt (first chunk,  native: one causal_prefill call for all, on the step's q/k/v
          no cached context)        torch:  SDPA per request
        chunk after cached context  native: one causal_prefill call on keys gathered from the cache
                                    (kv_gather: widened, fp8 dequantized, in one pass)
                                    torch:  SDPA per request, context and chunk merged by LSE

    An fp8 cache (float8_e4m3fn / float8_e5m2) stores fp8(k / k_scale), fp8(v / v_scale) and is
    read as fp8 * scale on every path (kernels/attention/fp8.py); k_scale / v_scale are the
    layer's float32 scalars (None: 1.0), ignored for the other cache dtypes.

    With a sliding window every prompt chunk takes one batched ``attend`` instead, the path that
    masks a window, gathering only the blocks its queries can see. Decode rows are attended
    apart from prompt rows, so one long chunk does not pad every decode.

    Cascade (``meta.common_prefix_len`` P > 0, no sliding window): the prefix's K/V gathered
    once (fp8 dequantized) and every query of the step attended against it in one flash call per
    layer (a GEMM per KV head); each request's positions P.. attended as above with their
    log-sum-exps (native decode and chunk kernels, or one batched ``attend``); the two merged.

    Sinks (gpt-oss): every row attended with its log-sum-exp as cascade's suffix is (prompt
    chunks with a sliding window through ``attend``), then scaled by its sink's share (_sunk).
    """

    name = "cpu"
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    supports_sliding_window = True
    supports_logits_soft_cap = True     # decodes natively (capped), prompts in one batched ``attend`` (_capped)
    supports_sinks = True               # every row with its log-sum-exp, then scaled (_sunk)
    supports_alibi = True               # decodes and prompts through ``attend`` (_alibi)
    supports_cascade = True
    # Measured (python -m tools.bench cascade, 64 decodes): below ~1k shared tokens the native decode
    # kernel, re-reading a short prefix from the CPU's caches, beats cascade's extra passes.
    cascade_min_prefix = 1024

    def __init__(self, native: bool = True) -> None:
        # Decided once: the native kernels are used when asked for and they run on this CPU.
        # K/V are written through the native kv_store whenever it runs here, whatever this says.
        self.native = native and available()[0]

    def forward(
        self,
        query: torch.Tensor,     # (T, H, D)
        key: torch.Tensor,       # (T, KVH, D)
        value: torch.Tensor,     # (T, KVH, D)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D)
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,   # () float32, fp8 caches only
        v_scale: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,     # (H,)
        alibi_slopes: torch.Tensor | None = None,   # (H,)
    ) -> torch.Tensor:           # (T, H, D); rows of padding tokens are zero
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        scales = _Scales(k_scale, v_scale)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        B = meta.num_reqs
        if alibi_slopes is not None:
            return self._alibi(query, kv_cache, meta, scale, sliding_window, scales, alibi_slopes)
        if sinks is not None:
            return self._sunk(query, kv_cache, meta, scale, sliding_window, scales, logits_soft_cap, sinks)
        if logits_soft_cap:
            return self._capped(query, kv_cache, meta, scale, sliding_window, scales, logits_soft_cap)
        if meta.common_prefix_len > 0 and sliding_window is None:
            return self._cascade(query, kv_cache, meta, scale, scales)
        if meta.is_pure_decode and query.shape[0] == B:  # no padding: request i owns token i
            return self._decode(query, kv_cache, meta.block_table[:B], meta.seq_lens[:B], scale, sliding_window,
                                scales)
        out = query.new_zeros(query.shape)                # (T, H, D); padding rows stay zero
        reqs = _Requests.of(meta)
        split = reqs.split(sliding_window)
        if split.decode.numel():
            tokens = reqs.starts[split.decode]            # (d,)
            out[tokens] = self._decode(query[tokens], kv_cache, reqs.block_table[split.decode],
                                       reqs.seq_lens[split.decode], scale, sliding_window, scales)
        if split.fresh.numel():
            self._fresh_prompts(query, key, value, out, reqs.starts[split.fresh], reqs.query_lens[split.fresh],
                                scale)
        if split.chunks.numel():
            self._chunks(query, key, value, kv_cache, out, reqs.take(split.chunks), meta.max_query_len, scale,
                         sliding_window, scales)
        return out

    def _capped(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, scales: _Scales, cap: float) -> torch.Tensor:
        """Gemma 2's capped scores: decodes through the native decode kernel (its portable tile
        caps), every prompt chunk in one batched ``attend`` (the prefill kernels do not cap)."""
        out = query.new_zeros(query.shape)
        reqs = _Requests.of(meta)
        rows = torch.arange(meta.num_reqs)
        if self._native_takes_decode(query, kv_cache):
            is_decode = reqs.query_lens == 1
            decode, rows = is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)
            if decode.numel():
                tokens = reqs.starts[decode]
                out[tokens] = paged_decode(query[tokens], kv_cache, reqs.block_table[decode], reqs.seq_lens[decode],
                                           scale, sliding_window, *scales, logits_soft_cap=cap)
        if rows.numel():
            r = reqs.take(rows)
            o, tokens = attend(query, kv_cache, r.block_table, r.seq_lens, r.starts, r.query_lens,
                               int(r.query_lens.max()), scale, sliding_window, *scales, logits_soft_cap=cap)
            out[tokens] = o
        return out

    def _alibi(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, scales: _Scales, slopes: torch.Tensor) -> torch.Tensor:
        """ALiBi (BLOOM, MPT): the decodes in one batched ``attend``, the prompt chunks in another
        (the native kernels add no biases)."""
        out = query.new_zeros(query.shape)
        reqs = _Requests.of(meta)
        is_decode = reqs.query_lens == 1
        for rows in (is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)):
            if rows.numel():
                r = reqs.take(rows)
                o, tokens = attend(query, kv_cache, r.block_table, r.seq_lens, r.starts, r.query_lens,
                                   int(r.query_lens.max()), scale, sliding_window, *scales, alibi_slopes=slopes)
                out[tokens] = o
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, sliding_window: int | None, scales: _Scales) -> torch.Tensor:
        """One query per request, request i's in row i: query (b, H, D) -> (b, H, D)."""
        if self._native_takes_decode(query, kv_cache):
            return paged_decode(query, kv_cache, block_table, seq_lens, scale, sliding_window, *scales)
        rows = torch.arange(query.shape[0])              # (b,)
        return attend(query, kv_cache, block_table, seq_lens.long(), rows, torch.ones_like(rows), 1, scale,
                      sliding_window, *scales)[0]

    def _fresh_prompts(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                       starts: torch.Tensor, query_lens: torch.Tensor, scale: float) -> None:
        """Writes out's rows of prompts' first chunks with no cached context: their keys are the
        step's own k/v, so the cache is not read and the causally masked half is skipped."""
        if self._native_takes_prefill(query, key, value) and causal_prefill(query, key, value, out, starts,
                                                                            query_lens, scale):
            return
        for a, n in zip(starts.tolist(), query_lens.tolist()):
            out[a:a + n] = causal_self_attention(query[a:a + n], key[a:a + n], value[a:a + n], scale)

    def _chunks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                out: torch.Tensor, reqs: _Requests, max_query_len: int, scale: float,
                sliding_window: int | None, scales: _Scales) -> None:
        """Writes out's rows of prompt chunks after cached context (of every prompt chunk, with a
        sliding window); a chunk's own keys are already in the cache."""
        if sliding_window is not None:                   # the one path that masks a window
            o, tokens = attend(query, kv_cache, reqs.block_table, reqs.seq_lens, reqs.starts, reqs.query_lens,
                               max_query_len, scale, sliding_window, *scales)
            out[tokens] = o
            return
        if self._native_takes_prefill(query, key, value) and _native_chunks(query, kv_cache, reqs, out, scale,
                                                                            scales):
            return
        for a, n, seq_len, blocks in zip(reqs.starts.tolist(), reqs.query_lens.tolist(), reqs.seq_lens.tolist(),
                                         reqs.block_table):
            k_ctx, v_ctx = gather_context(kv_cache, blocks, seq_len - n)   # (seq_len - n, KVH, D) each
            k, v = key[a:a + n], value[a:a + n]
            if is_fp8(kv_cache.dtype):     # the chunk's own keys as the cache holds them, as natively
                k = dequantize_kv(quantize_kv(k, kv_cache.dtype, scales.k), scales.k, query.dtype)
                v = dequantize_kv(quantize_kv(v, kv_cache.dtype, scales.v), scales.v, query.dtype)
            out[a:a + n] = chunk_attention(query[a:a + n], k, v, dequantize_kv(k_ctx, scales.k, query.dtype),
                                           dequantize_kv(v_ctx, scales.v, query.dtype), scale)

    def _cascade(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 scales: _Scales) -> torch.Tensor:
        """Attention over the shared prefix for all queries at once, over each request's suffix
        apart, merged by log-sum-exp."""
        N = int(meta.query_start_loc[meta.num_reqs])          # tokens past N are padding
        k, v = gather_prefix(kv_cache, meta, query.dtype, *scales)               # (P, KVH, D) each
        p_out, p_lse = prefix_attention(query[:N], k, v, scale)                  # (N, H, D), (N, H)
        s_out, s_lse = self._suffix(query[:N], kv_cache, meta, scale, scales)    # (N, H, D), (N, H)
        out = query.new_zeros(query.shape)                                       # (T, H, D)
        merge_attn_states(p_out, p_lse, s_out, s_lse, out=out[:N])
        return out

    def _suffix(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                scales: _Scales) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the step's N queries over their requests' positions past the
        prefix: (out (N, H, D), lse (N, H) float32)."""
        sv = suffix_view(meta)
        qsl = meta.query_start_loc[:meta.num_reqs + 1].long()
        reqs = _Requests(qsl[:-1], qsl[1:] - qsl[:-1], sv.seq_lens.long(), sv.block_table)
        return self._with_lse(query, kv_cache, reqs, scale, None, scales)

    def _sunk(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              sliding_window: int | None, scales: _Scales, cap: float | None, sinks: torch.Tensor) -> torch.Tensor:
        """Attention with sinks (gpt-oss): each row's output and log-sum-exp L, the output then
        scaled by e^L / (e^L + e^S) = sigmoid(L - S), S its head's sink: the same as a softmax
        with the sink as one more score whose value is zero."""
        N = int(meta.query_start_loc[meta.num_reqs])          # tokens past N are padding
        o, lse = self._with_lse(query[:N], kv_cache, _Requests.of(meta), scale, sliding_window, scales, cap)
        out = query.new_zeros(query.shape)
        torch.mul(o, torch.sigmoid(lse - sinks.float())[:, :, None].to(o.dtype), out=out[:N])
        return out

    def _with_lse(self, query: torch.Tensor, kv_cache: torch.Tensor, reqs: _Requests, scale: float,
                  sliding_window: int | None, scales: _Scales, cap: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of requests ``reqs`` (their N = sum(query_lens) queries, the step's
        rows 0..N-1) with each row's log-sum-exp: (out (N, H, D), lse (N, H) float32). Decodes
        natively, prompt chunks natively when no window or cap asks for the torch path."""
        N, H, _ = query.shape
        out, lse = torch.empty_like(query), torch.empty(N, H)
        rest = torch.arange(len(reqs.starts))                 # requests left to the torch path
        if self._native_takes_decode(query, kv_cache):
            is_decode = reqs.query_lens == 1
            decode, rest = is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)
            if decode.numel():
                tokens = reqs.starts[decode]                                    # (d,)
                d_lse = torch.empty(len(tokens), H)
                out[tokens] = paged_decode(query[tokens], kv_cache, reqs.block_table[decode],
                                           reqs.seq_lens[decode], scale, sliding_window, *scales, lse=d_lse,
                                           logits_soft_cap=cap)
                lse[tokens] = d_lse
            if (rest.numel() and sliding_window is None and not cap
                    and _native_chunks(query, kv_cache, reqs.take(rest), out, scale, scales, lse)):
                return out, lse
        if rest.numel():
            r = reqs.take(rest)
            o, tokens, r_lse = attend(query, kv_cache, r.block_table, r.seq_lens, r.starts, r.query_lens,
                                      int(r.query_lens.max()), scale, sliding_window, *scales, with_lse=True,
                                      logits_soft_cap=cap)
            out[tokens], lse[tokens] = o, r_lse
        return out, lse

    def _native_takes_decode(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        # (at most 64 heads of 256 dimensions: DeepSeek's latent rows, 576 wide, take the torch path)
        return (self.native and query.dtype == torch.float32 and kv_cache.dtype in KV_TYPES
                and query.shape[1] <= 64 and query.shape[2] <= 256)

    def _native_takes_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        return self.native and query.dtype == key.dtype == value.dtype == torch.float32


class _Scales(NamedTuple):
    """A layer's KV scales, passed along to the paths that read the cache."""
    k: torch.Tensor | None
    v: torch.Tensor | None


class _Split(NamedTuple):
    """A step's requests by path, as indices into its (B,) per-request rows."""
    decode: torch.Tensor   # (d,) one query
    fresh: torch.Tensor    # (f,) a prompt's first chunk, no cached context; none with a sliding window
    chunks: torch.Tensor   # (c,) every other prompt chunk


class _Requests(NamedTuple):
    """Per-request rows of a step (or of some of its requests)."""
    starts: torch.Tensor       # (b,) int64, the first of the request's tokens in the step
    query_lens: torch.Tensor   # (b,) int64
    seq_lens: torch.Tensor     # (b,) int64, cached context + query_lens
    block_table: torch.Tensor  # (b, max_blocks) int32

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _Requests:
        B = meta.num_reqs
        qsl = meta.query_start_loc[:B + 1].long()        # (B + 1,)
        return cls(qsl[:-1], qsl[1:] - qsl[:-1], meta.seq_lens[:B].long(), meta.block_table[:B])

    def take(self, idx: torch.Tensor) -> _Requests:
        return _Requests(self.starts[idx], self.query_lens[idx], self.seq_lens[idx], self.block_table[idx])

    def split(self, sliding_window: int | None) -> _Split:
        is_decode = self.query_lens == 1
        if sliding_window is None:
            is_fresh = (self.query_lens == self.seq_lens) & ~is_decode
        else:
            is_fresh = torch.zeros_like(is_decode)
        return _Split(is_decode.nonzero().squeeze(1), is_fresh.nonzero().squeeze(1),
                      (~is_decode & ~is_fresh).nonzero().squeeze(1))


def causal_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                   starts: torch.Tensor, lens: torch.Tensor, scale: float,
                   kstarts: torch.Tensor | None = None, ctx: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None, bidirectional: bool = False, window: int | None = None,
                   bfloat16: bool = False) -> bool:
    """Causal attention of prompt chunks in one native call (causal_prefill_f32 of
    kernels/cpu/paged_attention.c). Request i's queries are the rows starts[i] .. starts[i] +
    lens[i] of query (T, H, D); its keys and values the rows kstarts[i] .. kstarts[i] + ctx[i] +
    lens[i] of key, value (S, KVH, D): ctx[i] of cached context, then the chunk's own (without
    ``kstarts``/``ctx``: fresh prompts whose keys are the query's rows). All float32 with unit
    stride along D (strided rows and heads, e.g. views into a fused qkv, are read in place); the
    requests' rows of out (T, H, D) are written, and of ``lse`` (T, H) float32 with unit stride
    along H when given: each row's log-sum-exp of its scaled scores. False, with nothing
    written, when the kernel cannot take these tensors (the caller falls back to torch).
    ``bidirectional``: each query sees its whole prompt (an encoder's; fresh prompts only), or with
    ``window`` W the keys fewer than W positions from it on either side. ``bfloat16``: queries, keys,
    values and probabilities rounded to bfloat16 and multiplied with AVX512-BF16 dot products
    (float32 sums and softmax), where the CPU has them and D is a multiple of 32; float32 otherwise."""
    T, H, D = query.shape
    KVH = key.shape[1]
    tensors = (query, key, value, out)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(2) != 1 for t in tensors)
            or key.shape != value.shape or (kstarts is None and key.shape[0] != T) or key.shape[2] != D
            or out.shape != query.shape or KVH < 1 or H % KVH):
        return False
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != (T, H) or lse.stride(1) != 1):
        return False
    st = starts.to(torch.int64).contiguous()                                   # (b,)
    ks = st if kstarts is None else kstarts.to(torch.int64).contiguous()       # (b,)
    ln = lens.to(torch.int64).contiguous()                                     # (b,)
    cx = torch.zeros_like(st) if ctx is None else ctx.to(torch.int64).contiguous()  # (b,)
    return _causal_prefill_kernel()(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), st.data_ptr(), ks.data_ptr(),
        ln.data_ptr(), cx.data_ptr(), st.numel(), H, KVH, D, query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), out.stride(0), out.stride(1),
        scale, ptr(lse), 0 if lse is None else lse.stride(0), int(bidirectional), window or 0, int(bfloat16)) == 0


def _native_chunks(query: torch.Tensor, kv_cache: torch.Tensor, reqs: _Requests, out: torch.Tensor,
                   scale: float, scales: _Scales, lse: torch.Tensor | None = None) -> bool:
    """Prompt chunks after cached context through causal_prefill: every position's keys and
    values, the chunks' own included, gathered from the cache in one pass as float32 (S, KVH, D),
    S = sum(seq_lens), request after request (kv_gather: 16-bit rows widened, fp8 ones times
    their scale). False, nothing written, when the kernels cannot."""
    if not kv_cache.is_contiguous():
        return False
    _, num_blocks, bs, KVH, D = kv_cache.shape
    seq_lens = reqs.seq_lens                                                       # (b,)
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)           # (S,)
    kstarts = torch.cumsum(seq_lens, 0) - seq_lens                                 # (b,)
    pos = torch.arange(int(seq_lens.sum())) - kstarts[req]                         # (S,)
    slots = (reqs.block_table[req, pos // bs].long() * bs + pos % bs).contiguous()  # (S,)
    S = slots.shape[0]
    k = torch.empty(S, KVH, D)
    v = torch.empty(S, KVH, D)
    ks, vs = scale_tensor(scales.k), scale_tensor(scales.v)
    bad = _kv_gather_kernel()(kv_cache.data_ptr(), KV_TYPES[kv_cache.dtype], num_blocks * bs, KVH * D,
                              slots.data_ptr(), S, ptr(ks), ptr(vs), k.data_ptr(), v.data_ptr())
    if bad >= 0:
        raise IndexError(f"slot {int(slots[bad])} of position {bad} is outside the KV cache's "
                         f"{num_blocks * bs} slots")
    return causal_prefill(query, k, v, out, reqs.starts, reqs.query_lens, scale, kstarts,
                          seq_lens - reqs.query_lens, lse)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key/value for every slot >= 0 (for
    an fp8 cache, fp8(key / k_scale) and fp8(value / v_scale), saturated)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous to be written through slot_mapping")
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping[: key.shape[0]]                                           # (T,)
    if _kv_store_native(key, value, kv_cache, slots, k_scale, v_scale):
        return
    if bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    store_rows_(flat[0], slots, key, k_scale)
    store_rows_(flat[1], slots, value, v_scale)


def _kv_store_native(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     slots: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """write_kv_cache through kernels/cpu (one pass, no masks or syncs) when the layouts allow;
    False when they do not (nothing written)."""
    D = kv_cache.shape[-1]
    if not (key.dtype == value.dtype == torch.float32 and kv_cache.dtype in KV_TYPES and kv_cache.is_cpu
            and slots.dtype == torch.int64 and slots.is_contiguous() and key.dim() == 3
            and key.stride(2) == value.stride(2) == 1 and key.stride(1) == value.stride(1) == D):
        return False
    fn = _kv_store_kernel()
    if fn is None:
        return False
    _, num_blocks, block_size, kvh, _ = kv_cache.shape
    ks, vs = scale_tensor(k_scale), scale_tensor(v_scale)
    bad = fn(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(),
             key.shape[0], kv_cache.data_ptr(), KV_TYPES[kv_cache.dtype], num_blocks * block_size, kvh * D,
             ptr(ks), ptr(vs))
    if bad >= 0:
        raise IndexError(f"slot {int(slots[bad])} of token {bad} is past the KV cache's "
                         f"{num_blocks * block_size} slots")
    return True


@lru_cache(maxsize=1)
def _causal_prefill_kernel() -> ctypes._CFuncPtr:
    """paged_attention.c's causal_prefill_f32, declared once; RuntimeError when the kernels cannot run here."""
    return declare("causal_prefill_f32", [_PTR] * 8 + [_I64] * 12 + [ctypes.c_float, _PTR] + [_I64] * 4, _I64)


@lru_cache(maxsize=1)
def _kv_store_kernel() -> ctypes._CFuncPtr | None:
    """paged_attention.c's kv_store, declared once; None when the kernels cannot run here."""
    if not available()[0]:
        return None
    return declare("kv_store", [_PTR, _I64] * 2 + [_PTR, _I64, _PTR] + [_I64] * 3 + [_PTR, _PTR], _I64)


@lru_cache(maxsize=1)
def _kv_gather_kernel() -> ctypes._CFuncPtr:
    """paged_attention.c's kv_gather, declared once; RuntimeError when the kernels cannot run here."""
    return declare("kv_gather", [_PTR] + [_I64] * 3 + [_PTR, _I64] + [_PTR] * 4, _I64)
