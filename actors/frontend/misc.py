"""The endpoints around generation: models, tokenize / detokenize (vLLM's shapes), version,
probes, metrics and the debug views."""
from __future__ import annotations

import json
from importlib import metadata
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from actors.engine.config import EngineConfig
from actors.engine.sampling_params import SamplingParams
from actors.frontend.errors import ApiError, error_response, json_encoder, not_found
from actors.kv_manager.kv_events import offset_endpoint
from actors.frontend.params import chat_messages, check_chat_flags
from actors.frontend.protocol import BadRequest, DetokenizeRequest, TokenizeRequest
from actors.frontend.tools import template_tools
from actors.tokenizer.gguf_tokenizer import NO_TOKENIZER
from actors.tokenizer.multimodal import has_images

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer


def _json(body: object) -> web.Response:
    return web.Response(body=json_encoder.encode(body), content_type="application/json")


def version() -> str:
    try:
        return metadata.version("troupe")
    except metadata.PackageNotFoundError:
        return "unknown"


FINGERPRINT_MODES = ("full", "hash", "custom", "none")   # vLLM's --fingerprint-mode


def system_fingerprint(config, mode: str = "full", value: str | None = None) -> str | None:
    """The ``system_fingerprint`` answers carry (vLLM's --fingerprint-mode): ``full``,
    troupe-VERSION[-tpN][-ppN][-dpN][-ep]-HASH8 (HASH8: the configuration's digest, which changes
    when what decides the outputs does); ``hash``, without the parallel layout; ``custom``,
    ``value``; ``none``, no fingerprint."""
    if mode == "none":
        return None
    if mode == "custom":
        return value
    parts = [f"troupe-{version()}"]
    p = config.parallel
    if mode == "full":
        parts += [f"{name}{size}" for name, size in (("tp", p.tensor_parallel_size),
                                                      ("pp", p.pipeline_parallel_size),
                                                      ("dp", p.data_parallel_size)) if size > 1]
        if p.enable_expert_parallel:
            parts.append("ep")
    return "-".join(parts + [config.compute_hash()[:8]])


async def health(server: OpenAIServer, request: web.Request) -> web.Response:
    """200 when serving; 503 while the model loads and once the engine died."""
    if server.client is None:
        return error_response(503, "the model is loading")
    if server.client.dead is not None:
        return error_response(503, server.client.dead)
    return web.Response(status=200)


async def invocations(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    """vLLM's SageMaker route: a chat completion request (it has ``messages``) or a completion
    request (it has ``prompt``), answered as its own endpoint answers it."""
    from actors.frontend.chat import chat_completions
    from actors.frontend.completions import completions
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if isinstance(body, dict) and "messages" in body:
        return await chat_completions(server, request)
    if isinstance(body, dict) and "prompt" in body:
        return await completions(server, request)
    raise BadRequest("Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', "
                      "'CompletionRequest'] (a body with messages or with prompt)")


async def load(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: the chat, completion and Responses requests being answered now."""
    return _json({"server_load": server.server_load})


async def get_version(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json({"version": version()})


async def metrics(server: OpenAIServer, request: web.Request) -> web.Response:
    """Prometheus text: vLLM's metric names under the --metrics-prefix prefixes."""
    return web.Response(text=(await server.metrics_stats()).prometheus(server.options.metrics_prefixes),
                        content_type="text/plain")


async def debug_engine(server: OpenAIServer, request: web.Request) -> web.Response:
    return _json(server.engine().stats.as_dict())


async def reset_prefix_cache(server: OpenAIServer, request: web.Request) -> web.Response:
    """Forget every cached prefix (vLLM's endpoint of the same name)."""
    await server.engine().reset_prefix_cache()
    return web.Response(status=200)


def _card(server: OpenAIServer, name: str) -> dict:
    """One served name's card; ``root`` is the model it serves (vLLM's shape)."""
    c = server.engine()
    return {"id": name, "object": "model", "created": int(c.stats.started_at),
            "owned_by": "troupe", "root": c.config.model.source.served_name, "parent": None,
            "max_model_len": c.max_model_len}


def _lora_card(server: OpenAIServer, name: str) -> dict:
    """An adapter's card: ``root`` its directory, ``parent`` its base model (vLLM's shape)."""
    c = server.engine()
    lora = c.lora_requests[name]
    return {"id": name, "object": "model", "created": int(c.stats.started_at), "owned_by": "troupe",
            "root": lora.lora_path, "parent": lora.base_model_name or c.model_name,
            "max_model_len": c.max_model_len}


async def models(server: OpenAIServer, request: web.Request) -> web.Response:
    """A card per --served-model-name (the model's own name when none was given), then one per
    LoRA adapter."""
    c = server.engine()
    return _json({"object": "list", "data": [_card(server, n) for n in c.model_names]
                  + [_lora_card(server, n) for n in c.lora_requests]})


async def model(server: OpenAIServer, request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name in server.engine().lora_requests:
        return _json(_lora_card(server, name))
    if name not in server.engine().model_names:
        raise not_found(f"The model `{name}` does not exist.", "model")
    return _json(_card(server, name))


async def tokenize(server: OpenAIServer, request: web.Request) -> web.Response:
    req: TokenizeRequest = await server.read(request, TokenizeRequest)
    tok = server.engine().tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt and messages", "prompt")
    try:
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:   # tokenized exactly as /v1/chat/completions does (BOS as the GGUF asks)
            add_generation_prompt = req.add_generation_prompt is not False
            check_chat_flags(add_generation_prompt, bool(req.continue_final_message))
            if req.chat_template is not None and not server.options.trust_request_chat_template:
                raise BadRequest("Chat template is passed with request, but --trust-request-chat-template is not "
                                 "set. Refused request with untrusted chat template.", "chat_template")
            kwargs = dict(server.template_kwargs(req.chat_template_kwargs) or {})
            if req.tools:
                kwargs = {"tools": template_tools(req), **kwargs}
            messages = chat_messages(req.messages)
            if has_images(messages):       # read and expanded as the chat's own are
                rendered = await server.submit(SamplingParams(max_tokens=1), messages=messages, render_only=True,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=bool(req.continue_final_message),
                                               chat_template=req.chat_template, chat_template_kwargs=kwargs,
                                               add_special_tokens=req.add_special_tokens is True)
                ids = list(rendered.prompt_token_ids)
            else:
                ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=bool(req.continue_final_message),
                                      chat_template=req.chat_template, add_special_tokens=req.add_special_tokens is True,
                                      **kwargs)
    except (BadRequest, ApiError):
        raise
    except Exception as exc:      # template errors, text that is not valid Unicode: the input's
        raise BadRequest(f"could not tokenize: {exc}", "messages" if req.messages else "prompt") from None
    body = {"count": len(ids), "max_model_len": server.engine().max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return _json(body)


async def kv_event_sources(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's: where each engine core (by data-parallel rank) publishes its KV events, with the
    rest of its --kv-events-config; {} when they are off."""
    return _json({str(rank): source for rank, source in kv_event_sources_of(server.engine().config).items()})


def kv_event_sources_of(config: EngineConfig) -> dict[int, dict[str, Any]]:
    """Per data-parallel rank, where its engine core publishes KV events and the rest of
    --kv-events-config ({} when they are off)."""
    events = config.kv_events
    if events is None or not events.active:
        return {}
    return {rank: {**msgspec.structs.asdict(events), "endpoint": offset_endpoint(events.endpoint, rank),
                   "replay_endpoint": offset_endpoint(events.replay_endpoint, rank)}
            for rank in config.parallel.served_ranks}


async def tokenizer_info(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's GET /tokenizer_info (with --enable-tokenizer-info-endpoint): the tokenizer's
    configuration as tokenizer_config.json holds it, for clients that tokenize through the server."""
    tok = server.engine().tokenizer
    if not tok.has_text:
        raise BadRequest(NO_TOKENIZER)
    return _json(tok.tokenizer_config())


async def detokenize(server: OpenAIServer, request: web.Request) -> web.Response:
    req: DetokenizeRequest = await server.read(request, DetokenizeRequest)
    if not server.engine().tokenizer.has_text:
        raise BadRequest(NO_TOKENIZER)
    vocab = server.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
    return _json({"prompt": server.engine().tokenizer.decode(req.tokens, skip_special_tokens=False)})
