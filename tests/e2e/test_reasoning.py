"""--reasoning-parser on the real server, with a model whose tokenizer has the <think> and
</think> tokens (a tiny random Llama with SmolLM2's tokenizer and the two added): the answer's
reasoning and content are the output split where vLLM's parsers split it, plain and streamed;
a model without the tokens is refused at start-up. And gpt-oss's harmony markers, special
tokens in its vocabulary, reach the ``openai_gptoss`` parser (the text it reads keeps them)."""
from __future__ import annotations

import copy
import json

import pytest
import requests

from server import Server

pytestmark = pytest.mark.slow

TAGS = ["<think>", "</think>"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from helpers import save_tiny_llama, transformers_tokenizer_from_gguf
    from models.resolve import default_gguf_path
    out = tmp_path_factory.mktemp("thinking-llama")
    tok = copy.deepcopy(transformers_tokenizer_from_gguf(default_gguf_path()))   # the shared one stays as it is
    tok.add_tokens(TAGS)
    tok.save_pretrained(out)
    save_tiny_llama(out, vocab=len(tok), hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                    max_positions=512)
    return str(out), tok


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server("--model", checkpoint[0], "--threads", "1", "--reasoning-parser", "deepseek_r1",
               "--served-model-name", "thinker")
    yield s
    s.stop()


def _expected(text: str) -> tuple[str | None, str | None]:
    """deepseek_r1's split: reasoning up to the first </think> (all of it without one)."""
    if text.lstrip().startswith("<think>"):
        text = text.lstrip()[len("<think>"):]
    reasoning, tag, content = text.partition("</think>")
    return reasoning or None, (content or None) if tag else None


def _streamed(server, body: dict) -> tuple[str, str]:
    """The streamed answer's reasoning and content, each its deltas joined."""
    with requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=120) as resp:
        deltas = [c["delta"] for line in resp.iter_lines() if line.startswith(b"data: {")
                  for c in json.loads(line[6:])["choices"]]
    return "".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas)


def test_the_answer_splits_the_output_into_reasoning_and_content_plain_and_streamed(server, checkpoint):
    _, tok = checkpoint
    think_end = tok.convert_tokens_to_ids("</think>")
    words = tok.encode(" yes no maybe", add_special_tokens=False)
    body = {"model": "thinker", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 24,
            "temperature": 1.0, "allowed_token_ids": [think_end, *words], "return_token_ids": True}
    seen_split = False
    for seed in range(6):
        out = requests.post(server.url + "/v1/chat/completions", json={**body, "seed": seed}, timeout=120).json()
        choice = out["choices"][0]
        raw = requests.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}, timeout=30).json()["prompt"]
        reasoning, content = _expected(raw)
        assert (choice["message"]["reasoning"], choice["message"]["content"]) == (reasoning, content), raw
        seen_split |= reasoning is not None and content is not None
        assert _streamed(server, {**body, "seed": seed}) == (reasoning or "", content or "")
    assert seen_split                               # some outputs had both parts


def test_include_reasoning_false_leaves_the_reasoning_out_and_a_reply_may_carry_its_reasoning(server):
    out = requests.post(server.url + "/v1/chat/completions", json={
        "model": "thinker", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 8,
        "include_reasoning": False}, timeout=120).json()
    assert "reasoning" not in out["choices"][0]["message"]
    turns = [{"role": "user", "content": "Think."},
             {"role": "assistant", "content": "Yes.", "reasoning_content": "Because."},
             {"role": "user", "content": "Again."}]
    again = requests.post(server.url + "/v1/chat/completions", json={"model": "thinker", "messages": turns,
                                                                      "max_tokens": 2}, timeout=120)
    assert again.status_code == 200, again.text
    bad = requests.post(server.url + "/v1/chat/completions", json={"model": "thinker", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi", "reasoning": "no"}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].reasoning"


def test_structured_outputs_with_a_reasoning_parser_are_refused_naming_the_field(server):
    resp = requests.post(server.url + "/v1/chat/completions", json={
        "model": "thinker", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "response_format": {"type": "json_object"}}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"


def test_a_model_without_the_think_tokens_is_refused_at_start():
    with pytest.raises(RuntimeError) as err:
        Server("--threads", "1", "--reasoning-parser", "qwen3")
    assert "--reasoning-parser qwen3: the model's tokenizer has no <think> token" in str(err.value)


def test_a_response_puts_the_reasoning_in_a_reasoning_item_first(server):
    """Greedy, the Responses request and the chat request generate the same output: the
    response's reasoning item holds the chat message's reasoning, its message item the content."""
    chat = requests.post(server.url + "/v1/chat/completions", json={
        "model": "thinker", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 12,
        "temperature": 0}, timeout=120).json()["choices"][0]["message"]
    items = requests.post(server.url + "/v1/responses", json={
        "model": "thinker", "input": "Think.", "max_output_tokens": 12, "temperature": 0}, timeout=120).json()["output"]
    assert chat["reasoning"] and items[0]["type"] == "reasoning"
    assert items[0]["content"] == [{"type": "reasoning_text", "text": chat["reasoning"]}]
    messages = [i for i in items if i["type"] == "message"]
    assert [m["content"][0]["text"] for m in messages] == ([chat["content"]] if chat["content"] else [])


def test_a_streamed_response_sends_the_reasoning_item_then_the_message(server):
    """The streamed events build the same output as the whole response: the reasoning item's
    deltas first (output 0), then the message's (output 1, if any)."""
    body = {"model": "thinker", "input": "Think.", "max_output_tokens": 12, "temperature": 0}
    whole = requests.post(server.url + "/v1/responses", json=body, timeout=120).json()
    with requests.post(server.url + "/v1/responses", json={**body, "stream": True}, stream=True, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == whole["output"][0]["content"][0]["text"]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [item["type"] for item in whole["output"]] and added[0] == "reasoning"
    final = events[-1]["response"]["output"]
    assert [(i["type"], i.get("content")) for i in final] == [(i["type"], i.get("content")) for i in whole["output"]]


def test_thinking_token_budget_ends_the_reasoning_after_that_many_tokens(server, checkpoint):
    """vLLM's thinking_token_budget: a prompt that opens the reasoning (<think> at its end) gets
    at most that many reasoning tokens, then </think> (deepseek_r1's end tag) forced; with the
    budget 0 at once; the chat answer then splits there. Without a budget the same request runs
    on, greedy, without one."""
    _, tok = checkpoint
    think_end = tok.convert_tokens_to_ids("</think>")
    words = tok.encode(" yes no maybe", add_special_tokens=False)
    body = {"model": "thinker", "prompt": "Question: why? <think>", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": [think_end, *words]}

    def ids(**extra) -> list[int]:
        out = requests.post(server.url + "/v1/completions", json={**body, **extra}, timeout=120)
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["token_ids"]
    free = ids()
    assert think_end not in free[:4]                  # the model itself does not end its reasoning early
    for budget in (0, 3):
        capped = ids(thinking_token_budget=budget)
        assert capped[:budget] == free[:budget] and capped[budget] == think_end, (budget, capped)
    chat = requests.post(server.url + "/v1/chat/completions", json={
        "model": "thinker", "max_tokens": 8, "temperature": 0, "thinking_token_budget": 2,
        "messages": [{"role": "user", "content": "Think."}, {"role": "assistant", "content": "<think>"}],
        "continue_final_message": True, "add_generation_prompt": False, "allowed_token_ids": [think_end, *words],
        "return_token_ids": True}, timeout=120).json()["choices"][0]
    assert chat["token_ids"][2] == think_end and chat["message"]["content"] is not None
    bad = requests.post(server.url + "/v1/completions", json={**body, "thinking_token_budget": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"


HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    """A tiny random Llama whose tokenizer has harmony's markers as special tokens."""
    from helpers import save_tiny_llama, transformers_tokenizer_from_gguf
    from models.resolve import default_gguf_path
    out = tmp_path_factory.mktemp("harmony-llama")
    tok = copy.deepcopy(transformers_tokenizer_from_gguf(default_gguf_path()))
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.save_pretrained(out)
    save_tiny_llama(out, vocab=len(tok), hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                    max_positions=512)
    s = Server("--model", str(out), "--threads", "1", "--reasoning-parser", "openai_gptoss",
               "--served-model-name", "oss")
    yield s, tok
    s.stop()


def test_harmony_markers_reach_the_parser_which_splits_the_analysis_channel_from_the_final_one(harmony_server):
    """Outputs sampled from the markers and a few words: the answer's reasoning and content are
    the split of the output's text with its special tokens kept (plain and streamed), and some
    outputs have an analysis message (which the text without the markers could not show)."""
    from actors.frontend.reasoning import REASONING_PARSERS
    server, tok = harmony_server
    parser = REASONING_PARSERS["openai_gptoss"]
    allowed = tok.convert_tokens_to_ids(["<|channel|>", "<|message|>"]) + tok.encode("analysis yes",
                                                                                    add_special_tokens=False)
    body = {"model": "oss", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 32,
            "temperature": 1.0, "allowed_token_ids": allowed, "return_token_ids": True}
    reasoned = 0
    for seed in range(8):
        choice = requests.post(server.url + "/v1/chat/completions", json={**body, "seed": seed},
                               timeout=120).json()["choices"][0]
        raw = requests.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}, timeout=30).json()["prompt"]
        reasoning, content = parser.split(raw)
        assert (choice["message"].get("reasoning"), choice["message"]["content"]) == (reasoning, content), raw
        reasoned += reasoning is not None
        assert _streamed(server, {**body, "seed": seed}) == (reasoning or "", content or "")
    assert reasoned
