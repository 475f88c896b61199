"""vLLM's --enable-mfu-metrics: an analytic estimate of each step's floating-point operations and
memory traffic per device, from the model's shape and what the step computes, for Model FLOPs
Utilization (``vllm:estimated_flops_per_gpu_total`` and the bytes read and written, counters on
/metrics; "MFU: X TF/s/device Y GB/s/device" in the periodic stats line).

A step is its requests' (new tokens, context after them, prefill or decode). Per device (a
tensor-parallel rank holds its share of the heads and of the MLP columns, a pipeline stage its
share of the layers):

  attention   2 T D (q + 2 kv) d + 2 T q d D for the projections, 2 q d per query-key pair for
              the scores and as many for the values (a sliding layer's pairs capped at its window);
              reads the weights, the inputs and the KV cache the decodes attend to (a prefill's
              context as activations), writes the outputs and the new tokens' K and V
  MLP         gated: 3 matrices of D x I (a mixture-of-experts layer: each token's top-k experts,
              the weights of every expert the step touches read once)
  LM head     2 N D V for the N tokens that sample; reads the D x V weights

The bytes of a weight follow the quantization (4-bit formats half a byte, 8-bit ones a byte; exact
mode on a GGUF file reads its blocks),
activations the model's dtype, the KV cache its own. Estimates, not measurements: kernels read
some operands more than once and fuse others."""
from __future__ import annotations

from dataclasses import dataclass

from actors.engine.config import DTYPE_BYTES, EngineConfig, exact_from_gguf_blocks
from models.config import ArchConfig

# bytes per weight of the quantized formats (Q4_1 blocks of 32: 4.5 bits in GGUF's default mix)
WEIGHT_BYTES = {"awq": 0.5, "gptq": 0.5, "gguf": 0.5625, "gguf-i8": 1.0, "fp8": 1.0, "compressed-tensors": 1.0}


@dataclass(slots=True)
class StepCost:
    flops: int = 0
    read_bytes: int = 0
    write_bytes: int = 0


class PerfModel:
    """The estimate for one engine configuration (resolved: the architecture is known)."""

    def __init__(self, config: EngineConfig) -> None:
        arch: ArchConfig = config.model.arch
        p = config.parallel
        self.tp, self.pp = p.tensor_parallel_size, p.pipeline_parallel_size
        self.D, self.V, self.d = arch.hidden_size, arch.vocab_size, arch.head_size
        self.q = max(1, arch.num_heads // self.tp)
        self.kv = max(1, arch.num_kv_heads // self.tp)
        act = DTYPE_BYTES.get(config.model.dtype, 4)
        self.act = act
        self.cache = DTYPE_BYTES.get(config.cache.cache_dtype, act)
        quantization = config.model.quantization
        if exact_from_gguf_blocks(config.model.source.path, quantization, config.model.dtype, config.device.device,
                                  config.compilation.level, config.weight_transfer is not None):
            quantization = "gguf"                  # exact mode reads the file's blocks
        self.weight = WEIGHT_BYTES.get(quantization or "", act)
        windows = [arch.layer_sliding_window(i) for i in range(arch.num_layers)]
        self.full_layers = sum(w is None for w in windows) / self.pp
        self.sliding = [w for w in windows if w is not None]
        self.window = self.sliding[0] if self.sliding else None
        self.sliding_layers = len(self.sliding) / self.pp
        self.layers = arch.num_layers / self.pp
        moe = [arch.is_moe_layer(i) for i in range(arch.num_layers)]
        self.moe_layers = sum(moe) / self.pp
        self.dense_layers = self.layers - self.moe_layers
        self.I = arch.intermediate_size // self.tp
        self.expert_I = arch.moe_intermediate_size // max(self.tp, 1) if arch.num_experts else 0
        self.experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.last_stage_share = 1.0 / self.pp      # the LM head runs on the last stage: its average share

    def step(self, requests: list[tuple[int, int, bool]]) -> StepCost:
        """The cost of a step of ``requests``: (new tokens, context length after them, prefill)."""
        if not requests:
            return StepCost()
        D, d, q, kv, act = self.D, self.d, self.q, self.kv, self.act
        T = sum(n for n, _, _ in requests)
        logits_rows = sum(1 if prefill else n for n, _, prefill in requests)
        pairs_full = sum(n * c for n, c, _ in requests)
        pairs_window = sum(n * min(c, self.window) for n, c, _ in requests) if self.window else 0
        flops = (2 * T * D * (q + 2 * kv) * d + 2 * T * q * d * D) * self.layers
        flops += 4 * q * d * (pairs_full * self.full_layers + pairs_window * self.sliding_layers)
        # attention reads: weights, inputs, and what the queries attend to
        read = (D * (q + 2 * kv) * d + q * d * D) * self.weight * self.layers
        read += (T * D + T * q * d) * act * self.layers
        for n, c, prefill in requests:
            for layers, seen in ((self.full_layers, c), (self.sliding_layers, min(c, self.window or c))):
                if layers:
                    kv_bytes = self.act if prefill else self.cache
                    read += (n * q * d * act + 2 * seen * kv * d * kv_bytes) * layers
        write = (T * (q + 2 * kv) * d * act + 2 * T * kv * d * self.cache + T * D * act) * self.layers
        # MLP: dense layers, then mixture-of-experts ones
        if self.dense_layers:
            flops += 2 * T * D * self.I * 3 * self.dense_layers
            read += (3 * D * self.I * self.weight + T * D * act + T * self.I * act) * self.dense_layers
            write += (T * self.I * 2 * act + T * D * act) * self.dense_layers
        if self.moe_layers:
            routed = T * self.top_k
            touched = min(self.experts, routed)
            flops += (2 * routed * D * self.expert_I * 3 + 2 * T * D * self.experts) * self.moe_layers
            read += (touched * 3 * D * self.expert_I * self.weight + D * self.experts * self.weight
                     + routed * (D + self.expert_I) * act) * self.moe_layers
            write += (routed * (2 * self.expert_I + D) * act) * self.moe_layers
        # the LM head, for the rows that sample
        head = self.last_stage_share
        flops += 2 * logits_rows * D * self.V // self.tp * head
        read += (D * self.V // self.tp * self.weight + logits_rows * D * act) * head
        write += logits_rows * self.V // self.tp * 4 * head
        return StepCost(int(flops), int(read), int(write))
