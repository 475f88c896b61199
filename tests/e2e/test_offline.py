"""The offline API and the terminal chat, on the real default model."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.api import LLM, SamplingParams
from server import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    with LLM() as engine:
        yield engine


def test_llm_chat_answers_paris(llm):
    (result,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in result.text and result.finish_reason == "stop"


def test_llm_generate_batches_prompts_and_matches_one_at_a_time(llm):
    prompts = ["The sky is", "One, two, three,", "def fibonacci(n):", "Dear diary,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in together)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    a = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    b = llm.generate(["Once upon a time", "Unrelated prompt in the batch"], params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids


def test_chat_repl_streams_a_reply_from_piped_input():
    proc = subprocess.run([sys.executable, "-m", "tools.chat", "--temperature", "0"],
                          input="What is the capital of France?\n/exit\n", capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
