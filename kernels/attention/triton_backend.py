"""The Triton attention backend: KV store through slot_mapping, then the paged decode kernel for
pure-decode steps and the varlen paged prefill kernel for everything else (prefill, chunked
prefill, mixed batches).

Runs on CUDA. For tests it also runs on the CPU under Triton's interpreter: with
``TRITON_INTERPRET=1`` and ``TROUPE_TRITON_ON_CPU=1`` set before this module is imported,
"cpu" joins ``devices`` (or set ``TritonAttentionBackend.devices`` directly).

CUDA graphs ("uniform_decode"): the decode path reads only host ints from the metadata
(num_reqs, max_seq_len) to size its grid and buffers; it never reads device data on the host,
and its grid depends on (num_reqs, num_kv_heads, num_splits) only, since each program derives
its share of the context from the request's seq_len on the device. A graph captured for a batch
size therefore replays correctly for any seq_lens. The prefill path has no host syncs either,
but its grid follows max_query_len, so it is not captured.

Cascade (``meta.common_prefix_len`` P > 0, no sliding window, cap, sinks or ALiBi; never captured): the prefix kernel
attends every query over the shared pages at once (kernels/triton/cascade.py), the prefill kernel
attends each request's pages from P on and returns log-sum-exps, the merge kernel combines them.
No host syncs: padding rows are zeroed on the device.
"""
from __future__ import annotations

import os

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionRequirements
from kernels.attention.cascade import suffix_view
from kernels.triton import FP8_DTYPES, interpreting

MAX_HEAD_SIZE = 256


def _devices() -> tuple[str, ...]:
    on_cpu = interpreting() and os.environ.get("TROUPE_TRITON_ON_CPU", "0") not in ("", "0")
    return ("cuda", "cpu") if on_cpu else ("cuda",)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton. Any head size up to 256 (padded to a power of two >= 16 inside
    the kernels); pages of 16, 32 or 64 tokens; the KV cache in the query's dtype or fp8
    (float8_e4m3fn / float8_e5m2 with the layer's k_scale / v_scale, converted in the kernels)."""

    name = "triton"
    devices = _devices()
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
    head_sizes = None
    block_sizes = (16, 32, 64)
    supports_sliding_window = True
    supports_logits_soft_cap = True     # Gemma 2's capped scores, in both kernels
    supports_sinks = True               # gpt-oss's attention sinks, in both kernels' softmax denominators
    supports_alibi = True               # BLOOM's and MPT's biases, in both kernels' scores
    supports_cascade = True
    cudagraph_support = "uniform_decode"

    def __init__(self) -> None:
        # The kernels, and Triton with them (a third of a second), are imported once this backend
        # is chosen: a CPU worker only asks for its refusal.
        from kernels.triton import cascade, kv_store, paged_decode, paged_prefill
        self._cascade_kernels, self._kv_store = cascade, kv_store
        self._decode, self._prefill = paged_decode, paged_prefill

    @classmethod
    def refusal(cls, req: AttentionRequirements) -> str | None:
        reason = super().refusal(req)
        if reason is not None:
            return reason
        if req.head_size > MAX_HEAD_SIZE:
            return f"{cls.name}: head size {req.head_size} not supported (at most {MAX_HEAD_SIZE})"
        if req.kv_cache_dtype != req.dtype and req.kv_cache_dtype not in FP8_DTYPES:
            return (f"{cls.name}: KV cache dtype {req.kv_cache_dtype} must equal the model dtype {req.dtype} "
                    f"or be fp8")
        return None

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
        logits_soft_cap: float | None = None,  # each scaled score s becomes C * tanh(s / C) (Gemma 2)
        sinks: torch.Tensor | None = None,     # (H,): each head's sink logit (gpt-oss)
        alibi_slopes: torch.Tensor | None = None,   # (H,) float32: ALiBi's slopes
    ) -> torch.Tensor:           # (T, H, D); rows of padding tokens are zero
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(f"kv_cache pages hold {kv_cache.shape[2]} tokens, metadata says {meta.block_size}")
        self._kv_store.store_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        B = meta.num_reqs
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        if (meta.common_prefix_len > 0 and sliding_window is None and not logits_soft_cap and sinks is None
                and alibi_slopes is None):
            return self._cascade(query, kv_cache, meta, scale, k_scale, v_scale)
        if meta.is_pure_decode:
            # pure decode: request i owns token i (query_start_loc = 0, 1, ..., B); tokens past B are padding
            out = torch.empty_like(query)
            num_splits = self._decode.default_num_splits(B, kv_cache.shape[3], meta.max_seq_len)
            self._decode.paged_decode_attention(query[:B], kv_cache, meta.block_table[:B], meta.seq_lens[:B],
                                                scale, sliding_window, num_splits, out=out[:B], k_scale=k_scale,
                                                v_scale=v_scale, soft_cap=logits_soft_cap, sinks=sinks,
                                                alibi_slopes=alibi_slopes)
            out[B:].zero_()
            return out
        return self._prefill.paged_prefill_attention(query, kv_cache, meta.query_start_loc[:B + 1],
                                                     meta.seq_lens[:B], meta.block_table[:B], meta.max_query_len,
                                                     scale, sliding_window, k_scale=k_scale, v_scale=v_scale,
                                                     soft_cap=logits_soft_cap, sinks=sinks, alibi_slopes=alibi_slopes)

    def _cascade(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
        """Shared prefix for all queries at once, each request's suffix apart, merged."""
        B, T, H = meta.num_reqs, query.shape[0], query.shape[1]
        sv = suffix_view(meta)
        s_lse = torch.empty(T, H, dtype=torch.float32, device=query.device)
        s_out = self._prefill.paged_prefill_attention(query, kv_cache, meta.query_start_loc[:B + 1], sv.seq_lens,
                                                      sv.block_table, meta.max_query_len, scale, None,
                                                      k_scale=k_scale, v_scale=v_scale, lse=s_lse)
        prefix_blocks = meta.block_table[0, :meta.common_prefix_len // meta.block_size]
        p_out, p_lse = self._cascade_kernels.prefix_attention(query, kv_cache, prefix_blocks, scale, k_scale,
                                                              v_scale)
        padding = torch.arange(T, device=query.device) >= meta.query_start_loc[B]      # (T,), on the device
        p_lse.masked_fill_(padding[:, None], float("-inf"))
        s_lse.masked_fill_(padding[:, None], float("-inf"))      # padding rows: no keys, zero output
        return self._cascade_kernels.merge_attn_states(torch.empty_like(query), p_out, p_lse, s_out, s_lse)
