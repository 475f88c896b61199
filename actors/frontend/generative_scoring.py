"""POST /generative_scoring (vLLM's): how likely each item makes chosen tokens the next one.

For each item the prompt is the query followed by the item (``item_first``: the item first), as
token ids (text is tokenized: the query with special tokens as ``add_special_tokens`` says, the
items without, so a BOS is not repeated), cut to ``max_model_len - 1`` tokens. One step of
the model reads the next token's distribution, and the log-probs of ``label_token_ids`` come
back (the sampler's ``logprob_token_ids``). The item's score is the probability of the first
label: normalized over the labels alone (``apply_softmax``, the default), or the model's own
probability over the whole vocabulary. All items run at once, as one batch of requests."""
from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from actors.engine.sampling_params import SamplingParams
from actors.frontend.errors import error_response, json_encoder
from actors.frontend.fanout import Choice, close_all, merged_outputs
from actors.frontend.params import cache_salt, check_priority, served_name
from actors.frontend.protocol import require
from actors.frontend.streams import StreamTimeout

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

PATH = "/generative_scoring"


class GenerativeScoringRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's GenerativeScoringRequest."""
    model: str | None = None
    query: str | list[int]
    items: list[str | list[int]]        # all text or all token ids
    label_token_ids: list[int]
    apply_softmax: bool = True          # normalize over the labels alone; False: the model's probabilities
    item_first: bool = False            # the item before the query
    add_special_tokens: bool = True     # for the query's text
    cache_salt: str | None = None
    priority: int | None = 0
    request_id: str | None = None


def probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """The labels' probabilities: a softmax over their log-probs alone, or each one's own."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def prompts(req: GenerativeScoringRequest, tokenizer: Any, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The token ids of each item's prompt."""
    require(len(req.items) > 0, "items must contain at least one item.", "items")
    require(len({isinstance(item, str) for item in req.items}) == 1,
            "items must be all strings or all lists of token ids, not a mix", "items")
    def check(ids: list[int], what: str, param: str) -> list[int]:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        require(not outside, f"{what} holds token ids outside [0, {vocab_size}): {outside[:5]}", param)
        return ids

    query = req.query
    if isinstance(query, str):
        query = tokenizer.encode(query, add_special_tokens=req.add_special_tokens)
    query = check(query, "the query", "query")
    out = []
    for i, item in enumerate(req.items):
        ids = tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else item
        ids = check(ids, f"item {i}", "items")
        ids = ids + query if req.item_first else query + ids
        require(len(ids) > 0, f"the prompt of item {i} is empty", "items")
        out.append(ids[:max_model_len - 1])
    return out


async def generative_scoring(server: OpenAIServer, request: web.Request) -> web.Response:
    arrival = time.time()
    req: GenerativeScoringRequest = await server.read(request, GenerativeScoringRequest)
    client = server.engine()
    labels = req.label_token_ids
    require(len(labels) > 0, "label_token_ids must contain at least one token ID.", "label_token_ids")
    vocab = server.vocab_size
    for t in labels:
        require(0 <= t < vocab, f"label_token_id {t} is out of vocabulary range [0, {vocab}). Please provide "
                "valid token IDs.", "label_token_ids")
    bound = server.request_defaults.logprobs_bound(vocab)
    require(len(labels) <= bound, f"label_token_ids may hold at most {bound} tokens (the server's --max-logprobs), "
            f"got {len(labels)}", "label_token_ids")
    ids = prompts(req, client.tokenizer, vocab, client.max_model_len)
    priority = check_priority(req, client.config.scheduler.policy)   # type: ignore[arg-type]
    salt = cache_salt(req)                                            # type: ignore[arg-type]
    base = request.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex
    answer_id = f"generative-scoring-{base}"
    params = SamplingParams(max_tokens=1, logprobs=len(labels), logprob_token_ids=list(labels))
    rid = client.new_request_id()
    choices: list[Choice] = []
    try:
        for i, prompt in enumerate(ids):
            handle = await server.submit(params, request_id=f"{rid}-{i}", prompt_token_ids=prompt, priority=priority,
                                         arrival_time=arrival, cache_salt=salt,
                                         lora_request=client.lora_request_for(req.model))
            choices.append(Choice(i, i, handle))
        read: dict[int, dict[int, float]] = {}
        async for c, out in merged_outputs(choices):
            c.take(out)
            if out.logprobs is not None and out.logprobs.token_ids and c.index not in read:
                read[c.index] = dict(zip(out.logprobs.token_ids[0], out.logprobs.logprobs[0]))
    except StreamTimeout as exc:
        return error_response(504, str(exc))
    finally:
        close_all(choices)
    data = []
    for c in choices:
        if c.last is None or c.last.error is not None:
            return error_response(c.last.error_status if c.last is not None and c.last.error_status else 500,
                                  f"scoring item {c.index} failed: "
                                  f"{c.last.error if c.last is not None else 'it ended without output'}")
        got = read.get(c.index, {})
        missing = [t for t in labels if t not in got]
        if missing:
            return error_response(500, f"Token IDs {missing} not found in logprobs for item {c.index}.")
        score = probabilities([got[t] for t in labels], req.apply_softmax)[0]
        data.append({"index": c.index, "object": "score", "score": score})
    prompt_tokens = sum(c.handle.num_prompt_tokens for c in choices)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    body = {"id": answer_id, "object": "list", "created": int(time.time()),
            "model": served_name(client, req.model), "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                      "completion_tokens": completion_tokens}}
    return web.Response(body=json_encoder.encode(body), content_type="application/json",
                        headers={"X-Request-Id": base})

