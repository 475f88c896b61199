"""LoRA end to end through the server and the openai client, on a tiny random Llama served with
--enable-lora and one adapter from --lora-modules: adapters are listed with the base model as
their parent, one is loaded over HTTP, a request's model field picks it, a bad adapter is a 400
that changes nothing, and once unloaded its name is a 404 like any unknown model."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.e2e.server import Server
from tests.helpers import save_tiny_llama, save_tiny_lora, save_tiny_tokenizer

pytestmark = pytest.mark.slow

VOCAB = 128
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "t5 t17 t99 t3 t64"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = save_tiny_llama(root / "base", VOCAB, 64, 96, 4, 2, 16, 256)
    save_tiny_tokenizer(base, VOCAB)
    for i, name in enumerate(("first", "second")):
        save_tiny_lora(base, root / name, 8, ALL, seed=i, scale=0.2)
    save_tiny_lora(base, root / "wide", 32, ALL, seed=7)          # rank over --max-lora-rank 16
    s = Server("--model", base, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
               "--lora-modules", f"first={root / 'first'}", "--served-model-name", "tiny")
    yield s, root
    s.stop()


@pytest.fixture(scope="module")
def client(setup):
    import openai
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0).choices[0].text


def test_load_list_use_unload_then_a_404(setup, client):
    import openai
    server, root = setup
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "first"} and models["first"].parent == "tiny"
    status, text = _post(server.url + "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(root / "second")})
    assert status == 200 and "second" in text
    assert {m.id for m in client.models.list().data} == {"tiny", "first", "second"}
    base, first, second = (_complete(client, m) for m in ("tiny", "first", "second"))
    assert len({base, first, second}) == 3                      # each adapter changes the tokens
    reply = client.completions.create(model="second", prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert reply.model == "second" and reply.choices[0].text == second
    status, text = _post(server.url + "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    assert _complete(client, "first") == first and _complete(client, "tiny") == base
    status, _ = _post(server.url + "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert status == 404


@pytest.mark.parametrize("body, reason", [
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, "no adapter directory"),
    ({"lora_name": "wide", "lora_path": "{root}/wide"}, "more than --max-lora-rank 16"),
    ({"lora_name": "first", "lora_path": "{root}/second"}, "already been loaded"),
    ({"lora_name": "y"}, "lora_path"),
])
def test_a_bad_adapter_is_a_400_and_changes_nothing(setup, client, body, reason):
    server, root = setup
    before = {m.id for m in client.models.list().data}
    body = {k: v.format(root=root) for k, v in body.items()}
    status, text = _post(server.url + "/v1/load_lora_adapter", body)
    assert status == 400 and reason in text
    assert {m.id for m in client.models.list().data} == before
