"""The worker's side of --compilation-config: the layers' custom ops on or off, and at levels 2
and 3 torch.compile (inductor) of every decoder layer with dynamic token counts. The attention
call (models/layers.py ``attention``) is never traced, so each layer compiles into the pieces
before and after its attention. Inductor's artifacts go to a folder keyed by a hash of the
model's architecture, the compilation config, torch's version and the model and kernel code, so
a second start with the same model and code reuses them instead of compiling C++ again."""
from __future__ import annotations

import glob
import hashlib
import logging
import os

import torch
from torch import nn

from actors.engine.compilation import CompilationConfig
from kernels.cpu import fused
from models.layers import set_custom_ops, split_at_attention

log = logging.getLogger("troupe.worker")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = ("models/*.py", "models/quantization/*.py", "kernels/cpu/*.py", "kernels/cpu/*.c", "kernels/attention/*.py",
        "kernels/triton/*.py", "actors/worker/compilation.py")


def packs_linears(compilation: CompilationConfig, quantization: str | None) -> bool:
    """Whether the CPU's linear layers are packed for the native matmuls: at level 1, and
    whenever quantized (the quantized weights exist only as panels; at levels 2 and 3 they run
    as the custom op torch.ops.troupe.cpu_panel_matmul inside the compiled graphs). Float32
    weights at levels 2 and 3 stay torch's, for inductor to plan around."""
    return compilation.level == 1 or quantization is not None


def cache_dir(compilation: CompilationConfig, arch_repr: str) -> str:
    """The folder of this model's compiled artifacts (see the module docstring)."""
    h = hashlib.sha256(f"{arch_repr}|{compilation!r}|{torch.__version__}".encode())
    for pattern in CODE:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            with open(path, "rb") as f:
                h.update(f.read())
    root = compilation.cache_dir or os.path.join(os.environ.get("TROUPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "troupe"), "compile")
    return os.path.join(root, h.hexdigest()[:16])


def apply_compilation(model: nn.Module, compilation: CompilationConfig, arch_repr: str) -> str | None:
    """Set the model's layers up for ``compilation`` (in place); returns the artifacts' folder
    when the layers are compiled, else None."""
    if not compilation.custom_ops:
        set_custom_ops(model, False)
    if not compilation.compiles:
        return None
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "encoder_only", False):
        # an encoder's layers attend prompt by prompt (a step's prompt bounds are Python values):
        # they run eagerly, as vLLM runs its encoder-only attention outside the compiled graph
        log.info("compilation level %d: %s is an encoder; its layers run eagerly", compilation.level,
                 type(model).__name__)
        return None
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"--compilation-config level {compilation.level}: {type(model).__name__} has no "
                         f"decoder layers (``layers``) to compile")
    path = cache_dir(compilation, arch_repr)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path      # read by inductor at each compile
    fused.supports(torch.zeros(1))   # whether the native kernels load: decided before tracing
    split_at_attention(model)
    for layer in layers:     # casts to 16-bit types round inside fused kernels too, as in eager mode
        layer.compile(dynamic=True, options={"emulate_precision_casts": True})
    return path
