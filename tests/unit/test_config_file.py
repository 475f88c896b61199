"""vLLM's --config FILE.yaml: a deployment's YAML file of flags runs unchanged under `troupe serve`
(and `troupe run-batch`); the command line wins over the file, and a bad file stops the command
with one line naming it. vLLM's dotted keys of a JSON flag (--speculative-config.method ngram) too."""
from __future__ import annotations

import pytest

from actors.engine.args import EngineArgs
from tools import batch, serve

FILE = """\
model: HuggingFaceTB/SmolLM2-135M-Instruct
port: 8123
max_num_seqs: 7                   # underscores as vLLM's parser takes them
enable-prefix-caching: false
enable-log-requests: true
served-model-name: [first, second]
allowed-origins: ["https://app.example"]
speculative-config:
  method: ngram
  num_speculative_tokens: 3
override-generation-config: {temperature: 0.25}
"""


def _write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_vllm_config_file_sets_every_kind_of_flag(tmp_path):
    args = serve.parse_args(["--config", _write(tmp_path, FILE)])
    assert (args.model, args.port, args.max_num_seqs) == ("HuggingFaceTB/SmolLM2-135M-Instruct", 8123, 7)
    assert args.enable_prefix_caching is False and args.enable_log_requests is True
    assert args.served_model_name == ["first", "second"]
    assert args.allowed_origins == ["https://app.example"]
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.model.sampling_defaults.temperature == 0.25
    assert config.cache.enable_prefix_caching is False and config.model.served_model_names == ("first", "second")


def test_the_command_line_wins_over_the_file_and_a_positional_model_over_its_model(tmp_path):
    path = _write(tmp_path, FILE)
    args = serve.parse_args(["my/model", "--config", path, "--port", "9000", "--enable-prefix-caching",
                             "--served-model-name", "cli"])
    assert (args.model, args.port, args.max_num_seqs) == ("my/model", 9000, 7)
    assert args.enable_prefix_caching is True and args.served_model_name == ["cli"]
    assert serve.parse_args([f"--config={path}"]).port == 8123        # the --config=FILE spelling


def test_an_empty_file_changes_nothing_and_false_turns_a_default_on_flag_off(tmp_path):
    assert serve.parse_args(["--config", _write(tmp_path, "")]).port == serve.parse_args([]).port
    args = serve.parse_args(["--config", _write(tmp_path, "lenient: false\nasync-scheduling: false\n", "b.yaml")])
    assert args.lenient is False and args.async_scheduling is False


def test_run_batch_reads_the_same_file_format(tmp_path):
    args = batch.parse_args(["-i", "in.jsonl", "-o", "out.jsonl", "--config",
                             _write(tmp_path, "max-num-seqs: 9\nlenient: true\n")])
    assert (args.max_num_seqs, args.lenient) == (9, True)


@pytest.mark.parametrize("text, name, message", [
    ("no-such-flag: 1\n", "c.yaml", "'no-such-flag' is not a flag of this command"),
    ("- a list\n", "c.yaml", "expected a mapping of flag names to values, got a list"),
    ("port: [1\n", "c.yaml", "not valid YAML"),
    ("port: 1\n", "c.json", "the file must be YAML (.yaml or .yml)"),
])
def test_a_bad_file_exits_2_naming_the_file_and_the_fault(tmp_path, capsys, text, name, message):
    path = _write(tmp_path, text, name)
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--config", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path}: {message}" in err


def test_a_missing_file_twice_given_or_valueless_config_is_refused(tmp_path, capsys):
    for argv, message in ((["--config", str(tmp_path / "none.yaml")], "No such file or directory"),
                          (["--config", "a.yaml", "--config", "b.yaml"], "--config is given more than once"),
                          (["--config"], "--config needs a YAML file")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_vllm_flag_troupe_lacks_is_refused_from_the_file_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--config", _write(tmp_path, "decode-context-parallel-size: 2\n")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(
        "troupe: error: --decode-context-parallel-size is a vLLM flag Troupe does not implement")


def test_dotted_keys_build_a_json_flag_as_vllm_reads_them():
    args = serve.parse_args(["--speculative-config.method", "ngram", "--port", "8001",
                             "--speculative-config.num_speculative_tokens=3"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.speculative.method, config.speculative.num_speculative_tokens, args.port) == ("ngram", 3, 8001)
    # keys join the flag's JSON given whole (the keys win), nest, and `key+ a,b` is a list
    args = serve.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                             "--speculative-config.num_speculative_tokens", "4",
                             "--compilation-config.cudagraph_capture_sizes+", "1,2,4",
                             "--compilation-config.pass_config.fuse_norm_quant", "true"])
    assert args.speculative_config == '{"method": "ngram", "num_speculative_tokens": 4}'
    assert args.compilation_config == ('{"cudagraph_capture_sizes": [1, 2, 4], '
                                       '"pass_config": {"fuse_norm_quant": true}}')


def test_a_dotted_value_that_is_not_json_is_a_size_or_text():
    args = serve.parse_args(["--kv-transfer-config.kv_connector", "NixlConnector",
                             "--kv-transfer-config.kv_buffer_size", "1G"])
    assert args.kv_transfer_config == '{"kv_connector": "NixlConnector", "kv_buffer_size": 1073741824}'


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config.method"], "--speculative-config.method needs a value"),
    (["--compilation-config.mode", "0", "--compilation-config.mode.x", "1"], "given both as a value and as an object"),
    (["--speculative-config", "[1]", "--speculative-config.method", "ngram"], "given both whole"),
    (["--speculative-config..method", "ngram"], "an empty key"),
])
def test_a_bad_dotted_key_exits_2_naming_it(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
