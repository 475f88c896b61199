"""The Triton launchers registered as torch custom ops (namespace ``troupe``), each with a fake
(meta) implementation giving output shapes and dtypes, so torch.compile can trace through them
as opaque nodes. Call them as ``torch.ops.troupe.<name>`` after importing this module.

Custom-op outputs may not alias inputs, so the launchers that return an input (rms_norm without
residual, in-place rotary) are split into ops with a single clear contract:

    store_kv_cache(key, value, kv_cache!, slot_mapping) -> ()
    paged_decode_attention(query, kv_cache, block_table, seq_lens, scale, sliding_window, num_splits) -> Tensor
    paged_prefill_attention(query, kv_cache, query_start_loc, seq_lens, block_table,
                            max_query_len, scale, sliding_window) -> Tensor
    rms_norm(x, weight, eps) -> Tensor
    fused_add_rms_norm(x, residual, weight, eps) -> (Tensor, Tensor)
    rotary_embedding(positions, query, key, cos_sin_cache) -> (Tensor, Tensor)
    rotary_embedding_(positions, query!, key!, cos_sin_cache) -> ()
    rotary_embedding_rows_(query!, key!, cos, sin) -> ()      the layers' per-token cos/sin rows
    silu_and_mul(x) -> Tensor
    sample(logits, temperature, top_k, top_p, exp_noise) -> Tensor
    per_token_quant(x, fmt) -> (codes, scales)                  8-bit activations, one scale a row
    scaled_mm(a, b, a_scale, b_scale, fmt, out_dtype, native, splits) -> Tensor     W8A8 matmul
    int4_linear(x, qweight, zeros, scales, g_idx, group_size, out_dtype, splits) -> Tensor   W4A16
"""
from __future__ import annotations

import torch

from kernels.triton import kv_store, paged_decode, paged_prefill, quant, rmsnorm, rotary, sampling, silu_mul


@torch.library.custom_op("troupe::store_kv_cache", mutates_args=("kv_cache",))
def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    kv_store.store_kv_cache(key, value, kv_cache, slot_mapping)


@store_kv_cache.register_fake
def _(key, value, kv_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("troupe::paged_decode_attention", mutates_args=())
def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                           num_splits: int) -> torch.Tensor:
    return paged_decode.paged_decode_attention(query, kv_cache, block_table, seq_lens, scale,
                                               sliding_window, num_splits)


@paged_decode_attention.register_fake
def _(query, kv_cache, block_table, seq_lens, scale, sliding_window, num_splits):
    return torch.empty_like(query)


@torch.library.custom_op("troupe::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
                            scale: float, sliding_window: int | None) -> torch.Tensor:
    return paged_prefill.paged_prefill_attention(query, kv_cache, query_start_loc, seq_lens, block_table,
                                                 max_query_len, scale, sliding_window)


@paged_prefill_attention.register_fake
def _(query, kv_cache, query_start_loc, seq_lens, block_table, max_query_len, scale, sliding_window):
    return torch.empty_like(query)


@torch.library.custom_op("troupe::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm.rms_norm(x, weight, eps).out


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("troupe::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(rmsnorm.rms_norm(x, weight, eps, residual))


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("troupe::rotary_embedding", mutates_args=())
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(rotary.rotary_embedding(positions, query, key, cos_sin_cache, inplace=False))


@rotary_embedding.register_fake
def _(positions, query, key, cos_sin_cache):
    return torch.empty_like(query), torch.empty_like(key)


@torch.library.custom_op("troupe::rotary_embedding_", mutates_args=("query", "key"))
def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    rotary.rotary_embedding(positions, query, key, cos_sin_cache, inplace=True)


@rotary_embedding_.register_fake
def _(positions, query, key, cos_sin_cache) -> None:
    return None


@torch.library.custom_op("troupe::rotary_embedding_rows_", mutates_args=("query", "key"))
def rotary_embedding_rows_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rotary.rotary_embedding_rows(query, key, cos, sin, inplace=True)


@rotary_embedding_rows_.register_fake
def _(query, key, cos, sin) -> None:
    return None


@torch.library.custom_op("troupe::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_mul.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("troupe::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           exp_noise: torch.Tensor) -> torch.Tensor:
    return sampling.sample(logits, temperature, top_k, top_p, exp_noise)


@sample.register_fake
def _(logits, temperature, top_k, top_p, exp_noise):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.custom_op("troupe::per_token_quant", mutates_args=())
def per_token_quant(x: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.per_token_quant(x, fmt)


@per_token_quant.register_fake
def _(x, fmt):
    return (x.new_empty(x.shape, dtype=torch.uint8 if fmt == quant.FMT_FP8 else torch.int8),
            x.new_empty(x.shape[0], dtype=torch.float32))


@torch.library.custom_op("troupe::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, fmt: int,
              out_dtype: torch.dtype, native: bool | None = None, splits: int | None = None) -> torch.Tensor:
    return quant.scaled_mm(a, b, a_scale, b_scale, fmt, out_dtype, native, splits)


@scaled_mm.register_fake
def _(a, b, a_scale, b_scale, fmt, out_dtype, native=None, splits=None):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("troupe::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, group_size: int, out_dtype: torch.dtype,
                splits: int | None = None) -> torch.Tensor:
    return quant.int4_linear(x, qweight, zeros, scales, g_idx, group_size, out_dtype, splits)


@int4_linear.register_fake
def _(x, qweight, zeros, scales, g_idx, group_size, out_dtype, splits=None):
    return x.new_empty(x.shape[0], qweight.shape[1], dtype=out_dtype)
