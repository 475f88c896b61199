"""--enable-mfu-metrics (vLLM's): a step's FLOPs and bytes per device, estimated from the model's
shape, checked by hand on a small dense model; split by tensor and pipeline parallelism; a
mixture-of-experts layer counts each token's experts; the counters reach /metrics and the stats
line only when the flag is on."""
from __future__ import annotations

import dataclasses

import msgspec
import pytest

from actors.engine.args import EngineArgs
from actors.engine.messages import SchedulerStats
from actors.frontend.stat_logger import StatLines
from actors.frontend.stats import EngineStats
from actors.scheduler.perf import PerfModel
from models.config import ArchConfig

ARCH = ArchConfig("LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_size=4, max_model_len=64, rope_theta=1e4, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,))


def perf(arch: ArchConfig = ARCH, **options) -> PerfModel:
    config = EngineArgs(enable_mfu_metrics=True, **options).create_engine_config()
    return PerfModel(config.replace(model=msgspec.structs.replace(config.model, arch=arch, dtype="float32")))


def test_one_decode_token_costs_what_the_formulas_give_by_hand():
    cost = perf().step([(1, 10, False)])          # one token with 10 positions of context
    D, q, kv, d, I, V, L = 8, 2, 1, 4, 16, 100, 2
    attention = 2 * D * (q + 2 * kv) * d + 2 * q * d * D + 4 * q * d * 10
    assert cost.flops == (attention + 2 * D * I * 3) * L + 2 * D * V
    weights = (D * (q + 2 * kv) * d + q * d * D + 3 * D * I) * L + D * V
    kv_read = 2 * 10 * kv * d * L                    # the context's K and V, per layer
    assert cost.read_bytes > 4 * (weights + kv_read) and cost.read_bytes < 4 * (weights + kv_read) * 1.2
    assert cost.write_bytes >= 4 * (2 * kv * d * L + V)            # at least its K and V and its logits


def test_prefill_attention_grows_with_the_pairs_and_only_its_last_token_samples():
    p = perf()
    short, long = p.step([(16, 16, True)]), p.step([(32, 32, True)])
    assert long.flops > 2 * short.flops - 2 * 2 * 8 * 100       # attention quadruples, the LM head stays one row
    two = p.step([(16, 16, True), (1, 40, False)])
    assert two.flops > short.flops and two.read_bytes > short.read_bytes


def test_tensor_and_pipeline_parallel_devices_each_count_their_share():
    whole = perf().step([(8, 8, True)])
    tp = perf(tensor_parallel_size=2).step([(8, 8, True)])
    pp = perf(pipeline_parallel_size=2).step([(8, 8, True)])
    assert tp.flops < whole.flops and pp.flops == pytest.approx(whole.flops / 2, rel=0.01)


def test_a_mixture_of_experts_layer_counts_each_tokens_top_k_experts():
    moe = dataclasses.replace(ARCH, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    dense, mixed = perf().step([(4, 4, True)]), perf(moe).step([(4, 4, True)])
    assert mixed.flops > dense.flops                  # two experts per token instead of one MLP, plus the router
    one = perf(moe).step([(1, 4, False)])
    assert one.read_bytes < mixed.read_bytes          # one token touches 2 experts' weights, four touch up to 8


def test_the_counters_reach_metrics_and_the_stats_line_only_with_the_flag():
    stats = SchedulerStats(step=3, num_scheduled_reqs=1, estimated_flops=4_000_000_000_000,
                           estimated_read_bytes=2_000_000_000, estimated_write_bytes=1_000_000_000)
    on, off = EngineStats(model="m", mfu=True), EngineStats(model="m")
    for s in (on, off):
        s.observe_step(stats)
    assert "vllm:estimated_flops_per_gpu_total{model_name=\"m\",engine=\"0\"} 4000000000000" in on.prometheus()
    assert "estimated_flops" not in off.prometheus() and "estimated_read_bytes" not in off.prometheus()
    clock = iter([0.0, 2.0])
    lines = StatLines(on, "cpu", now=lambda: next(clock)).lines()
    (mfu,) = [(fmt, args) for _, fmt, args in lines if "MFU" in fmt]
    assert mfu[0].endswith("MFU: %.3f TF/s/device %.1f GB/s/device") and mfu[1] == (2.0, 1.5)
