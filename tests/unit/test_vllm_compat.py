"""A vLLM user changes nothing but the command: `vllm serve` command lines parse into the same
engine options under `troupe serve`, vLLM's flags Troupe lacks are refused by name (one line,
exit 2), --gpu-memory-utilization sizes the KV cache from the GPU's memory, --generation-config
gives request defaults, --max-logprobs bounds requests, and /metrics has vLLM's names."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import msgspec
import pytest

from actors.engine.args import EngineArgs, load_sampling_defaults
from actors.engine.config import CPU_KV_CACHE_BYTES
from actors.engine.sampling_params import SamplingDefaults
from actors.frontend.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, ServerDefaults
from actors.frontend.stats import METRICS, VLLM_METRIC_NAMES, EngineStats, RequestStats, parse_prefixes
from actors.worker.gpu_memory import GIB, NotEnoughGpuMemory, kv_cache_bytes_for_gpu
from models.config import ArchConfig
from models.resolve import DEFAULT_MODEL, ModelSource
from tools import serve, vllm_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 23,040 bytes of float32 K and V per token
ARCH = ArchConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e5, 1e-5, True, 1, (2,))


# -- the command line -------------------------------------------------------------------------

def test_a_vllm_serve_command_line_builds_the_engine_config_it_asks_for():
    args = serve.parse_args([
        DEFAULT_MODEL, "--served-model-name", "my-model", "other-name", "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching", "--max-logprobs", "5", "--seed", "3", "--generation-config", "vllm",
        "--uvicorn-log-level", "warning", "--disable-log-requests", "--trust-remote-code",
        "--max-model-len", "4k", "--kv-cache-memory-bytes", "1G", "--dtype", "half",
        "--enable-chunked-prefill", "--disable-log-stats", "--max-num-batched-tokens", "8K"])
    assert (args.model, args.log_level, args.enable_log_requests, args.trust_remote_code) == \
        (DEFAULT_MODEL, "WARNING", False, True)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    m, c = config.model, config.cache
    assert m.model_names == ("my-model", "other-name") and m.served_model_name == "my-model"
    assert (m.max_logprobs, m.seed, m.generation_config, m.dtype, m.max_model_len) == (5, 3, "vllm", "float16", 4000)
    assert (c.gpu_memory_utilization, c.enable_prefix_caching, c.kv_cache_memory_bytes) == (0.5, False, 1 << 30)
    assert config.scheduler.max_num_batched_tokens == 8192


def test_max_model_len_auto_or_minus_one_is_the_longest_context_that_fits():
    """vLLM's -1 / auto (and the offline None): the model's own context, capped to what the KV
    cache holds, which is what Troupe does when not told (0)."""
    for value in ("auto", "-1", "AUTO"):
        args = serve.parse_args(["--max-model-len", value])
        assert EngineArgs.from_cli_args(args).create_engine_config().model.max_model_len == 0
    for value in (None, -1, "auto"):
        assert EngineArgs(max_model_len=value).create_engine_config().model.max_model_len == 0
    assert EngineArgs(max_model_len="2k").create_engine_config().model.max_model_len == 2000


def test_server_flags_have_vllms_defaults_and_troupes_own_keep_working():
    args = serve.parse_args([])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (args.enable_log_requests, args.metrics_prefix, args.log_level) == (False, ("vllm", "troupe"), "INFO")
    assert (config.model.max_logprobs, config.model.generation_config, config.cache.gpu_memory_utilization,
            config.cache.enable_prefix_caching, config.cache.kv_cache_memory_bytes) == (20, "auto", 0.92, True, 0)
    assert config.model.model_names == (DEFAULT_MODEL,)
    on = serve.parse_args(["--enable-log-requests", "--metrics-prefix", "vllm", "--log-level", "debug",
                           "--kv-cache-gib", "0.5", "--num-gpu-blocks-override", "100", "-q", "gguf"])
    on_config = EngineArgs.from_cli_args(on).create_engine_config()
    assert (on.enable_log_requests, on.metrics_prefix, on.log_level) == (True, ("vllm",), "DEBUG")
    assert (on_config.cache.kv_cache_memory_bytes, on_config.cache.num_blocks) == (1 << 29, 100)
    assert on_config.model.quantization == "gguf"


def _option_strings() -> set[str]:
    parsers = []
    real = serve.argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        parsers.append(self)
        return real(self, *a, **k)
    serve.argparse.ArgumentParser.parse_args = grab
    try:
        serve.parse_args([])
    finally:
        serve.argparse.ArgumentParser.parse_args = real
    return {o for a in parsers[0]._actions for o in a.option_strings}


def test_every_flag_of_vllm_0_32_serve_is_taken_or_refused_by_name():
    """tests/unit/data/vllm_0.32_serve_flags.txt: the option strings of vLLM 0.32's `vllm serve`
    parser. Troupe's parser knows each: it implements it, accepts it as what it always does, or
    refuses it with its one line (the refused ones are each run above)."""
    with open(os.path.join(ROOT, "tests", "unit", "data", "vllm_0.32_serve_flags.txt")) as f:
        vllm = {line.strip() for line in f if line.strip()}
    assert len(vllm) == 430 and not vllm - _option_strings()


def test_vllm_0_32_spellings_set_what_they_name():
    args = serve.parse_args(["-sc", '{"method": "ngram", "num_speculative_tokens": 3}', "--optimization-level", "0",
                             "--device-memory-utilization", "0.5", "-ep", "--language-model-only",
                             "--no-enable-auto-tool-choice", "--no-trust-request-chat-template",
                             "--no-return-tokens-as-token-ids", "--no-enable-tokenizer-info-endpoint",
                             "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.compilation.level == 0 and config.cache.gpu_memory_utilization == 0.5
    assert args.enable_expert_parallel and not args.enable_auto_tool_choice
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.model.source.language_model_only
    assert not EngineArgs.from_cli_args(serve.parse_args(["--no-language-model-only"])).create_engine_config() \
        .model.source.language_model_only
    queued = EngineArgs.from_cli_args(serve.parse_args(["--max-num-queued-reqs", "4", "--max-num-queued-tokens",
                                                        "1000"])).create_engine_config().scheduler
    assert (queued.max_num_queued_reqs, queued.max_waiting_tokens) == (4, 1000)
    spec = serve.parse_args(["--spec-method", "ngram", "--spec-tokens", "5", "-cc", "2"])
    config = EngineArgs.from_cli_args(spec).create_engine_config()
    assert (config.speculative.method, config.speculative.num_speculative_tokens, config.compilation.level) == \
        ("ngram", 5, 2)
    both = serve.parse_args(["--spec-tokens", "5", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    with pytest.raises(ValueError, match=r"--spec-tokens and --speculative-config\['num_speculative_tokens'\] are mutually"):
        EngineArgs.from_cli_args(both).create_engine_config()
    sched = EngineArgs.from_cli_args(serve.parse_args([
        "--watermark", "0.05", "--long-prefill-token-threshold-adaptive", "--no-scheduler-reserve-full-isl",
        "--per-request-spec-decode-metrics", "summary"])).create_engine_config()
    assert (sched.scheduler.watermark, sched.scheduler.long_prefill_token_threshold_adaptive,
            sched.scheduler.scheduler_reserve_full_isl) == (0.05, True, False)
    assert sched.observability.per_request_spec_decode_metrics == "summary"
    traced = serve.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4317", "--collect-detailed-traces",
                               "model,worker"])
    assert EngineArgs.from_cli_args(traced).create_engine_config().observability.collect_detailed_traces == \
        ("model", "worker")
    for bad in (["--default-chat-template-kwargs", "[1]"], ["--no-enable-request-id-headers"],
                ["--watermark", "1"], ["--fingerprint-mode", "custom"],
                ["--enable-per-request-metrics", "--disable-log-stats"]):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(bad)
        assert exc.value.code == 2


def test_settings_that_name_what_troupe_does_are_accepted_and_others_refused_naming_the_value(capsys):
    """vLLM flags whose value may be what Troupe does: --tokenizer-mode auto, --load-format as the
    model's files are; another value exits 2 with one line naming it. --model-impl takes vLLM's
    values but terratorch (a library for geospatial models).
    (--runner and --convert are Troupe's own flags: tests/unit/test_pooling.py.)"""
    args = serve.parse_args(["--tokenizer-mode", "hf", "--runner", "generate", "--convert", "none",
                             "--model-impl", "auto", "--config-format", "hf", "--load-format", "gguf",
                             "--api-server-count", "1", "--mamba-ssm-cache-dtype", "float32"])
    EngineArgs.from_cli_args(args).create_engine_config()
    assert serve.parse_args(["-asc", "3"]).api_server_count == 3
    for flag, value in (("--tokenizer-mode", "mistral"), ("--config-format", "mistral"),
                        ("--mamba-ssm-cache-dtype", "bfloat16")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args([flag, value])
        line = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and line.startswith(f"troupe: error: {flag} {value} is a vLLM setting")
    with pytest.raises(ValueError, match="--load-format safetensors: the model's weights are gguf"):
        EngineArgs.from_cli_args(serve.parse_args(["--load-format", "safetensors"])).create_engine_config()
    assert serve.parse_args(["--model-impl", "transformers"]).model_impl == "transformers"
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--model-impl", "terratorch"])
    assert exc.value.code == 2 and "invalid choice: 'terratorch'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--model-impl transformers builds the model with transformers from a Hugging "
                                         "Face checkpoint directory; .* is a GGUF file"):
        EngineArgs.from_cli_args(serve.parse_args(["--model-impl", "transformers"])).create_engine_config()


def test_the_structured_outputs_config_takes_xgrammars_options_and_names_the_reasoning_parser(capsys):
    args = serve.parse_args(["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true, '
                             '"disable_fallback": true, "reasoning_parser": "qwen3"}'])
    assert args.reasoning_parser == "qwen3"
    config = EngineArgs.from_cli_args(args).create_engine_config().structured_outputs
    assert config.disable_any_whitespace and not config.any_whitespace
    assert EngineArgs().create_engine_config().structured_outputs.any_whitespace       # vLLM's default
    for bad, says in (('{"backend": "guidance"}', "always use xgrammar"), ('{"backend": "auto", "x": 1}', "unsupported structured outputs config field(s) x"),
                      ('{"enable_in_reasoning": false}', "from its first token"), ("[1]", "JSON object"),
                      ('{"reasoning_parser": "qwen3"}', "disagree")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(["--structured-outputs-config", bad, "--reasoning-parser", "deepseek_r1"])
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_hf_overrides_set_config_json_keys_over_the_checkpoints_and_a_gguf_headers(tmp_path):
    """vLLM's --hf-overrides: what every process reads as the model's config (the source carries
    them); a key a GGUF header does not give, or a value that is not an object, stops the start."""
    from helpers import save_tiny_llama
    from models.registry import model_config
    ckpt = save_tiny_llama(tmp_path / "tiny", vocab=128, hidden=32, intermediate=64, heads=4, kv_heads=2,
                           head_dim=8, max_positions=256)
    args = serve.parse_args(["--model", ckpt, "--hf-overrides",
                             '{"max_position_embeddings": 96, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}'])
    arch = model_config(EngineArgs.from_cli_args(args).create_engine_config().model.source)
    # linear scaling stretches the context max_position_embeddings gives (vLLM's derived max_model_len)
    assert (arch.max_model_len, arch.rope_scaling.rope_type, arch.rope_scaling.factor) == (192, "linear", 2.0)
    gguf = EngineArgs(hf_overrides={"max_position_embeddings": 1024, "rope_theta": 50000}).create_engine_config()
    arch = model_config(gguf.model.source)
    assert (arch.max_model_len, arch.rope_theta) == (1024, 50000.0)
    yarn = model_config(EngineArgs(hf_overrides={"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}).create_engine_config().model.source)
    assert (yarn.rope_scaling.rope_type, yarn.rope_scaling.original_max_position_embeddings, yarn.max_model_len) == \
        ("yarn", 2048, 8192)                                 # SmolLM2's GGUF context: 8192, not stretched by yarn
    linear = model_config(EngineArgs(hf_overrides={"max_position_embeddings": 1024, "rope_scaling": {
        "type": "linear", "factor": 2.0}}).create_engine_config().model.source)
    assert (linear.rope_scaling.factor, linear.max_model_len) == (2.0, 2048)
    with pytest.raises(ValueError, match="num_hidden_layers cannot be set on a GGUF file's config"):
        EngineArgs(hf_overrides='{"num_hidden_layers": 3}').create_engine_config()
    with pytest.raises(ValueError, match="JSON object"):
        EngineArgs(hf_overrides="[1]").create_engine_config()


def test_return_tokens_as_token_ids_is_the_servers_default_a_request_may_override():
    """vLLM's --return-tokens-as-token-ids: log-prob tokens read "token_id:N" unless a request's
    return_tokens_as_token_ids field says otherwise."""
    from actors.frontend.generation import Answer
    from actors.frontend.logprobs import TokenIdText, TokenText
    from actors.frontend.protocol import CompletionRequest
    assert serve.parse_args(["--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    assert not serve.parse_args([]).return_tokens_as_token_ids

    class Words:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(f"w{i}" for i in ids)
    text = TokenText(Words())
    for flag, field, as_ids in ((True, None, True), (True, False, False), (False, True, True), (False, None, False)):
        answer = Answer.of(CompletionRequest(prompt="x", return_tokens_as_token_ids=field), text, flag)
        assert isinstance(answer.text_of, TokenIdText) == as_ids
        assert answer.text_of(7) == (("token_id:7" if as_ids else "w7"), list(b"w7"))


def test_the_model_may_be_given_first_as_in_vllm_serve_but_not_twice_differently(capsys):
    assert serve.parse_args(["smollm2", "--port", "0"]).model == "smollm2"
    assert serve.parse_args(["--model", "smollm2", "smollm2"]).model == "smollm2"
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["smollm2", "--model", "gemma3-270m"])
    assert exc.value.code == 2 and "given twice" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--gpu-memory-utilization", "1.5"], ["--metrics-prefix", "prometheus"],
                                 ["--uvicorn-log-level", "loud"], ["--kv-cache-gib", "1", "--kv-cache-memory-bytes", "2G"],
                                 ["--max-model-len", "12.5K"]])
def test_bad_values_of_the_new_flags_exit_2_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(bad)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and bad[0] in err, err


REFUSED = (sorted(vllm_flags.REFUSED) + sorted(a for a, long in vllm_flags.ALIASES.items() if long not in vllm_flags.VALUES)
           + sorted(vllm_flags.NEVER))


@pytest.mark.parametrize("flag", REFUSED)
def test_each_vllm_flag_troupe_does_not_implement_exits_2_with_one_line_naming_it(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args([DEFAULT_MODEL, "--port", "0", flag, "1"] if flag not in vllm_flags.NEVER
                         else [flag])
    out, err = capsys.readouterr()
    long = vllm_flags.ALIASES.get(flag, flag)
    named = long if long == flag else f"{long} ({flag})"
    assert exc.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"troupe: error: {named} is a vLLM flag Troupe does not implement")


def test_refused_flags_are_refused_in_every_spelling_and_only_their_no_forms_pass(capsys):
    for argv in (["--decode-context-parallel-size=2"], ["-dcp", "2"], ["--fully-sharded-loras"],
                 ["--lora-dtype", "float16"], ["--port", "0", "--num-speculative-tokens", "1"]):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and "is a vLLM flag" in err, (argv, err)
    serve.parse_args(["--no-fully-sharded-loras", "--no-enable-expert-parallel", "--no-trust-remote-code",
                      "--disable-uvicorn-access-log", "--enable-request-id-headers", "--disable-fastapi-docs"])
    assert vllm_flags.BOOLEAN <= set(vllm_flags.REFUSED)


def test_help_describes_the_new_flags_and_hides_the_refused_ones(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--served-model-name NAME [NAME ...]", "--gpu-memory-utilization FRACTION", "--max-logprobs N",
                 "--enable-prefix-caching, --no-enable-prefix-caching", "--generation-config {auto,vllm,FOLDER}",
                 "--enable-log-requests", "--disable-log-requests", "--uvicorn-log-level", "--trust-remote-code",
                 "--metrics-prefix", "--chat-template", "--seed", "--kv-cache-memory-bytes", "[MODEL]"):
        assert flag in text, flag
    assert "Does not apply on the CPU" in text and "runs no code from checkpoints" in text
    assert "--decode-context-parallel-size" not in text.replace("(e.g. --decode-context-parallel-size)", "")
    assert "--tensor-parallel-size N, -tp N" in text and "--data-parallel-size N, -dp N" in text
    assert "--pipeline-parallel-size N, -pp N" in text


# -- --gpu-memory-utilization ----------------------------------------------------------------

def test_the_kv_cache_gets_what_the_utilization_leaves_after_weights_and_activations():
    assert kv_cache_bytes_for_gpu(80 * GIB, 20 * GIB, 0.9) == 52 * GIB
    assert kv_cache_bytes_for_gpu(139 * GIB, 3 * GIB, 0.5) == int(139 * GIB * 0.5) - 3 * GIB
    with pytest.raises(NotEnoughGpuMemory, match=r"--gpu-memory-utilization 0.25 allows 20.00 GiB .* 30.00 GiB "
                                                 r"are already in use.*--kv-cache-gib"):
        kv_cache_bytes_for_gpu(80 * GIB, 30 * GIB, 0.25)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_cache_bytes_for_gpu(80 * GIB, 1, 1.2)


def test_on_cuda_an_unsized_cache_waits_for_the_worker_and_an_explicit_size_wins():
    auto = EngineArgs().create_engine_config().resolve(cuda_available=True, cpu_count=8, arch=ARCH)
    assert not auto.kv_cache_sized and auto.model.max_model_len == 8192
    assert auto.resolve(cuda_available=True, cpu_count=8, arch=ARCH) == auto
    per_block = ARCH.kv_bytes_per_token(2) * 16                              # bfloat16 blocks
    sized = auto.with_kv_cache_bytes(100 * per_block)
    assert sized.kv_cache_sized and sized.cache.num_blocks == 100 and sized.model.max_model_len == 99 * 16
    assert sized.resolve(cuda_available=True, cpu_count=8, arch=ARCH) == sized     # a restarted worker's
    explicit = EngineArgs(kv_cache_bytes=50 * per_block).create_engine_config().resolve(
        cuda_available=True, cpu_count=8, arch=ARCH)
    assert explicit.kv_cache_sized and explicit.cache.num_blocks == 50
    cpu = EngineArgs(gpu_memory_utilization=0.1).create_engine_config().resolve(
        cuda_available=False, cpu_count=2, arch=ARCH)
    assert cpu.cache.num_blocks == CPU_KV_CACHE_BYTES // (ARCH.kv_bytes_per_token(4) * 16)   # does not apply


def test_a_worker_sizes_an_unsized_cache_from_the_memory_left_after_a_forward_pass(tmp_path, monkeypatch):
    """The CUDA path on the CPU: the profiling step runs through the real model runner, the
    device's memory is what a fake NVML reports."""
    import torch

    from actors.worker import worker as worker_module
    from actors.worker.worker import Worker
    from helpers import save_tiny_llama
    path = save_tiny_llama(tmp_path, 256, 64, 128, 4, 2, 16, 512)
    w = Worker(EngineArgs(model=path, device="cpu", max_num_batched_tokens=100, max_model_len=512,
                          num_threads=1).create_engine_config())
    w.config = w.config.replace(cache=msgspec.structs.replace(w.config.cache, num_blocks=0,
                                                              gpu_memory_utilization=0.5))
    monkeypatch.setattr(worker_module, "device_memory", lambda index: (70 * GIB, 100 * GIB))
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert w._gpu_kv_cache_bytes() == 20 * GIB                # 0.5 x 100 GiB - 30 GiB in use


def test_gpu_memory_is_read_through_nvml_and_else_through_torch(monkeypatch):
    import torch

    from actors.worker import gpu_memory
    monkeypatch.setitem(sys.modules, "pynvml", None)           # nvidia-ml-py missing
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (3 * GIB, 8 * GIB))
    assert gpu_memory.device_memory(0) == (3 * GIB, 8 * GIB)
    monkeypatch.setattr(gpu_memory, "_nvml_memory", lambda index: (5 * GIB, 8 * GIB))
    assert gpu_memory.device_memory(0) == (5 * GIB, 8 * GIB)


# -- --generation-config ----------------------------------------------------------------------

def _checkpoint_dir(path, generation: dict | None) -> ModelSource:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text("{}")
    if generation is not None:
        (path / "generation_config.json").write_text(msgspec.json.encode(generation).decode())
    return ModelSource("hf_dir", str(path), "my/checkpoint")


def test_auto_reads_the_checkpoints_generation_config_vllm_ignores_it_a_folder_is_read(tmp_path):
    source = _checkpoint_dir(tmp_path / "ckpt", {
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 300})
    expected = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                max_tokens=300)
    assert load_sampling_defaults(source, "auto") == expected
    assert load_sampling_defaults(source, "vllm") == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    assert load_sampling_defaults(source, str(other)) == SamplingDefaults(temperature=0.2)
    assert load_sampling_defaults(source, str(other / "generation_config.json")).temperature == 0.2
    gguf = ModelSource("gguf", str(tmp_path / "model.gguf"), "m")
    assert load_sampling_defaults(gguf, "auto") == SamplingDefaults()          # a GGUF file has none
    with pytest.raises(ValueError, match="no generation_config.json there"):
        load_sampling_defaults(source, str(tmp_path / "missing"))
    (other / "generation_config.json").write_text('{"top_k": "many"}')
    with pytest.raises(ValueError, match="top_k must be an integer"):
        load_sampling_defaults(source, str(other))
    (other / "generation_config.json").write_text('{"temperature": 7}')
    with pytest.raises(ValueError, match="temperature 7 is out of the range"):
        load_sampling_defaults(source, str(other))


def test_override_generation_config_replaces_and_adds_fields_even_over_vllm(tmp_path, caplog):
    source = _checkpoint_dir(tmp_path / "ckpt", {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 300})
    over = '{"temperature": 0.1, "top_k": 5, "do_sample": true}'
    assert load_sampling_defaults(source, "auto", over) == SamplingDefaults(temperature=0.1, top_p=0.9, top_k=5,
                                                                            max_tokens=300)
    assert load_sampling_defaults(source, "vllm", {"max_new_tokens": 8}) == SamplingDefaults(max_tokens=8)
    assert "do_sample sets no sampling default" in caplog.text
    with pytest.raises(ValueError, match="with --override-generation-config: temperature 9 is out of the range"):
        load_sampling_defaults(source, "auto", '{"temperature": 9}')
    for bad, why in (('{"temperature"', "not valid JSON"), ("[1, 2]", "a JSON object is required")):
        with pytest.raises(ValueError, match=f"--override-generation-config: {why}"):
            load_sampling_defaults(source, "auto", bad)
    args = serve.parse_args(["--generation-config", "vllm", "--override-generation-config", '{"top_p": 0.5}'])
    assert EngineArgs.from_cli_args(args).create_engine_config().model.sampling_defaults == SamplingDefaults(top_p=0.5)


def test_a_checkpoint_without_sampling_fields_leaves_the_defaults_alone(tmp_path):
    source = _checkpoint_dir(tmp_path / "a", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    assert load_sampling_defaults(source, "auto") == SamplingDefaults()
    assert load_sampling_defaults(_checkpoint_dir(tmp_path / "b", None), "auto") == SamplingDefaults()


def test_generation_defaults_fill_only_the_fields_a_request_leaves_unset():
    defaults = ServerDefaults(sampling=SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.1,
                                                        max_tokens=300))
    chat = lambda **f: msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **f},  # noqa: E731
                                       ChatCompletionRequest).with_server_defaults(defaults)
    p = chat().to_sampling_params(49152, 8192)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p, p.max_tokens) == (0.6, 20, 1.1, 1.0, 300)
    p = chat(temperature=0, top_k=None, max_tokens=7).to_sampling_params(49152, 8192)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 7)
    assert chat(max_completion_tokens=9).to_sampling_params(49152, 8192).max_tokens == 9
    assert chat().to_sampling_params(49152, 256).max_tokens == 255     # a default leaves room for the prompt
    completion = msgspec.convert({"prompt": "x"}, CompletionRequest).with_server_defaults(defaults)
    p = completion.to_sampling_params(49152, 8192)
    assert (p.temperature, p.max_tokens) == (0.6, 16)          # completions keep OpenAI's 16, as vLLM does
    bare = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    p = bare.to_sampling_params(49152, 8192)
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, None)


# -- --max-logprobs ---------------------------------------------------------------------------

def test_max_logprobs_bounds_chat_top_logprobs_and_completion_logprobs_naming_the_field():
    five = ServerDefaults(max_logprobs=5)
    chat = lambda top, d=five: msgspec.convert(  # noqa: E731
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": top},
        ChatCompletionRequest).with_server_defaults(d)
    assert chat(5).to_sampling_params(100, 1000).logprobs == 5
    with pytest.raises(BadRequest, match=r"top_logprobs must be in \[0, 5\] \(the server's --max-logprobs\)") as exc:
        chat(6).to_sampling_params(100, 1000)
    assert exc.value.param == "top_logprobs"
    with pytest.raises(BadRequest):
        chat(21, ServerDefaults()).to_sampling_params(100, 1000)          # vLLM's default: 20
    assert chat(90, ServerDefaults(max_logprobs=-1)).to_sampling_params(100, 1000).logprobs == 90
    completion = lambda lp, echo=False: msgspec.convert(  # noqa: E731
        {"prompt": "x", "logprobs": lp, "echo": echo}, CompletionRequest).with_server_defaults(five)
    assert completion(5, echo=True).to_sampling_params(100, 1000).prompt_logprobs == 5
    with pytest.raises(BadRequest) as exc:
        completion(6, echo=True).to_sampling_params(100, 1000)
    assert exc.value.param == "logprobs"


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_add_up_every_api_servers_requests_and_keep_the_engines_once():
    """--api-server-count: /metrics shows the engine cores' stats once (every API server receives
    them) and the sum of each API server's request counters, finish reasons and histograms."""
    mine, other = (EngineStats(model="m", max_model_len=1000, api_server=i) for i in (0, 1))
    for stats, n in ((mine, 2), (other, 3)):
        stats.last = msgspec.structs.replace(stats.last, prefix_cache_hits=40, num_running=5)
        for _ in range(n):
            stats.observe_finished("length")
            stats.time_to_first_token.observe(0.03)
            stats.observe_request(num_prompt_tokens=10, num_generation_tokens=4, max_tokens=None, arrival_time=0.0,
                                  scheduled_time=0.1, first_token_time=0.2, last_token_time=0.5, now=0.6)
        stats.prompt_tokens, stats.generation_tokens = 10 * n, 4 * n
    text = mine.with_requests_of([msgspec.msgpack.decode(msgspec.msgpack.encode(other.request_stats(1)),
                                                         type=RequestStats)], 4).prometheus(("vllm", "troupe"))
    labels = 'model_name="m",engine="0"'
    for line in (f'vllm:prompt_tokens_total{{{labels}}} 50', f'vllm:generation_tokens_total{{{labels}}} 20',
                 f'vllm:request_success_total{{{labels},finished_reason="length"}} 5',
                 f'vllm:time_to_first_token_seconds_count{{{labels}}} 5',
                 f'vllm:e2e_request_latency_seconds_count{{{labels}}} 5',
                 f'vllm:prefix_cache_hits_total{{{labels}}} 40', f'vllm:num_requests_running{{{labels}}} 5',
                 f'troupe:api_server_requests_total{{{labels},api_server="0"}} 2',
                 f'troupe:api_server_requests_total{{{labels},api_server="1"}} 3',
                 f'troupe:api_server_requests_open{{{labels},api_server="0"}} 4',
                 f'troupe:api_server_requests_open{{{labels},api_server="1"}} 1'):
        assert line in text, line
    assert mine.prompt_tokens == 20 and sum(mine.requests_finished.values()) == 2     # its own stay its own


def test_metrics_are_written_under_vllm_and_troupe_prefixes_as_chosen():
    assert "watermark_requests" not in EngineStats(model="m").prometheus()    # vLLM's: only with a watermark
    assert "estimated_flops" not in EngineStats(model="m").prometheus()      # only with --enable-mfu-metrics
    assert "rl_weight_update" not in EngineStats(model="m").prometheus()     # once a weight transfer call ran
    stats = EngineStats(model="my-model", max_model_len=1000,
                        watermark_requests={"watermarked": 2, "skipped": 0, "not_watermarked": 1}, mfu=True)
    stats.last = msgspec.structs.replace(stats.last, spec_num_accepted_tokens_per_pos=[3, 1])
    assert "api_server_requests" not in stats.prometheus()            # only with several API servers
    stats = stats.with_requests_of([EngineStats(model="my-model", api_server=1).request_stats(2)], 1)
    with stats.operation("rl_weight_update", "init"), stats.operation("sleep_mode", "wake"):
        assert 'vllm:rl_weight_update_operations_in_flight{model_name="my-model",engine="0",operation="init"} 1' \
            in stats.prometheus()
    both = stats.prometheus()
    assert 'vllm:rl_weight_update_operation_duration_seconds_count{model_name="my-model",engine="0",operation="init"} 1' \
        in both
    assert 'troupe:api_server_requests_open{model_name="my-model",engine="0",api_server="1"} 2' in both
    assert 'vllm:watermark_requests_total{model_name="my-model",engine="0",status="watermarked"} 2' in both
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="my-model",engine="0",position="1"} 1' in both
    for m in METRICS:
        for prefix in ("vllm", "troupe") if m.vllm else ("troupe",):
            assert f"# TYPE {prefix}:{m.name} {m.kind}\n" in both, (prefix, m.name)
            assert re.search(rf"^{prefix}:{m.name}(_bucket|_sum|_count)?{{", both, re.M), (prefix, m.name)
    assert "vllm:batch_size" not in both and "troupe:batch_size" in both
    only_vllm = stats.prometheus(("vllm",))
    assert "troupe:" not in only_vllm and all(f"# TYPE {n} " in only_vllm for n in VLLM_METRIC_NAMES)
    assert 'vllm:num_requests_running{model_name="my-model",engine="0"} 0' in only_vllm
    assert parse_prefixes("troupe, vllm") == ("troupe", "vllm")
    for bad in ("", "vllm,vllm", "prom"):
        with pytest.raises(ValueError):
            parse_prefixes(bad)


def test_request_histograms_count_sizes_phases_and_choices():
    stats = EngineStats(model="m", max_model_len=100)
    stats.observe_request(num_prompt_tokens=10, num_generation_tokens=5, max_tokens=None, arrival_time=100.0,
                          scheduled_time=100.5, first_token_time=101.0, last_token_time=103.0, now=103.5)
    stats.observe_choices(3, 5)
    assert stats.request_prefill_time.sum == pytest.approx(0.5)
    assert stats.request_decode_time.sum == pytest.approx(2.0)
    assert stats.request_inference_time.sum == pytest.approx(2.5)
    assert stats.request_time_per_output_token.sum == pytest.approx(0.5)      # 2 s over 4 tokens
    assert stats.request_params_max_tokens.sum == 90                            # what the context left
    assert stats.e2e_request_latency.sum == pytest.approx(3.5)
    assert stats.request_params_n.sum == 3 and stats.request_max_num_generation_tokens.sum == 5
    assert stats.request_prompt_tokens.buckets == (1, 2, 5, 10, 20, 50, 100)


def test_custom_histogram_buckets_replace_a_familys_buckets_on_metrics_and_bad_ones_are_refused():
    """vLLM's --custom-histogram-buckets: the time_to_first_token family's bounds replace TTFT's
    buckets, request_latency's all five phase histograms'; other families keep their defaults;
    vLLM's checks refuse an unknown family, an empty list, a bound <= 0, bounds out of order."""
    args = serve.parse_args(["--custom-histogram-buckets",
                             '{"time_to_first_token": [0.05, 0.5, 5], "request_latency": [1, 10]}'])
    buckets = EngineArgs.from_cli_args(args).create_engine_config().observability.custom_histogram_buckets
    stats = EngineStats(model="m", custom_buckets=buckets)
    stats.time_to_first_token.observe(0.2)
    text = stats.prometheus(("vllm",))
    assert re.findall(r'vllm:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"\} (\d+)', text) == \
        [("0.05", "0"), ("0.5", "1"), ("5", "1"), ("+Inf", "1")]
    assert stats.request_queue_time.buckets == (1, 10) and stats.e2e_request_latency.buckets == (1, 10)
    assert stats.inter_token_latency.buckets == EngineStats().inter_token_latency.buckets
    for bad, words in (('{"ttft": [1]}', "unknown bucket family 'ttft'"),
                       ('{"time_to_first_token": []}', "must not be empty"),
                       ('{"iteration_tokens": [0, 8]}', "must be finite and greater than 0"),
                       ('{"iteration_tokens": [8, 8]}', "must be strictly increasing")):
        with pytest.raises(ValueError, match=re.escape(words)):
            EngineArgs.from_cli_args(serve.parse_args(["--custom-histogram-buckets", bad])).create_engine_config()


def test_the_readme_metrics_table_lists_every_metric_and_no_other():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("### Metrics", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(vllm|troupe):([a-z0-9_]+)`", section, re.M)
    assert sorted(name for _, name in listed) == sorted(m.name for m in METRICS)
    assert all((prefix == "vllm") == m.vllm for (prefix, name), m in
               zip(sorted(listed, key=lambda p: p[1]), sorted(METRICS, key=lambda m: m.name)))
    for m in METRICS:
        row = next(line for line in section.splitlines() if f":{m.name}` |" in line)
        assert f"| {m.kind} |" in row and ("troupe: only" in row) == (not m.vllm), row


# -- the troupe command -----------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_troupe_command_lists_its_subcommands_and_prints_its_version():
    r = _cli("--help")
    assert r.returncode == 0 and all(name in r.stdout for name in ("serve", "chat", "batch", "bench", "trace"))
    r = _cli("--version")
    assert r.returncode == 0 and re.fullmatch(r"troupe \S+\n", r.stdout)
    r = _cli("trace", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: troupe trace")
    r = _cli("bench", "--help")
    assert r.returncode == 0 and "offline" in r.stdout
    r = _cli("launch")
    assert r.returncode == 2 and "unknown subcommand 'launch'" in r.stderr


# -- --enable-log-requests --------------------------------------------------------------------

def test_with_enable_log_requests_each_admitted_request_is_logged_once_at_info(caplog):
    import asyncio
    from types import SimpleNamespace

    from actors.engine.sampling_params import SamplingParams
    from actors.frontend.app import OpenAIServer, ServerOptions

    class Engine:
        async def submit(self, params, **kwargs):
            return SimpleNamespace(request_id=kwargs["request_id"], num_prompt_tokens=7)

    for log_requests in (True, False):
        server = OpenAIServer(options=ServerOptions(log_requests=log_requests))
        server.client = Engine()
        with caplog.at_level("INFO", logger="troupe.http"):
            caplog.clear()
            asyncio.run(server.submit(SamplingParams(temperature=0.5, max_tokens=9, seed=3), request_id="req-1"))
        lines = [r.getMessage() for r in caplog.records if r.name == "troupe.http"]
        if log_requests:
            assert lines == ["request req-1: 7 prompt tokens, params: max_tokens=9, temperature=0.5, seed=3"]
        else:
            assert lines == []


def test_the_offline_api_samples_with_generation_config_defaults_when_given_no_params():
    from types import SimpleNamespace

    from actors.api import AsyncLLM
    from actors.engine.sampling_params import SamplingDefaults
    llm = AsyncLLM.__new__(AsyncLLM)
    model = SimpleNamespace(sampling_defaults=SamplingDefaults(temperature=0.6, top_p=0.9, max_tokens=12))
    llm.client = SimpleNamespace(config=SimpleNamespace(model=model))
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 12)
    model.sampling_defaults = SamplingDefaults()
    assert llm.default_sampling_params().temperature == 1.0      # vLLM's own default


def test_every_request_field_of_vllm_0_32_is_a_field_here():
    """tests/unit/data/vllm_0.32_request_fields.json: the fields of vLLM 0.32's chat, completion
    and Responses requests (their pydantic models'). Each is a field of Troupe's request, so none
    is an "unknown field" 400: it is served, accepted as what Troupe does, or refused naming it.
    The same for its SamplingParams, but for four named fields."""
    from actors.frontend.protocol import ChatCompletionRequest, CompletionRequest
    from actors.frontend.responses import ResponsesRequest
    with open(os.path.join(ROOT, "tests", "unit", "data", "vllm_0.32_request_fields.json")) as f:
        vllm = json.load(f)
    assert {k: len(v) for k, v in vllm.items()} == {"chat": 68, "completion": 55, "responses": 53,
                                                    "sampling_params": 39}
    for name, cls in (("chat", ChatCompletionRequest), ("completion", CompletionRequest),
                      ("responses", ResponsesRequest)):
        assert not set(vllm[name]) - set(cls.__struct_fields__), name
    # the offline SamplingParams: vLLM's public fields but an internal one and those refused by
    # name (a TypeError naming it): decode tracing, MoE routing capture
    from actors.engine.sampling_params import SamplingParams
    missing = set(vllm["sampling_params"]) - set(SamplingParams.__struct_fields__)
    assert missing == {"output_text_buffer_length", "trace_decode_token_ids", "routed_experts_prompt_start"}
    with pytest.raises(TypeError, match="trace_decode_token_ids"):
        SamplingParams(trace_decode_token_ids=[1])


def test_tokenizer_names_a_tokenizer_directory_a_gguf_file_or_a_known_model(tmp_path):
    from models.resolve import ModelNotFoundError, default_gguf_path, resolve_tokenizer
    assert resolve_tokenizer(None) is None
    assert resolve_tokenizer("smollm2") == ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer(str(tmp_path)) == ModelSource("hf_dir", str(tmp_path), str(tmp_path))
    config = EngineArgs.from_cli_args(serve.parse_args(["--tokenizer", str(tmp_path)])).create_engine_config()
    assert config.model.tokenizer == ModelSource("hf_dir", str(tmp_path), str(tmp_path))
    assert EngineArgs().create_engine_config().model.tokenizer == config.model.source     # the model's own
    with pytest.raises(ModelNotFoundError, match="the directory has no tokenizer.json"):
        resolve_tokenizer(str(tmp_path / ".."))
    with pytest.raises(ModelNotFoundError, match="Troupe never downloads"):
        resolve_tokenizer("meta-llama/Llama-3.2-1B")


def test_several_api_servers_are_refused_on_a_headless_machine(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--headless", "-dp", "2", "-dpl", "1", "-asc", "2"])
    assert exc.value.code == 2 and "--api-server-count: a --headless machine runs no API server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["-asc", "0"])
    for argv in (["-dp", "2"], ["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1"], ["-dp", "2", "-dpl", "0"],
                 ["-dp", "2", "--data-parallel-backend", "ray"]):
        assert serve.parse_args([*argv, "-asc", "3"]).api_server_count == 3


def test_the_metrics_reader_gives_vllms_objects_for_every_metric_of_the_exposition():
    """``metrics_snapshot`` (what LLM.get_metrics returns) of the text /metrics serves: a label
    value with quotes and backslashes comes back as it was, every vllm: metric is one object per
    label set (no Troupe-only troupe: names), counters lose ``_total``, histogram buckets count
    up to ``+Inf``."""
    from actors.frontend.metrics_reader import Counter, Gauge, Histogram, metrics_snapshot
    stats = EngineStats(model='a "quoted" \\ model')
    stats.time_to_first_token.observe(0.03)
    stats.time_to_first_token.observe(7.0)
    stats.observe_finished("length")
    text = stats.prometheus(("vllm", "troupe"))
    metrics = metrics_snapshot(text)
    assert all(m.name.startswith("vllm:") for m in metrics)
    samples = [line for line in text.splitlines() if line.startswith("vllm:")]
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE vllm:")
                if any(s.startswith(line.split()[2]) for s in samples)}      # those with samples
    assert {m.name for m in metrics} == {f.removesuffix("_total") if f"# TYPE {f} counter" in text else f
                                         for f in families}
    by_name = {}
    for m in metrics:
        by_name.setdefault(m.name, []).append(m)
    ttft, = by_name["vllm:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and (ttft.count, ttft.sum) == (2, pytest.approx(7.03))
    assert ttft.labels == {"model_name": 'a "quoted" \\ model', "engine": "0"}
    assert list(ttft.buckets)[-1] == "+Inf" and ttft.buckets["+Inf"] == 2 and ttft.buckets["0.04"] == 1
    success = {m.labels["finished_reason"]: m.value for m in by_name["vllm:request_success"]}
    assert all(isinstance(m, Counter) for m in by_name["vllm:request_success"]) and success["length"] == 1
    running, = by_name["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0.0


def test_the_offline_api_takes_vllms_keywords_as_the_server_takes_their_flags():
    """``LLM(model, trust_remote_code=True, enable_chunked_prefill=True, ...)``, a vLLM script's
    keywords: those asking for what Troupe does are accepted (changing nothing), those it does
    not implement are a ValueError with the server's reason, a name vLLM does not have either is
    the TypeError listing the options."""
    accepted = EngineArgs.from_options(None, dict(trust_remote_code=True, enable_chunked_prefill=True,
                                                  tokenizer_mode="auto", disable_custom_all_reduce=False,
                                                  max_model_len=512))
    assert accepted.max_model_len == 512 and accepted == EngineArgs(max_model_len=512, enable_chunked_prefill=True)
    assert EngineArgs.from_options(None, dict(enable_chunked_prefill=False)).enable_chunked_prefill is False
    for options, why in ((dict(swap_space=4), "swap_space is a vLLM option Troupe does not implement: Troupe keeps"),
                         (dict(tokenizer_mode="mistral"), "tokenizer_mode='mistral' is a vLLM setting")):
        with pytest.raises(ValueError, match=re.escape(why)):
            EngineArgs.from_options(None, options)
    with pytest.raises(TypeError, match=r"unknown engine options \['no_such_option'\]"):
        EngineArgs.from_options(None, dict(no_such_option=1, trust_remote_code=True))
    # one table for both: every refused flag's keyword is refused offline, with the same reason
    from actors.engine.vllm_options import offline_option
    for flag, reason in vllm_flags.REFUSED.items():
        assert offline_option(flag[2:].replace("-", "_"), 7) == \
            f"{flag[2:].replace('-', '_')} is a vLLM option Troupe does not implement: {reason}"
