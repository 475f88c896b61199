"""Pooling models' settings, resolved as vLLM resolves them (--runner, --convert, --pooler-config,
a sentence-transformers checkpoint's modules.json, a request's PoolingParams), and the pooler's
arithmetic over a prompt computed in chunks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.engine.args import EngineArgs
from actors.engine.pooling import (ModelPooling, PoolerConfig, PoolingParams, model_pooling, pooler_config,
                                   resolve_runner, sentence_transformers_dense, sentence_transformers_pooling)
from actors.worker.pooler import Pooler


@pytest.mark.parametrize("architecture,runner,convert,expected", [
    ("LlamaForCausalLM", "auto", "auto", ("generate", "none")),
    ("LlamaModel", "auto", "auto", ("pooling", "embed")),
    ("Qwen3ForCausalLM", "pooling", "auto", ("pooling", "embed")),
    ("Qwen3ForCausalLM", "auto", "embed", ("pooling", "embed")),
    ("Gemma3TextModel", "pooling", "auto", ("pooling", "embed")),
    ("Qwen3ForSequenceClassification", "auto", "auto", ("pooling", "classify")),
    ("LlamaForCausalLM", "auto", "classify", ("pooling", "classify")),
])
def test_runner_and_conversion_follow_vllms_defaults(architecture, runner, convert, expected):
    assert resolve_runner(architecture, runner, convert) == expected


def test_runners_that_cannot_serve_the_checkpoint_are_refused_in_vllms_words():
    with pytest.raises(ValueError, match="Embedding models do not support `--runner generate`"):
        resolve_runner("LlamaModel", "generate", "auto")
    with pytest.raises(ValueError, match="You can pass `--convert embed`"):
        resolve_runner("LlamaForCausalLM", "pooling", "none")
    with pytest.raises(ValueError, match="--convert reward .* is not supported yet"):
        resolve_runner("LlamaForCausalLM", "pooling", "reward")
    with pytest.raises(ValueError, match="--runner must be one of"):
        resolve_runner("LlamaForCausalLM", "embedding", "auto")


def test_pooler_config_reads_vllms_json_and_refuses_what_it_cannot_do():
    assert pooler_config('{"pooling_type": "mean"}').seq_pooling_type == "MEAN"
    assert pooler_config({"pooling_type": "ALL"}).tok_pooling_type == "ALL"
    assert pooler_config('{"use_activation": false, "dimensions": 8}') == PoolerConfig(use_activation=False,
                                                                                       dimensions=8)
    with pytest.raises(ValueError, match="Parameter `normalize` was removed; use `use_activation` instead."):
        pooler_config('{"normalize": true}')
    with pytest.raises(ValueError, match="pooling_type 'MAX' is not one of"):
        pooler_config('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="Cannot set both `pooling_type` and `seq_pooling_type`"):
        pooler_config('{"pooling_type": "CLS", "seq_pooling_type": "MEAN"}')
    assert pooler_config('{"enable_chunked_processing": true}').enable_chunked_processing
    with pytest.raises(ValueError, match="max_embed_len must be at least 1, got 0"):
        pooler_config('{"max_embed_len": 0}')
    with pytest.raises(ValueError, match="--pooler-config"):
        pooler_config('{"pooling_typ": "MEAN"}')


def _sentence_transformers_files(path, pooling: dict, normalize: bool, dense: bool = False) -> str:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return str(path)


def test_a_sentence_transformers_checkpoint_says_how_it_pools(tmp_path):
    (tmp_path / "mean").mkdir()
    mean = _sentence_transformers_files(tmp_path / "mean", {"pooling_mode_mean_tokens": True,
                                                             "pooling_mode_cls_token": False}, normalize=True)
    assert sentence_transformers_pooling(mean) == {"use_activation": True, "seq_pooling_type": "MEAN"}
    (tmp_path / "last").mkdir()
    last = _sentence_transformers_files(tmp_path / "last", {"pooling_mode_lasttoken": True}, normalize=False)
    assert sentence_transformers_pooling(last) == {"use_activation": False, "seq_pooling_type": "LAST"}
    # the user's --pooler-config wins over the checkpoint's own, key by key
    settings = model_pooling(PoolerConfig(seq_pooling_type="CLS"), "embed", mean, {})
    assert (settings.pooler.seq_pooling_type, settings.pooler.use_activation) == ("CLS", True)
    assert sentence_transformers_pooling(str(tmp_path)) == {}        # no modules.json: not one


def test_a_sentence_transformers_dense_projection_is_read_with_its_weights_and_activation(tmp_path):
    import torch
    from safetensors.torch import save_file

    from actors.worker.pooler import dense_projector
    dense = _sentence_transformers_files(tmp_path, {"pooling_mode_mean_tokens": True}, True, dense=True)
    assert sentence_transformers_pooling(dense) == {"use_activation": True, "seq_pooling_type": "MEAN"}
    assert sentence_transformers_dense(dense) == ()         # a Dense folder without its config.json: skipped
    (tmp_path / "2_Dense").mkdir()
    config = {"in_features": 64, "out_features": 32, "bias": True,
              "activation_function": "torch.nn.modules.activation.Tanh"}
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Dense projection has no weights"):
        sentence_transformers_dense(dense)
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    save_file({"linear.weight": weight, "linear.bias": bias}, str(tmp_path / "2_Dense" / "model.safetensors"))
    (layer,) = sentence_transformers_dense(dense)
    assert (layer.in_features, layer.out_features, layer.bias, layer.activation) == (64, 32, True, "tanh")
    x = torch.randn(3, 64)
    torch.testing.assert_close(dense_projector((layer,))(x), torch.tanh(x @ weight.T + bias))
    settings = model_pooling(None, "embed", dense, {"is_matryoshka": True})
    assert settings.dense == (layer,) and settings.embedding_size(64) == 32
    with pytest.raises(ValueError, match=r"dimensions in range \[1, 32\], got 48"):
        settings.params(PoolingParams(dimensions=48), 64)
    assert model_pooling(None, "classify", dense, {}).dense == ()      # a classifier's head is its score layer
    config["activation_function"] = "torch.nn.modules.activation.Softplus"
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Activation function 'softplus' is not supported."):
        sentence_transformers_dense(dense)


@pytest.mark.parametrize("config,labels,activation", [
    ({"id2label": {"0": "neg", "1": "pos"}}, ("neg", "pos"), "softmax"),
    ({"num_labels": 1}, ("LABEL_0",), "sigmoid"),
    ({}, ("LABEL_0", "LABEL_1"), "softmax"),                          # transformers' default: two
    ({"num_labels": 3, "problem_type": "multi_label_classification"}, ("LABEL_0", "LABEL_1", "LABEL_2"), "sigmoid"),
    ({"num_labels": 1, "problem_type": "regression"}, ("LABEL_0",), "identity"),
    ({"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
     ("LABEL_0",), "identity"),
])
def test_a_classifiers_labels_and_activation_follow_its_config(config, labels, activation):
    settings = model_pooling(None, "classify", None, config)
    assert (settings.labels, settings.activation, settings.tasks) == (labels, activation, ("classify",))
    assert settings.params(None, 64) == PoolingParams(task="classify", use_activation=True, pooling_type="LAST")


def test_a_token_classifier_labels_tokens_with_a_biased_head():
    settings = model_pooling(None, "classify", None, {"architectures": ["LlamaForTokenClassification"],
                                                      "num_labels": 5})
    assert settings.tasks == ("token_classify",) and settings.head_bias and settings.num_labels == 5
    assert settings.params(None, 64).pooling_type == "ALL"
    assert not model_pooling(None, "classify", None, {"architectures": ["LlamaForTokenClassification"],
                                                      "token_classification_bias": False}).head_bias
    assert resolve_runner("Qwen2ForTokenClassification", "auto", "auto") == ("pooling", "classify")


def test_a_classifier_from_token_rows_names_what_it_lacks():
    ids = {"no": 3, "yes": 7}.get
    qwen3 = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    settings = model_pooling(None, "classify", None, qwen3, ids)
    assert (settings.labels, settings.score_from_tokens, settings.activation) == (("LABEL_0",), (3, 7), "sigmoid")
    for config, words in (({"classifier_from_token": ["no", "yes"]}, "needs a method"),
                          ({**qwen3, "classifier_from_token": ["yes"]}, "takes two tokens"),
                          ({**qwen3, "classifier_from_token": ["no", "maybe"]}, "'maybe' is not a token")):
        with pytest.raises(ValueError, match=words):
            model_pooling(None, "classify", None, config, ids)


def test_a_cross_encoders_activation_outside_torch_nn_is_refused():
    with pytest.raises(ValueError, match="activation 'os.system' is not supported"):
        model_pooling(None, "classify", None, {"sbert_ce_default_activation_function": "os.system"})


def test_request_params_take_the_models_defaults_and_matryoshka_limits():
    plain = ModelPooling(pooler=PoolerConfig(seq_pooling_type="MEAN", tok_pooling_type="ALL"))
    assert plain.params(None, 64) == PoolingParams(task="embed", use_activation=True, pooling_type="MEAN")
    assert plain.params(PoolingParams(task="token_embed", use_activation=False), 64).pooling_type == "ALL"
    with pytest.raises(ValueError, match="does not support Matryoshka embeddings"):
        plain.params(PoolingParams(dimensions=8), 64)
    with pytest.raises(ValueError, match="Task classify is not supported by this model"):
        plain.params(PoolingParams(task="classify"), 64)
    matryoshka = ModelPooling(pooler=PoolerConfig(seq_pooling_type="LAST"), is_matryoshka=True,
                              matryoshka_dimensions=(16, 32))
    assert matryoshka.params(PoolingParams(dimensions=16), 64).dimensions == 16
    with pytest.raises(ValueError, match=r"only supports Matryoshka dimensions \[16, 32\], got 8"):
        matryoshka.params(PoolingParams(dimensions=8), 64)
    with pytest.raises(ValueError, match=r"only supports dimensions in range \[1, 64\], got 65"):
        ModelPooling(is_matryoshka=True).params(PoolingParams(dimensions=65), 64)


def test_engine_config_of_a_pooling_model_refuses_generation_options_and_async_scheduling():
    config = EngineArgs(runner="pooling").create_engine_config()
    assert config.model.runner == "pooling" and config.model.pooling.pooler.seq_pooling_type == "LAST"
    assert EngineArgs().create_engine_config().model.pooling is None
    with pytest.raises(ValueError, match="--runner pooling .* does not take --async-scheduling"):
        EngineArgs(runner="pooling", async_scheduling=True).create_engine_config()
    with pytest.raises(ValueError, match="--pooler-config is for pooling models"):
        EngineArgs(pooler_config='{"pooling_type": "MEAN"}').create_engine_config()
    with pytest.raises(ValueError, match="a GGUF file has none"):
        EngineArgs(convert="classify").create_engine_config()
    from actors.engine.config import DeviceConfig
    resolved = config.replace(device=DeviceConfig(device="cpu"))
    from models.registry import model_config
    arch = model_config(config.model.source)
    assert resolved.resolve(cuda_available=False, cpu_count=2, arch=arch).scheduler.async_scheduling is False


def _pooled_in_chunks(params: PoolingParams, rows: torch.Tensor, chunks: list[int]) -> np.ndarray:
    pooler, start, out = Pooler(), 0, None
    for n in chunks:
        got = pooler.add("r", params, rows[start:start + n], start, len(rows))
        assert (got is not None) == (start + n == len(rows))
        out, start = got, start + n
    assert not pooler.partial
    return out


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS", "ALL"])
def test_a_prompt_pooled_in_chunks_equals_it_pooled_whole(kind):
    rows = torch.randn(11, 8, generator=torch.Generator().manual_seed(0))
    params = PoolingParams(pooling_type=kind, use_activation=False)
    whole = _pooled_in_chunks(params, rows, [11])
    expected = {"LAST": rows[-1], "MEAN": rows.mean(0), "CLS": rows[0], "ALL": rows}[kind].numpy()
    np.testing.assert_allclose(whole, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_pooled_in_chunks(params, rows, [4, 4, 3]), whole, rtol=1e-6, atol=1e-6)


def test_pooled_vectors_are_cut_to_their_dimensions_then_normalized():
    rows = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    out = _pooled_in_chunks(PoolingParams(pooling_type="MEAN", dimensions=3, use_activation=True), rows, [5])
    expected = rows.mean(0)[:3] / rows.mean(0)[:3].norm()
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-6, atol=1e-6)
    assert abs(float(np.linalg.norm(out)) - 1.0) < 1e-6


def test_a_preempted_request_starts_its_pooling_over():
    rows = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    params = PoolingParams(pooling_type="MEAN", use_activation=False)
    pooler = Pooler()
    assert pooler.add("r", params, rows[:3], 0, 6) is None
    pooler.forget(["r"])                         # preempted: recomputed from its first token
    assert pooler.add("r", params, rows[:3], 0, 6) is None
    np.testing.assert_allclose(pooler.add("r", params, rows[3:], 3, 6), rows.mean(0).numpy(), rtol=1e-6, atol=1e-6)


def test_a_reward_model_is_a_token_classifier_with_its_own_head():
    assert resolve_runner("Qwen2ForProcessRewardModel", "auto", "auto") == ("pooling", "classify")
    assert resolve_runner("Qwen2ForRewardModel", "pooling", "none") == ("pooling", "classify")
    with pytest.raises(ValueError, match="is a reward model: it scores every token with its own head"):
        resolve_runner("Qwen2ForRewardModel", "pooling", "embed")
    prm = model_pooling(pooler_config('{"step_tag_id": 12, "returned_token_ids": [1]}'), "classify", None,
                        {"architectures": ["Qwen2ForProcessRewardModel"]})
    assert (prm.tasks, prm.labels, prm.score_mlp, prm.activation) == (("token_classify",), ("LABEL_0", "LABEL_1"),
                                                                      True, "auto")
    assert prm.params(None, 64) == PoolingParams(task="token_classify", use_activation=True, pooling_type="STEP",
                                                 step_tag_id=12, returned_token_ids=(1,))
    assert prm.params(PoolingParams(step_tag_id=5), 64).step_tag_id == 5        # the request's own wins
    rm = model_pooling(None, "classify", None, {"architectures": ["Qwen2ForRewardModel"]})
    assert rm.num_labels == 1 and rm.params(None, 64).pooling_type == "ALL"
    assert pooler_config('{"pooling_type": "STEP"}').tok_pooling_type == "STEP"
