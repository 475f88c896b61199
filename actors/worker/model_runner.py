"""ModelRunner: the worker's persistent batch, input preparation, forward pass and sampling.

The scheduler sends full data for a request once (``new_reqs``) and diffs afterwards
(``cached_reqs``: new block ids, computed-token counts). The runner keeps each request's
tokens and blocks, appends what it samples, and drops requests listed as finished.
Pure: no asyncio, no transport.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kernels.attention import allocate_kv_caches
from kernels.attention.base import AttentionMetadata
from models.config import ModelConfig
from models.sampler import Sampler, SamplingMetadata
from transport.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]                 # prompt + output so far
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None


class StepInputs(NamedTuple):
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # (S,) int64: last token of each request that samples
    sampling_rows: list[int]       # batch row of each of those S requests


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()

    # -- 1) apply the scheduler's diffs to the persistent batch ------------------------------
    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for r in so.new_reqs:
            p = r.sampling_params
            gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            self.requests[r.req_id] = CachedRequestState(
                r.req_id, list(r.prompt_token_ids) + list(r.output_token_ids), list(r.block_ids),
                r.num_computed_tokens, p, gen)
        c = so.cached_reqs
        for rid, blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests.get(rid)
            if st is None:
                raise KeyError(f"step {so.step} updates request {rid!r}, which this worker does not hold")
            st.block_ids.extend(blocks)
            st.num_computed_tokens = computed

    # -- 2) inputs for the forward pass ---------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(states))
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        cu = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        num_tokens = int(cu[-1])
        row = np.repeat(np.arange(len(states)), n)                         # (T,)
        positions = np.arange(num_tokens) - cu[:-1][row] + start[row]      # (T,)
        input_ids = np.fromiter(
            (t for s, a, k in zip(states, start, n) for t in s.token_ids[a:a + k]),
            dtype=np.int64, count=num_tokens)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)  # padding -> null block
        for i, s in enumerate(states):
            block_table[i, :len(s.block_ids)] = s.block_ids
        slot_mapping = block_table[row, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start + n
        done = seq_lens == np.fromiter((len(s.token_ids) for s in states), dtype=np.int64,
                                       count=len(states))
        rows = np.flatnonzero(done)
        meta = AttentionMetadata(
            num_reqs=len(states), num_tokens=num_tokens, max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=torch.from_numpy(slot_mapping), block_size=bs)
        return StepInputs(torch.from_numpy(input_ids), torch.from_numpy(positions), meta,
                          torch.from_numpy(cu[1:][rows] - 1), rows.tolist())

    # -- 3) forward, sample, record -----------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled_ids: list[list[int]] = [[] for _ in req_ids]
        if not req_ids:
            return ModelRunnerOutput(req_ids, sampled_ids)
        inputs = self.prepare_inputs(so)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        for rid, k in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += k
        if inputs.sampling_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])   # (S, vocab)
            states = [self.requests[req_ids[i]] for i in inputs.sampling_rows]
            tokens = self.sampler(logits, sampling_metadata(states)).tolist()
            for i, st, tok in zip(inputs.sampling_rows, states, tokens):
                st.token_ids.append(tok)
                sampled_ids[i] = [tok]
        return ModelRunnerOutput(req_ids, sampled_ids)


def sampling_metadata(states: list[CachedRequestState]) -> SamplingMetadata:
    ps = [s.params for s in states]
    return SamplingMetadata.from_lists(
        temperature=[p.temperature for p in ps], top_p=[p.top_p for p in ps],
        top_k=[p.top_k for p in ps], generators=[s.generator for s in states])
