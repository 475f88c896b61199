"""The composed EngineConfig: built once from the command line or the offline API's options,
"auto" resolved once for the worker's platform and checkpoint, and the resolved config the same
after a trip between processes and after being resolved again."""
from __future__ import annotations

import argparse
import dataclasses

import msgspec
import pytest

from actors.engine.args import EngineArgs
from actors.engine.config import EngineConfig
from models.config import ArchConfig

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 23,040 bytes of float32 K and V per token
ARCH = ArchConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, True, 1, (2,))


def resolved(**options) -> EngineConfig:
    config = EngineArgs(**options).create_engine_config()
    return config.resolve(cuda_available=False, cpu_count=2, arch=ARCH)


def test_cpu_auto_values_resolve_to_float32_and_the_cache_the_memory_holds():
    c = resolved(kv_cache_bytes=1 << 30)
    per_block = ARCH.kv_bytes_per_token(4) * 16
    assert (c.device.device, c.model.dtype, c.cache.cache_dtype) == ("cpu", "float32", "float32")
    assert c.cache.num_blocks == (1 << 30) // per_block and c.device.num_threads == 2
    assert c.model.max_model_len == min(8192, (c.cache.num_blocks - 1) * 16)   # one request must fit
    assert c.model.arch == ARCH and c.model.served_model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_16_bit_kv_cache_holds_twice_the_blocks_and_caps_the_context_length():
    small = resolved(kv_cache_bytes=50 * ARCH.kv_bytes_per_token(4) * 16)       # 50 float32 blocks
    half = resolved(kv_cache_bytes=50 * ARCH.kv_bytes_per_token(4) * 16, kv_cache_dtype="float16")
    assert (small.cache.num_blocks, half.cache.num_blocks) == (50, 100)
    assert (small.model.max_model_len, half.model.max_model_len) == (49 * 16, 99 * 16)


def test_cuda_defaults_to_bfloat16_and_refuses_cpu_only_quantization():
    config = EngineArgs().create_engine_config()
    c = config.resolve(cuda_available=True, cpu_count=16, arch=ARCH)
    assert (c.device.device, c.model.dtype, c.cache.cache_dtype) == ("cuda", "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        EngineArgs(quantization="gguf").create_engine_config().resolve(cuda_available=True, cpu_count=16, arch=ARCH)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        EngineArgs(device="cuda").create_engine_config().resolve(cuda_available=False, cpu_count=2, arch=ARCH)


def test_resolving_is_done_once_a_resolved_config_stays_the_same():
    c = resolved(max_model_len=1000, kv_cache_dtype="bfloat16", num_threads=1)
    assert c.resolve(cuda_available=True, cpu_count=64, arch=ARCH) == c
    travelled = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineConfig)
    assert travelled == c and travelled.resolved and travelled.model.max_model_len == 1000


def test_bad_values_are_refused_naming_the_option_and_what_is_accepted():
    with pytest.raises(ValueError, match="unknown dtype 'float8'; accepted: auto, float32"):
        EngineArgs(dtype="float8").create_engine_config()
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineArgs(max_num_seqs=0).create_engine_config()
    with pytest.raises(TypeError, match=r"unknown engine options \['max_batch'\]; accepted: .*max_num_seqs"):
        EngineArgs.from_options(None, {"max_batch": 4})


def test_command_line_flags_build_the_same_config_as_the_offline_options():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--kv-cache-gib", "0.5", "--kv-cache-dtype", "float16", "--max-num-seqs", "8",
                         "--threads", "1", "--scheduling-policy", "priority"])
    from_cli = EngineArgs.from_cli_args(args).create_engine_config()
    offline = EngineArgs.from_options(None, {"kv_cache_bytes": 1 << 29, "kv_cache_dtype": "float16",
                                             "max_num_seqs": 8, "num_threads": 1,
                                             "scheduling_policy": "priority"}).create_engine_config()
    assert from_cli == offline
    with pytest.raises(SystemExit):
        p.parse_args(["--block-size", "0"])


@pytest.mark.parametrize("name,resolved_name",
                         [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_an_fp8_kv_cache_holds_four_times_the_blocks_of_float32(name, resolved_name):
    """One byte per element: 4x float32's blocks and 2x float16's in the same memory (also in
    1 GiB, up to the floor of each division), the context cap following; "fp8" is e4m3 (vLLM's
    meaning), resolved once; the worker's cache tensors are torch's fp8 dtypes."""
    import torch

    from actors.kv_manager.kv_cache_spec import create_kv_cache_views, model_kv_cache_specs
    from actors.worker.model_runner import torch_dtype
    per_f32_block = ARCH.kv_bytes_per_token(4) * 16
    f32 = resolved(kv_cache_bytes=50 * per_f32_block)
    f16 = resolved(kv_cache_bytes=50 * per_f32_block, kv_cache_dtype="float16")
    fp8 = resolved(kv_cache_bytes=50 * per_f32_block, kv_cache_dtype=name)
    assert (f32.cache.num_blocks, f16.cache.num_blocks, fp8.cache.num_blocks) == (50, 100, 200)
    assert fp8.cache.cache_dtype == resolved_name and fp8.model.max_model_len == 199 * 16
    assert fp8.resolve(cuda_available=False, cpu_count=2, arch=ARCH) == fp8
    gib = {d: resolved(kv_cache_dtype=d).cache.num_blocks for d in ("float32", "float16", name)}
    assert gib == {"float32": (1 << 30) // per_f32_block, "float16": (1 << 30) // (per_f32_block // 2),
                   name: (1 << 30) // (per_f32_block // 4)}
    assert 4 * gib["float32"] <= gib[name] < 4 * (gib["float32"] + 1)
    dtype = torch_dtype(fp8.cache.cache_dtype)
    assert dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[resolved_name]
    caches = create_kv_cache_views(model_kv_cache_specs(ARCH, 16, 1), 3, dtype)
    assert len(caches) == 30 and caches[0].shape == (2, 3, 16, 3, 64) and caches[0].dtype == dtype


def test_fp8_flags_on_the_command_line_and_offline():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    from_cli = EngineArgs.from_cli_args(args).create_engine_config()
    offline = EngineArgs.from_options(None, {"kv_cache_dtype": "fp8",
                                             "calculate_kv_scales": True}).create_engine_config()
    assert from_cli == offline and from_cli.cache.calculate_kv_scales and from_cli.cache.cache_dtype == "fp8"
    assert not EngineArgs().create_engine_config().cache.calculate_kv_scales
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8_e3m4'; accepted: .*fp8, fp8_e4m3, fp8_e5m2"):
        EngineArgs(kv_cache_dtype="fp8_e3m4").create_engine_config()


def test_a_draft_models_kv_cache_shares_the_blocks_so_the_same_memory_holds_fewer():
    """self_draft: the target's own checkpoint drafts; its 30 layers join the target's in every
    block, so 1 GiB holds half the blocks; a draft of another vocabulary is refused."""
    spec = {"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 4}
    plain, drafted = resolved(kv_cache_bytes=1 << 30), resolved(kv_cache_bytes=1 << 30, speculative_config=spec)
    assert drafted.model.draft_source == drafted.model.source and drafted.model.draft_arch == ARCH
    assert drafted.cache.num_blocks == plain.cache.num_blocks // 2
    assert len(drafted.kv_cache_specs()) == 60 and drafted.kv_cache_groups()[0].layer_ids == tuple(range(60))
    assert drafted.resolve(cuda_available=False, cpu_count=2, arch=ARCH) == drafted     # resolved once
    config = EngineArgs(speculative_config=spec).create_engine_config()
    other = ArchConfig("LlamaForCausalLM", 32000, 576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, True, 1, (2,))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        config.resolve(cuda_available=False, cpu_count=2, arch=ARCH, draft_arch=other)
    with pytest.raises(ValueError, match="already runs quantization 'gguf-i8'"):
        EngineArgs(quantization="gguf-i8", speculative_config=spec).create_engine_config()
    with pytest.raises(ValueError, match="runs on the CPU only"):
        config.resolve(cuda_available=True, cpu_count=2, arch=ARCH, draft_arch=ARCH)


def test_data_parallelism_needs_engine_processes_of_their_own():
    config = EngineArgs(data_parallel_size=2).create_engine_config()
    assert (config.parallel.data_parallel_size, config.parallel.data_parallel_rank) == (2, 0)
    with pytest.raises(ValueError, match="process of its own"):
        EngineArgs(data_parallel_size=2, multiprocess=False).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        EngineArgs(data_parallel_size=0).create_engine_config()
    args = argparse.ArgumentParser()
    EngineArgs.add_cli_args(args)
    assert EngineArgs.from_cli_args(args.parse_args(["-dp", "3"])).data_parallel_size == 3


def test_tensor_parallel_ranks_size_their_kv_blocks_by_the_most_kv_heads_one_holds():
    """SmolLM2's 3 KV heads on 2 ranks are 2 + 1: a block is sized for 2 heads, so the same
    memory per rank holds 3/2 the blocks; quantized checkpoints, GGUF blocks and a
    quantized self_draft split."""
    plain, split = resolved(kv_cache_bytes=1 << 30), resolved(kv_cache_bytes=1 << 30, tensor_parallel_size=2)
    assert split.cache.num_blocks == plain.cache.num_blocks * 3 // 2
    assert split.kv_cache_specs()[0].num_kv_heads == 2 and split.kv_cache_specs(1)[0].num_kv_heads == 1
    assert split.device.num_threads == 1                  # 2 cores over 2 ranks
    EngineArgs(tensor_parallel_size=2, quantization="awq").create_engine_config()
    EngineArgs(tensor_parallel_size=2, quantization="gguf").create_engine_config()
    EngineArgs(tensor_parallel_size=2, speculative_config={"method": "self_draft", "quantization": "gguf-i8",
                                                           "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="worker process of its own"):
        EngineArgs(tensor_parallel_size=2, multiprocess=False).create_engine_config()


def test_scheduler_limits_below_the_runners_sizes_are_vllms_and_checked():
    c = resolved(max_num_seqs=8, max_num_active_seqs=3, max_num_batched_tokens=512, max_num_scheduled_tokens=128)
    assert (c.scheduler.active_seqs, c.scheduler.token_budget) == (3, 128)
    assert (resolved().scheduler.active_seqs, resolved().scheduler.token_budget) == (64, 2048)
    with pytest.raises(ValueError, match=r"max_num_active_seqs \(9\) cannot be greater than max_num_seqs \(8\)"):
        resolved(max_num_seqs=8, max_num_active_seqs=9)
    with pytest.raises(ValueError, match=r"max_num_scheduled_tokens \(600\) cannot be greater than"):
        resolved(max_num_batched_tokens=512, max_num_scheduled_tokens=600)


def test_the_config_digest_follows_what_decides_the_outputs_and_nothing_else():
    """vLLM's compute_hash, behind system_fingerprint: the same configuration gives the same
    digest on every start and wherever the model is installed; the dtype, the quantization and
    the context length change it; the names it is served under and its tracing do not."""
    base = resolved(kv_cache_bytes=1 << 28).compute_hash()
    assert resolved(kv_cache_bytes=1 << 28).compute_hash() == base and len(base) == 64
    assert resolved(kv_cache_bytes=1 << 28, served_model_name="alias", disable_log_stats=True).compute_hash() == base
    moved = resolved(kv_cache_bytes=1 << 28)                    # the same model installed elsewhere
    moved = moved.replace(model=msgspec.structs.replace(moved.model, source=dataclasses.replace(
        moved.model.source, path="/elsewhere/model.gguf")))
    assert moved.compute_hash() == base
    for other in (dict(dtype="bfloat16"), dict(quantization="gguf"), dict(max_model_len=1024)):
        assert resolved(kv_cache_bytes=1 << 28, **other).compute_hash() != base, other


def test_system_fingerprint_modes_name_the_version_the_parallel_layout_and_the_digest():
    from actors.frontend.misc import system_fingerprint, version
    c = resolved(kv_cache_bytes=1 << 28)
    tp2 = resolved(kv_cache_bytes=1 << 28, tensor_parallel_size=2, data_parallel_size=2)
    h = c.compute_hash()[:8]
    assert system_fingerprint(c) == f"troupe-{version()}-{h}"
    assert system_fingerprint(tp2) == f"troupe-{version()}-tp2-dp2-{tp2.compute_hash()[:8]}"
    assert system_fingerprint(tp2, "hash") == f"troupe-{version()}-{tp2.compute_hash()[:8]}"
    assert system_fingerprint(c, "custom", "mine") == "mine" and system_fingerprint(c, "none") is None


def test_detailed_traces_need_an_otlp_endpoint_and_take_vllms_module_names():
    with pytest.raises(ValueError, match="requires `--otlp-traces-endpoint`"):
        EngineArgs(collect_detailed_traces=["model"]).create_engine_config()
    with pytest.raises(ValueError, match="'gpu' is not one of model, worker, all"):
        EngineArgs(collect_detailed_traces="model,gpu").create_engine_config()
    with pytest.raises(ValueError, match="per_request_spec_decode_metrics"):
        EngineArgs(per_request_spec_decode_metrics="all").create_engine_config()


def test_the_engines_configuration_and_the_servers_flags_load_without_torch():
    """Every process start reads them (the server's before it listens): torch, seconds to import,
    is for the processes that compute."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, tools.serve, actors.engine.args, actors.engine.config, "
                          "actors.frontend.app; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
