"""The harmony format gpt-oss answers in (OpenAI's): a sequence of messages, each a header and a
body, the header naming the message's channel and, for a tool call, its recipient::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>

(the recipient may also follow the channel: ``<|channel|>commentary to=functions.f <|constrain|>json``).
The prompt ends in ``<|start|>assistant``, so an answer starts at its first message's
``<|channel|>``; ``<|return|>`` and ``<|call|>`` end generation (the model's eos tokens), so
they usually do not reach the text, and the output's end closes its last message.

``read`` parses the text so far into messages; a message whose header is still arriving is
left out, and a body's tail that may be the start of a marker is held back, so each reading
extends the one before (what streaming relies on). Text outside any header (a model that does
not write harmony) is read as a message of no channel. The markers are special tokens: the
parsers that read them (reasoning.py's ``openai_gptoss``, tool_parsers.py's ``openai``) ask
for the text with special tokens kept."""
from __future__ import annotations

from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
ANALYSIS, COMMENTARY, FINAL = "analysis", "commentary", "final"


@dataclass(frozen=True, slots=True)
class Message:
    channel: str | None       # analysis, commentary, final; None: text outside any header
    recipient: str | None     # a tool call's (``functions.get_weather``); None: none
    body: str                 # as far as it is known
    closed: bool              # its end marker (or the output's end) was read


def header_fields(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header's text (between the previous message and ``<|message|>``)."""
    channel, recipient = None, None
    words = header.replace(START, " ").replace(CONSTRAIN, " ").replace(CHANNEL, f" {CHANNEL} ").split()
    for i, word in enumerate(words):
        if word == CHANNEL and i + 1 < len(words) and words[i + 1] != CHANNEL:
            channel = words[i + 1]
        elif word.startswith("to="):
            recipient = word[3:] or None
    return channel, recipient


def _held(body: str) -> str:
    """``body`` less a tail that may be the start of a marker."""
    at = body.rfind("<")
    if at >= 0 and any(m.startswith(body[at:]) for m in MARKERS):
        return body[:at]
    return body


def read(text: str, final: bool) -> list[Message]:
    """The messages of ``text`` (the whole output so far; ``final``: all of it)."""
    return scan(text, final)[0]


def scan(text: str, final: bool) -> tuple[list[Message], int]:
    """``read``'s messages, and where the last of the closed ones ends: what follows (an open
    message, a header still arriving) is all a later reading can change, so a stream may read on
    from there."""
    out: list[Message] = []
    i, n = 0, len(text)
    while i < n:
        if not text.startswith("<|", i):             # text outside any header, to the next marker
            nxt = min((k for k in (text.find(m, i) for m in MARKERS) if k >= 0), default=-1)
            stop = n if nxt < 0 else nxt
            body = text[i:stop]
            if nxt < 0 and not final:
                body = _held(body)
            if body:
                out.append(Message(None, None, body, nxt >= 0 or final))
            if nxt < 0:
                return out, i
            i = nxt
            if text.startswith((END, RETURN, CALL), i):  # a stray end marker closes nothing
                i = text.find("|>", i) + 2
            continue
        if text.startswith((END, RETURN, CALL), i):
            i = text.find("|>", i) + 2
            continue
        m = text.find(MESSAGE, i)
        if m < 0:
            return out, i                               # a header still arriving (or cut off: dropped)
        channel, recipient = header_fields(text[i:m])
        b = m + len(MESSAGE)
        ends = [(k, mk) for mk in (END, RETURN, CALL, START, CHANNEL) if (k := text.find(mk, b)) >= 0]
        if not ends:
            out.append(Message(channel, recipient, text[b:] if final else _held(text[b:]), final))
            return out, i
        e, marker = min(ends)
        out.append(Message(channel, recipient, text[b:e], True))
        i = e + len(marker) if marker in (END, RETURN, CALL) else e
    return out, n


BUILTIN_TOOLS = ("browser", "python", "container")    # gpt-oss's built-in tools: not the request's functions


def is_call(message: Message) -> bool:
    """A message to one of the request's functions (``functions.NAME``, or a bare name that is
    not a built-in tool's or the assistant)."""
    r = message.recipient
    return r is not None and r != "assistant" and r.split(".", 1)[0] not in BUILTIN_TOOLS


def is_builtin(message: Message) -> bool:
    """A message to a built-in tool (browser, python, container: run by no one here), left out of
    the content and the calls."""
    r = message.recipient
    return r is not None and r.split(".", 1)[0] in BUILTIN_TOOLS


def function_name(recipient: str) -> str:
    return recipient.removeprefix("functions.")


def call_text(message: Message) -> str:
    """A tool call as the ``openai`` tool parser reads it (closed with ``<|call|>`` once whole)."""
    return f"{CHANNEL}{COMMENTARY} to={message.recipient}{MESSAGE}{message.body}{CALL if message.closed else ''}"
