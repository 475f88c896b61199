"""GrammarCompiler actor: compiles structured-output grammars (JSON schemas, regexes, choices,
EBNF and Lark grammars) with xgrammar in a thread pool sized to the cores, off the engine's event
loop, into a cache shared with the scheduler (it reads the cache directly, on the same node).

The Tokenizer asks it to compile a request's grammar at admission (``CompileGrammar``: a spec
xgrammar refuses is an HTTP 400 there). A request whose grammar is not cached when it reaches the
scheduler (evicted, or the engine restarted) waits in WAITING_FOR_GRAMMAR while the scheduler
asks for it here the same way."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import msgspec

from actors.engine.config import EngineConfig
from actors.engine.sampling_params import StructuredOutputsParams
from actors.grammar.compiler import GrammarCache, GrammarError, grammar_key
from actors.runtime import Actor, Msg, Refusal


class GrammarCompiled(msgspec.Struct):
    seconds: float            # spent compiling (0 when it was cached)


class CompileGrammar(Msg):
    """Compile (or find cached) the grammar of ``spec``; refused (InvalidGrammar) with the reason
    when xgrammar cannot compile it."""
    reply_type: ClassVar[Any] = GrammarCompiled
    spec: StructuredOutputsParams
    request_id: str = ""         # the request it is compiled for, if any (tracing)


GrammarCompilerProtocol = CompileGrammar


class InvalidGrammar(Refusal):
    """A structured-output spec that cannot be compiled (an HTTP 400)."""


class GrammarCompilerActor(Actor):
    protocol = GrammarCompilerProtocol
    concurrent = True            # compiles run in threads side by side

    def __init__(self, config: EngineConfig) -> None:
        self.cache = GrammarCache(lambda: xgrammar_compiler(config), config.structured_outputs.any_whitespace)
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="grammar")

    def colocated(self) -> GrammarCache:
        return self.cache        # thread-safe; its entries are only ever added whole

    async def receive(self, msg: GrammarCompilerProtocol) -> GrammarCompiled:
        if msg.request_id:
            self.ctx.link((msg.request_id,))
        try:
            return GrammarCompiled(await self._compile(msg.spec))
        except GrammarError as exc:
            raise InvalidGrammar(str(exc)) from None

    async def _compile(self, spec: StructuredOutputsParams) -> float:
        key = grammar_key(spec)
        if self.cache.get(key) is not None:
            return 0.0
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self.pool, self.cache.compile, key)
        return time.perf_counter() - t0

    async def stopped(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def xgrammar_compiler(config: EngineConfig) -> Any:
    """An xgrammar compiler for the model's vocabulary (its tokenizer loaded in this process)."""
    # xgrammar and transformers take seconds to import: loaded with the first grammar only
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    from actors.tokenizer.gguf_tokenizer import TextTokenizer
    source, arch = config.model.tokenizer, config.model.arch
    tokenizer = TextTokenizer.from_source(source.kind, source.path)
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer), vocab_size=arch.vocab_size,
        stop_token_ids=list(arch.eos_token_ids))
    return xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
