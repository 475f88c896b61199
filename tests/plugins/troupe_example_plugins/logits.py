"""A batch-level logits processor (vLLM v1's interface): a request that passes
``{"banned_token_ids": [ids]}`` in its extra_args (the OpenAI field ``vllm_xargs``) never gets
those tokens; other requests are left alone."""
from __future__ import annotations

import torch

from models.logits_processors import BatchUpdate, LogitsProcessor

ARG = "banned_token_ids"


class BanTokensLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.banned: dict[int, list[int]] = {}        # batch index -> its banned token ids

    def is_argmax_invariant(self) -> bool:
        return False                                  # it can change the most likely token

    def applies_to(self, params) -> bool:
        return bool(params.extra_args and params.extra_args.get(ARG))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _prompt, _output in batch_update.added:
            ids = (params.extra_args or {}).get(ARG)
            if ids:
                self.banned[index] = [int(t) for t in ids]
            else:
                self.banned.pop(index, None)
        for index in batch_update.removed:
            self.banned.pop(index, None)
        for a, b, direction in batch_update.moved:       # never sent by Troupe; vLLM's meaning
            moved = self.banned.pop(a, None)
            other = self.banned.pop(b, None)
            if moved is not None:
                self.banned[b] = moved
            if other is not None and direction.name == "SWAP":
                self.banned[a] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (batch_size, V): row i is batch index i."""
        rows = [i for i, ids in self.banned.items() for _ in ids]
        cols = [t for ids in self.banned.values() for t in ids]
        if rows:
            logits[torch.tensor(rows, device=logits.device),
                   torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits
