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
    kind: str        # "json" | "regex" | "grammar" | "lark" | "structural_tag"
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
    if kind == "structural_tag":
        return GrammarKey("structural_tag", _structural_tag_text(spec.structural_tag))
    return GrammarKey("grammar" if "::=" in spec.grammar else "lark", spec.grammar)


def _structural_tag_text(text: str) -> str:
    """A structural tag checked for its shape (vLLM's two: {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}, or xgrammar's {"format": {...}}) and re-serialized compactly."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the structural tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise GrammarError("a structural tag is a JSON object")
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if (not isinstance(structures, list) or not isinstance(triggers, list)
                or not all(isinstance(t, str) for t in triggers)
                or not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                           and isinstance(s.get("schema", {}), (dict, bool)) for s in structures)):
            raise GrammarError("a structural tag's structures are objects with begin, schema and end, "
                               "and its triggers a list of strings")
    elif "format" not in tag:
        raise GrammarError("a structural tag has either structures and triggers, or a format")
    return json.dumps(tag, separators=(",", ":"), ensure_ascii=False)


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


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """vLLM's way: the legacy form as xgrammar's StructuralTagItems and triggers, the other as it is."""
    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    import xgrammar
    items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


_COMPILE: dict[str, Callable[[Any, str], Any]] = {
    "structural_tag": _compile_structural_tag,
    "regex": lambda c, text: c.compile_regex(text),
    "grammar": lambda c, text: c.compile_grammar(text),
    "lark": lambda c, text: c.compile_lark(text),
}
