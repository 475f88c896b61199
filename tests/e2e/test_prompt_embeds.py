"""vLLM's prompt embeds on the default model (`--enable-prompt-embeds`): /v1/completions takes
`prompt_embeds`, the base64 of a torch.save'd (tokens, hidden) tensor (or a list of them, each a
prompt before those of `prompt`), and answers what the tokens those rows embed answer; the prefix
cache serves a prompt's blocks to the same rows again and never to other rows of as many
positions (their token ids are placeholders); bad payloads and the fields that cannot go with
embeddings are 400s naming the field. Offline, `{"prompt_embeds": tensor}` in LLM.generate."""
from __future__ import annotations

import base64
import io
import json

import urllib.error
import urllib.request

import pytest
import torch

from server import Server

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
LONG = ("Once upon a time, in a village by the sea, there lived an old fisherman who told stories "
        "to the children every evening, by the fire, with a cup of tea. One day he said")


@pytest.fixture(scope="module")
def server():
    s = Server("--threads", "1", "--enable-prompt-embeds")
    try:
        yield s
    finally:
        s.stop()


class Answer:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self.text = status, body.decode()

    def json(self):
        return json.loads(self.text)


class Http:
    def __init__(self, url: str) -> None:
        self.url = url

    def post(self, path: str, json: dict) -> Answer:
        req = urllib.request.Request(self.url + path, globals()["json"].dumps(json).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return Answer(r.status, r.read())
        except urllib.error.HTTPError as e:
            return Answer(e.code, e.read())


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url)


@pytest.fixture(scope="module")
def embed():
    """Token ids -> the default model's input embeddings of them (its own embedding table)."""
    from models.registry import load_model
    from models.resolve import resolve_model
    model, _ = load_model(resolve_model(MODEL))

    @torch.inference_mode()
    def rows(ids: list[int]) -> torch.Tensor:
        return model.embed_input_ids(torch.tensor(ids)).clone()
    return rows


def payload(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def ids_of(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 12, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_embeddings_of_a_prompts_tokens_answer_as_the_prompt_does_streamed_or_not(http, embed):
    ids = ids_of(http, PROMPT)
    text = complete(http, prompt=PROMPT)["choices"][0]["text"]
    got = complete(http, prompt_embeds=payload(embed(ids)))
    assert got["choices"][0]["text"] == text
    assert got["usage"]["prompt_tokens"] == len(ids)
    batched = embed(ids).unsqueeze(0).to(torch.bfloat16)        # (1, tokens, hidden) in another dtype: taken
    assert complete(http, prompt_embeds=payload(batched))["usage"]["prompt_tokens"] == len(ids)
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
                                           "prompt_embeds": payload(embed(ids))})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


def test_a_list_of_embeddings_and_a_text_prompt_are_three_prompts_embeddings_first(http, embed):
    other = "def fibonacci(n):"
    texts = [complete(http, prompt=p)["choices"][0]["text"] for p in (PROMPT, other)]
    got = complete(http, prompt=other, prompt_embeds=[payload(embed(ids_of(http, PROMPT))),
                                                      payload(embed(ids_of(http, other)))])
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == [texts[0], texts[1], texts[1]]
    two = complete(http, prompt_embeds=payload(embed(ids_of(http, PROMPT))), n=2, temperature=0.8, seed=7)
    assert len(two["choices"]) == 2 and two["usage"]["prompt_tokens"] == len(ids_of(http, PROMPT))


def test_the_prefix_cache_serves_the_same_rows_and_never_other_rows(http, embed):
    ids = ids_of(http, LONG)
    assert len(ids) >= 32
    rows = embed(ids)
    first = complete(http, prompt_embeds=payload(rows), max_tokens=2)
    again = complete(http, prompt_embeds=payload(rows), max_tokens=2)
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= 32 and cached == (len(ids) - 1) // 16 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # as many positions (the same placeholder token ids), other rows: nothing cached
    shifted = embed(list(reversed(ids)))
    other = complete(http, prompt_embeds=payload(shifted), max_tokens=2)
    assert (other["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_bad_embeddings_and_fields_that_need_tokens_are_400s_naming_the_field(http, embed):
    good = payload(embed(ids_of(http, PROMPT)))
    cases = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
        ({"prompt_embeds": base64.b64encode(b"not a tensor file").decode()}, "prompt_embeds", "deserialized"),
        ({"prompt_embeds": payload(torch.zeros(4, 7))}, "prompt_embeds", "hidden_size 7"),
        ({"prompt_embeds": payload(torch.zeros(576))}, "prompt_embeds", "2D tensor"),
        ({"prompt_embeds": payload(torch.zeros(3, 576, dtype=torch.int32))}, "prompt_embeds", "floating-point"),
        ({"prompt_embeds": []}, "prompt_embeds", "provided and non-empty"),
        ({"prompt_embeds": good, "echo": True}, "echo", "Echo is unsupported"),
        ({"prompt_embeds": good, "prompt_logprobs": 1}, "prompt_logprobs", "not compatible"),
        ({}, "prompt", "provided and non-empty"),
    ]
    for body, param, words in cases:
        r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2} | body)
        assert r.status_code == 400, (body.keys(), r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["param"] == param, (words, error)
    assert complete(http, prompt_embeds=good, max_tokens=1)["usage"]["prompt_tokens"] > 0    # still serving


def test_offline_generate_takes_a_prompt_dict_of_embeddings(embed):
    from actors.api import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8)
    with LLM(enable_prompt_embeds=True, multiprocess=False) as llm:
        (plain,) = llm.generate([PROMPT], sp, use_tqdm=False)
        (got,) = llm.generate([{"prompt_embeds": embed(plain.prompt_token_ids)}], sp, use_tqdm=False)
        assert got.outputs[0].text == plain.outputs[0].text and got.prompt_token_ids == []
        with pytest.raises(ValueError, match="exactly one of"):
            llm.generate([{"prompt": PROMPT, "prompt_embeds": embed(plain.prompt_token_ids)}], sp, use_tqdm=False)
        with pytest.raises(ValueError, match="2D tensor"):
            llm.generate([{"prompt_embeds": embed(plain.prompt_token_ids)[0]}], sp, use_tqdm=False)
