"""Classifiers (vLLM's --convert classify; transformers' ...ForSequenceClassification checkpoints):
their label probabilities through the whole engine equal transformers'; a classifier of one label
is a cross-encoder that /score, /rerank and LLM.score read each query and document pair with, as
transformers' tokenizer encodes a text pair."""
from __future__ import annotations

import json

import numpy as np
import pytest
import requests
import torch

from actors.api import LLM
from helpers import save_tiny_tokenizer
from server import Server

pytestmark = pytest.mark.slow

VOCAB = 128
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


# the tiny decoder every checkpoint here has (with its architecture's own extra keys)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, num_hidden_layers=2)


def _saved(path, model):
    """``model`` with random weights, saved at ``path`` with the tiny tokenizer: (its path, it)."""
    model = _randomized(model)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    return str(path), model


def _randomized(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)
    return model.eval()


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    """A tiny LlamaForSequenceClassification with three named labels."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    return _saved(tmp_path_factory.mktemp("sentiment"), LlamaForSequenceClassification(LlamaConfig(
        **TINY, pad_token_id=0, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny Qwen3ForSequenceClassification of one label (a cross-encoder)."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    return _saved(tmp_path_factory.mktemp("reranker"), Qwen3ForSequenceClassification(Qwen3Config(
        **TINY, pad_token_id=0, num_labels=1)))


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


PROMPTS = [[5, 9, 2, 7, 3], [11, 12, 13], [(7 * i + 5) % 127 + 1 for i in range(40)]]


def test_a_sequence_classifier_gives_transformers_label_probabilities(sentiment):
    path, reference = sentiment
    with LLM(path, multiprocess=False, max_num_batched_tokens=16) as llm:     # the long prompt in chunks
        assert llm._run(llm._engine().get_supported_tasks()) == ("classify",)
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        raw = llm.encode([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)[0]     # the model's own task
        with pytest.raises(ValueError, match="Task embed is not supported by this model"):
            llm.embed([PROMPTS[0]], use_tqdm=False)
        with pytest.raises(ValueError, match="needs a cross-encoder"):
            llm.score("t1 t2", ["t3 t4"], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, torch.softmax(_logits(reference, ids), -1).numpy(), atol=2e-5)
    np.testing.assert_allclose(raw.outputs.data.numpy(), outs[0].outputs.probs, atol=1e-6)


def test_a_token_classifier_labels_every_prompt_token_as_transformers_does(tmp_path):
    """A tiny Qwen2ForTokenClassification (its head with a bias): the pooling task token_classify
    gives each prompt token's label probabilities, the prompt computed in chunks."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    _, reference = _saved(tmp_path, Qwen2ForTokenClassification(Qwen2Config(**TINY, pad_token_id=0, num_labels=4)))
    with LLM(str(tmp_path), multiprocess=False, max_num_batched_tokens=16) as llm:
        assert llm._run(llm._engine().get_supported_tasks()) == ("token_classify",)
        (out,) = llm.encode([{"prompt_token_ids": PROMPTS[2]}], use_tqdm=False)
        with pytest.raises(ValueError, match="Task classify is not supported by this model"):
            llm.classify([PROMPTS[0]], use_tqdm=False)
    assert tuple(out.outputs.data.shape) == (40, 4)
    np.testing.assert_allclose(out.outputs.data.numpy(), torch.softmax(_logits(reference, PROMPTS[2]), -1).numpy(),
                               atol=2e-5)


def _reward_checkpoint(path, architecture: str, labels: int):
    """A tiny Qwen2 reward model as its (remote-code) checkpoints are saved: the decoder stack under
    "model.", a score MLP (hidden -> hidden, ReLU, -> labels) under "score.0" and "score.2"."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model
    config = Qwen2Config(**TINY, architectures=[architecture])
    stack = _randomized(Qwen2Model(config))
    torch.manual_seed(3)
    score = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, labels)).eval()
    tensors = {f"model.{k}": v.contiguous() for k, v in stack.state_dict().items()}
    tensors.update({f"score.{k}": v.contiguous() for k, v in score.state_dict().items()})
    tensors["lm_head.weight"] = torch.randn(VOCAB, 64)          # saved by the causal LM it came from; unused
    save_file(tensors, str(path / "model.safetensors"))
    config.to_json_file(str(path / "config.json"))
    save_tiny_tokenizer(path, VOCAB)

    def reference(ids: list[int]) -> torch.Tensor:             # every token's scores
        with torch.no_grad():
            return score(stack(torch.tensor([ids])).last_hidden_state[0].float())
    return reference


def test_a_process_reward_model_scores_each_step_tag_and_an_outcome_model_every_token(tmp_path):
    """vLLM's Qwen2ForProcessRewardModel (STEP pooling: the rows of the step tag's tokens,
    softmax over its two labels, or the columns returned_token_ids keeps) and
    Qwen2ForRewardModel (a score per token, sigmoid; raw without activation), prompts computed
    in chunks."""
    from actors.api import PoolingParams
    (tmp_path / "prm").mkdir()
    (tmp_path / "rm").mkdir()
    prm = _reward_checkpoint(tmp_path / "prm", "Qwen2ForProcessRewardModel", 2)
    rm = _reward_checkpoint(tmp_path / "rm", "Qwen2ForRewardModel", 1)
    tag = 99
    prompt = [tag if i % 7 == 6 else t for i, t in enumerate(PROMPTS[2])]     # a step every 7 tokens
    steps = [i for i, t in enumerate(prompt) if t == tag]
    assert len(steps) == 5
    with LLM(str(tmp_path / "prm"), multiprocess=False, max_num_batched_tokens=16,
             pooler_config={"step_tag_id": tag}) as llm:
        assert llm._run(llm._engine().get_supported_tasks()) == ("token_classify",)
        (out,) = llm.encode([{"prompt_token_ids": prompt}], pooling_task="token_classify", use_tqdm=False)
        (one,) = llm.encode([{"prompt_token_ids": prompt}], PoolingParams(returned_token_ids=[1]),
                            pooling_task="token_classify", use_tqdm=False)
        with pytest.raises(ValueError, match=r"returned_token_ids must be in \[0, 2\)"):
            llm.encode([prompt], PoolingParams(returned_token_ids=[2]), pooling_task="token_classify",
                       use_tqdm=False)
    scores = prm(prompt)[steps]
    np.testing.assert_allclose(out.outputs.data.numpy(), torch.softmax(scores, -1).numpy(), atol=2e-5)
    np.testing.assert_allclose(one.outputs.data.numpy(), torch.sigmoid(scores[:, 1:]).numpy(), atol=2e-5)
    with LLM(str(tmp_path / "rm"), multiprocess=False, max_num_batched_tokens=16) as llm:
        (out,) = llm.encode([{"prompt_token_ids": prompt}], pooling_task="token_classify", use_tqdm=False)
        (raw,) = llm.encode([{"prompt_token_ids": prompt}], PoolingParams(use_activation=False),
                            pooling_task="token_classify", use_tqdm=False)
        with pytest.raises(ValueError, match=r"Task token_classify only supports \['use_activation'\] "
                                             r"parameters, does not support \['step_tag_id'\]"):
            llm.encode([prompt], PoolingParams(step_tag_id=3), pooling_task="token_classify", use_tqdm=False)
    assert tuple(out.outputs.data.shape) == (len(prompt), 1)
    np.testing.assert_allclose(raw.outputs.data.numpy(), rm(prompt).numpy(), atol=3e-5)
    np.testing.assert_allclose(out.outputs.data.numpy(), torch.sigmoid(rm(prompt)).numpy(), atol=2e-5)


@pytest.mark.parametrize("overrides, expected_labels", [
    ({"classifier_from_token": ["t5", "t9"], "is_original_qwen3_reranker": True}, 1),       # Qwen3-Reranker's way
    ({"classifier_from_token": ["t7", "t11", "t13"], "method": "no_post_processing"}, 3),
])
def test_a_causal_lm_becomes_a_classifier_from_its_head_rows_as_vllms_overrides_ask(overrides, expected_labels,
                                                                                      tmp_path):
    """vLLM's recipe for rerankers saved as causal LMs (Qwen3-Reranker: --hf-overrides with
    Qwen3ForSequenceClassification and classifier_from_token): the score head is the LM head's
    rows of those tokens; from_2_way_softmax scores the softmax of the two tokens' logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    _, reference = _saved(tmp_path, Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=False)))
    with LLM(str(tmp_path), multiprocess=False,
             hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], **overrides}) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS[:2]], use_tqdm=False)
        scores = llm.score("t4 t8", ["t16 t23", "t42"], use_tqdm=False) if expected_labels == 1 else None
    ids = [int(t[1:]) for t in overrides["classifier_from_token"]]
    for prompt, out in zip(PROMPTS, outs):
        logits = _logits(reference, prompt)[-1]
        expected = (torch.softmax(logits[ids], -1)[1:] if expected_labels == 1 else torch.softmax(logits[ids], -1))
        np.testing.assert_allclose(out.outputs.probs, expected.numpy(), atol=2e-5)
    if scores is not None:
        for doc, s in zip(([16, 23], [42]), scores):
            logits = _logits(reference, [4, 8] + doc)[-1]
            assert s.outputs.score == pytest.approx(float(torch.softmax(logits[ids], -1)[1]), abs=2e-5)


@pytest.fixture(scope="module")
def server(reranker):
    path, _ = reranker
    s = Server("--model", path, "--threads", "1")
    yield s
    s.stop()


def test_classify_endpoint_names_the_label_and_its_probabilities(server, reranker):
    _, reference = reranker
    r = requests.post(f"{server.url}/classify", json={"input": [_text(p) for p in PROMPTS[:2]]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for ids, item in zip(PROMPTS, body["data"]):
        assert item["label"] == "LABEL_0" and item["num_classes"] == 1
        np.testing.assert_allclose(item["probs"], torch.sigmoid(_logits(reference, ids)).numpy(), atol=2e-5)
    assert body["usage"]["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])
    plain = requests.post(f"{server.url}/classify", json={"input": PROMPTS[0], "use_activation": False},
                          timeout=60).json()
    np.testing.assert_allclose(plain["data"][0]["probs"], _logits(reference, PROMPTS[0]).numpy(), atol=2e-5)
    r = requests.post(f"{server.url}/v1/embeddings", json={"input": "t1 t2"}, timeout=30)
    assert r.status_code == 400 and "Task embed is not supported" in r.json()["error"]["message"]


def test_a_cross_encoder_scores_and_reranks_each_pair_read_together(server, reranker, tmp_path):
    _, reference = reranker
    query, docs = [4, 8, 15], [[16, 23], [42, 4, 8], [1, 2, 3, 4, 5, 6]]
    expected = [float(torch.sigmoid(_logits(reference, query + d))[0]) for d in docs]   # the pair, joined
    r = requests.post(f"{server.url}/score", json={"queries": _text(query), "documents": [_text(d) for d in docs]},
                      timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=2e-5)
    ranked = requests.post(f"{server.url}/rerank", json={"query": _text(query), "documents": [_text(d) for d in docs],
                                                          "top_n": 2}, timeout=60).json()
    order = list(np.argsort(expected)[::-1][:2])
    assert [res["index"] for res in ranked["results"]] == order
    np.testing.assert_allclose([res["relevance_score"] for res in ranked["results"]],
                               [expected[i] for i in order], atol=2e-5)
    assert ranked["usage"]["prompt_tokens"] == sum(len(query) + len(d) for d in docs)


def test_a_pair_is_encoded_as_transformers_encodes_text_with_text_pair(tmp_path):
    """A tokenizer.json with a pair template (BERT's: [CLS] A [SEP] B [SEP]): the cross-encoder's
    prompt is what transformers' fast tokenizer gives for text and text_pair."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from actors.frontend.scoring import pair_token_ids
    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    vocab = {"[CLS]": 0, "[SEP]": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[SEP]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    ours = TextTokenizer.from_hf_dir(str(tmp_path))
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    expected = theirs("w1 w2", text_pair="w3 w4 w5")["input_ids"]
    assert pair_token_ids(ours, True, "w1 w2", "w3 w4 w5") == expected == [0, 3, 4, 1, 5, 6, 7, 1]
    assert pair_token_ids(ours, True, "w1 w2", "w3 w4 w5", max_second=1) == [0, 3, 4, 1, 5, 1]
    # an LLM used as a reranker (use_sep_token false): the two joined, read as one prompt is
    assert pair_token_ids(ours, False, "w1 w2 ", "w3") == ours.encode("w1 w2 w3", add_special_tokens=True)
    # a score template (vLLM's, e.g. Qwen3-Reranker's): the pair as a "query" and a "document" message
    template = "{% for m in messages %}{{ m['role'] == 'query' and 'w9' or 'w8' }} {{ m['content'] }} {% endfor %}"
    rendered = ours.encode("w9 w1 w2 w8 w3 w4 w5 ", add_special_tokens=True)
    assert pair_token_ids(ours, True, "w1 w2", "w3 w4 w5", template=template) == rendered
    # the rendered text encoded with the special tokens tokenizer.json's post-processor adds, as transformers does
    assert rendered == theirs("w9 w1 w2 w8 w3 w4 w5 ")["input_ids"] == [0, 11, 3, 4, 10, 5, 6, 7, 1]
    assert pair_token_ids(ours, True, "w1 w2", "w3 w4 w5", max_first=1, template=template) == [0, 11, 3, 10, 5, 6, 7,
                                                                                                1]
    with pytest.raises(ValueError, match="reserved keys"):
        pair_token_ids(ours, True, "w1", "w2", template=template, template_kwargs={"tools": []})


def test_a_cross_encoder_reads_each_pair_through_a_score_template(reranker):
    """LLM.score with vLLM's chat_template: each pair rendered as a query and a document message,
    scored as the classifier scores that prompt."""
    path, reference = reranker
    template = "{% for m in messages %}{{ m['content'] }} t99 {% endfor %}"
    query, docs = [4, 8, 15], [[16, 23], [42, 4, 8]]
    with LLM(path, multiprocess=False) as llm:
        scores = llm.score(_text(query), [_text(d) for d in docs], chat_template=template, use_tqdm=False)
    expected = [float(torch.sigmoid(_logits(reference, query + [99] + d + [99]))[0]) for d in docs]
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=2e-5)
