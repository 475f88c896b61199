"""Streaming token ids -> text for one request: whole characters only, stop strings found and never leaked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

# Prompt tokens decoded ahead of the first generated one, so the first delta sees its left context
# (decoders such as SentencePiece's drop a leading space at the very start of a decode).
INITIAL_PREFIX_TOKENS = 5


class Decoder(Protocol):
    """A tokenizer's decoding; one may also offer ``decode_stream(context_ids, skip_special_tokens)``,
    a function of each next token id returning the text it completes (None: mid-character), used
    instead of decoding windows twice per token (TextTokenizer.decode_stream; None: it has none)."""
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerDelta(NamedTuple):
    text: str  # newly releasable text; may be "" while bytes or a possible stop string are held back
    stop_reason: str | None  # the stop string that ended the request, if one did
    finished: bool  # a stop string matched, or flush() was called


class IncrementalDetokenizer:
    """Decodes one request's generated tokens incrementally and applies its stop strings.

    Text passes through two holds before it is released:

        output_text:  | released ................ | held back (stop prefix) |   + undecoded ids
                      0                    num_released          len(output_text)

    1. Undecoded ids: ids whose bytes do not yet form whole characters (the decoded window ends in
       U+FFFD). They stay in the window `ids[prefix_offset:]` until a later id completes them.
    2. Held-back text: the longest tail of `output_text` (at most max(len(stop)) - 1 characters)
       that is a proper prefix of some stop string. It is released once it can no longer start a
       stop string, or by flush().

    Invariant: text before `num_released` is never changed or withdrawn, so a stop match always
    starts at or after it.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

        # Decode window: ids[prefix_offset:read_offset] is already in output_text, ids[read_offset:] is not
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - INITIAL_PREFIX_TOKENS, 0)
        self._read_offset = len(self._ids)
        # the tokenizer's own incremental decoder over the same window, where it has one
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._step: Callable[[int], str | None] | None = (
            make_stream(self._ids[self._prefix_offset:], skip_special_tokens) if make_stream else None)

        self.output_text = ""  # all text decoded so far (after a stop: cut at the stop string)
        self.num_released = 0  # characters of output_text handed out so far
        self.num_output_tokens = 0
        self.stop_reason: str | None = None
        self.finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> DetokenizerDelta:
        """Feed the tokens generated this step; returns the text that may now be shown.
        ``stop_terminated``: the last of them is the EOS or stop token that ended the request,
        counted but not shown unless ``include_stop_str_in_output`` (vLLM's rule, whether
        special tokens are skipped or not).

        Tokens arriving after the request finished (a stop matched earlier) are ignored.
        """
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            delta = self.update(new_token_ids[:-1])
            if not self.finished:
                self.num_output_tokens += 1
            return delta
        for token_id in new_token_ids:
            if self.finished:
                break
            self._ids.append(token_id)
            self.num_output_tokens += 1
            new_text = self._decode_new_text()
            self.output_text += new_text
            if new_text and self.stop and self.num_output_tokens >= self.min_tokens:
                self._check_stop(len(new_text))
        return self._release(hold=0 if self.finished else self._held_back_len())

    def flush(self) -> DetokenizerDelta:
        """End the request (length, EOS, abort): release every held character, incomplete bytes as U+FFFD."""
        if not self.finished:
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            tail = self._decode(self._prefix_offset, len(self._ids))[len(prefix_text):]
            self._read_offset = len(self._ids)
            self.output_text += tail
            if tail and self.stop and self.num_output_tokens >= self.min_tokens:
                self._check_stop(len(tail))
            self.finished = True
        return self._release(hold=0)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self) -> str:
        """Text completed by the ids past read_offset ("" while they end mid-character)."""
        if self._step is not None:
            try:
                text = self._step(self._ids[-1])
            except Exception:       # the library refused the window: decode it here from now on
                self._step = None
            else:
                if text:
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return text or ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _check_stop(self, num_new_chars: int) -> None:
        """Find stop strings overlapping the newest `num_new_chars` characters; the first to complete wins."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            search_from = max(len(self.output_text) - num_new_chars - len(s) + 1, self.num_released, 0)
            start = self.output_text.find(s, search_from)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return
        end, start, s = best
        self.output_text = self.output_text[:end if self.include_stop_str_in_output else start]
        self.stop_reason, self.finished = s, True

    def _held_back_len(self) -> int:
        """Length of the longest unreleased tail of output_text that could still begin a stop string."""
        unreleased = len(self.output_text) - self.num_released
        for n in range(min(self._max_hold, unreleased), 0, -1):
            tail = self.output_text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, hold: int) -> DetokenizerDelta:
        end = len(self.output_text) - hold
        text = self.output_text[self.num_released:end]
        self.num_released = max(end, self.num_released)
        return DetokenizerDelta(text, self.stop_reason, self.finished)
