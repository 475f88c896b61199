"""Encoder-only models on a GPU (``-m gpu``, skipped without CUDA): a tiny random BERT's
embeddings through a CUDA engine (its attention one prompt at a time through torch's SDPA, no
decode graphs captured, its layers eager at the default compilation level) equal transformers'
in float32 and agree with them in bfloat16."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.api import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bert_embedding_model_on_a_gpu_pools_transformers_hidden_states(tmp_path, dtype):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    hf = BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=96, max_position_embeddings=80)).eval()
    hf.save_pretrained(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    prompts = [[1, 5, 9, 2], [1, *range(10, 60), 2], [1, 7, 2]]
    with LLM(str(tmp_path), device="cuda", dtype=dtype, multiprocess=False, skip_tokenizer_init=True) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, p in zip(outs, prompts):
        with torch.no_grad():
            mean = hf(torch.tensor([p])).last_hidden_state[0].mean(0).double().numpy()
        got = np.asarray(out.outputs.embedding, dtype=np.float64)     # not normalized: no Normalize module
        if dtype == "float32":
            np.testing.assert_allclose(got, mean, atol=1e-4)
        else:
            assert got @ mean / (np.linalg.norm(got) * np.linalg.norm(mean)) > 0.999
