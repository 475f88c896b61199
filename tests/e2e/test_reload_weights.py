"""vLLM's collective_rpc("reload_weights"): an RL loop's trainer writes a checkpoint, the engine
reads it into the running model (weights_path), and answers with the new weights; a checkpoint
of another architecture, an unknown method or a bad argument is refused and changes nothing."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.api import LLM, SamplingParams
from helpers import save_tiny_llama

pytestmark = pytest.mark.slow

TOKENIZER = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = [504, 3575, 282, 4649, 314, 1345, 28]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny Llama architecture (SmolLM2's vocabulary), different weights,
    and one of another size."""
    root = tmp_path_factory.mktemp("reload")
    a = save_tiny_llama(root / "a", 49152, 64, 128, 4, 2, 16, 512)
    b = root / "b"
    shutil.copytree(a, b)
    weights = load_file(b / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file({k: (v + 0.15 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in weights.items()},
              b / "model.safetensors", metadata={"format": "pt"})
    other = save_tiny_llama(root / "other", 49152, 96, 128, 4, 2, 16, 512)
    return a, str(b), other


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_reload_weights_serves_the_new_checkpoint_and_back(checkpoints):
    a, b, other = checkpoints
    with LLM(b, tokenizer=TOKENIZER) as fresh:
        from_b = _tokens(fresh)
    with LLM(a, tokenizer=TOKENIZER) as llm:
        from_a = _tokens(llm)
        assert from_a != from_b
        assert llm.collective_rpc("reload_weights", kwargs={"weights_path": b}) == [None]
        assert _tokens(llm) == from_b                 # exactly what an engine started on b answers
        assert llm.collective_rpc("reload_weights") == [None]      # b again: the model now comes from b
        assert _tokens(llm) == from_b
        with pytest.raises(ValueError, match="not the same architecture"):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": other})
        with pytest.raises(ValueError, match="unknown worker method 'load_everything'"):
            llm.collective_rpc("load_everything")
        with pytest.raises(ValueError, match="unexpected keyword"):
            llm.collective_rpc("reload_weights", kwargs={"path": a})
        with pytest.raises(ValueError, match="unknown model"):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(a) + "-missing"})
        assert _tokens(llm) == from_b                 # a refused reload changed nothing
        llm.collective_rpc("reload_weights", kwargs={"weights_path": a, "is_checkpoint_format": "true"})
        assert _tokens(llm) == from_a
