"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request, answered as
one chat completion whose choice ``i`` answers conversation ``i``. The request is a chat
completion request whose ``messages`` is a list of conversations; every other field applies to
each of them. As in vLLM, no streaming, no tools, no beam search and ``n`` 1.

Each conversation runs as the chat endpoint runs one (``chat.start_chat``: its template, its
sampling, its echo and reasoning), all of them at once. Every conversation is decoded before any
is admitted, and one refused ends those admitted before it: a 400 leaves nothing running."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from actors.frontend.chat import ChatGeneration, start_chat
from actors.frontend.fanout import Choice, close_all
from actors.frontend.generation import Generation
from actors.frontend.protocol import BadRequest, ChatCompletionRequest, decode_body
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

PATH = "/v1/chat/completions/batch"

# fields of a chat request the batch endpoint does not take: field -> why (vLLM's words where it has them)
_REFUSED = {
    "stream": "Batch chat completions do not support streaming. Please set `stream` to False.",
    "stream_options": "Batch chat completions do not support streaming, so take no `stream_options`.",
    "tools": "Batch chat completions do not support tools. Please leave `tools` out.",
    "use_beam_search": "Batch chat completions do not support beam search. Please set `use_beam_search` to False.",
    "prompt_logprobs": "Batch chat completions do not support `prompt_logprobs`.",
    "return_prompt_text": "Batch chat completions do not support `return_prompt_text`.",
}


def conversations(body: bytes) -> tuple[list[Any], dict[str, Any]]:
    """The body's conversations and the fields every one of them takes; BadRequest for a body
    that is not a batch request."""
    obj = decode_body(body, dict)
    convs = obj.pop("messages", None)
    if not isinstance(convs, list) or not convs or not all(isinstance(c, list) and c for c in convs):
        raise BadRequest("messages must be a non-empty list of conversations, each a non-empty list of messages",
                         "messages")
    for name, why in _REFUSED.items():
        if obj.get(name) not in (None, False):
            raise BadRequest(why, name)
    n = obj.get("n", 1)
    if n not in (None, 1):
        raise BadRequest("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    if obj.get("tool_choice") not in (None, "none"):
        raise BadRequest('Batch chat completions do not support tools: `tool_choice` may only be "none".',
                         "tool_choice")
    kv = obj.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
        raise BadRequest("Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: one "
                         "pre-tokenized prompt cannot serve several conversations.",
                         "kv_transfer_params.prompt_token_ids")
    return convs, obj


class BatchChatGeneration(Generation):
    """The conversations' generations as one answer: choice ``i`` is conversation ``i``'s only
    choice, shaped by its own generation (its role, echo, reasoning and log-probs)."""
    object_name = ChatGeneration.object_name
    chunk_object = ChatGeneration.chunk_object
    id_prefix = ChatGeneration.id_prefix

    def __init__(self, gens: list[ChatGeneration]) -> None:
        first = gens[0]
        self.owner: dict[int, ChatGeneration] = {}
        choices: list[Choice] = []
        for i, g in enumerate(gens):
            c = g.choices[0]
            c.index = c.prompt_index = i
            self.owner[id(c)] = g
            choices.append(c)
        super().__init__("", first.model, choices, False, first.answer)
        self.id = first.id
        self.aliases = tuple(g.id for g in gens[1:])

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        return self.owner[id(c)].delta(c, out)

    def finish(self, c: Choice, out: RequestOutput) -> dict | None:
        return self.owner[id(c)].finish(c, out)

    def observe(self, c: Choice, out: RequestOutput) -> None:
        self.owner[id(c)].observe(c, out)

    def final(self, c: Choice) -> dict:
        return self.owner[id(c)].final(c)

    def choice_extras(self, c: Choice) -> dict[str, Any]:
        return self.owner[id(c)].choice_extras(c)

    def metrics(self) -> None:
        """None: each conversation is a request of its own (vLLM's batch answer has no metrics)."""
        return None


async def batch_chat_completions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    convs, shared = conversations(await request.read())
    reqs: list[ChatCompletionRequest] = [
        server.decode(msgspec.json.encode({**shared, "messages": conv}), ChatCompletionRequest) for conv in convs]
    gens: list[ChatGeneration] = []
    try:
        for req in reqs:
            gen, _ = await start_chat(server, req, arrival)
            gens.append(gen)
    except BaseException:
        for g in gens:
            close_all(g.choices)
        raise
    return await BatchChatGeneration(gens).respond(request, False)
