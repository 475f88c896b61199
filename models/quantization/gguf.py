"""``gguf`` and ``gguf-i8``: a GGUF checkpoint's Q4_1 / Q8_0 blocks run natively (see
models/gguf_native.py for the blocks, kernels/cpu/gemm.c for the kernels). The float weights
load as for the exact mode; once loaded, each layer whose weights are stored in one native
format is replaced by its panels, and its float weight dropped (kept when tied to the
embedding). ``gguf-i8``: the layers also take int8 activations in two parts (AVX512-VNNI or AVX2)."""
from __future__ import annotations

import torch
from torch import nn

from models.layers import Linear
from models.quantization.base import LinearMethod, QuantizationConfig, shards_of

BLOCK = 32                                     # values per Q4_1 / Q8_0 block


class GGUFConfig(QuantizationConfig):
    name = "gguf"
    int8_activations = False

    def __init__(self, gguf_path: str) -> None:
        self.gguf_path = gguf_path
        self.blocks: dict[str, dict] = {}

    @classmethod
    def from_config(cls, config: dict) -> "GGUFConfig":
        raise ValueError(f"the {cls.name} quantization mode needs a model loaded from a .gguf file")

    @classmethod
    def from_flag(cls, source_path: str | None) -> "GGUFConfig":
        from kernels.cpu.native import available
        ok, reason = available()
        if not ok:
            raise ValueError(f"the {cls.name} quantization mode needs the native CPU kernels: {reason}")
        if source_path is None or not source_path.endswith(".gguf"):
            raise ValueError(f"the {cls.name} quantization mode needs a model loaded from a .gguf file")
        if cls.int8_activations:
            from kernels.cpu.panels import int8_available
            if not int8_available():
                raise ValueError("the gguf-i8 quantization mode needs a CPU with AVX2 (or AVX512-VNNI); use 'gguf'")
        return cls(source_path)

    def prepare(self, model: nn.Module) -> None:
        from models.gguf_header import read_gguf
        from models.gguf_native import native_blocks
        self.blocks = native_blocks(model, read_gguf(self.gguf_path), model.config)

    def get_quant_method(self, layer: Linear, prefix: str, hf_names: dict) -> "GGUFLinearMethod | None":
        shards = self.blocks.get(prefix)
        if not shards or set(shards_of(layer)) != set(shards) or len({q for q, _ in shards.values()}) != 1:
            return None                          # not stored natively, or mixed formats: a float layer
        return GGUFLinearMethod(shards, self.int8_activations)


class GGUFInt8Config(GGUFConfig):
    name = "gguf-i8"
    int8_activations = True


class GGUFLinearMethod(LinearMethod):
    """The layer's shards' raw blocks, packed into panels once the float weights are loaded."""

    def __init__(self, shards: dict[str | None, tuple[str, torch.Tensor]], int8_activations: bool) -> None:
        self.shards, self.int8_activations = shards, int8_activations
        self.in_features = 0                   # the layer's, once create_weights saw it

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        self.in_features = int(layer.weight.shape[1])

    def shard(self, whole: Linear, part: Linear, rows: dict[str | None, tuple[int, int]] | None = None,
              cols: tuple[int, int] | None = None) -> None:
        """Block rows are whole output rows; a run of inputs is a run of whole blocks of 32."""
        part.quant_method = self.part(rows, cols)

    def part(self, rows: dict[str | None, tuple[int, int]] | None = None,
             cols: tuple[int, int] | None = None) -> GGUFLinearMethod:
        shards = {}
        for name, (qtype, raw) in self.shards.items():
            if rows is not None:
                r0, n = rows[name]
                raw = raw[r0:r0 + n]
            if cols is not None:
                c0, n = cols
                if c0 % BLOCK or n % BLOCK:
                    raise ValueError(f"a {qtype} layer's inputs split at {c0} + {n}: tensor parallelism splits "
                                     f"{qtype} weights at whole blocks of {BLOCK} inputs only")
                width = raw.shape[1] * BLOCK // self.in_features       # bytes per block
                raw = raw[:, c0 // BLOCK * width:(c0 + n) // BLOCK * width]
            shards[name] = (qtype, raw.contiguous())
        method = GGUFLinearMethod(shards, self.int8_activations)
        method.in_features = cols[1] if cols is not None else self.in_features
        return method

    def process_weights_after_loading(self, layer: Linear) -> nn.Module:
        from kernels.cpu.panels import PanelWeight
        from models.packed import PanelLinear
        qtype = next(iter(self.shards.values()))[0]
        raw = torch.cat([self.shards[s][1] for s in shards_of(layer)]).reshape(-1).contiguous()
        out_f, in_f = layer.weight.shape
        return PanelLinear(PanelWeight.pack_gguf(qtype, raw, out_f, in_f, self.int8_activations), layer.bias)
