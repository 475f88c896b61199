"""POST /v1/embeddings (OpenAI's, with vLLM's fields), POST /pooling and POST /classify (vLLM's):
the answers of a pooling model (``--runner pooling``). ``input`` is a string, token ids, a list of either, or a
chat conversation (``messages``, or a list of conversations), each item one engine request
admitted at once; ``encoding_format`` float, base64 (of ``embed_dtype`` float32, float16,
bfloat16, fp8_e4m3 or fp8_e5m2, in ``endianness`` byte order), or the raw bytes (``bytes``, with a ``metadata`` header
locating each vector; ``bytes_only``), as vLLM encodes them."""
from __future__ import annotations

import asyncio
import base64
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from aiohttp import web

from actors.engine.pooling import PoolingParams
from actors.engine.sampling_params import SamplingParams
from actors.frontend.errors import ApiError, bad_request, error_response, not_found
from actors.frontend.params import check_priority, chat_messages, completion_prompts, served_name
from actors.frontend.protocol import ChatMessage, require
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.engine.lora import LoRARequest
    from actors.frontend.app import OpenAIServer
    from actors.frontend.client import RequestHandle

EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
# float8 formats as torch converts to them (vLLM's embed_dtype): (mantissa bits, exponent bias,
# the float32 exponent below which a value is subnormal, the float32 bits from which it overflows,
# and the code it overflows to: e4m3fn saturates at 448, e5m2 goes to infinity)
_FP8 = {"fp8_e4m3": (3, 7, 121, 0x43E00000, 0x7E), "fp8_e5m2": (2, 15, 113, 143 << 23, 0x7C)}
ENDIANNESS = ("native", "big", "little")
ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")


class PoolingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields /v1/embeddings and /pooling share (vLLM's names). ``task`` is /pooling's:
    "embed" (one vector per input) or "token_embed" (one per input token)."""
    model: str | None = None
    input: str | list[Any] | None = None
    messages: list[Any] | None = None
    encoding_format: str = "float"
    embed_dtype: str = "float32"
    endianness: str = "native"
    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None        # vLLM's old name: refused as vLLM refuses it
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    padding: str | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    task: str | None = None


class Prompt(msgspec.Struct):
    """One engine request of a pooling request: ``submit``'s prompt keywords, and its own
    engine params where they differ from the request's (a text pair's token types)."""
    kwargs: dict[str, Any]
    params: SamplingParams | None = None


EMBEDDINGS, POOLING, CLASSIFY = "/v1/embeddings", "/pooling", "/classify"


async def create_embedding(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    """OpenAI's embeddings: one vector per input."""
    return await pooled(server, EMBEDDINGS, await request.read())


async def create_pooling(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    """vLLM's /pooling: the pooler's output per input (``task``: embed, or token_embed)."""
    return await pooled(server, POOLING, await request.read())


async def create_classification(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    """vLLM's /classify: a classifier's label and probabilities per input."""
    return await pooled(server, CLASSIFY, await request.read())


_APIS = {EMBEDDINGS: ("embed", "embedding", "embd-", "Embeddings"), POOLING: (None, "pooling", "pool-", "Pooling"),
         CLASSIFY: ("classify", "classification", "classify-", "Classification")}


async def pooled(server: OpenAIServer, path: str, body: bytes) -> web.Response:
    """The answer to a request ``body`` for ``path`` (EMBEDDINGS, POOLING or CLASSIFY): the
    HTTP handlers' and the batch runner's."""
    task, object_name, id_prefix, api = _APIS[path]
    client = server.engine()
    pooling = client.config.model.pooling
    if pooling is None:
        raise not_found(f"The model does not support {api} API: it generates text. Serve it with --runner "
                        "pooling (--convert embed, or classify) for embeddings and classification.")
    req: PoolingRequest = server.decode(body, PoolingRequest)
    if task is not None:
        require(req.task is None, "task is /pooling's field", "task")
    require(req.normalize is None, "Parameter `normalize` was removed; use `use_activation` instead.", "normalize")
    require(req.encoding_format in ENCODING_FORMATS, f"encoding_format must be one of "
            f"{', '.join(ENCODING_FORMATS)}, got {req.encoding_format!r}", "encoding_format")
    require(req.embed_dtype in EMBED_DTYPES, f"embed_dtype must be one of {', '.join(EMBED_DTYPES)}, "
            f"got {req.embed_dtype!r}", "embed_dtype")
    require(req.endianness in ENDIANNESS, f"endianness must be one of {', '.join(ENDIANNESS)}, "
            f"got {req.endianness!r}", "endianness")
    require(req.padding in (None, "do_not_pad"), "padding 'max_length' is not supported (decoder models "
            "read prompts unpadded)", "padding")
    require(req.truncation_side in (None, "left", "right"), "truncation_side must be left or right",
            "truncation_side")
    t = req.truncate_prompt_tokens
    require(t is None or t == -1 or t >= 1, f"truncate_prompt_tokens must be -1 (the last max_model_len) or "
            f"at least 1, got {t}", "truncate_prompt_tokens")
    params = PoolingParams(task=task or req.task, dimensions=req.dimensions, use_activation=req.use_activation)
    try:
        engine_params = client.pooling_request(params, req.truncate_prompt_tokens)
    except ValueError as exc:            # InvalidPrompt: what the model cannot do
        param = "task" if "task" in str(exc).lower() else "dimensions"
        raise bad_request(str(exc), param) from None
    priority = check_priority(req, client.config.scheduler.policy)
    rid = req.request_id or uuid.uuid4().hex
    prompts, side = _prompts(server, req), req.truncation_side   # None: as the tokenizer truncates (the start kept)
    lora = client.lora_request_for(req.model)          # a served LoRA adapter named as the model
    if task == "embed":
        vectors, counts = await embed_prompts(server, engine_params, prompts, rid, priority, side, lora)
        prompt_tokens = sum(counts)
    else:
        outs, prompt_tokens = await run_pooling(server, engine_params, prompts, rid, priority, side, lora)
        vectors = [out.pooling_output for out in outs]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if task != "classify" and req.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(vectors, req, f"{id_prefix}{rid}", served_name(client, req.model), usage)
    if task == "classify":
        data = [_classification(i, probs, pooling.labels) for i, probs in enumerate(vectors)]
    else:
        data = [{"index": i, "object": object_name, ("embedding" if task else "data"): _encoded(vector, req)}
                for i, vector in enumerate(vectors)]
    return web.json_response({
        "id": f"{id_prefix}{rid}", "object": "list", "created": int(time.time()),
        "model": served_name(client, req.model), "data": data,
        "usage": {**usage, "completion_tokens": 0}},
        dumps=lambda obj: msgspec.json.encode(obj).decode())


async def run_pooling(server: OpenAIServer, params: SamplingParams, prompts: list[Prompt], rid: str, priority: int,
                      truncation_side: str | None, lora_request: LoRARequest | None = None
                      ) -> tuple[list[RequestOutput], int]:
    """Every prompt admitted at once as a pooling request (``params``: the engine's, from
    ``EngineClient.pooling_request``), then their finished outputs, in order, and their prompt
    tokens in all. A refusal ends those admitted before it; an output the engine failed is
    answered with its error and status."""
    handles: list[RequestHandle] = []
    try:
        for i, prompt in enumerate(prompts):
            handles.append(await server.submit(
                prompt.params or params, request_id=f"{rid}-{i}" if len(prompts) > 1 else rid, priority=priority,
                truncation_side=truncation_side, lora_request=lora_request, **prompt.kwargs))
        outs = await asyncio.gather(*(_final(h) for h in handles))
    finally:
        for h in handles:
            h.close()
    for out in outs:
        if out.error is not None or out.pooling_output is None:
            raise ApiError(error_response(out.error_status or 500, out.error or "the request ended without an output"))
    return list(outs), sum(h.num_prompt_tokens for h in handles)


async def embed_prompts(server: OpenAIServer, params: SamplingParams, prompts: list[Prompt], rid: str, priority: int,
                        truncation_side: str | None, lora_request: LoRARequest | None = None
                        ) -> tuple[list[np.ndarray], list[int]]:
    """The embeddings of ``prompts`` (``params``: an embed task's engine params), in order,
    and each prompt's tokens: /v1/embeddings' and /v2/embed's, in pieces where the pooler
    config enables chunked processing."""
    if server.engine().config.model.pooling.pooler.enable_chunked_processing:
        return await run_chunked(server, params, prompts, rid, priority, truncation_side, lora_request)
    outs, _ = await run_pooling(server, params, prompts, rid, priority, truncation_side, lora_request)
    return [out.pooling_output for out in outs], [out.num_prompt_tokens for out in outs]


async def run_chunked(server: OpenAIServer, params: SamplingParams, prompts: list[Prompt], rid: str, priority: int,
                      truncation_side: str | None, lora_request: LoRARequest | None = None
                      ) -> tuple[list[np.ndarray], list[int]]:
    """vLLM's long-text embedding (the pooler config's ``enable_chunked_processing``): each
    prompt rendered whole (up to ``max_embed_len`` tokens), cut into pieces of max_model_len
    tokens embedded as requests of their own, and the pieces' vectors averaged, each weighing
    its tokens; the average is normalized again where the pieces were (``use_activation``).
    Returns the prompts' vectors, in order, and each one's tokens."""
    size = server.engine().max_model_len
    pieces: list[Prompt] = []
    owners: list[int] = []
    for i, prompt in enumerate(prompts):
        rendered = await server.submit(params, request_id=f"{rid}-{i}", priority=priority, render_only=True,
                                       truncation_side=truncation_side, **prompt.kwargs)
        ids = list(rendered.prompt_token_ids)
        for start in range(0, len(ids), size):
            pieces.append(Prompt({"prompt_token_ids": ids[start:start + size]}))
            owners.append(i)
    whole = msgspec.structs.replace(params, truncate_prompt_tokens=None)    # truncated when rendered
    outs, _ = await run_pooling(server, whole, pieces, rid, priority, truncation_side, lora_request)
    sums: list[np.ndarray | None] = [None] * len(prompts)
    weights, counts, unit = [0] * len(prompts), [0] * len(prompts), [True] * len(prompts)
    for out, owner, piece in zip(outs, owners, pieces):
        vector = np.asarray(out.pooling_output, dtype=np.float32)
        weight = len(piece.kwargs["prompt_token_ids"])
        unit[owner] &= bool(np.isclose(np.linalg.norm(vector), 1.0, rtol=1e-2, atol=1e-5))
        sums[owner] = vector * weight if sums[owner] is None else sums[owner] + vector * weight
        weights[owner] += weight
        counts[owner] += 1
    vectors = []
    for total, weight, count, normalized in zip(sums, weights, counts, unit):
        mean = total / weight
        if params.pooling.use_activation and count > 1 and normalized:
            mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
        vectors.append(mean)
    return vectors, weights


def _classification(index: int, probs: np.ndarray, labels: tuple[str, ...]) -> dict[str, Any]:
    """vLLM's ClassificationData: the most likely label, every label's probability."""
    return {"index": index, "label": labels[int(np.argmax(probs))] if len(probs) == len(labels) else None,
            "probs": probs.tolist(), "num_classes": len(probs)}


async def _final(handle: RequestHandle) -> RequestOutput:
    final: RequestOutput | None = None
    async for out in handle:
        if final is None:
            final = out
        else:
            final.merge(out)
    return final


def _prompts(server: OpenAIServer, req: PoolingRequest) -> list[Prompt]:
    """Each engine request's prompt: ``messages`` (a conversation, or a list of them), or
    ``input`` (text, token ids, a list of either, or a conversation)."""
    conversations: list[list[Any]] | None = None
    if req.messages is not None:
        require(req.input is None, "give input or messages, not both", "messages")
        conversations = _conversations(req.messages, "messages")
    elif isinstance(req.input, list) and req.input and isinstance(req.input[0], (dict, list)) \
            and _conversations(req.input, None) is not None:
        conversations = _conversations(req.input, "input")
    if conversations is not None:
        require(not (req.add_generation_prompt and req.continue_final_message),
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message")
        if req.chat_template is not None and not server.options.trust_request_chat_template:
            raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                              "set. Refused request with untrusted chat template.", "chat_template")
        return [chat_prompt(server, c, add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            chat_template_kwargs=req.chat_template_kwargs, chat_template=req.chat_template,
                            add_special_tokens=bool(req.add_special_tokens)) for c in conversations]
    require(req.input is not None, "input is required (a string, token ids, or a list of either)", "input")
    add_special = req.add_special_tokens is not False
    try:
        inputs = completion_prompts(req.input, server.vocab_size)
    except Exception as exc:
        raise bad_request(str(exc).replace("prompt", "input"), "input") from None
    return [Prompt({"prompt": p.text, "prompt_token_ids": p.token_ids, "add_special_tokens": add_special})
            for p in inputs]


def chat_prompt(server: OpenAIServer, conversation: list[Any], *, add_generation_prompt: bool = False,
                continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None, add_special_tokens: bool = False) -> Prompt:
    """A conversation (JSON messages) as a prompt rendered by the chat template."""
    return Prompt({"messages": chat_messages(_messages(conversation)), "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message,
                   "chat_template_kwargs": server.template_kwargs(chat_template_kwargs),
                   "chat_template": chat_template, "add_special_tokens": add_special_tokens})


def _messages(conversation: list[Any]) -> list[ChatMessage]:
    try:
        return msgspec.convert(conversation, list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise bad_request(f"messages: {exc}", "messages") from None


def _conversations(value: list[Any], param: str | None) -> list[list[Any]] | None:
    """A conversation (a list of messages) or a list of them, as a list of conversations;
    None (with no ``param`` to name in an error) when ``value`` is neither."""
    def is_message(m: Any) -> bool:
        return isinstance(m, dict) and isinstance(m.get("role"), str)
    if value and all(is_message(m) for m in value):
        return [value]
    if value and all(isinstance(c, list) and c and all(is_message(m) for m in c) for c in value):
        return value
    if param is None:
        return None
    raise bad_request(f"{param} must be a conversation (a list of messages with a role) or a list of them", param)


def _bytes_response(vectors: list[np.ndarray], req: PoolingRequest, rid: str, model: str,
                    usage: dict[str, int]) -> web.Response:
    """vLLM's ``bytes`` encoding: the vectors' raw bytes one after another (``embed_dtype``,
    ``endianness``), and for ``bytes`` (not ``bytes_only``) a ``metadata`` header, JSON, saying
    where each one starts and ends and its shape."""
    body, items, offset = [], [], 0
    for i, vector in enumerate(vectors):
        raw = _raw(vector, req)
        items.append({"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness, "start": offset,
                      "end": offset + len(raw), "shape": list(np.shape(vector))})
        body.append(raw)
        offset += len(raw)
    headers = None if req.encoding_format == "bytes_only" else {"metadata": msgspec.json.encode(
        {"id": rid, "created": int(time.time()), "model": model, "data": items, "usage": usage}).decode()}
    return web.Response(body=b"".join(body), headers=headers, content_type="application/octet-stream")


def _encoded(vector: np.ndarray, req: PoolingRequest) -> list | str:
    """The answer as JSON floats, or base64 of its bytes (``_raw``)."""
    if req.encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(_raw(vector, req)).decode("ascii")


def _fp8(flat: np.ndarray, mant: int, bias: int, subnormal_exp: int, overflow_bits: int, overflow: int
         ) -> np.ndarray:
    """float32 -> float8 codes (uint8) exactly as torch converts: nearest even, the subnormals as
    multiples of the smallest one, what overflows to ``overflow``, NaN to 0x7F."""
    bits = flat.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & 0x7FFFFFFF
    shift = 23 - mant
    normal = (mag + ((bias - 127) << 23 & 0xFFFFFFFF) + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift
    smallest = np.float32(2.0 ** (1 - bias - mant))
    with np.errstate(invalid="ignore"):      # NaN and infinity lanes are replaced below
        subnormal = np.rint(np.abs(flat) / smallest).astype(np.uint32)   # nearest even, as the float add does
    code = np.where(mag < (subnormal_exp << 23), subnormal, normal & 0xFF)
    code = np.where(mag >= overflow_bits, np.where(mag > 0x7F800000, 0x7F, overflow), code)
    return code.astype(np.uint8) | sign


def _raw(vector: np.ndarray, req: PoolingRequest) -> bytes:
    """The answer's bytes in ``embed_dtype`` and ``endianness`` (vLLM's; bfloat16 rounded to
    nearest even, as torch converts)."""
    flat = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    if req.embed_dtype == "float16":
        raw = flat.astype(np.float16)
    elif req.embed_dtype == "bfloat16":
        bits = flat.view(np.uint32)
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    elif req.embed_dtype in _FP8:
        raw = _fp8(flat, *_FP8[req.embed_dtype])
    else:
        raw = flat
    if req.endianness != "native" and req.endianness != sys.byteorder:
        raw = raw.byteswap()
    return raw.tobytes()
