"""vLLM's score and rerank endpoints. With an embedding model (a bi-encoder) every query and
document is embedded once and each pair's score is the cosine similarity of their embeddings;
with a classifier of one label (a cross-encoder) each pair is read together, as the tokenizer
encodes a text pair, and its score is the classifier's. ``POST /score`` and ``/v1/score`` pair ``queries`` with ``documents`` (or vLLM's
other names: ``items``, ``data_1``/``data_2``, ``text_1``/``text_2``) one to one, or one query
to every document; ``POST /rerank``, ``/v1/rerank`` and ``/v2/rerank`` (Jina's and Cohere's
shape) rank ``documents`` by their score against ``query``, the best ``top_n``."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from aiohttp import web

from actors.engine.pooling import PoolingParams
from actors.engine.sampling_params import SamplingParams
from actors.frontend.embeddings import Prompt, run_pooling
from actors.frontend.errors import bad_request, not_found
from actors.frontend.params import check_priority, served_name
from actors.frontend.protocol import BadRequest, require

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
# vLLM's names of the two sides of a score request, in the order it reads them
_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoringRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of vLLM's score and rerank requests (each endpoint checks its own)."""
    model: str | None = None
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None
    query: Any = None
    top_n: int = 0
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    use_activation: bool | None = None
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    padding: str | None = None


async def create_score(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return await scored(server, SCORE_PATHS[0], await request.read())


async def create_rerank(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return await scored(server, RERANK_PATHS[0], await request.read())


async def scored(server: OpenAIServer, path: str, body: bytes) -> web.Response:
    """The answer to a score (``path`` in SCORE_PATHS) or rerank request ``body``."""
    client = server.engine()
    if client.config.model.pooling is None:
        raise not_found(f"The model does not support {'Rerank' if path in RERANK_PATHS else 'Score'} API: it "
                        "generates text. Serve an embedding model (--runner pooling) to score with it.")
    req: ScoringRequest = server.decode(body, ScoringRequest)
    rerank = path in RERANK_PATHS
    if rerank:
        require(req.query is not None, "query is required", "query")
        require(req.documents is not None, "documents is required", "documents")
        require(req.top_n >= 0, f"top_n must be at least 0, got {req.top_n}", "top_n")
        queries, documents = [_text(req.query, "query")], _texts(req.documents, "documents")
        first, second = "query", "documents"
    else:
        first, second = next(((a, b) for a, b in _SIDES if getattr(req, a) is not None), _SIDES[0])
        require(getattr(req, first) is not None, f"{first} is required", first)
        require(getattr(req, second) is not None, f"{second} is required", second)
        queries, documents = _texts(getattr(req, first), first), _texts(getattr(req, second), second)
    require(len(queries) > 0, "At least one text element must be given", first)
    require(len(documents) > 0, "At least one text_pair element must be given", second)
    require(len(queries) in (1, len(documents)), "Input lengths must be either 1:1, 1:N or N:N", second)
    for name, value in (("max_tokens_per_query", req.max_tokens_per_query),
                        ("max_tokens_per_doc", req.max_tokens_per_doc)):
        require(value >= 0, f"{name} must be at least 0 (0: no truncation), got {value}", name)
    t = req.truncate_prompt_tokens
    require(t is None or t == -1 or t >= 1, f"truncate_prompt_tokens must be -1 (the last max_model_len) or "
            f"at least 1, got {t}", "truncate_prompt_tokens")
    require(req.padding in (None, "do_not_pad"), "padding 'max_length' is not supported", "padding")
    priority = check_priority(req, client.config.scheduler.policy)
    rid = req.request_id or uuid.uuid4().hex
    side = req.truncation_side                     # None: as the tokenizer truncates (the start kept)
    require(side in (None, "left", "right"), "truncation_side must be left or right", "truncation_side")
    if client.config.model.pooling.convert == "classify":
        scores, tokens = await _cross_encoder_scores(server, req, queries, documents, rid, priority, side)
    else:
        scores, tokens = await _bi_encoder_scores(server, req, queries, documents, rid, priority, side)
    name = served_name(client, req.model)
    dumps = lambda obj: msgspec.json.encode(obj).decode()      # noqa: E731
    if rerank:
        results = sorted(({"index": i, "document": {"text": documents[i]}, "relevance_score": float(s)}
                          for i, s in enumerate(scores)), key=lambda r: -r["relevance_score"])
        return web.json_response({"id": f"rerank-{rid}", "model": name,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                  "results": results[:req.top_n or len(results)]}, dumps=dumps)
    return web.json_response({"id": f"score-{rid}", "object": "list", "created": int(time.time()), "model": name,
                              "data": [{"index": i, "object": "score", "score": float(s)}
                                       for i, s in enumerate(scores)],
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}},
                             dumps=dumps)


async def _bi_encoder_scores(server: OpenAIServer, req: ScoringRequest, queries: list[str], documents: list[str],
                             rid: str, priority: int, side: str | None) -> tuple[np.ndarray, int]:
    """An embedding model's scores: each query and document embedded once, each pair's cosine
    similarity; with the pooler config's task token_embed, vLLM's late interaction (ColBERT's
    MaxSim over the two sides' token embeddings). A side's own token cap keeps its texts' first
    tokens (``truncate_text_to_tokens``), their special tokens then added as usual."""
    client = server.engine()
    late = late_interaction(client.config.model.pooling)
    try:
        params = client.pooling_request(PoolingParams(task="token_embed" if late else "embed",
                                                      use_activation=req.use_activation), req.truncate_prompt_tokens)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    lora = client.lora_request_for(req.model)
    queries = [truncate_text_to_tokens(client.tokenizer, q, req.max_tokens_per_query) for q in queries]
    documents = [truncate_text_to_tokens(client.tokenizer, d, req.max_tokens_per_doc) for d in documents]
    q_out, q_tokens = await run_pooling(server, params, [_prompt(q) for q in queries], f"{rid}-q", priority, side, lora)
    d_out, d_tokens = await run_pooling(server, params, [_prompt(d) for d in documents], f"{rid}-d", priority, side,
                                        lora)
    q = [o.pooling_output for o in q_out]
    q = q * len(d_out) if len(q) == 1 else q
    return np.array([pair_score(a, o.pooling_output, late) for a, o in zip(q, d_out)]), q_tokens + d_tokens


def with_token_types(params: SamplingParams, start: int) -> SamplingParams:
    """A pair's engine params: ``params`` with its second text's token type starting at ``start``."""
    return msgspec.structs.replace(params, pooling=msgspec.structs.replace(params.pooling,
                                                                           compressed_token_type_ids=start))


def late_interaction(pooling: Any) -> bool:
    """Whether an embedding model scores by late interaction (vLLM's: its pooling task, the
    pooler config's, is token_embed)."""
    return pooling is not None and pooling.pooler.task == "token_embed"


def pair_score(query: np.ndarray, document: np.ndarray, late: bool) -> float:
    """A bi-encoder's score of a pair: the cosine similarity of the two embeddings, or (``late``)
    ColBERT's MaxSim of their token embeddings (each query token's best dot product with a
    document token, summed; float32, as vLLM computes it)."""
    if late:
        return float((query.astype(np.float32) @ document.astype(np.float32).T).max(-1).sum())
    a, b = query.astype(np.float64), document.astype(np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))


async def _cross_encoder_scores(server: OpenAIServer, req: ScoringRequest, queries: list[str],
                                documents: list[str], rid: str, priority: int, side: str | None) -> tuple[np.ndarray, int]:
    """A classifier of one label (a cross-encoder) scores each query and document read together:
    its one score, after its activation."""
    client = server.engine()
    pooling = client.config.model.pooling
    if pooling.num_labels != 1:
        raise bad_request(f"scoring pairs needs a cross-encoder (a classifier of one label); this model has "
                          f"{pooling.num_labels} labels: use /classify")
    try:
        params = client.pooling_request(PoolingParams(task="classify", use_activation=req.use_activation),
                                        req.truncate_prompt_tokens)
        t = req.truncate_prompt_tokens
        pairs = [pair_prompt(client.tokenizer, pooling.use_sep_token, q, d, req.max_tokens_per_query,
                             req.max_tokens_per_doc, client.config.model.chat_template, req.chat_template_kwargs,
                             max_length=client.max_model_len if t == -1 else t)
                 for q, d in zip(queries * len(documents) if len(queries) == 1 else queries, documents)]
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    prompts = [Prompt({"prompt_token_ids": ids}, None if types is None else with_token_types(params, types))
               for ids, types in pairs]
    outs, tokens = await run_pooling(server, params, prompts, rid, priority, side, client.lora_request_for(req.model))
    return np.array([float(o.pooling_output[0]) for o in outs]), tokens


def pair_token_ids(tokenizer: Any, use_sep_token: bool, first: str, second: str, max_first: int = 0,
                   max_second: int = 0, template: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A cross-encoder's prompt, as vLLM builds it: the query and the document (each first cut
    to its own token cap, when given) put through ``template`` (the server's --chat-template,
    or LLM.score's ``chat_template``: a "query" and a "document" message, as vLLM's score
    templates read them, e.g. Qwen3-Reranker's), else encoded as a text pair (``use_sep_token``,
    the default) or joined as one text (an LLM used as a reranker)."""
    return pair_prompt(tokenizer, use_sep_token, first, second, max_first, max_second, template, template_kwargs)[0]


def pair_prompt(tokenizer: Any, use_sep_token: bool, first: str, second: str, max_first: int = 0,
                max_second: int = 0, template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                max_length: int | None = None) -> tuple[list[int], int | None]:
    """``pair_token_ids``' ids, and where the second text's token type (1) starts, for an
    encoder with token types (vLLM's compressed_token_type_ids; None: every token of type 0).
    ``max_length`` (a request's truncate_prompt_tokens): a text pair longer than that loses
    tokens of its longer text first and keeps its special tokens, as transformers' pair
    truncation (``truncation=True``) does, which vLLM's cross-encoders use."""
    first, second = truncate_text_to_tokens(tokenizer, first, max_first), truncate_text_to_tokens(tokenizer, second,
                                                                                                  max_second)
    if template is not None:
        kwargs = dict(template_kwargs or {})
        reserved = {"chat_template", "tools", "tokenize"} & kwargs.keys()
        if reserved:
            raise ValueError(f"chat_template_kwargs contains reserved keys that conflict with fixed scorer "
                             f"arguments: {reserved}")
        text = tokenizer.apply_chat_template([{"role": "query", "content": first},
                                              {"role": "document", "content": second}],
                                             add_generation_prompt=False, chat_template=template, **kwargs)
        return tokenizer.encode(text, add_special_tokens=True), None
    if use_sep_token:
        ids, types = tokenizer.encode_pair_with_types(first, second)
        start = compress_token_types(types)
        if max_length is not None and len(ids) > max_length:
            ids, start = _longest_first(tokenizer, ids, start, first, second, max_length)
        return ids, start
    return tokenizer.encode(first + second, add_special_tokens=True), None


def _longest_first(tokenizer: Any, ids: list[int], start: int | None, first: str, second: str,
                   max_length: int) -> tuple[list[int], int | None]:
    """A text pair's ids (its special tokens around the two texts' own) cut to ``max_length``:
    the texts get lengths as transformers' ``longest_first`` truncation gives them (the shorter
    one whole when it fits in half, else both halves), their special tokens stay; the ids cut
    from the end where the texts cannot be found among them."""
    a, b = tokenizer.encode(first), tokenizer.encode(second)
    at = next((i for i in range(len(ids) - len(a) + 1) if ids[i:i + len(a)] == a), None)
    bt = None if at is None else next((i for i in range(at + len(a), len(ids) - len(b) + 1)
                                       if ids[i:i + len(b)] == b), None)
    room = max_length - (len(ids) - len(a) - len(b))
    if bt is None or room <= 0:
        return ids[:max_length], start if start is None or start < max_length else None
    n1, n2 = sorted((len(a), len(b)))
    n2 = n1 if n1 > room else max(n1, room - n1)
    if n1 + n2 > room:
        n1 = room // 2
        n2 = n1 + room % 2
    na, nb = (n1, n2) if len(a) <= len(b) else (n2, n1)
    cut = ids[:at] + a[:na] + ids[at + len(a):bt] + b[:nb] + ids[bt + len(b):]
    return cut, None if start is None else start - (len(a) - na)


def truncate_text_to_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """``text`` cut to at most ``max_tokens`` of its own tokens (0: whole), as vLLM applies
    max_tokens_per_query / max_tokens_per_doc: the original characters up to where the last kept
    token ends, tokenized again until they fit (no decode, which can change the text); a
    vocabulary without character offsets (a GGUF file's) decodes its first tokens instead."""
    while text and max_tokens:
        ids = tokenizer.encode(text)
        if len(ids) <= max_tokens:
            break
        offsets = tokenizer.token_offsets(text, ids)
        if offsets is None:
            return tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[:min(end, len(text) - 1)]
    return text


def compress_token_types(types: list[int]) -> int | None:
    """Token types 0...0 1...1 as the position of the first 1 (vLLM's compression); None when
    every one is 0. ValueError for another pattern."""
    start = next((i for i, t in enumerate(types) if t), None)
    if start is not None and any(t != 1 for t in types[start:]):
        raise ValueError(f"token types must be zeros then ones, got {types}")
    return start


def _text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        raise BadRequest(f"{param}: multimodal score inputs are not supported (this is a text model)", param)
    raise BadRequest(f"{param} must be a string or a list of strings", param)


def _texts(value: Any, param: str) -> list[str]:
    return [_text(v, param) for v in value] if isinstance(value, list) else [_text(value, param)]


def _prompt(text: str) -> Prompt:
    return Prompt({"prompt": text, "add_special_tokens": True})
