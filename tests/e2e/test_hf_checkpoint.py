"""A Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) serves through
the whole engine, with the tokenizer and chat template read from the directory."""
from __future__ import annotations

import pytest

from actors.api import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """SmolLM2's GGUF, loaded by transformers (the weights dequantized to float32), re-saved by
    transformers as a float32 safetensors checkpoint with its tokenizer files."""
    from helpers import transformers_model_from_gguf, transformers_tokenizer_from_gguf
    from models.resolve import default_gguf_path
    path = default_gguf_path()
    out = tmp_path_factory.mktemp("smollm2-hf")
    transformers_tokenizer_from_gguf(path).save_pretrained(out)
    model = transformers_model_from_gguf(path)        # shared with other tests: left as it was
    quantizer, quantization = getattr(model, "hf_quantizer", None), model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None                         # saved as plain float32 weights
    try:
        model.save_pretrained(out)
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            model.config.quantization_config = quantization
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


def test_a_gguf_model_with_tokenizer_reads_the_tokenizer_and_its_template_from_there(tmp_path):
    """vLLM's --tokenizer (a GGUF file with its tokenizer's own directory, as vLLM's GGUF guide
    serves one): the directory's tokenizer and chat template render the prompt."""
    import json

    from models.resolve import default_gguf_path
    from tools.quantize import write_gguf_tokenizer
    write_gguf_tokenizer(default_gguf_path(), str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'Question: ' + messages[-1]['content'] + '\\nAnswer:' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(default_gguf_path(), tokenizer=str(tmp_path)) as llm:
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        assert tokenizer.source == str(tmp_path)
        assert tokenizer.decode(out.prompt_token_ids) == "Question: What is the capital of France?\nAnswer:"
    assert out.outputs[0].token_ids
