"""The engine's request and step types: a request as it enters the engine core, the step the
scheduler sends the workers (``SchedulerOutput``) and what they answer (``ModelRunnerOutput``),
and what the engine core emits per step (``EngineCoreOutputs``). Hot paths carry one message
per engine step, never one per token. Each actor's own control messages sit at the top of its
file."""
from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import numpy as np

from actors.engine.lora import LoRARequest
from actors.engine.sampling_params import SamplingParams
from actors.kv_transfer.base import KVConnectorOutput
from transport.msg import Msg


# -- requests ----------------------------------------------------------------------------------

class MultiModalFeature(msgspec.Struct, array_like=True):
    """One multimodal item of a prompt (vLLM's MultiModalFeatureSpec): what the checkpoint's
    processor made of it, and the prompt positions its placeholder tokens span."""
    modality: str                       # "image"
    identifier: str                     # a digest of the item and its processing: prefix cache and encoder keys
    offset: int                         # its first placeholder position in the prompt
    length: int                         # the positions it spans
    data: dict[str, np.ndarray]         # the processor's outputs for it (pixel_values, ...), a batch of one
    # which of its positions take its embeddings, in order (None: all); the others (an image's
    # start and end markers) are plain tokens
    is_embed: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    @property
    def embed_span(self) -> tuple[int, int]:
        """The positions from its first embedding's to past its last (the markers around left out)."""
        if self.is_embed is None:
            return self.offset, self.end
        at = np.flatnonzero(self.is_embed)
        return self.offset + int(at[0]), self.offset + int(at[-1]) + 1


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: list[int] = []
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # vLLM's prompt_embeds (--enable-prompt-embeds): the prompt as input embeddings, (prompt tokens,
    # hidden) float32; prompt_token_ids then holds as many placeholders (0)
    prompt_embeds: np.ndarray | None = None
    # vLLM's: which API server sent it (--api-server-count): its outputs go back to that one
    client_index: int = 0
    mm_features: list[MultiModalFeature] | None = None   # its images, in prompt order (None: text)


# -- engine outputs (engine core -> frontend), one message per step ---------------------------

class Logprobs(msgspec.Struct, array_like=True):
    """Log-probs of consecutive positions: per position, the chosen token first, then the top
    alternatives, each with its log-prob; and the chosen token's rank (1 = most likely)."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def extend(self, other: Logprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None    # the stop token id that ended it, if any
    error: str | None = None
    logprobs: Logprobs | None = None        # one position per new token
    prompt_logprobs: Logprobs | None = None # the prompt positions computed in this step
    num_cached_tokens: int = 0              # prompt tokens served from the prefix cache
    # time.time() when the request was first scheduled (its queue time ends there); set at least
    # on the request's first output. 0.0 = not reported.
    first_scheduled_time: float = 0.0
    # vLLM's: on a finished request, what another instance needs to read its KV (a KV connector's)
    kv_transfer_params: dict[str, Any] | None = None
    num_external_tokens: int = 0            # prompt tokens whose KV was loaded from another instance
    error_status: int = 0                   # with error: the HTTP status it answers (0: 500)
    # --per-request-spec-decode-metrics: this step's verification of the request's drafts
    # (drafts scheduled, drafts accepted); None: no drafts verified (or the metrics are off)
    spec_step: tuple[int, int] | None = None
    # --collect-detailed-traces: the request's seconds so far in the model's forward passes and
    # in the workers' whole steps (each request of a step is charged the step's); None: off
    model_times: tuple[float, float] | None = None
    # vLLM's prompt_logprob_token_ids: the log-probs of the asked ids at the prompt rows scored in
    # this step, float32 (rows, ids); -inf where a row's id is -1 (padding)
    prompt_token_id_logprobs: np.ndarray | None = None
    # --return-sampling-mask: the support (token ids, int32) each new token was drawn from
    sampling_mask: list[np.ndarray] | None = None
    # a pooling request's answer, on its last output: float32, (dims,) or (prompt tokens, dims)
    pooling_output: np.ndarray | None = None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_reqs: int = 0          # requests served by this step (the batch size)
    num_scheduled_tokens: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0             # since start
    prefix_cache_queries: int = 0        # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0           # of those, tokens served from the cache
    prompt_tokens_computed: int = 0      # since start: prompt positions the steps computed (cache hits not)
    generation_tokens: int = 0           # since start: tokens the requests generated
    busy_seconds: float = 0.0            # since start: wall time of back-to-back step cycles
    compute_seconds: float = 0.0         # since start: of that, model forward and sampling
    # speculative decoding, since start: requests verified with drafts (once per step), draft
    # tokens verified, of those accepted, and accepted per draft position (0 = the first draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []
    # a KV connector's, since start: prompt tokens looked up remotely and loaded (vLLM's external
    # prefix cache), and the transfer counters (actors/kv_transfer/base.py TRANSFER_STATS)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_transfer: dict[str, float] = {}
    # --kv-cache-metrics, since the last stats: each sampled block evicted, as (lifetime, idle
    # before eviction, gaps between its last reuses) in seconds
    kv_cache_eviction_events: list[tuple[float, float, list[float]]] = []
    # --enable-mfu-metrics, since start: the steps' estimated FLOPs and bytes read and written per device
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0
    # images, since start: looked up in the workers' encoder cache, and found there
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


CALLABLE = "__callable__"        # WorkerRPC's method for a function (vLLM's collective_rpc of a callable)


class EngineCoreOutputs(Msg):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    engine_index: int = 0                # which engine core (data parallelism) sent them
    weight_version: str | None = None    # vLLM's: the version of the weights that sampled them


# -- engine core <-> worker ------------------------------------------------------------------

class NewRequestData(msgspec.Struct, array_like=True):
    """Everything a worker needs about a request it has not seen (or saw before a preemption)."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]       # per KV cache group, its block table (0: the null block)
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    prompt_embeds: np.ndarray | None = None   # a prompt given as embeddings (EngineCoreRequest's)
    mm_features: list[MultiModalFeature] | None = None   # its images (EngineCoreRequest's)


class CachedRequestData(msgspec.Struct, array_like=True):
    """Diffs for requests the worker already holds: blocks added (per KV cache group) and the
    computed-token count."""
    req_ids: list[str] = []
    new_block_ids: list[tuple[list[int], ...]] = []
    num_computed_tokens: list[int] = []
    # pipeline parallelism: each request's scheduled tokens (the stages before the last never
    # sampled the newest; empty without pipeline parallelism)
    new_token_ids: list[list[int]] = []


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]     # empty for a request whose prompt is not done yet
    logprobs: dict[str, Logprobs] = {}     # for requests that asked, their sampled tokens'
    prompt_logprobs: dict[str, Logprobs] = {}
    prompt_token_id_logprobs: dict[str, np.ndarray] = {}   # prompt_logprob_token_ids' scores, (rows, ids)
    sampling_masks: dict[str, np.ndarray] = {}   # --return-sampling-mask: a sampled token's support
    compute_s: float = 0.0                 # seconds of model forward and sampling in this step
    prepare_s: float = 0.0                 # of the step in the worker: input preparation
    sample_s: float = 0.0                  # logits and sampling (part of compute_s)
    worker_s: float = 0.0                  # the whole step in the worker's handler
    # speculative decoding: each request's draft tokens for its next step (none: no entry)
    spec_token_ids: dict[str, list[int]] = {}
    kv_connector_output: KVConnectorOutput | None = None   # transfers that ended (a KV connector's)
    errors: dict[str, str] = {}            # requests that failed in this step (their rows' outputs ignored): why
    # pooling requests whose prompt this step completed: what they pooled (float32, on the host)
    pooler_output: dict[str, np.ndarray] = {}


class SchedulerOutput(Msg):
    """One engine step for the workers. Requests appear in ``num_scheduled_tokens`` order."""
    reply_type: ClassVar[Any] = ModelRunnerOutput
    step: int
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]              # finished, aborted or preempted: drop their state
    # structured outputs: row i of the bitmask, (rows, ceil(vocab / 32)) int32, is the tokens
    # grammar_req_ids[i] may sample this step (bit j of word w allows token 32 w + j)
    grammar_req_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None
    prev_step: int = -1                      # the step the worker must have taken before this one (-1: none)
    # speculative decoding: each request's draft tokens scheduled after its own tokens (they are
    # among its num_scheduled_tokens, at the end); the worker samples 1 to len + 1 tokens for it
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # a KV connector's metadata for the worker's side (None: no connector); a step with no tokens
    # is still sent while transfers are under way, so the worker reports them
    kv_connector_metadata: bytes | None = None
    removed_lora_ids: list[int] = []         # unloaded adapters (lora_int_id): drop them before this step
    pinned_loras: list[LoRARequest] = []     # adapters to read now and evict last (vLLM's pin_lora)
    # images: per request, the mm_features (indices) the encoder makes embeddings of this step;
    # the images' identifiers whose embeddings the encoder cache drops before it (evicted), or
    # every one (reset_encoder_cache)
    scheduled_encoder_inputs: dict[str, list[int]] = {}
    free_encoder_mm_hashes: list[str] = []
    reset_encoder_cache: bool = False
