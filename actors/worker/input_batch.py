"""The worker's persistent batch: every request it holds lives in a slot of preallocated numpy
arrays (its tokens, its block table in each KV cache group, its counters), so a step's inputs are gathered with
vectorized indexing instead of rebuilt request by request.

Slots are reused: a finished request frees its slot, a new one takes the lowest free slot.
The arrays stay on the host whatever the model's device; only seeded generators live on the
device (a CUDA tensor draws from a CUDA generator). A seeded request that comes back after a
preemption has its generator moved past the draws of the tokens it already sampled, so its
tokens do not depend on whether it was preempted.

Speculative decoding: a step's draft tokens are written into the token matrix just past a
request's tokens (the model reads its inputs from there) without being counted in ``num_tokens``;
the tokens the rejection sampler emits then overwrite them. A seeded request with drafts draws one
race row per verified position and its generator is put back after the rows of the tokens it
emitted (``models.rejection_sampler.rewind_generators``), so it still stands at one row per token.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from actors.engine.lora import LoRARequest
from actors.engine.messages import MultiModalFeature, NewRequestData
from kernels.attention.base import AttentionMetadata
from actors.engine.sampling_params import SamplingParams
from actors.spec_decode.config import accepts_drafts
from models.sampler import seeded_generator


@dataclass(slots=True)
class SlotState:
    """What does not fit in the arrays: the request's parameters and its seeded generator."""
    req_id: str
    params: SamplingParams
    generator: torch.Generator | None
    lora_request: LoRARequest | None = None
    prompt_embeds: np.ndarray | None = None   # (prompt tokens, hidden): a prompt given as embeddings
    mm_features: list[MultiModalFeature] | None = None   # its images
    # M-RoPE with images: (its prompt's positions (3, prompt tokens), the delta of those after)
    mrope: tuple[np.ndarray, int] | None = None

    @property
    def has_embeds(self) -> bool:
        return self.prompt_embeds is not None or bool(self.mm_features)


class TokenInputs(NamedTuple):
    """A forward pass's inputs over the batch: tokens ``start[r] .. start[r] + n[r]`` of each
    request in ``slots``."""
    input_ids: np.ndarray          # (T,) int64
    positions: np.ndarray          # (T,) int64
    query_start_loc: np.ndarray    # (B + 1,) int64: where each request's tokens start, then T
    meta: AttentionMetadata        # one per KV cache group in ``meta.groups`` when several


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device | str = "cpu", num_kv_cache_groups: int = 1, mrope_merge_size: int = 0,
                 video_tokens_per_second: float = 1.0) -> None:
        """``mrope_merge_size``: for a model whose images take M-RoPE positions (models/mrope.py),
        its vision patches merged per side into an image position; 0: positions are the tokens'
        indices. ``video_tokens_per_second``: a video's M-RoPE time positions a second."""
        self.mrope_merge_size = mrope_merge_size
        self.video_tokens_per_second = video_tokens_per_second
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.accepts_drafts = np.zeros(max_num_reqs, dtype=bool)      # speculative decoding: may get drafts
        G = num_kv_cache_groups
        self.block_table = np.zeros((G, max_num_reqs, max_blocks), dtype=np.int32)  # per group; 0: null block
        self.num_blocks = np.zeros((G, max_num_reqs), dtype=np.int64)
        self.slots: dict[str, int] = {}
        self.states: list[SlotState | None] = [None] * max_num_reqs
        self.num_with_embeds = 0              # requests held whose prompt came as embeddings, or holds images
        self.num_mrope = 0                    # requests held with M-RoPE positions of their own (images)
        self._free = list(range(max_num_reqs))

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slots

    def add(self, r: NewRequestData) -> int:
        if r.req_id in self.slots:
            raise ValueError(f"request {r.req_id!r} is already in the batch")
        if not self._free:
            raise RuntimeError(f"the batch is full ({self.max_num_reqs} requests)")
        tokens = r.prompt_token_ids + r.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {r.req_id!r} has {len(tokens)} tokens, more than {self.max_model_len}")
        i = heapq.heappop(self._free)
        self.slots[r.req_id] = i
        n = len(tokens)
        self.token_ids[i, :n] = tokens
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = len(r.prompt_token_ids)
        self.num_computed_tokens[i] = r.num_computed_tokens
        self.accepts_drafts[i] = accepts_drafts(r.sampling_params)
        self.num_blocks[:, i] = 0
        self.append_blocks(i, r.block_ids)
        self.states[i] = SlotState(r.req_id, r.sampling_params, self._generator(r), r.lora_request, r.prompt_embeds,
                                   r.mm_features)
        self.num_with_embeds += self.states[i].has_embeds
        if self.mrope_merge_size and r.mm_features:
            from models.mrope import mrope_positions
            self.states[i].mrope = mrope_positions(len(r.prompt_token_ids), r.mm_features, self.mrope_merge_size,
                                                   self.video_tokens_per_second)
            self.num_mrope += 1
        return i

    def _generator(self, r: NewRequestData) -> torch.Generator | None:
        """A seeded request's generator, past the draws of the tokens it already sampled."""
        p = r.sampling_params
        if p.seed is None:
            return None
        return seeded_generator(p.seed, p.temperature, len(r.output_token_ids), self.vocab_size, self.device)

    def remove(self, req_id: str) -> None:
        i = self.slots.pop(req_id, None)
        if i is not None:
            self.num_with_embeds -= self.states[i].has_embeds
            self.num_mrope -= self.states[i].mrope is not None
            self.states[i] = None
            self.block_table[:, i] = 0
            heapq.heappush(self._free, i)

    def slot(self, req_id: str) -> int:
        try:
            return self.slots[req_id]
        except KeyError:
            raise KeyError(f"this worker does not hold request {req_id!r}") from None

    def append_blocks(self, i: int, block_ids: tuple[list[int], ...]) -> None:
        """Slot ``i`` gains ``block_ids[g]`` at the end of its block table in group g. (Entries a
        sliding-window group released keep their old ids here: kernels read no key out of a
        layer's window.)"""
        if len(block_ids) != self.block_table.shape[0]:
            raise ValueError(f"block ids for {len(block_ids)} KV cache groups, the batch has "
                             f"{self.block_table.shape[0]}")
        for g, ids in enumerate(block_ids):
            k, n = int(self.num_blocks[g, i]), len(ids)
            if n:
                self.block_table[g, i, k:k + n] = ids
                self.num_blocks[g, i] = k + n

    def append_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """One new token per given slot (vectorized)."""
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1

    def write_tokens(self, i: int, start: int, token_ids: list[int]) -> None:
        """Slot ``i``'s tokens from position ``start`` on, as the scheduler knows them (a pipeline
        stage that does not sample learns its requests' new tokens so)."""
        end = start + len(token_ids)
        self.token_ids[i, start:end] = token_ids
        self.num_tokens[i] = max(int(self.num_tokens[i]), end)

    def write_drafts(self, i: int, draft_token_ids: list[int]) -> None:
        """Slot ``i``'s draft tokens, just past its tokens (not counted as its tokens)."""
        n = int(self.num_tokens[i])
        self.token_ids[i, n:n + len(draft_token_ids)] = draft_token_ids

    def append_token_lists(self, slots: np.ndarray, token_lists: list[list[int]]) -> None:
        """One or more new tokens per given slot."""
        for i, tokens in zip(slots.tolist(), token_lists):
            n = int(self.num_tokens[i])
            self.token_ids[i, n:n + len(tokens)] = tokens
            self.num_tokens[i] = n + len(tokens)

    def token_inputs(self, slots: np.ndarray, start: np.ndarray, n: np.ndarray,
                     prefix_len: Callable[[np.ndarray, np.ndarray], int] | None = None) -> TokenInputs:
        """The inputs of a pass over tokens ``start .. start + n`` of the requests in ``slots``
        (vectorized): their ids and positions from the token matrix, and the attention metadata
        from the block tables. ``prefix_len(block_table (B, blocks) of group 0, its lengths (B,))``:
        the shared prefix for cascade attention (none when not given)."""
        bs = self.block_size
        cu = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        row = np.repeat(np.arange(len(slots)), n)                          # (T,)
        positions = np.arange(cu[-1]) - cu[:-1][row] + start[row]          # (T,)
        input_ids = self.token_ids[slots[row], positions]                  # (T,)
        max_blocks = int(self.num_blocks[:, slots].max())
        tables = self.block_table[:, slots, :max_blocks]                   # (G, B, max_blocks)
        slot_mapping = tables[:, row, positions // bs].astype(np.int64) * bs + positions % bs   # (G, T)
        seq_lens = start + n
        common = prefix_len(tables[0], self.num_blocks[0, slots]) if prefix_len is not None else 0
        query_start_loc = torch.from_numpy(cu.astype(np.int32))
        seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32))
        state_slots = torch.from_numpy(slots.astype(np.int64))      # a state-space layer's recurrent state rows
        metas = [AttentionMetadata(
            num_reqs=len(slots), num_tokens=int(cu[-1]), max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=query_start_loc, seq_lens=seq_lens_t,
            block_table=torch.from_numpy(np.ascontiguousarray(tables[g])),
            slot_mapping=torch.from_numpy(slot_mapping[g]), block_size=bs, common_prefix_len=common,
            state_slots=state_slots)
            for g in range(len(tables))]
        meta = metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], groups=tuple(metas))
        return TokenInputs(input_ids, positions, cu, meta)

    def rope_positions(self, slots: np.ndarray, positions: np.ndarray, cu: np.ndarray) -> np.ndarray:
        """The rotary positions of a pass whose tokens sit at ``positions`` (T,) of the requests in
        ``slots`` (``cu``: where each request's tokens start in the pass): the tokens' indices,
        but M-RoPE's for the requests holding images: their prompt's rows, the delta past it. One
        row (T,) where every token's rows agree (no image position in the pass), else (3, T)."""
        if not self.num_mrope:
            return positions
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        for r, i in enumerate(slots.tolist()):
            mrope = self.states[i].mrope
            if mrope is None:
                continue
            table, delta = mrope
            at = positions[cu[r]:cu[r + 1]]
            inside = at < table.shape[1]
            out[:, cu[r]:cu[r + 1]] = np.where(inside, table[:, np.minimum(at, table.shape[1] - 1)], at + delta)
        return out[0].copy() if (out[0] == out[1]).all() and (out[0] == out[2]).all() else out

    def embeds_inputs(self, slots: np.ndarray, start: np.ndarray, n: np.ndarray,
                      encode: Callable[[MultiModalFeature], torch.Tensor] | None = None,
                      ) -> tuple[np.ndarray, list[torch.Tensor]] | None:
        """For a pass over tokens ``start .. start + n`` of the requests in ``slots``: the tokens
        (indices into the pass) that take embeddings rather than their token's, and those rows
        (pieces of (k, hidden)); None when there are none. They are prompt positions given as
        embeddings, and the positions of an image that take its embeddings: ``encode`` gives an
        image's (its embedding positions, hidden) (the runner's encoder cache), asked once per
        pass for the requests that hold the same image (a request's n choices) (None: images are
        not read here, a pipeline stage after the first)."""
        if not self.num_with_embeds:
            return None
        index, rows, offset = [], [], 0
        encoded: dict[str, torch.Tensor] = {}       # this pass's images by identifier (n choices share one)
        for r, i in enumerate(slots.tolist()):
            state, first, count = self.states[i], int(start[r]), int(n[r])
            embeds = state.prompt_embeds
            if embeds is not None and first < len(embeds):
                end = min(first + count, len(embeds))
                index.append(np.arange(offset, offset + end - first))
                rows.append(torch.from_numpy(embeds[first:end]))
            features = (state.mm_features or ()) if encode is not None else ()
            for feature in features:
                lo, hi = max(first, feature.offset), min(first + count, feature.end)
                if lo >= hi:
                    continue
                out = encoded.get(feature.identifier)
                if out is None:
                    out = encoded[feature.identifier] = encode(feature)
                a, b = lo - feature.offset, hi - feature.offset          # the item's own positions
                if feature.is_embed is None:
                    positions, taken, rows_from = np.arange(a, b), b - a, a
                else:
                    positions = np.flatnonzero(feature.is_embed[a:b]) + a
                    taken, rows_from = len(positions), int(feature.is_embed[:a].sum())
                if taken:
                    index.append(positions - a + (lo - first) + offset)
                    rows.append(out[rows_from:rows_from + taken])
            offset += count
        if not index:
            return None
        return np.concatenate(index), rows

    def image_spans(self, slots: np.ndarray, start: np.ndarray, n: np.ndarray,
                    cu: np.ndarray) -> tuple[tuple[int, int, int, int, int], ...]:
        """A prefix LM's images in a pass over tokens ``start .. start + n`` of the requests in
        ``slots`` (``cu``: where each request's tokens start in the pass): per image whose
        positions the pass computes, (request, the pass's row of its first such position, that
        position, the image's first and end positions) (``AttentionMetadata.mm_prefix_spans``).
        ValueError for an image the pass cuts (its later positions in a later pass)."""
        spans = []
        for r, i in enumerate(slots.tolist()):
            features = self.states[i].mm_features
            if not features:
                continue
            first, end = int(start[r]), int(start[r] + n[r])
            for feature in features:
                lo_img, hi_img = feature.embed_span
                lo = max(lo_img, first)
                if lo >= min(hi_img, end):
                    continue
                if hi_img > end:
                    raise ValueError(f"request {self.states[i].req_id!r}: an image of a prefix LM was cut at position "
                                     f"{end} (it ends at {hi_img}); its positions attend to each other in one step")
                spans.append((r, int(cu[r]) + lo - first, lo, lo_img, hi_img))
        return tuple(spans)

    def output_token_ids(self, i: int) -> list[int]:
        return self.token_ids[i, self.num_prompt_tokens[i]:self.num_tokens[i]].tolist()

    def prompt_token_ids(self, i: int) -> list[int]:
        return self.token_ids[i, :self.num_prompt_tokens[i]].tolist()
