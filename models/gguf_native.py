"""The GGUF block formats run natively: each linear layer keeps its checkpoint's Q4_1 / Q8_0
weights (repacked into the panels of ``kernels/cpu/gemm.c``: 0.625 / 1.06 bytes a weight instead
of float32's 4) and multiplies them by float32 activations with the native panel kernel, which
dequantizes to exactly the checkpoint's float32 values and sums the products in the order it sums
float32 panels: the results are float32 copies' bit for bit (which is why exact mode on the CPU
keeps a GGUF file's blocks, actors/worker/worker.py). A decode step reads a fifth of float32's
weight bytes; larger batches dequantize each panel once per call and run at float32 speed.

Fused layers (q|k|v, gate|up) take their shards' block rows in shard order; the model class's
row fixups (llama.cpp's permutation of attn_q / attn_k) are undone on whole block rows, and a
tensor with a value fixup keeps its float32 layer. The ``gguf`` and ``gguf-i8`` configs of
models/quantization/gguf.py pack the blocks ``native_blocks`` finds.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from models.config import ArchConfig
from models.gguf_header import GGUFFile
from models.gguf_loader import raw_tensor_data
from models.registry import _compile_tensor_map, _lookup

NATIVE_TYPES = {GGMLQuantizationType.Q4_1: "Q4_1", GGMLQuantizationType.Q8_0: "Q8_0"}


def native_blocks(model: nn.Module, gguf: GGUFFile, config: ArchConfig) -> dict[str, dict]:
    """module name -> {shard (None for unfused): (qtype, (rows, row_bytes) uint8 tensor)} for
    every weight stored in a natively supported format."""
    compiled = _compile_tensor_map(model.gguf_tensor_map)
    row_fixups, value_fixups = type(model).gguf_row_fixups(config), type(model).gguf_value_fixups(config)
    data = np.memmap(gguf.path, mode="r")
    out: dict[str, dict] = {}
    for info in gguf.tensors.values():
        if (info.ggml_type not in NATIVE_TYPES or len(info.shape) != 2
                or any(info.name.endswith(suffix) for suffix, _ in value_fixups)):
            continue
        param, shard = _lookup(compiled, info.name, type(model).__name__)
        rows = torch.from_numpy(np.array(raw_tensor_data(data, info)))  # (out, row_bytes) copy
        for suffix, fix in row_fixups:
            if info.name.endswith(suffix):
                rows = fix(rows).contiguous()
        out.setdefault(param.removesuffix(".weight"), {})[shard] = (NATIVE_TYPES[info.ggml_type], rows)
    if config.tie_word_embeddings and "embed_tokens" in out:
        out.setdefault("lm_head", out["embed_tokens"])
    return out
