"""LoRAModelManager: the worker's adapters (vLLM's two LRU caches). Adapters are read from their
PEFT directory the first time a step needs them and kept on the host, at most
``max_cpu_loras`` (the least recently used one goes first); the adapters a step uses are
activated into the layers' ``max_loras`` slots (``lora_index_to_id``), a free one or the least
recently used one not needed by the step. A pinned adapter (vLLM's ``pin_lora``) is read at
once and goes last from both: only when every other place is taken by the step's own adapters,
where vLLM would fail the step. The scheduler never puts more than ``max_loras``
adapters in a step, so every step finds its slots. An adapter that cannot be read when a step
needs it (its directory removed or its files corrupted since it was loaded) fails only its own
rows: they run without an adapter and ``failed`` names it, the model runner fails those
requests with that reason. Pure: no asyncio, no transport.

    _registered (host, LRU, max_cpu_loras)      lora_index_to_id (layer slots, max_loras)
    id 7 -> LoRAModel   (least recent)          slot 0: 9
    id 9 -> LoRAModel                           slot 1: 3      a step's token of id 9 reads slot 0
    id 3 -> LoRAModel   (most recent)           slot 2: None
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch
from torch import nn

from actors.engine.lora import LoRAConfig, LoRARequest
from models.config import ArchConfig
from models.lora import InvalidAdapter, load_adapter
from models.lora_layers import LoRAAwareDecode, LoRALinear, LoRAMapping, wrap_lora_modules
from models.registry import _compile_tensor_map, _lookup


class LoRAModel(NamedTuple):
    """An adapter on the host: per wrapped module, per slice, (A (r, in), s B (rows, r))."""
    id: int
    name: str
    weights: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]


class LoRAModelManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, arch: ArchConfig, device: torch.device) -> None:
        self.config, self.arch = config, arch
        self.mapping = LoRAMapping(device)
        self.modules: dict[str, LoRALinear] = wrap_lora_modules(model, config.max_loras, config.max_lora_rank,
                                                                self.mapping, device)
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no layers LoRA can adapt")
        self._names = _compile_tensor_map(model.hf_tensor_map)     # (the transformers backend's: its own)
        self._rows = model.hf_rows
        self._model_name = type(model).__name__
        # a pipeline stage's layers (models/pipeline_parallel.py): an adapter's others are other stages'
        self._stage = range(getattr(model, "start_layer", 0), getattr(model, "end_layer", 1 << 30))
        self._registered: OrderedDict[int, LoRAModel] = OrderedDict()
        self.lora_index_to_id: list[int | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict()   # slots, least recently used first
        self.pinned: set[int] = set()        # adapters evicted last (pin_adapter)
        self.failed: dict[int, str] = {}     # the last step's adapters that could not be read: id -> why
        if getattr(model, "native_decode", None) is not None:     # LoRA steps through it too
            model.native_decode = LoRAAwareDecode(model.native_decode, self.mapping,
                                                  LoRAAwareDecode.lora_words(model.layers, self.modules))
        model.lora_manager = self

    # -- the host cache ----------------------------------------------------------------------
    def add_adapter(self, req: LoRARequest, keep: frozenset[int] = frozenset()) -> LoRAModel:
        """The adapter of ``req``, read from its directory unless already on the host; makes room
        by dropping the least recently used adapter not in ``keep`` (an unpinned one first)."""
        lora = self._registered.get(req.lora_int_id)
        if lora is not None:
            self._registered.move_to_end(req.lora_int_id)
            return lora
        try:
            weights = self._map_weights(load_adapter(req.lora_path, self.arch, self.config.max_lora_rank))
        except Exception as exc:        # noqa: BLE001 - any reason the files cannot be read
            raise InvalidAdapter(f"LoRA adapter {req.lora_name!r} could not be loaded from {req.lora_path}: "
                                 f"{exc}") from exc
        lora = LoRAModel(req.lora_int_id, req.lora_name, weights)
        while len(self._registered) >= self.config.cpu_capacity:
            victim = self._least_recent(self._registered, lambda i: i not in keep)
            if victim is None:
                raise RuntimeError(f"no room for adapter {req.lora_name!r}: {len(keep)} adapters in one step, "
                                   f"max_cpu_loras is {self.config.cpu_capacity}")
            self.remove_adapter(victim)
        self._registered[lora.id] = lora
        return lora

    def pin_adapter(self, req: LoRARequest) -> None:
        """Read ``req``'s adapter onto the host now (InvalidAdapter when it cannot be) and evict it
        last from the host cache and from the layer slots."""
        self.add_adapter(req)
        self.pinned.add(req.lora_int_id)

    def _least_recent(self, order: Iterable[int], candidate: Callable[[int], bool],
                      adapter: Callable[[int], int | None] = lambda i: i) -> int | None:
        """The first key of ``order`` (least recently used first) that ``candidate`` allows, one
        whose adapter (``adapter`` of the key) is not pinned before any that is."""
        allowed = [i for i in order if candidate(i)]
        return next((i for i in allowed if adapter(i) not in self.pinned), allowed[0] if allowed else None)

    def remove_adapter(self, lora_id: int) -> bool:
        """Drop an adapter from the host and from its slot, if it has one."""
        self.pinned.discard(lora_id)
        if self._registered.pop(lora_id, None) is None:
            return False
        if lora_id in self.lora_index_to_id:
            self._deactivate(self.lora_index_to_id.index(lora_id))
        return True

    def _map_weights(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                     ) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Hugging Face module names onto the wrapped (fused) modules and their slices, through
        the model's tensor map (the same for a model loaded from GGUF)."""
        out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, ab in weights.items():
            param, shard = _lookup(self._names, f"{module}.weight", self._model_name)
            target = param.removesuffix(".weight")
            layer = target.split(".")[1] if target.startswith("layers.") else ""
            if target not in self.modules and layer.isdigit() and int(layer) not in self._stage:
                continue                        # held by another pipeline stage, which applies it
            if target not in self.modules:
                raise ValueError(f"adapter module {module} maps to {target}, which has no LoRA slots")
            a, b = ab                           # B's rows in the order the model holds the module's (GLM's q, k)
            out.setdefault(target, {})[shard or ""] = (a, self._rows(f"{module}.weight", b))
        return out

    # -- the layer slots ---------------------------------------------------------------------
    def activate_adapter(self, lora_id: int, keep: frozenset[int]) -> int:
        """The slot holding adapter ``lora_id`` (registered), copied into one if needed: a free
        slot, else the least recently used one whose adapter is not in ``keep``."""
        if lora_id in self.lora_index_to_id:
            slot = self.lora_index_to_id.index(lora_id)
        else:
            free = [i for i, x in enumerate(self.lora_index_to_id) if x is None]
            slot = free[0] if free else self._least_recent(
                self._slot_lru, lambda i: self.lora_index_to_id[i] not in keep, lambda i: self.lora_index_to_id[i])
            if slot is None:
                raise RuntimeError(f"no free LoRA slot: a step uses more than max_loras "
                                   f"({self.config.max_loras}) adapters")
            weights = self._registered[lora_id].weights
            for name, module in self.modules.items():
                if name in weights:
                    module.set_lora(slot, weights[name])
                else:
                    module.reset_lora(slot)
            self.lora_index_to_id[slot] = lora_id
        self._slot_lru[slot] = None
        self._slot_lru.move_to_end(slot)
        return slot

    def _deactivate(self, slot: int) -> None:
        for module in self.modules.values():
            module.reset_lora(slot)
        self.lora_index_to_id[slot] = None
        self._slot_lru.pop(slot, None)

    # -- a step ------------------------------------------------------------------------------
    def set_adapter_mapping(self, row_requests: list[LoRARequest | None], num_tokens: np.ndarray) -> bool:
        """Make the step's adapters resident and map its tokens to their slots: row r (with
        ``num_tokens[r]`` tokens) runs with ``row_requests[r]`` (None: the base model).
        An adapter that cannot be read is left out: its rows run without one and ``failed``
        says why. Returns whether any token has an adapter."""
        self.failed = {}
        ids = {r.lora_int_id: r for r in row_requests if r is not None}
        if len(ids) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(ids)} adapters; max_loras is {self.config.max_loras}")
        keep = frozenset(ids)
        for req in list(ids.values()):
            try:
                self.add_adapter(req, keep)
            except InvalidAdapter as exc:
                self.failed[req.lora_int_id] = str(exc)
                del ids[req.lora_int_id]
        if not ids:
            self.mapping.clear()
            return False
        slot_of = {i: self.activate_adapter(i, keep) for i in ids}
        row_slots = np.fromiter((-1 if r is None or r.lora_int_id not in ids else slot_of[r.lora_int_id]
                                 for r in row_requests),
                                dtype=np.int64, count=len(row_requests))
        self.mapping.set(np.repeat(row_slots, num_tokens))
        return True
