"""Pooling models (vLLM's --runner pooling): embeddings through the whole engine equal
transformers' hidden states pooled the same way, whether a prompt is computed whole or in
chunks, beside others, or partly from the prefix cache; the server answers /v1/embeddings (the
OpenAI client's base64 included), /pooling, and vLLM's score and rerank endpoints (cosine
similarities of the embeddings), and refuses generation on such a model."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F

from actors.api import LLM, PoolingParams
from helpers import save_tiny_tokenizer
from server import Server

pytestmark = pytest.mark.slow

VOCAB = 128


def _random_weights(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15)


@pytest.fixture(scope="module")
def bare_llama(tmp_path_factory):
    """A sentence-transformers-style embedding checkpoint: a bare ``LlamaModel`` (no LM head, its
    tensors without the "model." prefix) whose modules.json pools the mean and normalizes."""
    import json

    from transformers import LlamaConfig, LlamaModel
    path = tmp_path_factory.mktemp("bare_llama")
    model = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, num_hidden_layers=2))
    _random_weights(model)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                "pooling_mode_mean_tokens": True}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "t5 t6 ",
                                                                                    "document": ""}}))
    return str(path), model.eval()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3ForCausalLM checkpoint (an LM head of its own), embedded with --runner pooling."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    path = tmp_path_factory.mktemp("qwen3")
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256, rms_norm_eps=1e-6, num_hidden_layers=2,
                                         tie_word_embeddings=False))
    _random_weights(model)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    return str(path), model.eval()


def _hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()          # after the final norm, as the last layer's output


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (VOCAB - 1) + 1 for i in range(n)] for n in lengths]


def test_a_bare_sentence_transformers_checkpoint_embeds_as_transformers_pools_it(bare_llama):
    """Mean pooling and normalization read from modules.json; prompts batched, the longest in
    chunks of 16 tokens, equal to transformers' mean of the last hidden states."""
    path, reference = bare_llama
    prompts = _prompts([1, 5, 23, 100])
    with LLM(path, multiprocess=False, max_num_batched_tokens=16, max_model_len=128) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        assert llm._run(llm._engine().get_supported_tasks()) == ("embed", "token_embed")
        scores = llm.score({"prompt_token_ids": prompts[0]}, [{"prompt_token_ids": p} for p in prompts[1:]],
                           use_tqdm=False)
        with pytest.raises(ValueError, match="Input lengths must be either 1:1, 1:N or N:N"):
            llm.score(prompts[:2], prompts[:3], use_tqdm=False)
        with pytest.raises(ValueError, match="it answers pooling requests"):
            llm.generate([prompts[1]], use_tqdm=False)
    for ids, out in zip(prompts, outs):
        expected = torch.nn.functional.normalize(_hidden(reference, ids).mean(0), dim=-1)
        assert out.prompt_token_ids == ids and out.outputs.hidden_size == 64
        np.testing.assert_allclose(out.outputs.embedding, expected.numpy(), atol=2e-5)
    vectors = np.array([out.outputs.embedding for out in outs])
    np.testing.assert_allclose([s.outputs.score for s in scores], vectors[1:] @ vectors[0], atol=1e-5)


def test_a_dense_projection_after_the_pooling_shapes_the_embedding(bare_llama, tmp_path):
    """A sentence-transformers checkpoint with a Dense layer (64 -> 24, tanh) between its pooling
    and its normalization: embeddings of 24 floats, as sentence-transformers computes them."""
    import json
    import shutil

    from safetensors.torch import save_file
    path, reference = bare_llama
    st = tmp_path / "with_dense"
    shutil.copytree(path, st)
    modules = json.loads((st / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (st / "modules.json").write_text(json.dumps(modules))
    (st / "2_Dense").mkdir()
    (st / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 64, "out_features": 24, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"}))
    torch.manual_seed(1)
    weight, bias = torch.randn(24, 64) * 0.2, torch.randn(24) * 0.2
    save_file({"linear.weight": weight, "linear.bias": bias}, str(st / "2_Dense" / "model.safetensors"))
    prompts = _prompts([3, 40])
    with LLM(str(st), multiprocess=False, max_model_len=128) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for ids, out in zip(prompts, outs):
        projected = torch.tanh(_hidden(reference, ids).mean(0) @ weight.T + bias)
        assert out.outputs.hidden_size == 24
        np.testing.assert_allclose(out.outputs.embedding, torch.nn.functional.normalize(projected, dim=-1).numpy(),
                                   atol=2e-5)


def test_a_causal_lm_converted_to_embeddings_pools_its_last_token_and_reuses_the_prefix_cache(qwen3):
    path, reference = qwen3
    (long_prompt,) = _prompts([70])
    with LLM(path, multiprocess=False, runner="pooling", max_model_len=128,
             hf_overrides={"matryoshka_dimensions": [16, 32]}) as llm:
        first, again = (llm.embed([{"prompt_token_ids": long_prompt}], use_tqdm=False)[0] for _ in range(2))
        cut = llm.embed([{"prompt_token_ids": long_prompt}], PoolingParams(dimensions=16), use_tqdm=False)[0]
        raw = llm.encode([{"prompt_token_ids": long_prompt}], PoolingParams(use_activation=False),
                         pooling_task="token_embed", use_tqdm=False)[0]
        with pytest.raises(ValueError, match=r"only supports Matryoshka dimensions \[16, 32\], got 8"):
            llm.embed([long_prompt], PoolingParams(dimensions=8), use_tqdm=False)
    hidden = _hidden(reference, long_prompt)
    np.testing.assert_allclose(first.outputs.embedding, torch.nn.functional.normalize(hidden[-1], dim=-1).numpy(),
                               atol=2e-5)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64       # four blocks of 16 reused
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-6)
    np.testing.assert_allclose(cut.outputs.embedding, torch.nn.functional.normalize(hidden[-1, :16], dim=-1).numpy(),
                               atol=2e-5)
    # token embeddings need every position: the cache is not read for them, and every row is right
    assert raw.num_cached_tokens == 0 and tuple(raw.outputs.data.shape) == (70, 64)
    np.testing.assert_allclose(raw.outputs.data.numpy(), hidden.numpy(), atol=1e-4)


@pytest.fixture(scope="module")
def server():
    s = Server("--runner", "pooling", "--max-model-len", "256", "--threads", "1")
    yield s
    s.stop()


def _embed(server, **body) -> requests.Response:
    return requests.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def test_the_default_model_embeds_through_the_server_as_transformers_computes_it(server):
    from helpers import transformers_model_from_gguf, transformers_tokenizer_from_gguf
    from models.resolve import default_gguf_path
    texts = ["The capital of France is Paris.", "I like green apples."]
    r = _embed(server, input=texts)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"]
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    tokenizer = transformers_tokenizer_from_gguf(default_gguf_path())
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                             "completion_tokens": 0}
    model = transformers_model_from_gguf(default_gguf_path())
    for d, prompt in zip(body["data"], ids):
        expected = torch.nn.functional.normalize(_hidden(model, prompt)[-1], dim=-1).numpy()
        got = np.array(d["embedding"])
        assert got.shape == (576,) and float(got @ expected) > 0.9999
    # the same prompt as token ids gives the same vector
    again = _embed(server, input=ids[0]).json()["data"][0]["embedding"]
    np.testing.assert_allclose(again, body["data"][0]["embedding"], atol=1e-5)


def test_the_openai_client_reads_its_base64_embeddings(server):
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    got = client.embeddings.create(model=client.models.list().data[0].id, input=["hello world", "goodbye"])
    floats = _embed(server, input=["hello world", "goodbye"]).json()["data"]
    for item, plain in zip(got.data, floats):
        np.testing.assert_allclose(item.embedding, plain["embedding"], atol=1e-6)


def test_raw_bytes_with_their_metadata_header_decode_to_the_floats(server):
    """vLLM's bytes encoding: the vectors' bytes back to back, a metadata header locating each;
    bytes_only the same body without it."""
    import json
    plain = np.array([d["embedding"] for d in _embed(server, input=["hello world", "goodbye"]).json()["data"]])
    r = _embed(server, input=["hello world", "goodbye"], encoding_format="bytes", embed_dtype="float16",
               endianness="big")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["id"].startswith("embd-") and meta["usage"]["prompt_tokens"] == meta["usage"]["total_tokens"] > 0
    assert [(d["index"], d["start"], d["end"], d["shape"]) for d in meta["data"]] == [(0, 0, 1152, [576]),
                                                                                     (1, 1152, 2304, [576])]
    got = np.frombuffer(r.content, dtype=">f2").astype(np.float32).reshape(2, 576)
    np.testing.assert_allclose(got, plain, atol=1e-3)
    only = _embed(server, input=["hello world", "goodbye"], encoding_format="bytes_only")
    assert "metadata" not in only.headers
    np.testing.assert_allclose(np.frombuffer(only.content, dtype=np.float32).reshape(2, 576), plain, atol=1e-6)


def test_base64_in_each_dtype_and_byte_order_decodes_to_the_floats(server):
    plain = np.array(_embed(server, input="hello world").json()["data"][0]["embedding"], dtype=np.float32)
    for dtype, endianness, tol in (("float32", "little", 0), ("float16", "big", 1e-3), ("bfloat16", "native", 8e-3)):
        r = _embed(server, input="hello world", encoding_format="base64", embed_dtype=dtype, endianness=endianness)
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        if dtype == "bfloat16":
            values = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<" if endianness == "little" else ">"))
        np.testing.assert_allclose(values.astype(np.float32), plain, atol=tol)
    for dtype, torch_dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        r = _embed(server, input="hello world", encoding_format="base64", embed_dtype=dtype)
        raw = bytearray(base64.b64decode(r.json()["data"][0]["embedding"]))
        got = torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype)
        assert torch.equal(got.view(torch.uint8), torch.from_numpy(plain).to(torch_dtype).view(torch.uint8)), dtype


def test_pooling_endpoint_gives_every_tokens_vector_and_chat_input_is_rendered(server):
    r = requests.post(f"{server.url}/pooling", json={"input": "hello world", "task": "token_embed"}, timeout=60)
    assert r.status_code == 200, r.text
    rows = np.array(r.json()["data"][0]["data"])
    assert r.json()["data"][0]["object"] == "pooling" and rows.shape == (2, 576)
    last = _embed(server, input="hello world").json()["data"][0]["embedding"]
    np.testing.assert_allclose(rows[-1], last, atol=1e-5)          # LAST pooling: the last token's, normalized
    pooled = requests.post(f"{server.url}/pooling", json={"input": "hello world"}, timeout=60).json()
    np.testing.assert_allclose(pooled["data"][0]["data"], last, atol=1e-6)
    messages = [{"role": "user", "content": "hello world"}]
    chat = _embed(server, messages=messages)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 2        # the chat template's tokens around the text
    in_input = _embed(server, input=messages).json()
    np.testing.assert_allclose(in_input["data"][0]["embedding"], chat.json()["data"][0]["embedding"], atol=1e-6)


def test_score_and_rerank_are_the_cosine_similarities_of_the_embeddings(server):
    query, docs = "Where is Paris?", ["Paris is in France.", "Apples are green.", "The Eiffel Tower is in Paris."]
    vectors = np.array([d["embedding"] for d in _embed(server, input=[query, *docs]).json()["data"]])
    expected = vectors[1:] @ vectors[0]
    r = requests.post(f"{server.url}/score", json={"queries": query, "documents": docs}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pairs = requests.post(f"{server.url}/v1/score", json={"text_1": [query, docs[0]], "text_2": [docs[0], docs[0]]},
                          timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [expected[0], 1.0], atol=1e-5)
    ranked = requests.post(f"{server.url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2},
                           timeout=60).json()
    order = list(np.argsort(-expected)[:2])
    assert [res["index"] for res in ranked["results"]] == order
    assert [res["document"]["text"] for res in ranked["results"]] == [docs[i] for i in order]
    np.testing.assert_allclose([res["relevance_score"] for res in ranked["results"]], expected[order], atol=1e-5)
    bad = requests.post(f"{server.url}/score", json={"queries": [query, query], "documents": docs}, timeout=30)
    assert bad.status_code == 400 and "Input lengths must be either 1:1, 1:N or N:N" in bad.json()["error"]["message"]


def test_what_a_pooling_server_cannot_do_is_refused_by_name(server):
    chat = requests.post(f"{server.url}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 404 and "pooling model" in chat.json()["error"]["message"]
    for body, param, words in (
            ({"input": "hi", "dimensions": 8}, "dimensions", "does not support Matryoshka"),
            ({"input": "hi", "normalize": True}, "normalize", "use `use_activation` instead"),
            ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format must be one of"),
            ({"input": []}, "input", "must not be empty"),
            ({"input": "hi " * 300}, "prompt", "maximum context length is 256 tokens"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages:")):
        r = _embed(server, **body)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], r.text
    r = requests.post(f"{server.url}/pooling", json={"input": "hi", "task": "classify"}, timeout=30)
    assert r.status_code == 400 and "Task classify is not supported" in r.json()["error"]["message"]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_pooling_model_splits_over_pipeline_stages_the_last_one_pooling(bare_llama):
    """--runner pooling with --pipeline-parallel-size 2, as vLLM runs it (the last stage pools):
    prompts computed in 8-token chunks through two stages give transformers' mean-pooled
    embeddings, and every token's vector (task token_embed)."""
    path, model = bare_llama
    prompts = _prompts([5, 30, 12])
    with LLM(path, pipeline_parallel_size=2, max_num_batched_tokens=8) as llm:
        embeds = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        tokens = llm.encode([{"prompt_token_ids": p} for p in prompts], pooling_task="token_embed", use_tqdm=False)
    for p, embed, token in zip(prompts, embeds, tokens):
        hidden = _hidden(model, p)
        np.testing.assert_allclose(embed.outputs.embedding, F.normalize(hidden.mean(0), dim=-1).numpy(), atol=2e-6)
        np.testing.assert_allclose(token.outputs.data.numpy(), F.normalize(hidden, dim=-1).numpy(), atol=2e-6)


def test_a_batch_file_of_embedding_requests_runs_offline(bare_llama, tmp_path):
    """tools.batch with a pooling model: /v1/embeddings and /pooling lines answered as the server
    answers them, a generation line refused with the server's 404."""
    import json
    import subprocess
    import sys

    from server import ROOT
    path, reference = bare_llama
    prompts = _prompts([6, 9])
    lines = [{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": prompts}},
             {"custom_id": "b", "url": "/pooling", "body": {"input": prompts[0], "task": "token_embed"}},
             {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": prompts[0], "max_tokens": 2}}]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run([sys.executable, "-m", "tools.batch", "-i", str(source), "-o", str(results),
                           "--model", path, "--no-progress", "--threads", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by_id = {rec["custom_id"]: rec["response"] for rec in map(json.loads, results.read_text().splitlines())}
    assert by_id["a"]["status_code"] == 200 and by_id["b"]["status_code"] == 200
    for ids, item in zip(prompts, by_id["a"]["body"]["data"]):
        expected = torch.nn.functional.normalize(_hidden(reference, ids).mean(0), dim=-1).numpy()
        np.testing.assert_allclose(item["embedding"], expected, atol=2e-5)
    np.testing.assert_allclose(by_id["b"]["body"]["data"][0]["data"],
                               torch.nn.functional.normalize(_hidden(reference, prompts[0]), dim=-1).numpy(),
                               atol=2e-5)
    assert by_id["c"]["status_code"] == 404


@pytest.fixture(scope="module")
def long_text_server(bare_llama):
    """The bare checkpoint with a context of 64 tokens, embedding longer prompts in pieces
    (vLLM's enable_chunked_processing) up to 300 tokens."""
    import json
    s = Server("--model", bare_llama[0], "--max-model-len", "64", "--threads", "1", "--pooler-config",
               json.dumps({"enable_chunked_processing": True, "max_embed_len": 300}))
    yield s
    s.stop()


def _mean_embedding(reference, ids: list[int]) -> np.ndarray:
    return torch.nn.functional.normalize(_hidden(reference, ids).mean(0), dim=-1).numpy()


def test_a_prompt_longer_than_the_context_is_embedded_in_pieces_averaged_by_their_tokens(bare_llama,
                                                                                          long_text_server):
    """150 tokens against a context of 64: pieces of 64, 64 and 22 tokens, each embedded as
    transformers pools it, averaged with those weights and normalized again; a short prompt
    beside it is one piece; past max_embed_len a prompt is refused unless truncated, and
    truncation keeps the prompt's start, as vLLM's pooling tokenizers do."""
    _, reference = bare_llama
    long_ids, short_ids = _prompts([150, 12])
    r = _embed(long_text_server, input=[long_ids, short_ids])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 162
    pieces = [long_ids[:64], long_ids[64:128], long_ids[128:]]
    mean = sum(len(p) * _mean_embedding(reference, p) for p in pieces) / 150
    np.testing.assert_allclose(body["data"][0]["embedding"], mean / np.linalg.norm(mean), atol=3e-5)
    np.testing.assert_allclose(body["data"][1]["embedding"], _mean_embedding(reference, short_ids), atol=3e-5)
    (too_long,) = _prompts([301])
    refused = _embed(long_text_server, input=too_long)
    assert refused.status_code == 400 and "maximum context length is 300 tokens" in refused.json()["error"]["message"]
    cut = _embed(long_text_server, input=too_long, truncate_prompt_tokens=40).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"], _mean_embedding(reference, too_long[:40]), atol=3e-5)
    # /pooling is not chunked: its prompts keep to the context
    r = requests.post(f"{long_text_server.url}/pooling", json={"input": long_ids}, timeout=60)
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]


def test_cohere_embed_gives_each_asked_type_and_puts_the_input_types_instruction_first(bare_llama,
                                                                                       long_text_server):
    """/v2/embed: float, binary, ubinary and base64 of the same vectors; input_type "query" puts
    the checkpoint's sentence-transformers prompt before each text (no chat template here);
    truncate NONE with max_tokens refuses a longer input, START keeps its end."""
    _, reference = bare_llama
    url = f"{long_text_server.url}/v2/embed"
    texts = ["t1 t2 t3", "t9 t8 t7 t6 t5 t4 t3 t2"]
    r = requests.post(url, json={"texts": texts, "embedding_types": ["float", "binary", "ubinary", "base64"]},
                      timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == texts and body["id"].startswith("embd-")
    assert body["meta"] == {"api_version": {"version": "2"}, "billed_units": {"input_tokens": 11, "image_tokens": 0}}
    floats = np.array(body["embeddings"]["float"], dtype=np.float32)
    np.testing.assert_allclose(floats[0], _mean_embedding(reference, [1, 2, 3]), atol=3e-5)
    bits = np.packbits(floats >= 0, axis=-1)
    assert body["embeddings"]["ubinary"] == bits.tolist()
    assert body["embeddings"]["binary"] == (bits.astype(int) - 128).tolist()
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in body["embeddings"]["base64"]]
    np.testing.assert_array_equal(decoded, floats)
    query = requests.post(url, json={"texts": texts[:1], "input_type": "query"}, timeout=60).json()
    np.testing.assert_allclose(query["embeddings"]["float"][0], _mean_embedding(reference, [5, 6, 1, 2, 3]),
                               atol=3e-5)
    assert query["meta"]["billed_units"]["input_tokens"] == 5 and "binary" not in query["embeddings"]
    start = requests.post(url, json={"texts": texts[1:], "truncate": "START", "max_tokens": 3}, timeout=60).json()
    np.testing.assert_allclose(start["embeddings"]["float"][0], _mean_embedding(reference, [4, 3, 2]), atol=3e-5)
    for body, param, words in (
            ({"texts": texts[1:], "truncate": "NONE", "max_tokens": 3}, "max_tokens",
             "Input of 8 tokens exceeds max_tokens=3 with truncate=NONE"),
            ({"texts": texts, "input_type": "classification"}, "input_type",
             "Unsupported input_type 'classification'. Supported values: document, query"),
            ({"texts": texts, "images": ["data:image/png;base64,AAAA"]}, "texts", "Exactly one of texts, images"),
            ({"images": ["data:image/png;base64,AAAA"]}, "images", "embeds text only"),
            ({"texts": texts, "embedding_types": ["int8"]}, "embedding_types", "embedding_types must be of")):
        r = requests.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == param, r.text


def test_a_lora_adapter_shapes_the_embeddings_of_the_requests_that_name_it(tmp_path):
    """--enable-lora with --runner pooling: a request naming an adapter (LLM.embed's lora_request,
    or the server's model field for a --lora-modules name) embeds as peft's model with that
    adapter computes it, one beside it without embeds as the base model, in the same batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.lora import LoRARequest
    from helpers import save_tiny_lora
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                         rms_norm_eps=1e-6, num_hidden_layers=2, tie_word_embeddings=False))
    _random_weights(model)
    model.save_pretrained(base)
    save_tiny_tokenizer(base, VOCAB)
    peft = save_tiny_lora(str(base), str(adapter), 8, ["q_proj", "v_proj", "gate_proj"], seed=1)
    (ids,) = _prompts([40])
    with LLM(str(base), multiprocess=False, runner="pooling", enable_lora=True, max_lora_rank=8,
             max_num_batched_tokens=16) as llm:
        with_adapter, plain = llm.embed([{"prompt_token_ids": ids}] * 2, lora_request=[LoRARequest("a", 1, str(adapter)),
                                                                                       None], use_tqdm=False)
    with torch.no_grad():
        expected = peft(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        with peft.disable_adapter():
            expected_plain = peft(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    np.testing.assert_allclose(with_adapter.outputs.embedding,
                               torch.nn.functional.normalize(expected, dim=-1).numpy(), atol=2e-5)
    np.testing.assert_allclose(plain.outputs.embedding,
                               torch.nn.functional.normalize(expected_plain, dim=-1).numpy(), atol=2e-5)
    server = Server("--model", str(base), "--runner", "pooling", "--enable-lora", "--max-lora-rank", "8",
                    "--lora-modules", f"sql={adapter}", "--threads", "1")
    try:
        served = _embed(server, model="sql", input=ids).json()
        base_served = _embed(server, input=ids).json()
    finally:
        server.stop()
    assert served["model"] == "sql"
    np.testing.assert_allclose(served["data"][0]["embedding"], with_adapter.outputs.embedding, atol=1e-5)
    np.testing.assert_allclose(base_served["data"][0]["embedding"], plain.outputs.embedding, atol=1e-5)


def test_a_token_embedding_model_scores_by_late_interaction(bare_llama):
    """--pooler-config '{"task": "token_embed"}': LLM.score is vLLM's late interaction, ColBERT's
    MaxSim: each query token's best dot product with a document token's (both normalized), summed."""
    path, reference = bare_llama
    query, docs = _prompts([6, 9, 14])[0], _prompts([9, 14])
    with LLM(path, multiprocess=False, pooler_config={"task": "token_embed"}) as llm:
        scores = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    q = torch.nn.functional.normalize(_hidden(reference, query), dim=-1)
    for doc, got in zip(docs, scores):
        d = torch.nn.functional.normalize(_hidden(reference, doc), dim=-1)
        assert got.outputs.score == pytest.approx(float((q @ d.T).max(-1).values.sum()), abs=1e-4)
