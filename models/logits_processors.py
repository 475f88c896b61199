"""Batch-level logits processors, vLLM v1's interface: a processor is built once per worker, told
each step which requests joined and left the persistent batch (``update_state``), and applied to
the logits of the whole batch (``apply``). Enabled with ``--logits-processors`` (fully qualified
class names) or by a package's ``troupe.logits_processors`` entry point; a request passes
arguments to them through ``SamplingParams.extra_args`` (the OpenAI field ``vllm_xargs``).

Where they run in the sampler's chain (models/sampler.py), as in vLLM: processors that may change
the argmax after logit_bias and before the penalties (step 7b), argmax-invariant ones after
temperature, beside min_p (step 10b), and not at all for an all-greedy batch.

Batch indices are the worker's batch slots (actors/worker/input_batch.py): a request keeps its
slot while it is in the batch, so nothing ever moves (``moved`` is always empty) and
``batch_size`` is one past the highest slot in use. The logits ``apply`` gets have one row per
slot (rows of slots that sample nothing this step hold zeros and are ignored afterwards).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from actors.engine.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = 0       # a -> b, a left empty
    SWAP = 1                 # a <-> b


# (index, params, prompt token ids, output token ids: a list the worker extends as it samples)
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """What changed in the batch since the last step. Process ``added`` first, then
    ``removed``, then ``moved`` (an index in ``added`` is never also in ``removed``)."""
    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM v1's batch-level logits processor. Subclassing is optional (any class with these
    methods works); ``applies_to`` is Troupe's addition, see below."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """``vllm_config``: the engine's resolved EngineConfig; ``device``: the logits' device."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (batch_size, V) float32, row i = batch index i; return the processed logits
        (writing in place and returning ``logits`` is fine)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` never changes a row's most likely token (then greedy requests
        skip it, and it runs after temperature)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called every step before sampling; None when the batch did not change."""

    def applies_to(self, params: SamplingParams) -> bool:
        """Whether this processor may change the logits of a request with ``params``.
        Speculative decoding verifies drafts without calling processors per position, so a
        request that a processor able to move the argmax applies to decodes without drafts.
        Default: every request (a processor that acts only on requests asking through their
        ``extra_args`` should say so)."""
        return True


_REQUIRED = ("apply", "is_argmax_invariant", "update_state")


def check_processor_class(cls: type, what: str) -> type:
    missing = [m for m in _REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{what} {cls.__module__}.{cls.__qualname__} is not a logits processor: "
                         f"it lacks {', '.join(missing)} (vLLM's LogitsProcessor interface)")
    return cls


@dataclass(slots=True)
class _BatchChanges:
    added: dict[int, AddedRequest] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)


class LogitsProcessors:
    """The worker's processors over its persistent batch: records the batch's changes, hands
    them over once per step (``flush``), keeps each request's output token list up to date, and
    applies the processors to a step's sampling rows (``bind``)."""

    def __init__(self, processors: list[Any]) -> None:
        self.processors = processors
        self.non_argmax_invariant = [p for p in processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self.outputs: dict[int, list[int]] = {}       # slot -> its request's output tokens (live)
        # the slots whose request some processor of each kind applies to (``applies_to``; a
        # processor without it applies to every request): a step none of whose rows is among
        # them skips that kind, keeping the sampler's fast paths (no logits copy when greedy)
        self._moves_argmax: set[int] = set()
        self._keeps_argmax: set[int] = set()
        self._changes = _BatchChanges()

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        out = list(output_token_ids)
        self.outputs[slot] = out
        for kind, slots in ((self.non_argmax_invariant, self._moves_argmax), (self.argmax_invariant, self._keeps_argmax)):
            if any(_applies(p, params) for p in kind):
                slots.add(slot)
            else:
                slots.discard(slot)
        self._changes.removed.discard(slot)
        self._changes.added[slot] = (slot, params, list(prompt_token_ids), out)

    def remove(self, slot: int) -> None:
        self.outputs.pop(slot, None)
        self._moves_argmax.discard(slot)
        self._keeps_argmax.discard(slot)
        self._changes.added.pop(slot, None)
        self._changes.removed.add(slot)      # whoever the processors last saw there

    def accepts_drafts(self, params: SamplingParams) -> bool:
        """False when a processor that may move the argmax applies to the request (its drafts
        could not be verified the way decoding them one by one would), or an argmax-invariant
        one applies to a request that samples."""
        for p in self.processors:
            if _applies(p, params) and (p in self.non_argmax_invariant or not params.greedy):
                return False
        return True

    @property
    def batch_size(self) -> int:
        return max(self.outputs) + 1 if self.outputs else 0

    def flush(self) -> None:
        """Tell every processor what changed since the last step (None: nothing)."""
        c = self._changes
        update = None
        if c.added or c.removed:
            update = BatchUpdate(self.batch_size, sorted(c.removed), [c.added[s] for s in sorted(c.added)], [])
            self._changes = _BatchChanges()
        for p in self.processors:
            p.update_state(update)

    def append_outputs(self, slots: np.ndarray, token_lists: Sequence[Sequence[int]]) -> None:
        for slot, tokens in zip(slots.tolist(), token_lists):
            self.outputs[slot].extend(tokens)

    def bind(self, slots: np.ndarray) -> BoundLogitsProcessors:
        slots = np.asarray(slots, dtype=np.int64)
        rows = slots.tolist()
        return BoundLogitsProcessors(self, torch.from_numpy(slots),
                                     bool(self._moves_argmax) and not self._moves_argmax.isdisjoint(rows),
                                     bool(self._keeps_argmax) and not self._keeps_argmax.isdisjoint(rows))


@dataclass(frozen=True, slots=True)
class BoundLogitsProcessors:
    """The processors for one sampling call: row j of the sampler's logits is slot ``slots[j]``.
    ``changes_argmax`` / ``has_argmax_invariant``: whether a processor of that kind applies to
    one of these rows' requests (else the sampler skips that kind)."""
    procs: LogitsProcessors
    slots: torch.Tensor                      # (S,) int64
    changes_argmax: bool = True
    has_argmax_invariant: bool = True

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> None:
        self._apply(self.procs.non_argmax_invariant, logits)

    def apply_argmax_invariant(self, logits: torch.Tensor) -> None:
        self._apply(self.procs.argmax_invariant, logits)

    def _apply(self, processors: list[Any], logits: torch.Tensor) -> None:
        """In place on logits (S, V): scattered into the batch's (batch_size, V) rows, processed,
        gathered back (no copy when the rows already are slots 0 .. S-1 in order)."""
        if not processors:
            return
        S, V = logits.shape
        n = self.procs.batch_size
        identity = S == n and bool((self.slots == torch.arange(S)).all())
        full = logits
        if not identity:
            full = logits.new_zeros((n, V))
            full[self.slots.to(logits.device)] = logits
        for p in processors:
            full = p.apply(full)
        if not identity:
            logits.copy_(full[self.slots.to(logits.device)])
        elif full is not logits:
            logits.copy_(full)


def _applies(processor: Any, params: SamplingParams) -> bool:
    check = getattr(processor, "applies_to", None)
    return True if check is None else bool(check(params))


def load_logits_processor_classes(names: Sequence[str]) -> list[type]:
    """The classes of the installed ``troupe.logits_processors`` entry points (as TROUPE_PLUGINS
    allows), then those ``names`` gives (--logits-processors), each once."""
    from actors.runtime.plugins import LOGITS_PROCESSORS, load_plugins_by_group, resolve_class
    classes = [check_processor_class(cls, f"entry point {name!r} ({LOGITS_PROCESSORS})")
               for name, cls in load_plugins_by_group(LOGITS_PROCESSORS).items()]
    classes += [check_processor_class(resolve_class(name, "--logits-processors"), "--logits-processors")
                for name in names]
    return list(dict.fromkeys(classes))


def build_logits_processors(classes: Sequence[type], config: Any, device: torch.device,
                            is_pin_memory: bool) -> LogitsProcessors | None:
    """One instance of each class for a worker on ``device`` (None when there are none)."""
    if not classes:
        return None
    return LogitsProcessors([cls(config, device, is_pin_memory) for cls in classes])


class _Thinking:
    """One request's reasoning, read from its prompt and output as they grow."""
    __slots__ = ("budget", "prompt", "out", "seen", "open_at", "forcing")

    def __init__(self, budget: int, prompt: list[int], out: list[int]) -> None:
        self.budget = budget
        self.prompt = prompt
        self.out = out                   # the worker's live list of the request's output tokens
        self.seen = 0                    # output tokens read so far
        self.open_at: int | None = None  # where the open reasoning's tokens start (None: not reasoning)
        self.forcing: int | None = None  # end tokens forced so far (None: not ending the reasoning)

    def token(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.out[i - n]

    def ends_with(self, end: int, seq: tuple[int, ...]) -> bool:
        """Whether the tokens before position ``end`` of prompt + output end with ``seq``."""
        k = len(seq)
        return end >= k and all(self.token(end - k + j) == seq[j] for j in range(k))


class ThinkingBudgetProcessor:
    """vLLM's thinking_token_budget, built into every worker whose engine knows the model's
    reasoning tags (--reasoning-parser or --reasoning-config): a request that sets it reasons for
    at most that many tokens (counted from the reasoning's start tag, in the prompt or the
    output), then the reasoning's end (``end_token_ids``, which may hold a transition phrase) is
    forced one token a step, as vLLM forces it (the token's logit raised to 1e9). A reasoning the
    model ends itself (its natural end tag) resets the count for a later one."""

    FORCED_LOGIT = 1e9

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        r = vllm_config.model.reasoning
        self.start, self.end, self.natural_end = r.start_token_ids, r.end_token_ids, r.natural_end_token_ids
        self.states: dict[int, _Thinking] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return params.thinking_token_budget is not None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for slot, params, prompt, out in batch_update.added:
            if params.thinking_token_budget is None:
                self.states.pop(slot, None)
                continue
            st = self.states[slot] = _Thinking(params.thinking_token_budget, list(prompt or []), out)
            for end in range(1, len(st.prompt) + 1):      # is the prompt's last reasoning still open?
                self._read(st, end)
        for slot in batch_update.removed:
            self.states.pop(slot, None)

    def _read(self, st: _Thinking, end: int) -> None:
        """Take in the token before position ``end``."""
        if st.forcing is not None:
            st.forcing += 1
            if st.forcing >= len(self.end):
                st.forcing = st.open_at = None          # the forced end closed the reasoning
            return
        if st.ends_with(end, self.start):
            st.open_at = end
        elif st.open_at is not None and st.ends_with(end, self.natural_end):
            st.open_at = None

    def forced(self, st: _Thinking) -> int | None:
        """The token this request's next step must sample (None: any)."""
        total = len(st.prompt) + len(st.out)
        n = len(st.prompt) + st.seen
        while n < total:                                # the tokens sampled since the last step
            n += 1
            self._read(st, n)
        st.seen = len(st.out)
        if st.forcing is None and st.open_at is not None and total - st.open_at >= st.budget:
            st.forcing = 0
        return self.end[st.forcing] if st.forcing is not None else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for slot, st in self.states.items():
            token = self.forced(st)
            if token is not None and slot < logits.shape[0]:
                rows.append(slot)
                tokens.append(token)
        if rows:
            logits[torch.tensor(rows), torch.tensor(tokens)] = self.FORCED_LOGIT
        return logits
