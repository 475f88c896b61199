"""Pipeline parallelism: a loaded model cut in place to one stage's part (chapter 8 of the book;
vLLM's ``PPMissingLayer`` and start/end layers), and the stage-to-stage hand-over of its
intermediate tensors through ``torch.distributed`` send/recv (gloo on the CPU, NCCL on GPUs).

A stage keeps the contiguous run of decoder layers ``models/pp_layout.py`` gives it; the others,
and what it does not run, become ``PPMissingLayer``: the first stage keeps the embedding, the
last the final norm and the LM head (sampling happens there only). A stage's forward takes the
previous stage's intermediate tensors (``intermediate_keys``: Llama's hidden states and residual
stream, Gemma 3's hidden states), each (tokens, hidden), and a stage before the last returns
them. Both ends know the step's token count, so only the tensors travel."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.pp_layout import pp_layers

IntermediateTensors = dict[str, torch.Tensor]


class PPMissingLayer(nn.Module):
    """A layer (or embedding, norm, LM head) another pipeline stage holds."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this layer belongs to another pipeline stage")


def split_stage(model: nn.Module, pp_size: int, pp_rank: int) -> nn.Module:
    """Cut ``model`` (weights loaded, before tensor-parallel sharding or packing) in place to
    stage ``pp_rank`` of ``pp_size``; returns it. ValueError for a model that cannot run as a
    stage (its forward does not take intermediate tensors)."""
    if pp_size == 1:
        return model
    if hasattr(model, "split_pipeline_stage"):       # a model that cuts itself (the transformers backend)
        model.split_pipeline_stage(pp_size, pp_rank)
        return model
    if not getattr(model, "intermediate_keys", ()) or not isinstance(getattr(model, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} does not support pipeline parallelism (its forward takes no "
                         "intermediate tensors)")
    start, end = pp_layers(len(model.layers), pp_size, pp_rank)
    if hasattr(model, "check_pipeline_stage"):       # a model whose layers need more than their inputs
        model.check_pipeline_stage(start, end)
    for i in range(len(model.layers)):
        if not start <= i < end:
            model.layers[i] = PPMissingLayer()
    if pp_rank > 0:
        model.embed_tokens = PPMissingLayer()
    if pp_rank < pp_size - 1:
        model.norm = PPMissingLayer()
        model.lm_head = PPMissingLayer()
    model.start_layer, model.end_layer = start, end
    return model


def stage_layers(model: nn.Module, kv_caches: list | None = None) -> nn.ModuleList:
    """The decoder layers this stage runs (all of them without pipeline parallelism); with
    ``kv_caches``, ValueError unless there is one per layer."""
    start, end = model.start_layer, model.end_layer
    layers = model.layers if (start, end) == (0, len(model.layers)) else model.layers[start:end]
    if kv_caches is not None and len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
    return layers


def is_last_stage(model: nn.Module) -> bool:
    return model.end_layer == len(model.layers)


class StageLink:
    """This stage's neighbours in the world group: the rank it receives intermediate tensors from
    (None for the first stage) and the rank it sends them to (None for the last)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, keys: tuple[str, ...], hidden_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.keys, self.hidden_size, self.dtype, self.device = keys, hidden_size, dtype, device
        self._sends: list[Any] = []          # the last step's sends, waited for before the next

    def recv(self, num_tokens: int) -> IntermediateTensors:
        out = {}
        for key in self.keys:
            t = torch.empty((num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
            torch.distributed.recv(t, src=self.prev_rank)
            out[key] = t
        return out

    def send(self, tensors: IntermediateTensors) -> None:
        """Sent without waiting for the next stage to take them (it may still run the step
        before); the buffers are kept until the next send."""
        self.wait()
        self._sends = [(t, torch.distributed.isend(t, dst=self.next_rank))
                       for t in (tensors[k].contiguous() for k in self.keys)]

    def wait(self) -> None:
        for _, work in self._sends:
            work.wait()
        self._sends = []
