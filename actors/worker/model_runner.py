"""ModelRunner: applies the scheduler's diffs to the persistent batch, prepares a step's inputs,
runs the model, samples, and reports log-probs. Pure: no asyncio, no transport.

The scheduler sends full data for a request once (``new_reqs``) and diffs afterwards
(``cached_reqs``: new block ids, computed-token counts); the runner appends what it samples.

Inputs are always prepared on the CPU (numpy over the persistent batch). On CUDA they are copied
to the device: uniform decode steps through the padded buffers of ``CudaGraphRunner`` (a graph
replay once captured), every other step as plain tensors for an eager forward. On the CPU the
step runs on the prepared tensors directly, unless ``cudagraph_sizes`` asks for the padded path
(tests use it to check padding without a GPU).

When the step's requests share a long prefix in the same blocks, the metadata carries its length
for cascade attention (kernels/attention/cascade.py; off with ``--disable-cascade-attn``, and for
models with a sliding window or a backend without it); such a step runs eagerly.

Speculative decoding (``config.speculative``, n-gram): a request's draft tokens, named by the
scheduler's ``scheduled_spec_decode_tokens``, are the last of its scheduled tokens; they are
written into the batch's token matrix past its tokens, and the logits of its k draft positions and
of the position after them (the bonus) go to the rejection sampler, which emits 1 .. k + 1 tokens;
first, every verified position goes through the logits processors as decoding it would (penalties
over the tokens so far and the drafts before it, bad words, min_tokens, logit bias, allowed ids,
and its own row of the grammar bitmask: the scheduler sends k + 1 rows for such a request).
Requests without drafts in the step sample with the plain Sampler (all its processors, log-probs,
grammar bitmasks). Emitted tokens are appended; the computed-token count goes back by the drafts
rejected (the scheduler does the same and sends it with the next step). Then the n-gram proposer
drafts the next step's tokens of every request that sampled and accepts drafts
(``accepts_drafts``), and they go back in ``ModelRunnerOutput.spec_token_ids``. With a draft model
(methods draft_model, self_draft) the draft model does so instead (actors/spec_decode/draft_model.py),
its KV cache in views of the same blocks (the config's KV cache specs list its layers after the
target's). A step with drafts has several queries per request and runs eagerly.

Plugins' batch-level logits processors (models/logits_processors.py; --logits-processors and
``troupe.logits_processors`` entry points) follow the batch's slots: told of each step's added and
removed requests before sampling, applied by the Sampler to the rows that sample (bound to their
slots), their output lists extended with what is emitted. A request that one of them may change
decodes without drafts (``LogitsProcessors.accepts_drafts``).

LoRA (``--enable-lora``: the worker wrapped the model's projections, ``model.lora_manager``):
before each forward the manager makes the step's adapters resident in the layers' slots and maps
every token to its request's slot (-1: the base model); a uniform decode step with adapters
replays the decode graph captured with LoRA (``BatchDescriptor.has_lora``).

Pipeline parallelism (``link``: this stage's neighbours, models/pipeline_parallel.py): the KV
cache holds the stage's layers only; a stage after the first receives the previous stage's
intermediate tensors instead of embedding the tokens, a stage before the last sends its own on
and returns no tokens (it learns the sampled ones from the scheduler's ``new_token_ids``, and
computes a step's draft tokens with the others); the last stage samples, verifies drafts and
proposes the next ones as above, a draft model running whole on it (its KV cache beside the
stage's layers, in views of the same blocks).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from actors.engine.config import EngineConfig
from actors.engine.messages import Logprobs, ModelRunnerOutput, MultiModalFeature, SchedulerOutput
from actors.kv_manager.kv_cache_spec import (create_kv_cache_views, create_state_views, layer_groups, stage_groups,
                                             layers_without_kv)
from actors.worker.cuda_graphs import CudaGraphRunner
from actors.worker.pooler import Pooler, dense_projector
from actors.worker.input_batch import InputBatch
from actors.worker.platforms import platform_for
from kernels.attention.base import AttentionMetadata
from kernels.attention.cascade import cascade_prefix_len
from kernels.attention.fp8 import FP8_NAMES
from models.layers import bind_kv_cache_groups, first_attention, kv_layer_hooks
from models.lora import InvalidAdapter
from models.pipeline_parallel import StageLink
from actors.spec_decode.draft_model import DraftModelProposer
from actors.spec_decode.ngram import NgramProposer
from models.logits_processors import (ThinkingBudgetProcessor, build_logits_processors,
                                     load_logits_processor_classes)
from models.rejection_sampler import RejectionSampler, SpecDecodeMetadata, rewind_generators
from models.watermark import Watermarker, contexts_of
from models.sampler import (LogprobsTensors, Sampler, SamplingMetadata, apply_logits_processors,
                            compute_prompt_logprobs, score_prompt_token_ids)

log = logging.getLogger("troupe.worker")


def torch_dtype(name: str) -> torch.dtype:
    """A resolved config's dtype name ("float32", "bfloat16", "float16", and for the KV cache
    "fp8_e4m3", "fp8_e5m2") as torch's."""
    return FP8_NAMES[name] if name in FP8_NAMES else getattr(torch, name)


def _rows(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A pass's embedding rows as one (k, width) float32 tensor: pieces narrower than the widest
    (a prompt's embeddings beside an image's with its DeepStack features) padded with zeros,
    which add nothing."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([torch.nn.functional.pad(p.to(device, torch.float32), (0, width - p.shape[1]))
                      for p in pieces])


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) for each pair (vectorized)."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


class StepInputs(NamedTuple):
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64; M-RoPE's (3, T) where a pass holds image positions
    meta: AttentionMetadata
    slots: np.ndarray              # (B,) batch slot of each scheduled request, in order
    sample_rows: np.ndarray        # (S,) rows of the requests that sample this step
    logits_indices: torch.Tensor   # (S + N,) int64: per sampling row, its k drafts' positions and its last
    num_draft_tokens: np.ndarray | None = None   # (S,) k of each sampling row (None: no drafts in the step)
    # prompt positions given as embeddings: their indices among the step's tokens (k,) and their
    # rows (k, hidden) (None: none in the step)
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    """Runs steps of ``model`` with the KV cache a resolved ``config`` sizes, on its device.
    ``cudagraph_sizes``: the decode batch sizes to capture (CUDA), or to pad to (tests)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig,
                 cudagraph_sizes: list[int] | None = None, draft_model: torch.nn.Module | None = None,
                 link: StageLink | None = None) -> None:
        if not config.resolved:
            raise ValueError("the model runner needs a resolved config (EngineConfig.resolve)")
        self.model = model
        self.config = config
        self.arch = config.model.arch
        self.block_size = bs = config.cache.block_size
        self.device = torch.device(config.device.device)
        kv_dtype = torch_dtype(config.cache.cache_dtype)
        # the target's layers, then a draft model's; with tensor parallelism, this rank's KV heads
        attention = first_attention(model) if config.parallel.tensor_parallel_size > 1 else None
        local = attention.num_kv_heads if attention is not None else None     # an encoder has no KV cache layers
        specs = config.kv_cache_specs(local)
        groups = config.kv_cache_groups()
        self.num_kv_cache_groups = G = len(groups)
        L = self.arch.num_layers
        group_of = layer_groups(groups, len(specs), layers_without_kv(specs))
        self.link = link
        self.samples = link is None or link.next_rank is None       # the last pipeline stage, or the only one
        if link is None:
            views = create_kv_cache_views(specs, config.cache.num_blocks, kv_dtype, self.device, groups)
            self.kv_caches, self.draft_kv_caches = views[:L], views[L:]
            bind_kv_cache_groups(model, [g for g in group_of[:L] if g >= 0])
        else:                  # a pipeline stage: its layers' caches only (the last: and the draft model's)
            start, end = model.start_layer, model.end_layer
            last = len(specs) if self.samples else end
            views = create_kv_cache_views(specs, config.cache.num_blocks, kv_dtype, self.device,
                                          stage_groups(groups, start, last), range(start, last))
            self.kv_caches, self.draft_kv_caches = views[:end - start], views[end - start:]
            bind_kv_cache_groups(model, [g for g in group_of[start:end] if g >= 0])
        if self.arch.mamba is not None:     # a state-space layer's cache: its requests' recurrent states
            start = model.start_layer if link is not None else 0
            states = create_state_views(self.arch, config.scheduler.max_num_seqs, torch_dtype(config.model.dtype),
                                        self.device)
            self.kv_caches = [states.get(start + i, view) for i, view in enumerate(self.kv_caches)]
            per_slot = sum(t[0].numel() * t.element_size() for pair in states.values() for t in pair)
            log.info("recurrent states of %d Mamba layers: %d slots of %.2f MiB (taken as requests first write them)",
                     len(states), config.scheduler.max_num_seqs, per_slot / 2**20)
        max_model_len = config.model.max_model_len
        mrope_images = bool(self.arch.mrope_section) and self.arch.image_token_id is not None
        mrope_merge = self.arch.image_merge_size if mrope_images else 0
        self.batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, bs, self.arch.vocab_size, self.device, G,
                                mrope_merge, self.arch.video_tokens_per_second)
        self.sampler = Sampler()
        # plugins' batch-level logits processors, and the built-in thinking budget where the engine
        # knows the model's reasoning tags (None: none of them)
        classes = load_logits_processor_classes(config.model.logits_processors)
        if config.model.reasoning is not None and config.model.reasoning.resolved:
            classes.append(ThinkingBudgetProcessor)
        self.logitsprocs = build_logits_processors(classes, config, self.device,
                                                   platform_for(self.device.type).pin_memory)
        self._meta_cache: tuple | None = None     # (row states' ids, SamplingMetadata, the states)
        # --watermark-config: the keyed uniforms of the rows it watermarks (None: off)
        self.watermarker = Watermarker(config.watermark) if config.watermark is not None else None
        spec = config.speculative
        # L + k + 1 <= max_model_len: the drafts and the token after them fit the context
        self.proposer = (NgramProposer.from_config(spec, max_model_len - 1)
                         if spec is not None and spec.method == "ngram" else None)
        self.drafter = None
        if draft_model is not None:
            if spec is None or spec.method == "ngram" or not self.draft_kv_caches:
                raise ValueError("a draft model needs a config with speculative method draft_model or self_draft")
            bind_kv_cache_groups(draft_model, group_of[L:])
            self.drafter = DraftModelProposer(draft_model, self.draft_kv_caches, spec.num_speculative_tokens,
                                              config.scheduler.max_num_seqs, max_model_len, self.device)
        self.rejection_sampler = RejectionSampler()
        self.graphs = (CudaGraphRunner(model, self.kv_caches, cudagraph_sizes, max_model_len, bs,
                                       self.device, G) if cudagraph_sizes else None)
        self._first_attn = first_attention(model)   # its calculate_kv_scales: the next step runs eagerly
        backend = getattr(self._first_attn, "backend", None)
        self.cascade = (not config.model.disable_cascade_attn and getattr(backend, "supports_cascade", False)
                        and self.arch.max_sliding_window is None)
        self.cascade_min_prefix = getattr(backend, "cascade_min_prefix", 0)
        self.lora = getattr(model, "lora_manager", None)   # actors/worker/lora_manager.py, with --enable-lora
        self.encoder_failures: dict[str, str] = {}     # this step's images whose encoding failed: why
        # the encoder cache: images' embeddings by identifier, kept as the scheduler says
        # (SchedulerOutput.scheduled_encoder_inputs, free_encoder_mm_hashes)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # a KV connector whose hooks this step's forward calls in every attention layer (the
        # worker sets it per step: KVConnectorBase.has_layer_work); such a step runs eagerly
        self.kv_layer_hooks = None
        # --runner pooling: every request pools its prompt's hidden states, none samples
        pooling = config.model.pooling
        self.pooler = None if pooling is None else Pooler(
            getattr(model, "score", None), pooling.activation, pooling.pooler.logit_mean, pooling.pooler.logit_sigma,
            dense_projector(pooling.dense), step_after_head=pooling.score_mlp,
            sparse=getattr(model, "sparse_head", None), token_heads=pooling.token_heads)

    def capture_cudagraphs(self) -> float:
        """Capture the decode graphs (CUDA only, after the KV cache exists). Returns seconds."""
        if self.graphs is None:
            raise RuntimeError("this runner was built without cudagraph_sizes")
        return self.graphs.capture()

    # -- 1) the scheduler's diffs ------------------------------------------------------------
    def update_states(self, so: SchedulerOutput) -> None:
        b, procs = self.batch, self.logitsprocs
        if so.reset_encoder_cache:
            self.encoder_cache.clear()
        for ident in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(ident, None)
        if self.watermarker is not None:
            self.watermarker.forget(so.finished_req_ids)
        if self.pooler is not None:
            self.pooler.forget(so.finished_req_ids)
        for rid in so.finished_req_ids:
            if procs is not None and rid in b:
                procs.remove(b.slot(rid))
            b.remove(rid)
        for r in so.new_reqs:
            i = b.add(r)
            if procs is not None:
                procs.add(i, r.sampling_params, r.prompt_token_ids, r.output_token_ids)
                b.accepts_drafts[i] &= procs.accepts_drafts(r.sampling_params)
            if self.drafter is not None:
                self.drafter.add(i, r.num_computed_tokens)
        c = so.cached_reqs
        for rid, blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            i = b.slot(rid)
            b.append_blocks(i, blocks)
            b.num_computed_tokens[i] = computed
        if not self.samples:           # a pipeline stage that did not sample its requests' newest tokens
            for rid, computed, tokens in zip(c.req_ids, c.num_computed_tokens, c.new_token_ids):
                b.write_tokens(b.slot(rid), computed, tokens)

    # -- 2) the step's inputs ----------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b, bs = self.batch, self.block_size
        slots = np.fromiter((b.slot(r) for r in so.num_scheduled_tokens), dtype=np.int64,
                            count=len(so.num_scheduled_tokens))
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(slots))
        start = b.num_computed_tokens[slots]                                # (B,)
        drafts = so.scheduled_spec_decode_tokens
        num_drafts = np.zeros(len(slots), dtype=np.int64)                  # (B,)
        if drafts:
            for r, rid in enumerate(so.num_scheduled_tokens):
                d = drafts.get(rid)
                if d:
                    b.write_drafts(int(slots[r]), d)
                    num_drafts[r] = len(d)
        prefix_len = None
        if self.cascade:
            prefix_len = lambda tables, num_blocks: cascade_prefix_len(   # noqa: E731
                tables, num_blocks, start, n, bs, self.arch.num_heads, self.arch.num_kv_heads,
                min_prefix=self.cascade_min_prefix)
        ti = b.token_inputs(slots, start, n, prefix_len)
        cu = ti.query_start_loc
        if self.arch.mm_prefix_lm and b.num_with_embeds:     # images that attend to themselves both ways
            spans = b.image_spans(slots, start, n, cu)
            if spans:
                ti = ti._replace(meta=dataclasses.replace(ti.meta, mm_prefix_spans=spans))
        sample_rows = np.flatnonzero(start + n - num_drafts == b.num_tokens[slots])   # prompt complete
        input_ids = torch.from_numpy(ti.input_ids)
        positions = torch.from_numpy(b.rope_positions(slots, ti.positions, cu))     # M-RoPE's with images
        if self.pooler is not None and self.arch.type_vocab_size > 1:
            input_ids = self._with_token_types(input_ids, torch.from_numpy(ti.positions), slots, cu)
        first_stage = self.link is None or self.link.prev_rank is None
        if first_stage and so.scheduled_encoder_inputs:
            self._encode_scheduled(so.scheduled_encoder_inputs)
        given = b.embeds_inputs(slots, start, n, self._embeddings if first_stage else None)
        embeds = None if given is None else (torch.from_numpy(given[0]), _rows(given[1], self.device))
        if not drafts:
            return StepInputs(input_ids, positions, ti.meta, slots, sample_rows, torch.from_numpy(cu[1:][sample_rows] - 1),
                              embeds=embeds)
        k = num_drafts[sample_rows]                                         # (S,)
        logits_indices = ranges(cu[1:][sample_rows] - 1 - k, k + 1)         # (S + N,)
        return StepInputs(input_ids, positions, ti.meta, slots, sample_rows, torch.from_numpy(logits_indices), k,
                          embeds)

    def _encode_scheduled(self, scheduled: dict[str, list[int]]) -> None:
        """The images the scheduler has this step encode, into the encoder cache."""
        for rid, indices in scheduled.items():
            features = self.batch.states[self.batch.slot(rid)].mm_features
            for k in indices:
                self._embeddings(features[k])

    def _embeddings(self, feature: MultiModalFeature) -> torch.Tensor:
        """An image's embeddings from the encoder cache, encoded (and kept) where they are not
        there: the step the scheduler encodes it in, or a later one after a reset (a failed
        encoding is not kept: another request with the image tries again)."""
        out = self.encoder_cache.get(feature.identifier)
        if out is None and feature.identifier in self.encoder_failures:    # failed this step already
            return torch.zeros(feature.num_embeds, self.arch.hidden_size)
        if out is None:
            out = self._encode(feature)
            if feature.identifier not in self.encoder_failures:
                self.encoder_cache[feature.identifier] = out
        return out

    @torch.inference_mode()
    def _encode(self, feature: MultiModalFeature) -> torch.Tensor:
        """An image's embeddings (its embedding positions, hidden), by the model's encoder. An
        encoder that fails fails the requests holding the image, not the step: the reason is
        kept (``encoder_failures``, by identifier) and zeros stand in for the rows this step."""
        try:
            out = self.model.embed_multimodal(feature.modality, feature.data)
            if out.shape[0] != feature.num_embeds:
                raise ValueError(f"it made {out.shape[0]} embeddings for an item whose placeholders take "
                                 f"{feature.num_embeds}")
            return out
        except Exception as exc:       # noqa: BLE001 (any failure of one item's encoding is that item's)
            log.warning("the %s encoder failed on item %s: %s", feature.modality, feature.identifier[:12], exc)
            self.encoder_failures[feature.identifier] = f"the {feature.modality} encoder failed: {exc}"
            return torch.zeros(feature.num_embeds, self.arch.hidden_size)

    def _failed_by_encoder(self, req_ids: list[str], slots: np.ndarray) -> dict[str, str]:
        """The step's requests holding an image whose encoding failed, with the reason; the
        failures are forgotten (another request sending such an image tries again)."""
        failures, self.encoder_failures = self.encoder_failures, {}
        errors = {}
        for rid, i in zip(req_ids, slots.tolist()):
            for feature in self.batch.states[i].mm_features or ():
                if feature.identifier in failures:
                    errors[rid] = failures[feature.identifier]
        return errors

    def _with_token_types(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: np.ndarray,
                          cu: np.ndarray) -> torch.Tensor:
        """An encoder's token types packed into the step's token ids (models/bert.py, vLLM's
        packing): type 1 from each text pair's ``compressed_token_type_ids`` on, 0 elsewhere."""
        from models.bert import encode_token_types
        types = None
        for r, i in enumerate(slots.tolist()):
            start = self.batch.states[i].params.pooling.compressed_token_type_ids
            if start is None:
                continue
            if types is None:
                types = torch.zeros_like(input_ids)
            types[cu[r]:cu[r + 1]] = (positions[cu[r]:cu[r + 1]] >= start).to(types.dtype)
        return input_ids if types is None else encode_token_types(input_ids, types)

    # -- 3) forward, sample, record -----------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        if self.lora is not None:          # unloaded adapters leave their slot and the host cache
            for lora_id in so.removed_lora_ids:
                self.lora.remove_adapter(lora_id)
            for req in so.pinned_loras:
                try:
                    self.lora.pin_adapter(req)
                except InvalidAdapter as exc:   # its requests will fail with the reason; nothing to pin
                    log.warning("pin_lora: %s", exc)
        if self.logitsprocs is not None:
            self.logitsprocs.flush()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids, [[] for _ in req_ids], {}, {})
        if not req_ids:
            return out
        t_prepare = time.perf_counter()
        inp = self.prepare_inputs(so)
        if self.encoder_failures:         # the requests holding an image that could not be encoded
            out.errors = self._failed_by_encoder(req_ids, inp.slots)
        if self.lora is not None:          # each token's adapter slot, the step's adapters resident
            row_loras = [self.batch.states[i].lora_request for i in inp.slots.tolist()]
            self.lora.set_adapter_mapping(row_loras, np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64,
                                                                 count=len(req_ids)))
            if self.lora.failed:           # an adapter that could not be read fails its requests only
                out.errors = {**out.errors, **{rid: self.lora.failed[lr.lora_int_id]
                                               for rid, lr in zip(req_ids, row_loras)
                                               if lr is not None and lr.lora_int_id in self.lora.failed}}
        t0 = time.perf_counter()
        out.prepare_s = t0 - t_prepare
        hidden = self._forward(inp)                                                    # (T, hidden)
        b = self.batch
        b.num_computed_tokens[inp.slots] += np.fromiter(so.num_scheduled_tokens.values(),
                                                        dtype=np.int64, count=len(req_ids))
        if not self.samples:           # a pipeline stage before the last: its tensors to the next stage
            self.link.send(hidden)
            out.compute_s = time.perf_counter() - t0
            return out
        if self.pooler is not None:
            self._pool(so, inp, hidden, out)
            out.compute_s = time.perf_counter() - t0
            return out
        self._prompt_logprobs(so, inp, hidden, out)
        t_sample = time.perf_counter()
        if len(inp.sample_rows):
            logits = self.model.compute_logits(hidden[inp.logits_indices.to(self.device)])  # (S + N, vocab)
            if inp.num_draft_tokens is None:
                self._sample(so, req_ids, inp.sample_rows, inp.slots[inp.sample_rows], logits, out)
            else:
                self._sample_with_drafts(so, req_ids, inp, logits, out)
            if self.proposer is not None:
                self._propose(req_ids, inp.sample_rows, inp.slots[inp.sample_rows], out)
        if self.drafter is not None:
            self._draft(req_ids, inp, out)
        t_end = time.perf_counter()
        out.compute_s = t_end - t0                    # forward and sampling: model compute
        out.sample_s = t_end - t_sample
        return out

    def _pool(self, so: SchedulerOutput, inp: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Each request's chunk of hidden states to the pooler; the answers of those whose
        prompt this step completed."""
        b, cu = self.batch, inp.meta.query_start_loc.tolist()
        for row, (rid, n) in enumerate(so.num_scheduled_tokens.items()):
            i = int(inp.slots[row])
            params, start = b.states[i].params.pooling, int(b.num_computed_tokens[i]) - n
            pooled = self.pooler.add(rid, params, hidden[cu[row]:cu[row] + n], start, int(b.num_prompt_tokens[i]),
                                     b.token_ids[i, start:start + n] if self.pooler.needs_token_ids(params) else None)
            if pooled is not None:
                out.pooler_output[rid] = pooled

    def _sample(self, so: SchedulerOutput, req_ids: list[str], rows: np.ndarray, sample_slots: np.ndarray,
                logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """One token for each of ``rows`` (batch rows; ``sample_slots`` their slots) from its
        logits row (S, vocab), with the plain Sampler; appended and reported with its log-probs."""
        b = self.batch
        meta = self.sampling_metadata(sample_slots)
        if so.grammar_bitmask is not None:
            meta = dataclasses.replace(meta, grammar_bitmask=self._grammar_bitmask(so, req_ids, rows))
        if self.logitsprocs is not None:
            meta = dataclasses.replace(meta, logitsprocs=self.logitsprocs.bind(sample_slots))
        if self.watermarker is not None:
            meta = self._watermarked(meta, req_ids, rows, sample_slots, logits.shape[-1])
        result = self.sampler(logits, meta)
        tokens = result.sampled_token_ids.cpu().numpy()
        b.append_tokens(sample_slots, tokens)
        if self.logitsprocs is not None:
            self.logitsprocs.append_outputs(sample_slots, tokens[:, None].tolist())
        for row, tok in zip(rows.tolist(), tokens.tolist()):
            out.sampled_token_ids[row] = [tok]
        if result.supports is not None:
            for row, support in zip(rows.tolist(), result.supports):
                out.sampling_masks[req_ids[row]] = support
        if result.logprobs is not None:
            self._sample_logprobs(req_ids, rows, sample_slots, result.logprobs, out)

    def _watermarked(self, meta: SamplingMetadata, req_ids: list[str], rows: np.ndarray, slots: np.ndarray,
                     vocab_size: int) -> SamplingMetadata:
        """``meta`` with the watermark's uniforms for each row that samples with it: a request
        that did not opt out (watermarking false), that is not greedy, whose context is not a
        repeat (deduplicate_contexts)."""
        b, wm = self.batch, self.watermarker
        marked, contexts = [], []
        for j, (row, i) in enumerate(zip(rows.tolist(), slots.tolist())):
            params = b.states[i].params
            if params.watermarking is False or params.greedy:
                continue
            n = int(b.num_tokens[i])
            tokens = b.token_ids[i]
            if wm.skips(req_ids[row], tokens, n, int(b.num_prompt_tokens[i])):
                continue
            marked.append(j)
            contexts.append(contexts_of(tokens, [n], wm.s.context_width)[0])
        if not marked:
            return meta
        uniforms = wm.uniforms(torch.tensor(contexts, dtype=torch.int64, device=self.device), vocab_size)
        return dataclasses.replace(meta, watermark_uniforms=dict(zip(marked, uniforms)))

    def _sample_with_drafts(self, so: SchedulerOutput, req_ids: list[str], inp: StepInputs,
                            logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """logits (S + N, vocab): per sampling row, its k draft positions then its bonus position.
        Rows without drafts sample from their one row with the plain Sampler; the others go
        through the rejection sampler, and their rejected drafts are no longer computed."""
        b = self.batch
        k = inp.num_draft_tokens                                            # (S,)
        rows_per = k + 1
        last = np.cumsum(rows_per) - 1                                      # (S,) each row's bonus position
        plain = np.flatnonzero(k == 0)
        if len(plain):
            rows = inp.sample_rows[plain]
            self._sample(so, req_ids, rows, inp.slots[rows], logits[torch.from_numpy(last[plain]).to(self.device)],
                         out)
        spec = np.flatnonzero(k > 0)
        rows = inp.sample_rows[spec]
        slots = inp.slots[rows]
        idx = ranges(last[spec] - k[spec], rows_per[spec])                 # their draft and bonus rows
        drafts = [so.scheduled_spec_decode_tokens[req_ids[r]] for r in rows.tolist()]
        meta = self.sampling_metadata(slots)
        target = logits[torch.from_numpy(idx).to(self.device)]
        grammar = so.grammar_bitmask is not None and any(req_ids[r] in so.grammar_req_ids for r in rows.tolist())
        if grammar or not meta.no_logits_processors:       # per position, as decoding them one by one would
            target = target.to(torch.float32, copy=True)
            apply_logits_processors(target, self._position_metadata(so, [req_ids[r] for r in rows.tolist()],
                                                                    slots, drafts))
        emitted = RejectionSampler.parse_output(self.rejection_sampler(
            target, None, SpecDecodeMetadata.from_lists(drafts, self.device), meta))
        rewind_generators(self.rejection_sampler.generator_states, meta.generators, emitted)
        b.append_token_lists(slots, emitted)
        if self.logitsprocs is not None:
            self.logitsprocs.append_outputs(slots, emitted)
        b.num_computed_tokens[slots] -= k[spec] + 1 - np.fromiter(map(len, emitted), dtype=np.int64,
                                                                  count=len(emitted))
        for row, tokens in zip(rows.tolist(), emitted):
            out.sampled_token_ids[row] = tokens

    def _propose(self, req_ids: list[str], rows: np.ndarray, slots: np.ndarray, out: ModelRunnerOutput) -> None:
        """The next step's drafts of the requests that sampled (batch ``rows``, in ``slots``) and
        accept drafts."""
        b = self.batch
        takes = b.accepts_drafts[slots]
        rows, slots = rows[takes], slots[takes]
        if not len(slots):
            return
        n = b.num_tokens[slots]
        proposals = self.proposer.propose(b.token_ids[slots, :int(n.max())], n)
        for row, d, m in zip(rows.tolist(), proposals.draft_token_ids.tolist(), proposals.num_draft_tokens.tolist()):
            if m:
                out.spec_token_ids[req_ids[row]] = d[:m]

    def _draft(self, req_ids: list[str], inp: StepInputs, out: ModelRunnerOutput) -> None:
        """The draft model follows every scheduled request that accepts drafts up to the
        target's computed tokens (and the tokens just emitted), and drafts the next step's tokens
        of those that sampled."""
        b = self.batch
        rows = np.flatnonzero(b.accepts_drafts[inp.slots])
        if not len(rows):
            return
        slots = inp.slots[rows]
        sampled = np.isin(rows, inp.sample_rows)
        ends = b.num_computed_tokens[slots] + sampled       # a sampling row: its tokens (the last not yet computed)
        for r, d in zip(rows.tolist(), self.drafter.propose(b, slots, ends, sampled)):
            if d:
                out.spec_token_ids[req_ids[r]] = d

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states (T, hidden) of the step's tokens, on the model's device."""
        hooks = self.kv_layer_hooks
        if hooks is not None:
            with kv_layer_hooks(hooks):
                return self._forward_layers(inp)
        eager = self._first_attn is not None and self._first_attn.calculate_kv_scales   # layers set KV scales
        has_lora = self.lora is not None and self.lora.mapping.active    # the graph with LoRA deltas
        eager = eager or inp.embeds is not None or inp.positions.dim() == 2   # prompt embeddings, M-RoPE's rows
        desc = self.graphs.dispatch(inp.meta, has_lora) if self.graphs is not None and not eager else None
        if desc is not None:
            return self.graphs.run(desc, inp)                  # padded buffers, a graph on CUDA
        return self._forward_layers(inp)

    def _forward_layers(self, inp: StepInputs) -> torch.Tensor:
        """The step's forward through the model's own layers (no captured graph)."""
        # a pipeline stage after the first: the previous stage's tensors for the step's tokens
        stage_in = ({} if self.link is None or self.link.prev_rank is None
                    else {"intermediate": self.link.recv(len(inp.input_ids))})
        if inp.embeds is not None and not stage_in:          # the first stage: prompt embeddings in
            hidden = self.model.embed_input_ids(inp.input_ids.to(self.device))
            index, rows = inp.embeds
            index, width = index.to(self.device), hidden.shape[1]
            hidden[index] = rows[:, :width].to(self.device, hidden.dtype)
            stage_in = {"inputs_embeds": hidden}
            if rows.shape[1] > width:       # an image's DeepStack features beside its embeddings (Qwen3-VL's)
                stage_in["deepstack"] = (index, rows[:, width:].to(self.device, hidden.dtype)
                                         .unflatten(1, (-1, width)).transpose(0, 1))
        if self.device.type == "cpu":
            return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, **stage_in)
        to_dev = lambda t: t.to(self.device, non_blocking=True)    # noqa: E731 (pageable: copied at once)
        shared = {name: to_dev(getattr(inp.meta, name)) for name in ("query_start_loc", "seq_lens", "state_slots")}
        metas = [dataclasses.replace(m, **shared, block_table=to_dev(m.block_table),
                                     slot_mapping=to_dev(m.slot_mapping)) for m in inp.meta.groups or (inp.meta,)]
        meta = metas[0] if len(metas) == 1 else dataclasses.replace(metas[0], groups=tuple(metas))
        return self.model(to_dev(inp.input_ids), to_dev(inp.positions), self.kv_caches, meta, **stage_in)

    def sampling_metadata(self, slots: np.ndarray) -> SamplingMetadata:
        """The sampler's per-row tensors. Reused while the same requests sit in the same rows
        and no row's sampling reads its tokens so far: then nothing in it changes from step to
        step (seeded generators advance in place)."""
        b = self.batch
        rows = slots.tolist()
        states = [b.states[i] for i in rows]
        key = tuple(map(id, states))
        if self._meta_cache is not None and self._meta_cache[0] == key:
            return self._meta_cache[1]
        params = [s.params for s in states]
        meta = SamplingMetadata.from_params(
            params, [s.generator for s in states], eos_token_ids=self.arch.eos_token_ids,
            output_token_ids=lambda: [b.output_token_ids(i) for i in rows],
            prompt_token_ids=lambda: [b.prompt_token_ids(i) for i in rows],
            logprobs_mode=self.config.model.logprobs_mode, device=self.device)
        if self.config.model.return_sampling_mask:
            meta = dataclasses.replace(meta, return_supports=True)
        reusable = not SamplingMetadata.reads_output_tokens(params)
        self._meta_cache = (key, meta, states) if reusable else None   # states held: ids stay theirs
        return meta

    @staticmethod
    def _grammar_rows(so: SchedulerOutput) -> dict[str, int]:
        """Each constrained request's first row in the scheduler's bitmask (one row per request,
        one per verified position for a request with drafts)."""
        out, row = {}, 0
        for rid in so.grammar_req_ids:
            out[rid] = row
            row += 1 + len(so.scheduled_spec_decode_tokens.get(rid, ()))
        return out

    def _grammar_bitmask(self, so: SchedulerOutput, req_ids: list[str], sample_rows: np.ndarray) -> torch.Tensor:
        """(S, words) int32 for the rows that sample: the scheduler's row for each request with a
        grammar, every token allowed for the others."""
        rows = {req_ids[r]: j for j, r in enumerate(sample_rows.tolist())}
        mask = np.full((len(rows), so.grammar_bitmask.shape[1]), -1, dtype=np.int32)
        for rid, first in self._grammar_rows(so).items():
            if rid in rows:
                mask[rows[rid]] = so.grammar_bitmask[first]
        return torch.from_numpy(mask).to(self.device)

    def _position_metadata(self, so: SchedulerOutput, rids: list[str], slots: np.ndarray,
                           drafts: list[list[int]]) -> SamplingMetadata:
        """The logits processors' metadata for every verified position of requests with drafts:
        position i of a request sees its tokens so far and its first i drafts (penalties, bad
        words, min_tokens) and its grammar's row for that position."""
        b = self.batch
        counts = [len(d) + 1 for d in drafts]
        params = [b.states[i].params for i, n in zip(slots.tolist(), counts) for _ in range(n)]
        meta = SamplingMetadata.from_params(
            params, [None] * len(params), eos_token_ids=self.arch.eos_token_ids,
            output_token_ids=lambda: [b.output_token_ids(i) + d[:j] for i, d in zip(slots.tolist(), drafts)
                                      for j in range(len(d) + 1)],
            prompt_token_ids=lambda: [b.prompt_token_ids(i) for i, n in zip(slots.tolist(), counts)
                                      for _ in range(n)],
            logprobs_mode=self.config.model.logprobs_mode, device=self.device)
        if so.grammar_bitmask is None:
            return meta
        first = self._grammar_rows(so)
        mask = np.full((len(params), so.grammar_bitmask.shape[1]), -1, dtype=np.int32)
        row = 0
        for rid, n in zip(rids, counts):
            if rid in first:
                mask[row:row + n] = so.grammar_bitmask[first[rid]:first[rid] + n]
            row += n
        return dataclasses.replace(meta, grammar_bitmask=torch.from_numpy(mask).to(self.device))

    def _sample_logprobs(self, req_ids: list[str], rows: np.ndarray, slots: np.ndarray,
                         lp: LogprobsTensors, out: ModelRunnerOutput) -> None:
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        for j, (row, i) in enumerate(zip(rows.tolist(), slots.tolist())):
            k = self.batch.states[i].params.num_logprobs
            if k is not None:
                out.logprobs[req_ids[row]] = Logprobs([ids[j][:k + 1]], [vals[j][:k + 1]], [ranks[j]])

    def _prompt_logprobs(self, so: SchedulerOutput, inp: StepInputs, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        """Log-probs of the prompt tokens whose predecessors were computed in this step."""
        b = self.batch
        cu = inp.meta.query_start_loc.tolist()
        for row, (rid, n) in enumerate(so.num_scheduled_tokens.items()):
            i = int(inp.slots[row])
            params = b.states[i].params
            k, scored = params.prompt_logprobs, params.prompt_logprob_token_ids
            if k is None and scored is None:
                continue
            start = int(b.num_computed_tokens[i]) - n            # first position of this chunk
            stop = min(start + n, int(b.num_prompt_tokens[i]) - 1)   # predicts positions < prompt end
            first = params.prompt_logprob_start or 0             # vLLM's: rows from there are scored
            lo = start if k is not None else max(start, first)   # the rows whose logits are needed
            if stop <= lo:
                continue
            logits = self.model.compute_logits(hidden[cu[row] + lo - start:cu[row] + stop - start])
            if k is not None:
                targets = torch.from_numpy(b.token_ids[i, start + 1:stop + 1]).to(self.device)
                lp = compute_prompt_logprobs(logits, targets, k)
                out.prompt_logprobs[rid] = Logprobs(lp.token_ids.tolist(), lp.logprobs.tolist(),
                                                    lp.ranks.tolist())
            if scored is not None and stop > first:
                top = max(start, first)
                ids = torch.tensor(scored[top - first:stop - first], dtype=torch.long, device=self.device)
                out.prompt_token_id_logprobs[rid] = score_prompt_token_ids(logits[top - lo:], ids)
