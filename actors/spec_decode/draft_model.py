"""DraftModelProposer: the draft model of speculative decoding (methods ``draft_model`` and
``self_draft``), run by the worker in the step that verified the last drafts.

Its KV cache lives in the target's blocks (``kv_cache_spec.with_draft_layers``): the KV manager
allocates both at once, and reserves ``k`` lookahead slots past each step's tokens for the drafts
written here. Per request (a slot of the persistent batch) it keeps how many positions of its KV
hold the request's real tokens (``num_computed``), and which drafts it wrote past them.

One step, for every scheduled request that accepts drafts:
  1. catch-up: the positions the target computed (a prompt chunk), and for a request that sampled
     the tokens it emitted, are run through the draft model in one pass (drafts it wrote the KV of
     last step and the target accepted are not run again: their KV is the same); the logits of a
     sampling request's last position give its first draft (greedy);
  2. k - 1 passes of one token per proposing request (a pure-decode step: the native decode
     stack on the CPU) give the others, each draft's KV written at its position.
Drafts are the draft model's argmax: a one-hot proposal, so the rejection sampler's acceptance
(min(1, p_target)) keeps the target's distribution exact for sampled requests too.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from actors.worker.input_batch import InputBatch, TokenInputs


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], num_speculative_tokens: int,
                 max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches          # one per draft layer, in the target's blocks
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)   # positions whose KV holds real tokens
        self.spec_start = np.zeros(max_num_reqs, dtype=np.int64)     # the first position of the drafts written
        self.spec_tokens = np.zeros((max_num_reqs, max(self.k - 1, 1)), dtype=np.int64)
        self.spec_len = np.zeros(max_num_reqs, dtype=np.int64)       # drafts whose KV was written

    def add(self, slot: int, num_computed_tokens: int) -> None:
        """A request entered ``slot`` with this many tokens computed (a prefix cache hit's blocks
        hold the draft's KV too: the request that computed them ran the draft over them)."""
        self.num_computed[slot] = num_computed_tokens
        self.spec_len[slot] = 0

    def num_drafts(self, batch: InputBatch, slots: np.ndarray) -> np.ndarray:
        """How many drafts each slot's request can use next step: k, less where the context
        length or max_tokens ends it first (the verified step emits up to drafts + 1 tokens)."""
        n = batch.num_tokens[slots]
        room = np.minimum(self.k, self.max_model_len - 1 - n)
        left = np.array([np.iinfo(np.int64).max if (m := batch.states[i].params.max_tokens) is None
                         else m - int(n_i - batch.num_prompt_tokens[i]) - 1
                         for i, n_i in zip(slots.tolist(), n.tolist())], dtype=np.int64)
        return np.maximum(np.minimum(room, left), 0)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, slots: np.ndarray, ends: np.ndarray, proposing: np.ndarray
                ) -> list[list[int]]:
        """Bring the draft's KV of each slot's request up to position ``ends`` (exclusive) and,
        where ``proposing``, draft its next tokens (``ends`` is then its number of tokens).
        Returns the drafts of every given slot ([] where it does not propose)."""
        self._keep_accepted(batch, slots, ends)
        start = np.minimum(self.num_computed[slots], ends)
        n = ends - start
        k = np.where(proposing, self.num_drafts(batch, slots), 0)
        run = (n > 0) & ((k > 0) | ~proposing)
        drafts: list[list[int]] = [[] for _ in range(len(slots))]
        if run.any():
            rows = np.flatnonzero(run)
            ti = batch.token_inputs(slots[rows], start[rows], n[rows])
            hidden = self._forward(ti)
            self.num_computed[slots[rows]] = ends[rows]
            first = np.flatnonzero(k[rows] > 0)                          # rows (of ``rows``) that propose
            if len(first):
                last = torch.from_numpy(ti.query_start_loc[1:][first] - 1).to(self.device)
                tokens = self._greedy(hidden[last])
                for j, tok in zip(rows[first].tolist(), tokens):
                    drafts[j].append(tok)
        self._draft_more(batch, slots, k, drafts)
        for j, i in enumerate(slots.tolist()):
            d = drafts[j]
            self.spec_start[i] = ends[j]
            self.spec_len[i] = max(len(d) - 1, 0)          # the last draft's KV is not written
            self.spec_tokens[i, :self.spec_len[i]] = d[:-1]
        return drafts

    def _draft_more(self, batch: InputBatch, slots: np.ndarray, k: np.ndarray, drafts: list[list[int]]) -> None:
        """Drafts 2 .. k: one token per pass for the requests still drafting."""
        for step in range(1, int(k.max(initial=0))):
            rows = np.array([j for j in np.flatnonzero(k > step).tolist() if drafts[j]], dtype=np.int64)
            if not len(rows):
                return
            s = slots[rows]
            for j, i in zip(rows.tolist(), s.tolist()):
                batch.write_drafts(i, drafts[j])
            pos = batch.num_tokens[s] + step - 1                        # the previous draft's position
            ti = batch.token_inputs(s, pos, np.ones(len(rows), dtype=np.int64))
            tokens = self._greedy(self._forward(ti))
            for j, tok in zip(rows.tolist(), tokens):
                drafts[j].append(tok)

    def _keep_accepted(self, batch: InputBatch, slots: np.ndarray, ends: np.ndarray) -> None:
        """Drafts whose KV was written last step and that are now the request's tokens (the
        target accepted them) count as computed: the run stops at the first that is not."""
        for j, i in enumerate(slots.tolist()):
            m = int(self.spec_len[i])
            if not m or self.num_computed[i] != self.spec_start[i]:
                continue
            s = int(self.spec_start[i])
            m = min(m, int(ends[j]) - 1 - s)
            if m <= 0:
                continue
            same = batch.token_ids[i, s:s + m] == self.spec_tokens[i, :m]
            self.num_computed[i] = s + (m if same.all() else int(np.argmin(same)))

    def _forward(self, ti: TokenInputs) -> torch.Tensor:
        """Hidden states (T, hidden) of the pass's tokens, their KV written in the draft's layers."""
        to_dev = (lambda t: t) if self.device.type == "cpu" else (lambda t: t.to(self.device))   # noqa: E731
        meta = ti.meta
        if self.device.type != "cpu":
            metas = [dataclasses.replace(m, query_start_loc=to_dev(m.query_start_loc), seq_lens=to_dev(m.seq_lens),
                                         block_table=to_dev(m.block_table), slot_mapping=to_dev(m.slot_mapping))
                     for m in meta.groups or (meta,)]
            meta = metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], groups=tuple(metas))
        return self.model(to_dev(torch.from_numpy(ti.input_ids)), to_dev(torch.from_numpy(ti.positions)),
                          self.kv_caches, meta)

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()
