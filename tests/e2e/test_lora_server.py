"""LoRA end to end through the server and the openai client, on a tiny random Llama served with
--enable-lora and one adapter from --lora-modules (runtime loading allowed by
VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM asks): adapters are listed with the adapter path as
their root and the base model as their parent, one is loaded over HTTP, a request's model
field picks it, a bad adapter is a 400 (a path with no adapter a 404) that changes nothing, and
once unloaded its name is a 404 like any unknown model. An adapter whose files went away after
the worker dropped it (--max-cpu-loras) fails only its own requests, with a 400 naming it;
unloading an adapter frees its place in the worker's cache at once."""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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
    s = Server("--model", base, "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16",
               "--lora-modules", f"first={root / 'first'}",
               json.dumps({"name": "other", "path": str(root / "second"), "base_model_name": "not-served"}),
               "--served-model-name", "tiny",
               env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
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
    assert set(models) == {"tiny", "first", "other"} and models["first"].parent == "tiny"
    assert models["first"].root == str(root / "first")
    assert models["other"].parent == "tiny"               # as vLLM: a base_model_name not served is ignored
    status, text = _post(server.url + "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(root / "second")})
    assert status == 200 and text == "Success: LoRA adapter 'second' added successfully."
    assert {m.id for m in client.models.list().data} == {"tiny", "first", "other", "second"}
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


@pytest.mark.parametrize("body, status, reason", [
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "No adapter found for /nonexistent/adapter"),
    ({"lora_name": "wide", "lora_path": "{root}/wide"}, 400, "more than --max-lora-rank 16"),
    ({"lora_name": "first", "lora_path": "{root}/second"}, 400, "The lora adapter 'first' has already been loaded."),
    ({"lora_name": "y"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
])
def test_a_bad_adapter_is_refused_as_vllm_does_and_changes_nothing(setup, client, body, status, reason):
    server, root = setup
    before = {m.id for m in client.models.list().data}
    body = {k: v.format(root=root) for k, v in body.items()}
    got, text = _post(server.url + "/v1/load_lora_adapter", body)
    assert got == status and reason in json.loads(text)["error"]["message"]
    assert {m.id for m in client.models.list().data} == before


def test_unloading_an_unknown_adapter_is_vllms_404(setup):
    got, text = _post(setup[0].url + "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert got == 404
    assert json.loads(text)["error"] == {"message": "The lora adapter 'never' cannot be found.",
                                         "type": "NotFoundError", "param": "lora_name", "code": 404}


def _load(server, name: str, path) -> None:
    status, text = _post(server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert status == 200, text


def test_an_adapter_whose_files_went_away_fails_only_its_requests(setup, client):
    """Read by the worker, dropped from its cache of two by two other adapters, then its
    directory removed (or its weights corrupted): its request is a 400 naming it, a request
    on the base model sent with it is served, and so are later ones."""
    import openai
    server, root = setup
    for name, src in (("gone", "second"), ("broken", "first")):
        shutil.copytree(root / src, root / name)
        _load(server, name, root / name)
        _complete(client, name)                                  # the worker reads it
    _load(server, "fill", root / "second")
    base, fill = _complete(client, "tiny"), _complete(client, "fill")
    _complete(client, "first")                                   # the worker's cache: fill, first
    shutil.rmtree(root / "gone")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    for name in ("gone", "broken"):
        with ThreadPoolExecutor(2) as pool:
            failing, served = pool.submit(_complete, client, name), pool.submit(_complete, client, "tiny")
            with pytest.raises(openai.BadRequestError, match=f"LoRA adapter '{name}' could not be loaded"):
                failing.result(timeout=120)
            assert served.result(timeout=120) == base
    assert _complete(client, "fill") == fill and _complete(client, "tiny") == base


def test_unloading_an_adapter_frees_its_place_in_the_workers_cache(setup, client):
    """The worker keeps two adapters: kept, then dropped (most recently used). Once dropped is
    unloaded, a third adapter takes its place, not kept's: kept is still served after its
    directory is removed, so the worker never had to read it again."""
    server, root = setup
    shutil.copytree(root / "second", root / "kept")
    _load(server, "kept", root / "kept")
    _load(server, "dropped", root / "first")
    _load(server, "third", root / "second")
    kept = _complete(client, "kept")
    _complete(client, "dropped")
    status, _ = _post(server.url + "/v1/unload_lora_adapter", {"lora_name": "dropped"})
    assert status == 200
    _complete(client, "third")
    shutil.rmtree(root / "kept")
    assert _complete(client, "kept") == kept
