"""A Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) serves through
the whole engine, with the tokenizer and chat template read from the directory."""
from __future__ import annotations

import pytest
import torch

from actors.api import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """SmolLM2's GGUF re-saved by transformers as a float32 safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from models.resolve import default_gguf_path
    import os
    path = default_gguf_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    out = tmp_path_factory.mktemp("smollm2-hf")
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    from transformers.utils.quantization_config import GgufConfig
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None                 # plain float32 weights from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    return str(out)


def test_checkpoint_directory_answers_like_the_gguf(checkpoint):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(checkpoint) as llm:
        (from_dir,) = llm.chat(messages, params, use_tqdm=False)
    with LLM() as llm:
        (from_gguf,) = llm.chat(messages, params, use_tqdm=False)
    assert "Paris" in from_dir.text
    assert from_dir.token_ids == from_gguf.token_ids
