"""LoRA on the real default model: SmolLM2-135M from its GGUF file with a random PEFT adapter
(rank 8, all seven target modules) written by peft gives the logits of peft applied to
transformers' SmolLM2 on the same weights, and the same greedy tokens; in the quantized mode
gguf-i8 the adapter's delta is added in float: logits within the mode's tolerance of the exact
mode's with the same adapter, and the same greedy tokens."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from actors.engine.lora import LoRAConfig, LoRARequest
from actors.worker.lora_manager import LoRAModelManager
from kernels.attention import allocate_kv_caches, build_attention_metadata
from models.native_decode import attach
from models.packed import prepack_linears
from models.registry import load_model
from models.resolve import default_gguf_path, resolve_model

pytestmark = pytest.mark.slow

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK, STEPS = 16, 4
PROMPT_TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' SmolLM2 (float32, the GGUF's weights dequantized) with a random adapter
    applied by peft, the adapter saved by peft; -> (peft model, adapter path, prompt ids)."""
    from peft import LoraConfig, get_peft_model
    import copy

    from helpers import transformers_model_from_gguf, transformers_tokenizer_from_gguf
    path = default_gguf_path()
    prompt = transformers_tokenizer_from_gguf(path)(PROMPT_TEXT)["input_ids"]
    hf = copy.deepcopy(transformers_model_from_gguf(path))        # peft changes the model it wraps
    peft_model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0,
                                               init_lora_weights=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:                 # B random and non-zero, unlike peft's default
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp_path_factory.mktemp("lora-smollm2") / "adapter"
    peft_model.save_pretrained(out)
    return peft_model.eval(), str(out), prompt


def _ours(quantization: str | None = None):
    model, config = load_model(resolve_model(None), block_size=BLOCK)
    if quantization:
        from models.quant import quantize
        quantize(model, quantization, default_gguf_path())
    prepack_linears(model)                      # as the worker does
    if not quantization:
        attach(model)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=1, max_lora_rank=8), config, torch.device("cpu"))
    return model, config, manager


def _generate(ours, prompt: list[int], lora: LoRARequest | None) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits (rows, vocab), then STEPS greedy tokens (decode steps on the paged cache)."""
    model, config, manager = ours
    caches = allocate_kv_caches(config, num_blocks=4, block_size=BLOCK)
    new, done, tokens, first = list(prompt), 0, [], None
    for _ in range(STEPS):
        manager.set_adapter_mapping([lora], np.array([len(new)]))
        meta = build_attention_metadata([len(new)], [done + len(new)], [[1, 2, 3]], BLOCK)
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(new), torch.arange(done, done + len(new)), caches, meta))
        first = logits if first is None else first
        done += len(new)
        new = [int(logits[-1].argmax())]
        tokens.append(new[0])
    return first, tokens


@pytest.fixture(scope="module")
def exact(reference):
    _, path, prompt = reference
    ours = _ours()
    return _generate(ours, prompt, LoRARequest("rand8", 1, path)), _generate(ours, prompt, None)


def test_smollm2_with_a_peft_adapter_matches_peft_on_transformers(reference, exact):
    peft_model, _, prompt = reference
    (logits, tokens), (base_logits, base_tokens) = exact
    with torch.inference_mode():
        ref = peft_model(torch.tensor([prompt])).logits[0].float()
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        ref_tokens = peft_model.generate(torch.tensor([prompt]), attention_mask=mask,
                                         max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-3)          # measured: 2e-4, logits up to 25
    assert tokens == ref_tokens[0, len(prompt):].tolist()
    assert (logits - base_logits).abs().max() > 0.5             # the adapter does change the logits
    assert tokens != base_tokens


def test_smollm2_gguf_i8_adds_the_adapters_delta_in_float(reference, exact):
    from kernels.cpu.panels import int8_available
    if not int8_available():
        pytest.skip("the gguf-i8 mode needs a CPU with AVX2 or AVX512-VNNI")
    _, path, prompt = reference
    (logits, tokens), (_, base_tokens) = exact
    ours = _ours("gguf-i8")
    quant, quant_tokens = _generate(ours, prompt, LoRARequest("rand8", 1, path))
    quant_base, quant_base_tokens = _generate(ours, prompt, None)
    torch.testing.assert_close(quant, logits, rtol=0, atol=0.05)    # measured: 0.01; the adapter moves them by 13
    assert (quant - quant_base).abs().max() > 0.5                    # the adapter's effect is there
    assert quant_tokens == tokens and quant_base_tokens == base_tokens
