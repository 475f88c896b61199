"""An adapter trained on the Hugging Face model applies to the same model loaded from GGUF (whose
q and k rows llama.cpp permuted: the loader undoes it, the adapter's names map onto the same
layers): logits equal peft's on transformers; and in the quantized mode, where the projections
run GGUF Q8_0 blocks natively, the delta added in float32 gives the logits of the dequantized
float model with the same adapter."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")   # before any kernel module

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from actors.engine.lora import LoRAConfig, LoRARequest  # noqa: E402
from actors.worker.lora_manager import LoRAModelManager  # noqa: E402
from kernels.attention import allocate_kv_caches, build_attention_metadata  # noqa: E402
from kernels.cpu.native import available  # noqa: E402
from models.packed import prepack_linears  # noqa: E402
from models.quant import quantize  # noqa: E402
from models.registry import load_model  # noqa: E402
from models.resolve import ModelSource  # noqa: E402
from tests.helpers import save_tiny_llama, save_tiny_lora  # noqa: E402

VOCAB, BLOCK = 128, 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 99, 3, 64, 21, 8, 120, 44]


def write_gguf(hf, path: str, quantized: bool) -> None:
    """The transformers Llama ``hf`` as a GGUF file: float32 tensors, or Q8_0 projections."""
    import gguf
    from gguf.quants import quantize as quantize_blocks
    from tests.models.test_gguf_architectures import _permute
    c = hf.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf_name, t in hf.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith("q_proj"):
            t = _permute(t, c.num_attention_heads)
        if base.endswith("k_proj"):
            t = _permute(t, c.num_key_value_heads)
        a = t.float().numpy().astype(np.float32)
        if quantized and base.startswith("model.layers.") and base.endswith("_proj"):
            w.add_tensor(f"{names.get_name(base)}.{suffix}", quantize_blocks(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf")
    path = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    peft_model = save_tiny_lora(path, root / "lora", 8, ALL, seed=1)
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    write_gguf(hf, str(root / "f32.gguf"), quantized=False)
    write_gguf(hf, str(root / "q8.gguf"), quantized=True)
    return root, peft_model, LoRARequest("lora", 1, str(root / "lora"))


def _logits(path: str, lora: LoRARequest | None, quantization: str | None = None) -> torch.Tensor:
    model, config = load_model(ModelSource("gguf", path, "tiny"), block_size=BLOCK)
    if quantization:
        quantize(model, quantization, path)
        kinds = {m.weight.kind for m in model.modules() if type(m).__name__ == "PanelLinear"}
        assert kinds == {"Q8_0"}, kinds              # every projection runs its GGUF blocks
    prepack_linears(model)
    manager = LoRAModelManager(model, LoRAConfig(max_lora_rank=16), config, torch.device("cpu"))
    manager.set_adapter_mapping([lora], np.array([len(PROMPT)]))
    caches = allocate_kv_caches(config, num_blocks=8, block_size=BLOCK)
    meta = build_attention_metadata([len(PROMPT)], [len(PROMPT)], [[1, 2, 3]], BLOCK)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), caches, meta))


def test_a_hugging_face_adapter_on_the_gguf_model_matches_peft(files):
    root, peft_model, lora = files
    with torch.inference_mode():
        ref = peft_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(_logits(str(root / "f32.gguf"), lora), ref, rtol=0, atol=2e-4)


@pytest.mark.skipif(not available()[0], reason="the quantized mode needs the native CPU kernels")
def test_the_quantized_mode_adds_the_delta_in_float(files):
    root, _, lora = files
    q8 = str(root / "q8.gguf")
    exact, quant = _logits(q8, lora), _logits(q8, lora, "gguf")      # the same Q8_0 weights, dequantized or not
    torch.testing.assert_close(quant, exact, rtol=0, atol=2e-3)
    assert (quant - _logits(q8, None, "gguf")).abs().max() > 1e-2      # the adapter does change them
