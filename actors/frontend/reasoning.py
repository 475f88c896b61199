"""Reasoning parsers (vLLM's ``--reasoning-parser``): a thinking model's output split into its
reasoning, between ``<think>`` and ``</think>``, and its content after them, which the chat
endpoint answers as the message's ``reasoning`` and ``content`` (streamed as ``delta.reasoning``
then ``delta.content``); tool calls are read from the content only.

  deepseek_r1  the chat template opens the thinking (``<think>`` ends the prompt): the output is
               reasoning until ``</think>`` (a ``<think>`` the model writes itself is dropped);
               an output without ``</think>`` is all reasoning
  qwen3        the model opens its thinking itself: reasoning only between the tags; an output
               that does not start with ``<think>`` (``enable_thinking`` false) is all content
  granite      Granite 3.2 / 3.3 with ``thinking`` on: as qwen3, its tags plain text,
               "Here is my thought process:" (or "Here's ...") and "Here is my response:"
  openai_gptoss  gpt-oss's harmony messages (actors/frontend/harmony.py): the analysis channel
               is the reasoning, the final and commentary channels the content; a tool call's
               message stays in the content, whole, for the ``openai`` tool parser to read

As vLLM does, a parser needs its tags to be tokens of the model's vocabulary (granite's are plain
text): the server refuses to start with one the tokenizer lacks. The split reads the text, so a tag split across stream
chunks is held back until it is whole."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from actors.engine.config import ReasoningConfig
from actors.frontend import harmony


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opened_by_prompt: bool = True      # deepseek_r1: the output begins inside the reasoning
    # other spellings of the tags (granite's "Here's ..." beside "Here is ...")
    start_alternatives: tuple[str, ...] = ()
    end_alternatives: tuple[str, ...] = ()
    tags_are_tokens: bool = True       # False: the tags are plain text (granite's), not checked
    # the tags are special tokens: the text is decoded with them kept (harmony's markers)
    keeps_special_tokens: ClassVar[bool] = False

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.start_alternatives)

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.end_alternatives)

    def check(self, tokenizer: Any) -> None:
        """ValueError unless both tags are single tokens of ``tokenizer`` (for token tags)."""
        if not self.tags_are_tokens:
            return
        for tag in (self.start, self.end):
            if len(tokenizer.encode(tag)) != 1:
                raise ValueError(f"--reasoning-parser {self.name}: the model's tokenizer has no {tag} token "
                                 "(this model does not think in those tags)")

    @property
    def budget_tags(self) -> tuple[str, str, str]:
        """For a request's thinking_token_budget: what opens the reasoning, what a spent budget
        forces, and what closes the reasoning when the model ends it itself (here the tags)."""
        return self.start, self.end, self.end

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output (None: none of it)."""
        stream = self.stream()
        reasoning, content = stream.feed(text, final=True)
        return reasoning or None, content if content or not stream.reasoned else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One choice's output as it comes: each piece of text split into reasoning and content."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.state = "opening"       # before any reasoning text: a <think> may come first
        self.held = ""               # text that may be the beginning of a tag
        self.reasoned = parser.opened_by_prompt    # the output has (had) reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) newly shown by ``text``; ``final``: nothing more comes (what was
        held back is shown)."""
        text = self.held + text
        self.held = ""
        reasoning, content = [], []
        while text:
            if self.state == "content":
                content.append(text)
                break
            if self.state == "opening":
                stripped = text.lstrip()
                if not final and (not stripped or any(s.startswith(stripped) for s in self.p.starts)):
                    self.held = text             # maybe the start of <think>
                    break
                start = next((s for s in self.p.starts if stripped.startswith(s)), None)
                if start is not None:
                    text = stripped[len(start):]
                    self.reasoned = True
                elif not self.p.opened_by_prompt:
                    self.state = "content"       # qwen3 without <think>: no thinking
                    continue
                self.state = "reasoning"
                continue
            found = [(text.find(e), e) for e in self.p.ends]
            at, end = min(((a, e) for a, e in found if a >= 0), default=(-1, ""))   # reasoning, up to </think>
            if at >= 0:
                reasoning.append(text[:at])
                text = text[at + len(end):]
                self.state = "content"
                continue
            keep = 0 if final else max(_partial_tag(text, e) for e in self.p.ends)
            reasoning.append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        if final and self.held:                  # what could have been a tag, shown as what it is
            (content if self.state == "content" or (self.state == "opening" and not self.p.opened_by_prompt)
             else reasoning).append(self.held)
            self.held = ""
        return "".join(reasoning), "".join(content)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages: the analysis channel's bodies are the reasoning; the final
    and commentary channels' (and any text outside a header) the content, where each tool call
    stays whole (harmony.call_text) for the ``openai`` tool parser."""
    name: str = "openai_gptoss"
    start: str = harmony.CHANNEL           # the markers the tokenizer must have as tokens
    end: str = harmony.MESSAGE
    opened_by_prompt: bool = False
    keeps_special_tokens: ClassVar[bool] = True

    @property
    def budget_tags(self) -> tuple[str, str, str]:
        """The analysis message's header; a spent budget ends it and opens the final channel."""
        h = harmony
        return (f"{h.CHANNEL}{h.ANALYSIS}{h.MESSAGE}", f"{h.END}{h.START}assistant{h.CHANNEL}{h.FINAL}{h.MESSAGE}", h.END)

    def stream(self) -> HarmonyReasoningStream:      # type: ignore[override]
        return HarmonyReasoningStream()


class HarmonyReasoningStream:
    """One choice's harmony output as it comes: each piece read from the start of the message
    still open (harmony.scan; the closed ones' parts are kept), what is new of each part shown
    (the readings extend one another)."""

    def __init__(self) -> None:
        self.open = ""                 # the text from the first message not yet closed
        self.closed = ("", "")         # the closed messages' reasoning and content
        self.shown = ("", "")
        self.reasoned = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.open += text
        messages, done = harmony.scan(self.open, final)
        still_open = 0 if final or not messages or messages[-1].closed else 1
        settled = _harmony_parts(messages[:len(messages) - still_open])
        self.closed = (self.closed[0] + settled[0], self.closed[1] + settled[1])
        self.open = self.open[done:]
        rest = _harmony_parts(messages[len(messages) - still_open:])
        reasoning, content = self.closed[0] + rest[0], self.closed[1] + rest[1]
        self.reasoned = self.reasoned or bool(reasoning)
        (r0, c0), self.shown = self.shown, (reasoning, content)
        return reasoning[len(r0):], content[len(c0):]


def _harmony_parts(messages: list[harmony.Message]) -> tuple[str, str]:
    """(reasoning, content) of harmony messages: the analysis channel's bodies, then the final and
    commentary channels' (a call whole, for the tool parser; a built-in tool's left out)."""
    reasoning = "".join(m.body for m in messages if m.channel == harmony.ANALYSIS and m.recipient is None)
    content = "".join(harmony.call_text(m) if harmony.is_call(m) else m.body for m in messages
                      if harmony.is_call(m) or (m.channel != harmony.ANALYSIS and not harmony.is_builtin(m)))
    return reasoning, content


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opened_by_prompt=True),
    "qwen3": ReasoningParser("qwen3", opened_by_prompt=False),
    "granite": ReasoningParser("granite", "Here is my thought process:", "Here is my response:", opened_by_prompt=False,
                               start_alternatives=("Here's my thought process:",),
                               end_alternatives=("Here's my response:",), tags_are_tokens=False),
    "openai_gptoss": HarmonyReasoningParser(),
}


class ReasoningParserManager:
    """vLLM's registry interface for reasoning parsers, over ``REASONING_PARSERS``: a file given
    to ``--reasoning-parser-plugin`` registers its parsers with it (vLLM's flag), and
    ``--reasoning-parser`` then names one. A parser is a ``ReasoningParser`` (its tags, and
    whether the chat template opens the reasoning), or a subclass of it whose instance the
    registry makes::

        from actors.frontend.reasoning import ReasoningParser, ReasoningParserManager

        ReasoningParserManager.register_module("thought", module=ReasoningParser(
            "thought", start="<thought>", end="</thought>", opened_by_prompt=False))
    """
    reasoning_parsers = REASONING_PARSERS

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: ReasoningParser | type[ReasoningParser] | None = None) -> Any:
        """Register ``module`` under ``name`` (names; default: its ``name``), or, without
        ``module``, return a decorator that does. ``force`` off: a name already taken is a
        KeyError."""
        if not isinstance(force, bool):
            raise TypeError(f"force must be a boolean, but got {type(force)}")

        def add(parser: ReasoningParser | type[ReasoningParser]) -> Any:
            given = parser
            if isinstance(parser, type) and issubclass(parser, ReasoningParser):   # a subclass: its instance
                named = parser.__dataclass_fields__["name"].default is not dataclasses.MISSING
                parser = parser() if named else parser(name if isinstance(name, str) else
                                                      (name or [parser.__name__])[0])
            if not isinstance(parser, ReasoningParser):
                raise TypeError(f"a reasoning parser must be a ReasoningParser or a subclass of it, got {given!r}")
            names = [name] if isinstance(name, str) else list(name or [parser.name])
            for n in names:
                if not force and n in REASONING_PARSERS:
                    raise KeyError(f"{n} is already registered as a reasoning parser")
            for n in names:
                REASONING_PARSERS[n] = parser
            return given

        return add(module) if module is not None else add

    @classmethod
    def get_reasoning_parser(cls, name: str) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise KeyError(f"reasoning helper parser '{name}' not found.")
        return REASONING_PARSERS[name]

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path`` (its parsers register themselves); ValueError
        naming it when it cannot be read or fails."""
        import_plugin_file(plugin_path, "--reasoning-parser-plugin")


def import_plugin_file(plugin_path: str, flag: str) -> None:
    """Run the Python file ``plugin_path`` as a module named after it; ValueError naming ``flag``
    when it is not a file or fails."""
    import importlib.util
    import os
    import sys
    module_name = os.path.splitext(os.path.basename(plugin_path))[0]
    if not os.path.isfile(plugin_path):
        raise ValueError(f"{flag} {plugin_path}: no such file")
    try:
        spec = importlib.util.spec_from_file_location(module_name, plugin_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{flag} {plugin_path} failed: {type(exc).__name__}: {exc}") from exc


def resolve_reasoning(config: ReasoningConfig, tokenizer: Any) -> ReasoningConfig:
    """``config`` with its strings completed from its parser's tags and its token ids read with
    ``tokenizer`` (vLLM's ReasoningConfig.initialize_token_ids). Without a start and an end string
    it stays unresolved (a request's thinking_token_budget is then refused); ValueError for an
    unknown parser, no tokenizer, or a string the tokenizer reads as no tokens."""
    parser = None
    if config.reasoning_parser:
        parser = REASONING_PARSERS.get(config.reasoning_parser)
        if parser is None:
            raise ValueError(f"unknown reasoning parser {config.reasoning_parser!r}; choose from "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
    tags = parser.budget_tags if parser else ("", "", "")
    start = config.reasoning_start_str or tags[0]
    end = config.reasoning_end_str or tags[1]
    natural = tags[2] if parser else end
    if not start or not end:
        return config
    if not tokenizer.has_text:
        raise ValueError("a reasoning config needs the tokenizer, and --skip-tokenizer-init loads none")
    ids = [tuple(tokenizer.encode(s, add_special_tokens=False)) for s in (start, end, natural)]
    if not all(ids):
        raise ValueError(f"ReasoningConfig: failed to tokenize reasoning strings: reasoning_start_str={start!r}, "
                         f"reasoning_end_str={end!r}. Ensure the strings are valid tokens in the model's vocabulary.")
    return msgspec.structs.replace(config, reasoning_start_str=start, reasoning_end_str=end,
                                   start_token_ids=ids[0], end_token_ids=ids[1], natural_end_token_ids=ids[2])
