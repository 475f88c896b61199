"""Speculative decoding with a draft model (method draft_model) on tiny random checkpoints: the
target drafting with a copy of itself (every draft accepted) and with a smaller model of the same
vocabulary and KV page (its layers appended to the target's one KV cache group; few accepted),
greedy requests getting the tokens of plain decoding either way, also when preempted; a draft of
another vocabulary is refused at start-up. Over two tensor-parallel ranks the draft model is split
as the target is, and over two pipeline stages it runs whole on the last, with the same tokens."""
from __future__ import annotations

import pytest

from actors.api import LLM, SamplingParams
from helpers import save_tiny_llama, save_tiny_tokenizer

VOCAB = 256
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], list(range(20, 60))]
PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),       # max_tokens mid-draft
          SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    def save(name, hidden, intermediate, vocab=VOCAB, kv_heads=2):
        path = save_tiny_llama(tmp_path_factory.mktemp(name), vocab, hidden, intermediate, 4, kv_heads, 16, 512)
        return save_tiny_tokenizer(path, vocab)
    return {"target": save("target", 64, 128), "small": save("small", 48, 96),
            "other_vocab": save("other_vocab", 64, 128, vocab=300), "one_kv_head": save("one_kv", 48, 96, kv_heads=1)}


def _run(target: str, draft: str | None, **options):
    spec = None if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    options.setdefault("multiprocess", False)
    with LLM(target, speculative_config=spec, **options) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return tokens, llm.client.stats.last


@pytest.fixture(scope="module")
def plain(models):
    return _run(models["target"], None)[0]


def test_the_target_drafting_with_its_own_copy_has_every_draft_accepted(models, plain):
    tokens, stats = _run(models["target"], models["target"])
    assert tokens == plain and [len(t) for t in tokens] == [30, 17, 25]
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_a_smaller_draft_model_gives_the_targets_tokens_also_when_preempted(models, plain):
    tokens, stats = _run(models["target"], models["small"])
    assert tokens == plain and stats.spec_num_draft_tokens > 0
    tokens, stats = _run(models["target"], models["small"], num_gpu_blocks_override=7, max_num_batched_tokens=64)
    assert tokens == plain and stats.num_preemptions > 0


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_up(models):
    with pytest.raises(Exception, match="must share the target's tokenizer"):
        _run(models["target"], models["other_vocab"])


def test_a_draft_model_split_over_two_tensor_parallel_ranks_gives_the_targets_tokens(models, plain):
    """The draft model is split over the ranks as the target is (its KV heads in the target's blocks)."""
    tokens, stats = _run(models["target"], models["target"], tensor_parallel_size=2, multiprocess=True)
    assert tokens == plain and 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    tokens, stats = _run(models["target"], models["small"], tensor_parallel_size=2, multiprocess=True)
    assert tokens == plain and stats.spec_num_draft_tokens > 0
    with pytest.raises(Exception, match="needs the target's 2 KV heads, not 1"):
        _run(models["target"], models["one_kv_head"], tensor_parallel_size=2, multiprocess=True)


def test_a_draft_model_on_the_last_of_two_pipeline_stages_gives_the_targets_tokens(models, plain):
    """The target's layers in two stages, the draft model whole on the last one (its layers'
    KV beside the stage's), with preemptions too."""
    tokens, stats = _run(models["target"], models["target"], pipeline_parallel_size=2, multiprocess=True)
    assert tokens == plain and 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    tokens, stats = _run(models["target"], models["small"], pipeline_parallel_size=2, multiprocess=True,
                         num_gpu_blocks_override=7, max_num_batched_tokens=64)
    assert tokens == plain and stats.spec_num_draft_tokens > 0 and stats.num_preemptions > 0
