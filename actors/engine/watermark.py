"""WatermarkConfig: vLLM's ``--watermark-config`` (models/watermark.py is the watermark itself).
Kept apart from it so that reading the engine's configuration loads no torch."""
from __future__ import annotations

from typing import Any

import msgspec

from actors.engine.json_flags import checked_fields

ALGORITHMS = ("gumbel", "dual_key_gumbel")
CONTEXT_SCOPES = ("none", "single_turn", "all")
PRFS = ("philox",)
MIN_DEDUP_HISTORY = 1024                       # below this, repetition loops grow more likely


class WatermarkConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's WatermarkConfig (``--watermark-config``): the secret ``key`` (an integer in
    [0, 2**64)), the algorithm, ``alpha`` (dual_key_gumbel: key B's share), ``context_width`` (the
    tokens before a token its noise depends on), ``deduplicate_contexts`` (where a repeated context
    is looked for: none, single_turn, the request's generated tokens, or all, its prompt too, the
    first context_width generated tokens then left unwatermarked) over the last
    ``deduplicate_contexts_max_history`` positions (None: all), the PRF, and whether speculative
    decoding may leave draft tokens unwatermarked."""
    key: int
    algorithm: str = "gumbel"
    alpha: float = 0.1
    context_width: int = 4
    deduplicate_contexts: str = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192
    prf: str = "philox"
    allow_target_only_watermarking: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.key, bool) or not isinstance(self.key, int) or not 0 <= self.key <= 2 ** 64 - 1:
            raise ValueError("watermark_config.key must be an integer in [0, 2**64) (philox keys must fit in 64 bits)")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"watermark_config.algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"watermark_config.alpha must be in [0, 1], got {self.alpha!r}")
        if isinstance(self.context_width, bool) or not isinstance(self.context_width, int) or self.context_width < 1:
            raise ValueError(f"watermark_config.context_width must be a positive integer, got {self.context_width!r}")
        if self.deduplicate_contexts not in CONTEXT_SCOPES:
            raise ValueError(f"watermark_config.deduplicate_contexts must be one of {', '.join(CONTEXT_SCOPES)}, "
                             f"got {self.deduplicate_contexts!r}")
        h = self.deduplicate_contexts_max_history
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ValueError(f"watermark_config.deduplicate_contexts_max_history must be a positive integer or "
                             f"null, got {h!r}")
        if self.prf not in PRFS:
            raise ValueError(f"watermark_config.prf must be one of {', '.join(PRFS)}, got {self.prf!r}")

    @classmethod
    def of(cls, raw: dict[str, Any]) -> WatermarkConfig:
        """The JSON object's config; ValueError naming an unknown or missing field."""
        raw = checked_fields(cls, raw, "--watermark-config")
        if "key" not in raw:
            raise ValueError("--watermark-config needs a key (the secret integer the watermark is keyed with)")
        return cls(**raw)

    def __repr__(self) -> str:          # the key stays out of logs and /server_info
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "key")
        return f"WatermarkConfig(key=<redacted>, {fields})"

    @property
    def dedup_warning(self) -> str | None:
        """vLLM's warning for settings that make degenerate, repetitive generations likelier."""
        h = self.deduplicate_contexts_max_history
        if self.deduplicate_contexts == "none" or (h is not None and h < MIN_DEDUP_HISTORY):
            return ("Gumbel-max watermarking with context deduplication disabled or limited to fewer than "
                    f"{MIN_DEDUP_HISTORY} positions may increase the frequency of degenerate generations, including "
                    f"repetition loops. Use deduplicate_contexts='single_turn' or 'all' with "
                    f"deduplicate_contexts_max_history at least {MIN_DEDUP_HISTORY} or null to mitigate this.")
        return None
