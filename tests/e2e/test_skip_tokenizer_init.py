"""vLLM's --skip-tokenizer-init and --tokens-only on a checkpoint that has no tokenizer at all: the
server starts, prompts come as token ids and answers carry the token ids the same checkpoint
gives with a tokenizer (their text empty); whatever needs text is a 400 in vLLM's words."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import requests

from actors.api import LLM, SamplingParams
from helpers import save_tiny_llama, save_tiny_tokenizer
from server import ROOT, Server

pytestmark = pytest.mark.slow

VOCAB = 128
PROMPT = [5, 9, 2, 7, 3]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A tiny Llama checkpoint with no tokenizer files."""
    return save_tiny_llama(tmp_path_factory.mktemp("bare_llama"), VOCAB, 64, 96, 4, 2, 16, 256)


@pytest.fixture(scope="module")
def greedy_with_tokenizer(bare, tmp_path_factory):
    """The checkpoint's greedy token ids when it has a tokenizer (a copy with one)."""
    copy = tmp_path_factory.mktemp("with_tokenizer") / "llama"
    shutil.copytree(bare, copy)
    save_tiny_tokenizer(copy, VOCAB)
    with LLM(str(copy), multiprocess=False) as llm:
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def server(bare):
    s = Server("--model", bare, "--tokens-only", "--threads", "1")
    yield s
    s.stop()


def test_offline_generates_the_same_tokens_without_a_tokenizer(bare, greedy_with_tokenizer):
    with LLM(bare, multiprocess=False, skip_tokenizer_init=True) as llm:
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)
        assert list(out.outputs[0].token_ids) == greedy_with_tokenizer and out.outputs[0].text == ""
        with pytest.raises(ValueError, match="You cannot pass text prompts when `skip_tokenizer_init=True`"):
            llm.generate(["t5 t9"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="Tokenizer not available when `skip_tokenizer_init=True`"):
            llm.get_tokenizer()


def test_a_checkpoint_without_a_tokenizer_needs_the_flag(bare):
    proc = subprocess.run([sys.executable, "-m", "tools.serve", "--port", "0", "--model", bare], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "has no tokenizer.json" in proc.stderr and "--skip-tokenizer-init" in proc.stderr


def test_token_ids_in_token_ids_out_plain_streamed_and_through_generate(server, greedy_with_tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choice = plain["choices"][0]
    assert choice["token_ids"] == greedy_with_tokenizer and choice["text"] == ""
    lp = requests.post(server.url + "/v1/completions", json={**body, "logprobs": 1}, timeout=60).json()
    assert lp["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in greedy_with_tokenizer]
    streamed = requests.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == greedy_with_tokenizer and len(chunks) > 2       # each step's ids as they come
    gen = requests.post(server.url + "/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=60).json()
    assert gen["choices"][0]["token_ids"] == greedy_with_tokenizer


def test_what_needs_text_is_refused_in_vllms_words(server):
    for path, body, param, words in (
            ("/v1/completions", {"prompt": "t5 t9", "max_tokens": 2}, "prompt", "You cannot pass text prompts"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]}, "messages",
             "Tokenizer not available when `skip_tokenizer_init=True`"),
            ("/v1/completions", {"prompt": PROMPT, "stop": ["t9"]}, "stop", "use stop_token_ids"),
            ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_object"}}, "response_format",
             "Structured outputs requires a tokenizer"),
            ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2},
                                        "output_mode": "text"}, "output_mode", "requires a tokenizer"),
            ("/tokenize", {"prompt": "t5"}, "prompt", "You cannot pass text prompts"),
            ("/detokenize", {"tokens": [5]}, None, "Tokenizer not available")):
        resp = requests.post(server.url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and words in error["message"], (path, error)
    assert requests.post(server.url + "/abort_requests", json={"request_ids": ["none"]}, timeout=30).status_code == 200


def test_flags_that_read_text_are_refused_at_start():
    for flag in (["--reasoning-parser", "qwen3"], ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]):
        proc = subprocess.run([sys.executable, "-m", "tools.serve", "--skip-tokenizer-init", *flag], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--skip-tokenizer-init loads no tokenizer" in proc.stderr, proc.stderr
