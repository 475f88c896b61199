"""The pooling model's head (vLLM's ``Pooler``, for ``--runner pooling``): each pooling
request's last-layer hidden states (after the final norm), chunk by chunk as its prompt is
computed, turned into its answer once the prompt is done: the last token's (LAST), the first's
(CLS), their mean (MEAN), or every token's (ALL, task token_embed); then its first ``dimensions``
kept (a Matryoshka model's) and L2-normalized unless ``use_activation`` is off; or, for a
classifier (task classify; token_classify: every token's), its score head's label scores. Sums run in float32 whatever the
model's dtype."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from actors.engine.pooling import PoolingParams


class Pooler:
    """``head``: a classifier's score layer (hidden -> labels), for task "classify": its scores
    calibrated (``(s - logit_mean) / logit_sigma``, vLLM's) and, with ``use_activation``, put
    through ``activation`` (sigmoid, softmax or identity)."""

    def __init__(self, head: torch.nn.Module | None = None, activation: str = "softmax",
                 logit_mean: float | None = None, logit_sigma: float | None = None) -> None:
        # a request whose prompt spans several steps: what its chunks have added up so far
        # (MEAN: the sum of rows; CLS: the first row; ALL: the rows)
        self.partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        self.head, self.activation = head, activation
        self.logit_mean, self.logit_sigma = logit_mean, logit_sigma

    def forget(self, req_ids: list[str]) -> None:
        """Drop finished, aborted or preempted requests (a preempted one starts over)."""
        for rid in req_ids:
            self.partial.pop(rid, None)

    def add(self, rid: str, params: PoolingParams, rows: torch.Tensor, start: int, num_prompt: int
            ) -> np.ndarray | None:
        """Chunk ``rows`` (n, hidden) of positions [start, start + n) of a prompt of
        ``num_prompt`` tokens; the request's answer once the chunk ends the prompt, else None."""
        kind, done = params.pooling_type, start + len(rows) >= num_prompt
        if kind == "LAST":
            if not done:
                return None
            pooled = rows[-1].float()
        elif kind == "CLS":
            if start == 0:
                self.partial[rid] = rows[0].float()
            if not done:
                return None
            pooled = self.partial.pop(rid)
        elif kind == "MEAN":
            total = rows.float().sum(0)
            if rid in self.partial:
                total += self.partial.pop(rid)
            if not done:
                self.partial[rid] = total
                return None
            pooled = total / num_prompt
        elif kind == "ALL":
            chunks = self.partial.setdefault(rid, [])
            chunks.append(rows.float())
            if not done:
                return None
            pooled = torch.cat(self.partial.pop(rid))
        else:
            raise ValueError(f"pooling type {kind!r} is not supported")
        if params.task in ("classify", "token_classify"):     # one row, or one per token
            return self._classify(pooled, params.use_activation).cpu().numpy()
        if params.dimensions is not None:
            pooled = pooled[..., :params.dimensions]
        if params.use_activation:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().numpy()

    def _classify(self, pooled: torch.Tensor, activate: bool) -> torch.Tensor:
        if self.head is None:
            raise ValueError("this model has no score head to classify with (--convert classify)")
        scores = self.head(pooled.to(self.head.weight.dtype))
        if self.logit_mean is not None:
            scores = scores - self.logit_mean
        if self.logit_sigma is not None:
            scores = scores / self.logit_sigma
        if not activate or self.activation == "identity":
            return scores
        return torch.sigmoid(scores) if self.activation == "sigmoid" else torch.softmax(scores, dim=-1)
