"""OPT through the whole engine, as vLLM's first example serves facebook/opt-125m: a checkpoint
with GPT-2's vocab.json and merges.txt (no tokenizer.json), a text prompt tokenized with the BOS
its tokenizer adds (as transformers' GPT2Tokenizer, and vLLM's LLM, tokenize it), greedy tokens
equal to transformers' forward, for OPT's common shape and OPT-350m's (norms after the adds,
projected embeddings)."""
from __future__ import annotations

import json

import pytest
import torch

PROMPT = "Hello world, the quick brown"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer
    path = tmp_path_factory.mktemp("opt")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog."] * 20, vocab_size=300,
                            min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.save_model(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
        "tokenizer_class": "GPT2Tokenizer"}))
    return path, bpe.get_vocab_size()


@pytest.mark.parametrize("pre_norm", [True, False], ids=["opt-125m-shape", "opt-350m-shape"])
def test_the_engine_generates_transformers_greedy_tokens_from_a_text_prompt(tokenizer_dir, pre_norm):
    from transformers import GPT2Tokenizer, OPTConfig, OPTForCausalLM
    from actors.api import LLM, SamplingParams
    from helpers import hf_greedy
    path, vocab = tokenizer_dir
    torch.manual_seed(0)
    hf = OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=1, bos_token_id=2,
                                  eos_token_id=2, do_layer_norm_before=pre_norm,
                                  word_embed_proj_dim=64 if pre_norm else 32))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    hf.save_pretrained(path)
    hf.eval()
    ids = GPT2Tokenizer.from_pretrained(str(path))(PROMPT)["input_ids"]
    assert ids[0] == 2
    (want,) = hf_greedy(hf, [ids], 12)
    with LLM(str(path), multiprocess=False, kv_cache_bytes=1 << 22) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == ids
    assert out.token_ids == want and len(set(want)) > 2
