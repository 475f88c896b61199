"""POST /v2/embed: Cohere's Embed API (v2) on a pooling model, as vLLM serves it. ``texts`` (or
``inputs`` of text content) embedded as /v1/embeddings embeds them; ``input_type`` puts the
model's instruction for that type before each text (config.json's ``task_instructions``, or a
sentence-transformers checkpoint's ``prompts``: as a system message where the model has a chat
template); ``truncate`` NONE, START or END (``max_tokens``: the tokens kept); ``output_dimension``
a Matryoshka size; ``embedding_types`` float, binary / ubinary (signs packed eight to a byte,
most significant first) and base64 (little-endian float32)."""
from __future__ import annotations

import base64
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from aiohttp import web

from actors.engine.pooling import PoolingParams
from actors.frontend.embeddings import Prompt, chat_prompt, embed_prompts
from actors.frontend.errors import bad_request, not_found
from actors.frontend.params import check_priority
from actors.frontend.protocol import require

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

PATH = "/v2/embed"
EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")
TRUNCATE = ("NONE", "START", "END")


class CohereEmbedContent(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: dict[str, str] | None = None


class CohereEmbedInput(msgspec.Struct, kw_only=True):
    content: list[CohereEmbedContent]


class CohereEmbedRequest(msgspec.Struct, kw_only=True):
    """Cohere's embed request (vLLM's fields; others are ignored, as vLLM's model ignores them)."""
    model: str | None = None
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[CohereEmbedInput] | None = None
    output_dimension: int | None = None
    embedding_types: list[str] | None = None
    truncate: str = "END"
    max_tokens: int | None = None
    priority: int = 0


async def create_cohere_embedding(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    client = server.engine()
    pooling = client.config.model.pooling
    if pooling is None or "embed" not in pooling.tasks:
        raise not_found("The model does not support Embeddings API: serve an embedding model with --runner pooling")
    req: CohereEmbedRequest = server.decode(await request.read(), CohereEmbedRequest)
    given = [f for f in (req.texts, req.images, req.inputs) if f is not None]
    require(len(given) == 1 and bool(given[0]), "Exactly one of texts, images, or inputs must be provided, "
            "and it must be non-empty", "texts")
    for item in req.inputs or []:
        for part in item.content:
            require(part.type in ("text", "image_url"), f"content type must be text or image_url, got {part.type!r}",
                    "inputs")
            require(part.type != "text" or part.text is not None,
                    "CohereEmbedContent with type='text' requires text", "inputs")
    if req.images is not None or any(p.type == "image_url" for item in req.inputs or [] for p in item.content):
        raise bad_request("images are not supported: this model embeds text only", "images")
    types = req.embedding_types or ["float"]
    for kind in types:
        require(kind in EMBEDDING_TYPES, f"embedding_types must be of {', '.join(EMBEDDING_TYPES)}, got {kind!r}",
                "embedding_types")
    require(req.truncate in TRUNCATE, f"truncate must be one of {', '.join(TRUNCATE)}, got {req.truncate!r}",
            "truncate")
    require(req.max_tokens is None or req.max_tokens >= 1, f"max_tokens must be at least 1, got {req.max_tokens}",
            "max_tokens")
    instructions = dict(pooling.task_instructions)
    if req.input_type is not None:
        if not instructions:
            raise bad_request(f"Unsupported input_type {req.input_type!r}. This model does not define any "
                              "input_type task instructions.", "input_type")
        if req.input_type not in instructions:
            raise bad_request(f"Unsupported input_type {req.input_type!r}. Supported values: "
                              f"{', '.join(sorted(instructions))}", "input_type")
    prefix = instructions.get(req.input_type or "") or None
    if req.truncate == "NONE":
        keep, side = None, "right"
    else:
        keep, side = req.max_tokens or -1, "left" if req.truncate == "START" else "right"
    try:
        params = client.pooling_request(PoolingParams(task="embed", dimensions=req.output_dimension), keep)
    except ValueError as exc:
        raise bad_request(str(exc), "output_dimension") from None
    priority = check_priority(req, client.config.scheduler.policy)
    rid = uuid.uuid4().hex
    vectors, counts = await embed_prompts(server, params, _prompts(server, req, prefix), rid, priority, side,
                                          client.lora_request_for(req.model))
    if req.truncate == "NONE" and req.max_tokens is not None:
        for n in counts:
            require(n <= req.max_tokens, f"Input of {n} tokens exceeds max_tokens={req.max_tokens} with "
                    "truncate=NONE. Set truncate to END or START to allow truncation.", "max_tokens")
    floats = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])
    answer: dict[str, Any] = {"id": f"embd-{rid}", "embeddings": typed_embeddings(floats, types)}
    if req.texts is not None:
        answer["texts"] = req.texts
    answer["meta"] = {"api_version": {"version": "2"}, "billed_units": {"input_tokens": sum(counts), "image_tokens": 0}}
    answer["response_type"] = "embeddings_by_type"
    return web.json_response(answer, dumps=lambda obj: msgspec.json.encode(obj).decode())


def _prompts(server: OpenAIServer, req: CohereEmbedRequest, prefix: str | None) -> list[Prompt]:
    """Each text as a prompt; with an instruction, a chat of it (the system's) and the text
    where the model has a chat template, else the instruction and the text joined. ``inputs``
    always go through the chat template, as vLLM renders them."""
    if req.texts is not None:
        if prefix is None:
            return [Prompt({"prompt": text, "add_special_tokens": True}) for text in req.texts]
        if server.engine().tokenizer.chat_template is None:
            return [Prompt({"prompt": prefix + text, "add_special_tokens": True}) for text in req.texts]
        contents = [[{"type": "text", "text": text}] for text in req.texts]
    else:
        contents = [[{"type": "text", "text": p.text} for p in item.content] for item in req.inputs]
    system = [] if prefix is None else [{"role": "system", "content": [{"type": "text", "text": prefix}]}]
    return [chat_prompt(server, [*system, {"role": "user", "content": content}]) for content in contents]


def typed_embeddings(floats: np.ndarray, types: list[str]) -> dict[str, Any]:
    """Cohere's embeddings_by_type: each asked type of the (n, dims) float32 vectors."""
    out: dict[str, Any] = {}
    for kind in types:
        if kind == "float":
            out["float"] = floats.tolist()
        elif kind in ("binary", "ubinary"):
            require(floats.shape[1] % 8 == 0, "Embedding dimension must be a multiple of 8 for binary embedding "
                    f"types, but got {floats.shape[1]}.", "embedding_types")
            packed = np.packbits(floats >= 0, axis=-1)
            out[kind] = (packed.astype(np.int16) - 128 if kind == "binary" else packed).tolist()
        else:
            out["base64"] = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in floats]
    return out
