"""Grammar compilation on xgrammar: a request's StructuredOutputsParams becomes a normalized key
(the same schema sent twice, whatever its spacing, is one key) and a compiled grammar for the
model's vocabulary, cached by key. Pure: no asyncio; ``compile`` is meant to run
in a thread (xgrammar releases the GIL while it compiles)."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

from actors.engine.sampling_params import StructuredOutputsParams

CACHE_SIZE = 512                        # compiled grammars kept (least recently used dropped)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # "[23:19:21] /project/cpp/x.cc:94: "


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message names the problem."""


class GrammarKey(NamedTuple):
    kind: str        # "json" | "regex" | "grammar" | "lark"
    text: str        # canonical: a JSON schema re-serialized compactly, choices as EBNF


def grammar_key(spec: StructuredOutputsParams) -> GrammarKey:
    """The normalized key of ``spec`` (GrammarError when it is malformed before any compiling)."""
    try:
        kind = spec.kind()
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    if kind == "json":
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or a boolean), not {type(schema).__name__}")
        # spacing normalized; key order kept: it is the order properties are generated in
        return GrammarKey("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if kind == "json_object":
        return GrammarKey("json", JSON_OBJECT_SCHEMA)
    if kind == "regex":
        return GrammarKey("regex", spec.regex)
    if kind == "choice":
        if not spec.choice:
            raise GrammarError("choice must list at least one string")
        return GrammarKey("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    return GrammarKey("grammar" if "::=" in spec.grammar else "lark", spec.grammar)


class GrammarCache:
    """Compiled grammars by key, built on first use with an xgrammar compiler for one vocabulary.
    ``make_compiler`` builds that compiler (it loads the tokenizer: slow, so only when the first
    grammar is asked for). Thread-safe: compiles may run in several threads at once."""

    def __init__(self, make_compiler: Callable[[], Any], any_whitespace: bool = True) -> None:
        self._make_compiler = make_compiler
        self.any_whitespace = any_whitespace      # JSON may carry whitespace (vLLM's default)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._grammars: OrderedDict[GrammarKey, Any] = OrderedDict()

    def get(self, key: GrammarKey) -> Any | None:
        """The compiled grammar of ``key`` if it is cached (no compiling)."""
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
            return grammar

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of ``key``, compiled now if it is not cached; GrammarError when
        xgrammar refuses it."""
        grammar = self.get(key)
        if grammar is not None:
            return grammar
        compiler = self._xgrammar_compiler()
        try:
            if key.kind == "json":       # compact when whitespace is off, as vLLM's (",", ":")
                grammar = compiler.compile_json_schema(key.text, any_whitespace=self.any_whitespace,
                                                       separators=None if self.any_whitespace else (",", ":"))
            else:
                grammar = _COMPILE[key.kind](compiler, key.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_XGRAMMAR_PREFIX.sub("", str(exc)).strip()) from None
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler


_COMPILE: dict[str, Callable[[Any, str], Any]] = {
    "regex": lambda c, text: c.compile_regex(text),
    "grammar": lambda c, text: c.compile_grammar(text),
    "lark": lambda c, text: c.compile_lark(text),
}
