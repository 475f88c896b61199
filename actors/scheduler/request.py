"""A request inside the engine core: its tokens, how many are computed, its status, and the
hashes of its full blocks (extended as tokens arrive) for prefix caching."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from actors.kv_manager.block_hash import DEFAULT_HASHER, BlockHash, BlockHasher, extend_block_hashes
from actors.engine.lora import LoRARequest
from actors.engine.messages import EngineCoreRequest, MultiModalFeature
from actors.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()     # its prompt's KV loads from another instance
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after here is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()        # vLLM's repetition detection ended it

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    block_size: int = 0               # for block hashes; 0 = no hashing
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None   # its adapter (None: the base model)
    hasher: BlockHasher = DEFAULT_HASHER      # --prefix-caching-hash-algo's
    # a prompt given as embeddings (vLLM's prompt_embeds): (prompt tokens, hidden) float32; its
    # prompt_token_ids are then placeholders (0), hashed with the embeddings' digests
    prompt_embeds: np.ndarray | None = None
    mm_features: list[MultiModalFeature] | None = None   # its images: their digests join its blocks' hashes
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    # speculative decoding: draft tokens proposed for its next step, after its own tokens; never
    # part of all_token_ids (so never hashed nor cached) until the worker accepted them
    spec_token_ids: list[int] = field(default_factory=list)
    # tokens sampled by steps sent to the workers whose outputs have not come back yet (async
    # scheduling plans the next step on the assumption that each will be there)
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0        # prompt tokens served from the prefix cache at admission
    num_external_tokens: int = 0      # of those, loaded from another instance (a KV connector)
    num_preemptions: int = 0
    num_worker_failures: int = 0      # workers that died while it was running
    first_scheduled_time: float = 0.0  # time.time() when first scheduled: its queue time ends
    first_output_sent: bool = False
    stop_reason: int | str | None = None
    # --collect-detailed-traces: seconds in the model's forward passes and the workers' steps
    model_forward_s: float = 0.0
    model_execute_s: float = 0.0

    @property
    def kv_transfer_params(self) -> dict | None:
        """vLLM's: what the KV connector is told about this request (SamplingParams.extra_args)."""
        extra = self.sampling_params.extra_args
        return extra.get("kv_transfer_params") if extra else None

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @classmethod
    def from_engine_request(cls, r: EngineCoreRequest, block_size: int = 0,
                            hasher: BlockHasher = DEFAULT_HASHER) -> Request:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.arrival_time,
                   tuple(r.eos_token_ids), r.priority, block_size, r.cache_salt, r.lora_request, hasher,
                   prompt_embeds=r.prompt_embeds, mm_features=r.mm_features)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self.block_size:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size,
                                self.lora_request, self.cache_salt, self.hasher, self.prompt_embeds,
                                self.mm_features)
