"""StepCostModel: how long the worker takes for a step, predicted from what the step holds, for the
scheduler's latency target (``--max-step-latency-ms``, Sarathi-Serve's stall-free batching).

A step's compute time is modelled as

    t = c0 + c1 * tokens + c2 * attention / 1000

with ``tokens`` the step's scheduled tokens (every matmul's rows) and ``attention`` the number of
(query, key) pairs its attention reads: a chunk of n tokens after c computed ones reads
n * c + n (n + 1) / 2. The coefficients are fitted by least squares over the steps the worker
ran (the compute seconds each step reports), older steps weighing less (a forgetting factor), so
the model follows the machine as it warms up or gets busy; until ``MIN_OBSERVATIONS`` steps are
in, it predicts nothing and the scheduler caps no chunk.
"""
from __future__ import annotations

import numpy as np

MIN_OBSERVATIONS = 8
# --max-step-latency-ms auto: a prompt chunk beside decodes may cost this many times the step's
# fitted fixed cost c0 (the weights read once per step, the step's overheads): steps stay short
# wherever the machine is, and the fixed cost paid per chunk stays at most an eleventh of its
# time (6, 10 and 16 compared under load: 6 cut the tail most but queued prompts at 4 req/s,
# 16 let the tail back; README, "Stall-free batching")
AUTO_CHUNK_COST = 10.0
# ... or, where a step's fixed cost is small against a token's (quantized weights read fast), the
# cost of this many prompt tokens: ten fixed costs of gguf-i8 (5 ms) left room for 45 tokens a
# step, and at 4 req/s prompts queued for seconds (README, "Stall-free batching")
AUTO_MIN_CHUNK_TOKENS = 128
FORGET = 0.98              # each step weighs this much less than the next
RIDGE = 1e-9               # keeps the normal equations solvable while the steps look alike


def attention_pairs(computed: int, n: int) -> int:
    """(query, key) pairs read by a chunk of ``n`` tokens after ``computed`` ones (causal)."""
    return n * computed + n * (n + 1) // 2


class StepCostModel:
    def __init__(self, coefficients: tuple[float, float, float] | None = None) -> None:
        """``coefficients``: fixed (c0, c1, c2) in seconds (tests, a known machine); None: fitted."""
        self.fixed = coefficients is not None
        self.coef = np.array(coefficients if coefficients is not None else (0.0, 0.0, 0.0), dtype=np.float64)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.observations = 0

    @property
    def ready(self) -> bool:
        return self.fixed or self.observations >= MIN_OBSERVATIONS

    def predict(self, tokens: int, attention: int) -> float:
        """Seconds for a step of ``tokens`` tokens reading ``attention`` pairs."""
        c0, c1, c2 = self.coef
        return c0 + c1 * tokens + c2 * attention / 1000.0

    def observe(self, tokens: int, attention: int, seconds: float) -> None:
        """A step the worker ran: its size and its compute seconds."""
        if self.fixed or tokens <= 0 or seconds <= 0.0:
            return
        x = np.array([1.0, tokens, attention / 1000.0])
        self._xtx = FORGET * self._xtx + np.outer(x, x)
        self._xty = FORGET * self._xty + x * seconds
        self.observations += 1
        if self.observations >= MIN_OBSERVATIONS:
            coef = np.linalg.solve(self._xtx + RIDGE * np.eye(3), self._xty)
            self.coef = np.maximum(coef, 0.0)          # no term makes a step faster

    def auto_chunk_seconds(self) -> float:
        """--max-step-latency-ms auto: what a step's prompt chunks beside decodes may cost, the
        larger of AUTO_CHUNK_COST fixed step costs and AUTO_MIN_CHUNK_TOKENS tokens' cost."""
        c0, c1, _ = self.coef
        return max(AUTO_CHUNK_COST * c0, AUTO_MIN_CHUNK_TOKENS * c1)

    def describe(self) -> str:
        c0, c1, c2 = self.coef
        return f"{c0 * 1e3:.2f} ms + {c1 * 1e3:.3f} ms a token + {c2 * 1e3:.4f} ms per 1000 attention pairs"

    def max_chunk(self, computed: int, seconds: float) -> int:
        """The most tokens a prompt chunk after ``computed`` tokens may take within ``seconds``
        (beyond the step's other work): the largest n with c1 n + c2 (n c + n (n + 1) / 2) / 1000
        within them."""
        if seconds <= 0.0:
            return 0
        _, c1, c2 = self.coef
        a, b = c2 / 2000.0, c1 + c2 * (computed + 0.5) / 1000.0    # a n^2 + b n <= seconds
        if a <= 0.0:
            return int(seconds / b) if b > 0.0 else 1 << 30
        return int((-b + (b * b + 4.0 * a * seconds) ** 0.5) / (2.0 * a))
