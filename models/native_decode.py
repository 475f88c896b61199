"""Pure-decode steps of Llama-style models in one native call (kernels/cpu/decode_stack.c).

``NativeDecodeStack.build(model)`` checks, once after the weights are packed, that every layer
is one the native stack reproduces exactly: RMSNorms, a q|k|v projection without per-head norms,
SiLU-gated MLP, every linear a ``PanelLinear`` (float32 or GGUF panels), attention through the
CPU backend with its native kernels, float32 weights and activations; a tensor-parallel rank's
layers too when its all-reduces go through the ranks' shared memory (kernels/cpu/shm_comm.py),
which the call then makes itself. It returns None otherwise,
and the model keeps its per-layer path. ``run`` then takes a step's embeddings and returns the
last layer's output and the residual stream, bit for bit what the per-layer path computes (same
kernels, same order), or None when the step is not one it takes (a prompt in the batch, a
KV cache of another dtype, several KV cache groups, a step whose layers still have to set their KV
scales from it), so the caller falls back. A cascade step (``meta.common_prefix_len``) takes the
per-layer path too.

A step whose requests each bring a few tokens (at most ``MAX_FLAT_QUERY``: speculative decoding's
verification of k drafts, a draft model catching up) runs flattened: each token is a decode row of
its own, attending over the keys up to its position in its request's blocks. Every layer stores the
keys and values of all rows before attending, so a token sees the ones before it in its request,
and it gets exactly the logits a decode step at that position would.
"""
from __future__ import annotations

import ctypes
import dataclasses
from functools import lru_cache

import torch
from torch import nn

from kernels.attention.base import AttentionMetadata
from kernels.cpu import shm_comm
from models.tensor_parallel import RowParallel

WORDS = 4 * 8 + 7         # decode_stack.c's DS_WORDS
KV_WORD = 4 * 8 + 2       # the word of a layer's KV cache address (then its window, k_scale, v_scale)
# decode_stack.c's phases, in its order: the keys of NativeDecodeStack.profile_seconds() (silu_and_mul
# stays 0 where the SiLU is fused into the gate|up matmul: its time is counted in gate_up_proj)
MAX_FLAT_QUERY = 16       # the longest query per request run flattened (longer: a prompt, per-layer path)
PHASES = ("norm", "qkv_proj", "rotary_kv_store", "attention", "o_proj", "gate_up_proj", "silu_and_mul",
          "down_proj")


@lru_cache(maxsize=1)
def _kernel():
    from kernels.cpu import native
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return native.declare("decode_stack", [i64, ptr, ptr, ptr, ptr, ptr] + [i64] * 6 + [ptr, ptr, i64, ptr, ptr, i64,
                                                                                  ptr, i64, i64, i64, ptr, ptr, ptr,
                                                                                  ptr], i64)


def _linear_words(module: nn.Module) -> list[int] | None:
    from models.packed import PanelLinear
    if type(module) is not PanelLinear:
        return None
    fn, args = module.weight.call
    from kernels.cpu.panels import _i8x2_gemm
    kind, codes, d, m, n, k = args
    bias = module.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    return [1 if fn is _i8x2_gemm() else 0, kind, codes, d or 0, m or 0, n, k,
            0 if bias is None else bias.data_ptr()]


class NativeDecodeStack:
    def __init__(self, model: nn.Module, words: torch.Tensor, floats: torch.Tensor, dims: tuple[int, ...],
                 first_attn: nn.Module, comm: torch.Tensor | None = None) -> None:
        self.model = model          # holds the weights (and KV scales) whose addresses ``words`` records
        self.comm = comm            # a tensor-parallel rank's: its shared-memory all-reduce (decode_stack.c)
        self.words = words          # (L, WORDS) int64; the KV cache addresses are filled per runner
        self.floats = floats        # (L, 5) float32: scale, eps of the two norms, residual multiplier, score cap
        self.dims = dims            # hidden, heads, kv heads, head size, intermediate
        self.profile: torch.Tensor | None = None   # (len(PHASES),) float64 seconds, when profiling
        self._caches: list[torch.Tensor] | None = None
        self._first_attn = first_attn   # its calculate_kv_scales: the layers wait to set their KV scales

    @classmethod
    def build(cls, model: nn.Module) -> "NativeDecodeStack | None":
        from kernels.attention.cpu import CpuAttentionBackend
        from kernels.cpu import fused, native
        from models.layers import GatedMLP, RMSNorm, SelfAttention
        from models.llama import LlamaDecoderLayer
        layers = getattr(model, "layers", None)
        if not layers or not native.available()[0] or not fused.ENABLED:
            return None
        try:
            _kernel()
        except AttributeError:
            return None
        rows, floats = [], []
        dims, groups = None, set()
        for layer in layers:
            if type(layer) is not LlamaDecoderLayer:         # Llama's order of norms and adds, no other
                return None
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
            if (type(attn) is not SelfAttention or type(mlp) is not GatedMLP or mlp.act != "silu"
                    or any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 or not n.weight.is_contiguous()
                           for n in norms)
                    or attn.q_norm is not None or attn.sinks is not None or attn.alibi_slopes is not None
                    or attn.bidirectional or type(attn.backend) is not CpuAttentionBackend
                    or not attn.backend.native or attn.head_size % 2):
                return None
            o, down = attn.o_proj, mlp.down_proj
            if type(o) is RowParallel and type(down) is RowParallel:     # a tensor-parallel rank's
                groups.update((o.group, down.group))
                o, down = o.linear, down.linear
            lins = [_linear_words(m) for m in (attn.qkv_proj, o, mlp.gate_up_proj, down)]
            if any(w is None for w in lins):
                return None
            d = (o.out_features, attn.num_heads, attn.num_kv_heads, attn.head_size, down.in_features)
            if dims is not None and d != dims:
                return None
            dims = d
            if any(t.dtype != torch.float32 or t.numel() != 1 or t.device.type != "cpu"
                   for t in (attn.k_scale, attn.v_scale)):
                return None
            rows.append([w for lin in lins for w in lin] + [norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
                                                             0, attn.sliding_window or 0, attn.k_scale.data_ptr(),
                                                             attn.v_scale.data_ptr(),
                                                             attn.rotary_dim if attn.use_rope else 0])
            floats.append([attn.scale, norms[0].eps, norms[1].eps, getattr(layer, "residual_multiplier", 1.0),
                           attn.logits_soft_cap or 0.0])
        comm = None
        if groups:               # the all-reduces in the call: through the ranks' shared memory only
            shm = shm_comm.communicator(*groups) if len(groups) == 1 else None
            if shm is None:
                return None
            comm = torch.tensor([shm.base, shm.world, shm.rank, shm_comm.CHUNK, ctypes.addressof(shm.seq)],
                                dtype=torch.int64)
        return cls(model, torch.tensor(rows, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32), dims,
                   layers[0].self_attn, comm)

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """Record the layers' cache addresses (once per list of caches)."""
        from kernels.cpu.native import KV_TYPES
        if self._caches is kv_caches:
            return True
        first = kv_caches[0]
        if (len(kv_caches) != self.words.shape[0] or first.dtype not in KV_TYPES
                or any(c.dtype != first.dtype or c.shape != first.shape or not c.is_contiguous()
                       or c.device.type != "cpu" for c in kv_caches)
                or first.shape[3] != self.dims[2] or first.shape[4] != self.dims[3]):
            return False
        self.words[:, KV_WORD] = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64)
        self._caches = kv_caches
        return True

    def unbind(self) -> None:
        """Forget the KV caches (sleep mode gives their memory back; the next run binds anew)."""
        self._caches = None

    def run(self, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata, lora: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """emb (T, hidden) of a step of short queries (one token per request, no padding; or a
        few, flattened) -> (last layer's output, residual stream), or None when this step is not
        one it takes. ``lora``: (the layers' LoRA words (L, 24) int64, each token's slot (T,)
        int64), see decode_stack.c; the deltas are added after each linear."""
        from kernels.cpu.native import KV_TYPES
        if not meta.is_pure_decode:
            if meta.max_query_len > MAX_FLAT_QUERY or emb.shape[0] != meta.num_tokens:
                return None
            meta = flatten(meta)
        B = meta.num_reqs
        if (meta.num_tokens != B or meta.common_prefix_len or meta.groups
                or emb.dtype != torch.float32 or emb.dim() != 2
                or not emb.is_contiguous() or cos.dtype != torch.float32 or sin.dtype != torch.float32
                or cos.stride(0) != sin.stride(0) or cos.stride(-1) != 1 or sin.stride(-1) != 1
                or self._first_attn.calculate_kv_scales or not self._bind(kv_caches)
                or (lora is not None and lora[1].shape != (B,))):
            return None
        Hd, H, KVH, D, I = self.dims
        _, num_blocks, BS, _, _ = kv_caches[0].shape
        slots = meta.slot_mapping[:B].to(torch.int64).contiguous()
        table = meta.block_table[:B].to(torch.int32).contiguous()
        lens = meta.seq_lens[:B].to(torch.int32).contiguous()
        h = torch.empty(B, Hd)
        residual = torch.empty(B, Hd)
        status = _kernel()(self.words.shape[0], self.words.data_ptr(), self.floats.data_ptr(), emb.data_ptr(),
                           h.data_ptr(), residual.data_ptr(), B, Hd, H, KVH, D, I, cos.data_ptr(), sin.data_ptr(),
                           cos.stride(0), slots.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(),
                           KV_TYPES[kv_caches[0].dtype], num_blocks, BS,
                           None if self.profile is None else self.profile.data_ptr(),
                           None if lora is None else lora[0].data_ptr(), None if lora is None else lora[1].data_ptr(),
                           None if self.comm is None else self.comm.data_ptr())
        if status == -2:
            raise MemoryError("the native decode stack could not allocate its buffers")
        if status == -3:
            raise RuntimeError("a tensor-parallel rank died during an all-reduce")
        if status >= 0:
            raise IndexError(f"slot {int(slots[status])} of token {status} is past the KV cache's "
                             f"{num_blocks * BS} slots")
        return h, residual

    def start_profile(self) -> None:
        """Accumulate each phase's wall time over the following steps (profile_seconds)."""
        self.profile = torch.zeros(len(PHASES), dtype=torch.float64)

    def profile_seconds(self) -> dict[str, float]:
        return {} if self.profile is None else dict(zip(PHASES, self.profile.tolist()))


def flatten(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata of a step with several tokens per request as a decode step of one row per
    token: row t has its request's block table and the keys up to its own position."""
    qsl = meta.query_start_loc[:meta.num_reqs + 1].to(torch.int64)
    n = qsl[1:] - qsl[:-1]                                               # (B,) tokens per request
    req = torch.repeat_interleave(torch.arange(meta.num_reqs), n)        # (T,) each token's request
    T = int(qsl[-1])
    lens = meta.seq_lens[:meta.num_reqs].to(torch.int64)[req] - qsl[1:][req] + torch.arange(T) + 1
    return dataclasses.replace(meta, num_reqs=T, max_query_len=1, query_start_loc=torch.arange(T + 1, dtype=torch.int32),
                               seq_lens=lens.to(torch.int32), block_table=meta.block_table[req])


def attach(model: nn.Module) -> bool:
    """Give ``model`` (a LlamaForCausalLM or subclass, weights packed) its native decode stack
    when it qualifies; returns whether it does."""
    stack = NativeDecodeStack.build(model)
    model.native_decode = stack
    return stack is not None

