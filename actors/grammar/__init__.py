"""Structured outputs: grammars compiled with xgrammar (the GrammarCompiler actor) and the
matchers that turn them into per-step token bitmasks for the scheduler."""
