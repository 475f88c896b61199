"""The quantized mode, as a transformation applied after loading (the model files know nothing
of it).

``gguf``: linear layers stored as Q4_1 / Q8_0 in the GGUF file keep those weights and multiply
them by float32 activations with the native panel kernel (``models/gguf_native.py``,
``kernels/cpu/gemm.c``): the weights are exactly the checkpoint's, summed in float32 panels' order
(exact mode's results bit for bit), and a decode step reads a fifth of float32's weight bytes.

``gguf-i8``: the same weights, but multiplied by the activations split into
two int8 parts per block of 32 (x ~= s1 q1 + s2 q2, about 14 bits kept) with integer dot
products (AVX512-VNNI, or AVX2's vpmaddubsw): decoding runs faster, and with AVX512-VNNI
compute-bound batches too, at the price of rare greedy-token changes (measured with
``python -m tools.bench agreement --quantization gguf-i8``). One int8 part (llama.cpp's Q8_1 activations) was measured at 54% agreement here and rejected.

Measured here and rejected: int8 weights with dynamic int8 activations (per token) change one
greedy token in ten on SmolLM2; two int8 parts per weight and activation (three int8 products)
keep 98% of greedy tokens but run slower than oneDNN's float32 on AVX-512 CPUs.
"""
from __future__ import annotations

from torch import nn

QUANT_MODES = ("gguf", "gguf-i8")


def quantize(model: nn.Module, mode: str, gguf_path: str | None = None) -> nn.Module:
    """Transform an already loaded ``model`` in place for ``mode`` (one of QUANT_MODES, through
    the registry of models/quantization); returns it."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; supported: {', '.join(QUANT_MODES)}")
    from models.quantization import attach_linear_methods, process_weights_after_loading, resolve_quantization
    config = resolve_quantization(mode, None, gguf_path)
    attach_linear_methods(model, config, model.gguf_tensor_map)
    process_weights_after_loading(model)
    return model
