"""Log-prob formatting in the two OpenAI shapes.

Chat:        ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
Completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``

Token strings are each id decoded alone; a token that is only part of a UTF-8 character reads
``bytes:\\xe2\\x80`` (as OpenAI writes it), and ``bytes`` holds its raw byte values."""
from __future__ import annotations

import codecs
import re
from functools import lru_cache
from typing import Any, Iterator

from actors.engine.messages import Logprobs

MIN_LOGPROB = -9999.0        # -inf (a token the sampler could never pick) as JSON can carry it
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def finite(lp: float) -> float:
    return lp if lp > MIN_LOGPROB else MIN_LOGPROB     # also maps NaN to the floor


class TokenText:
    """Token id -> (display text, raw bytes), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if not getattr(self.tokenizer, "has_text", True):     # --skip-tokenizer-init: ids are all there is
            return f"token_id:{token_id}", []
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        (symbol,) = self.tokenizer.convert_ids_to_tokens([token_id])
        raw = self._raw_bytes(symbol or "")
        if raw is None:
            return text, list(text.encode("utf-8"))
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _raw_bytes(self, symbol: str) -> bytes | None:
        m = _BYTE_TOKEN.fullmatch(symbol)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        table = _byte_decoder()
        if self.byte_level and symbol and all(ch in table for ch in symbol):
            return bytes(table[ch] for ch in symbol)
        return None


class TokenIdText:
    """``return_tokens_as_token_ids`` (vLLM's): a token shows as ``token_id:N``; its bytes stay
    the token's own (text offsets count the decoded text)."""

    def __init__(self, text_of: TokenText) -> None:
        self.text_of = text_of

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        return f"token_id:{token_id}", self.text_of(token_id)[1]


def ranked_positions(lp: Logprobs) -> Iterator[dict[int, tuple[float, int]]]:
    """Positions of ``lp`` as vLLM's ``{token_id: (logprob, rank)}``: the chosen token with its
    own rank, alternative i with rank i (a token listed twice kept once)."""
    for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
        entry = {ids[0]: (values[0], rank)}
        for r, (tok, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entry.setdefault(tok, (value, r))
        yield entry


def prompt_logprobs_json(lp: Logprobs | None, text_of: TokenText | TokenIdText) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` of an answer: None for the first prompt token (nothing
    precedes it), then per token ``{token_id: {logprob, rank, decoded_token}}`` (the token's
    text, also where log-prob tokens read as ids)."""
    if isinstance(text_of, TokenIdText):
        text_of = text_of.text_of
    out: list[dict[str, dict] | None] = [None]
    for entry in ranked_positions(lp) if lp is not None else ():
        out.append({str(tok): {"logprob": finite(value), "rank": rank, "decoded_token": text_of(tok)[0]}
                    for tok, (value, rank) in entry.items()})
    return out


def chat_logprobs(lp: Logprobs | None, text_of: TokenText, top: int) -> list[dict[str, Any]]:
    """Entries for ``content``: per position the chosen token, then its ``top`` alternatives."""
    if lp is None:
        return []
    out = []
    for ids, vals in zip(lp.token_ids, lp.logprobs):
        token, raw = text_of(ids[0])
        alts = []
        for alt, val in zip(ids[1:top + 1], vals[1:top + 1]):
            alt_token, alt_raw = text_of(alt)
            alts.append({"token": alt_token, "logprob": finite(val), "bytes": alt_raw})
        out.append({"token": token, "logprob": finite(vals[0]), "bytes": raw, "top_logprobs": alts})
    return out


class CompletionLogprobs:
    """Builds completions-shaped log-probs, chunk by chunk; ``text_offset`` runs on across
    chunks (each token's offset in the choice's text, echoed prompt included)."""

    def __init__(self, text_of: TokenText, top: int) -> None:
        self.text_of = text_of
        self.top = top
        self.offset = 0                  # characters of the choice's text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def empty(self) -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def first_prompt_token(self, out: dict[str, list], token_id: int) -> None:
        """The first prompt token of an echo: no log-prob (nothing precedes it)."""
        self._append(out, token_id, None, None)

    def add(self, out: dict[str, list], lp: Logprobs | None) -> None:
        if lp is None:
            return
        for ids, vals in zip(lp.token_ids, lp.logprobs):
            tops = {self.text_of(alt)[0]: finite(val)
                    for alt, val in zip(ids[1:self.top + 1], vals[1:self.top + 1])}
            tops.setdefault(self.text_of(ids[0])[0], finite(vals[0]))   # the sampled token too
            self._append(out, ids[0], finite(vals[0]), tops)

    def _append(self, out: dict[str, list], token_id: int, logprob: float | None,
                tops: dict[str, float] | None) -> None:
        token, raw = self.text_of(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(self.offset)
        # offsets count the characters of the decoded text: a token holding part of a
        # character adds nothing until the token that completes it
        self.offset += len(self._utf8.decode(bytes(raw)))


def merge_completion_logprobs(parts: list[dict[str, list]]) -> dict[str, list] | None:
    if not parts:
        return None
    merged: dict[str, list] = {k: [] for k in parts[0]}
    for part in parts:
        for k, v in part.items():
            merged[k].extend(v)
    return merged
