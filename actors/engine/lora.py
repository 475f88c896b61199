"""LoRA's engine-wide types, with vLLM's names: ``LoRARequest`` (which adapter a request runs
with: its name, a number unique to this loading of it, its PEFT directory), ``LoRAConfig``
(--enable-lora, --max-loras, --max-cpu-loras, --max-lora-rank and the --lora-modules served
from the start) and the parsing of ``--lora-modules``. Torch-free: the frontend and the engine
core import it."""
from __future__ import annotations

import json

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``. ``lora_int_id`` (> 0) tells
    two loadings of the same name apart: the worker caches adapters by it."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


class LoRAModulePath(msgspec.Struct, frozen=True):
    """One adapter of --lora-modules: ``name=path`` or vLLM's JSON object."""
    name: str
    path: str
    base_model_name: str | None = None


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_loras: int = 1                     # adapters one step may use (their slots in the layers)
    max_cpu_loras: int = 0                 # adapters the worker keeps loaded on the host; 0: max_loras
    max_lora_rank: int = 16                # the largest rank an adapter may have
    lora_modules: tuple[LoRAModulePath, ...] = ()   # loaded at start, as /v1/load_lora_adapter would

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules value: ``name=path``, or ``{"name": ..., "path": ...,
    "base_model_name": ...}`` as vLLM takes it."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return msgspec.convert(json.loads(text), LoRAModulePath)
        except (ValueError, msgspec.ValidationError) as exc:
            raise ValueError(f"--lora-modules {text!r}: {exc} (expected {{\"name\": ..., \"path\": ...}})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object with name and path")
    return LoRAModulePath(name, path)
