"""vLLM's worker extensions and functions run in the workers: --worker-extension-cls mixes a
class's methods into every worker (called by name with collective_rpc), collective_rpc takes a
function and apply_model a function of the model, in this process and in worker processes (there
only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, as in vLLM); a class that redefines a worker
method is refused at start-up."""
from __future__ import annotations

import pytest

from actors.api import LLM, SamplingParams
from tests.helpers import save_tiny_llama, save_tiny_tokenizer

pytestmark = pytest.mark.slow

VOCAB = 128
PROMPT = [5, 17, 42, 9, 77, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
EXTENSION = "tests.e2e.rl_extension.NormScaler"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("extension"), VOCAB, 64, 96, 4, 2, 16, 256)
    return save_tiny_tokenizer(path, VOCAB)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_extension_changes_the_served_weights_and_functions_run_in_the_worker(model):
    with LLM(model, worker_extension_cls=EXTENSION) as llm:
        before, total = _tokens(llm), llm.collective_rpc("norm_sum")
        assert llm.collective_rpc("scale_norm", args=(4.0,)) == ["tp0"]
        assert llm.collective_rpc("norm_sum") == [4.0 * total[0]]
        assert _tokens(llm) != before
        llm.collective_rpc("scale_norm", kwargs={"factor": 0.25})
        assert _tokens(llm) == before                 # powers of two: exactly the weights again
        assert llm.apply_model(lambda m: type(m).__name__) == ["LlamaForCausalLM"]
        assert llm.collective_rpc(lambda worker, k: worker.tp_size * k, args=(3,)) == [3]
        with pytest.raises(ValueError, match="unknown worker method 'norm_mean'.*norm_sum, scale_norm"):
            llm.collective_rpc("norm_mean")


def test_across_worker_processes_functions_need_vllms_permission(model, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with LLM(model, worker_extension_cls=EXTENSION, tensor_parallel_size=2, multiprocess=True) as llm:
        assert llm.collective_rpc("scale_norm", args=(1.0,)) == ["tp0", "tp1"]
        count = lambda m: sum(p.numel() for p in m.parameters())     # noqa: E731 (pickled by value)
        with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
            llm.apply_model(count)
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        whole = sum(t.numel() for t in __import__("safetensors.torch").torch.load_file(
            f"{model}/model.safetensors").values())
        halves = llm.apply_model(count)
        assert len(halves) == 2 and halves[0] == halves[1] and halves[0] < whole
        assert llm.collective_rpc(lambda worker: worker.tp_rank) == [0, 1]
        # a function that raises, or one the workers cannot import, fails the call, not the engine
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            llm.collective_rpc(lambda worker: 1 / 0)
        with pytest.raises(RuntimeError, match="No module named 'test_worker_extension'"):
            llm.apply_model(_named_by_reference)
        assert llm.collective_rpc("scale_norm", args=(1.0,)) == ["tp0", "tp1"]


def test_an_extension_that_redefines_a_worker_method_is_refused_at_start_up(model):
    with pytest.raises(Exception, match="the worker already has reload_weights"):
        LLM(model, worker_extension_cls="tests.e2e.rl_extension.Clashing")


def _named_by_reference(model) -> int:    # pickled by its module's name, which the workers lack
    return 0
