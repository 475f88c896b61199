"""An architecture added by a plugin: a Llama checkpoint under another architecture name."""
from __future__ import annotations

from typing import ClassVar

from models.llama import LlamaForCausalLM


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    gguf_architectures: ClassVar[tuple[str, ...]] = ()     # Llama's GGUF files stay Llama's
