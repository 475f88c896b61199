"""Weight transfer into an engine on a GPU (``-m gpu``, skipped without CUDA): a trainer on the
host sends over gloo, the CUDA worker receives on the host and its model, rebuilt on the device,
answers as an engine started on the pushed weights does."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from actors.api import LLM, SamplingParams
from actors.worker.weight_transfer import LLMWeightSyncClient, TrainerWeightTransferEngine
from server import free_port
from tests.helpers import save_tiny_llama, save_tiny_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 128
PROMPT = [5, 17, 42, 9, 77, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_a_cuda_engine_takes_a_trainers_weights_over_gloo(tmp_path):
    a = save_tiny_llama(tmp_path / "a", VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(a, VOCAB)
    weights = load_file(f"{a}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    other = {k: v + 0.15 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}

    def tokens(llm: LLM) -> list[int]:
        return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    with LLM(a, device="cuda", dtype="float32", enforce_eager=True, kv_cache_bytes=256 << 20,
             weight_transfer_config={"backend": "gloo", "timeout_s": 60}) as llm:
        from_a = tokens(llm)
        trainer = TrainerWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2},
            client=LLMWeightSyncClient(llm), source=other)
        trainer.send_weights(weight_version="other")
        from_other = tokens(llm)
        trainer.send_weights(weights)
        assert tokens(llm) == from_a and from_other != from_a
        trainer.shutdown()
