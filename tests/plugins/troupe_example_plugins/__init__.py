"""An example Troupe plugin package. Its general plugin (``register``) runs in every process of
the engine: it registers an architecture name served by a Llama subclass (imported only when a
checkpoint names it), and, when TROUPE_EXAMPLE_PID_DIR is set, records the process's pid there
(one empty file per process, named by its pid)."""
from __future__ import annotations

import os

ARCHITECTURE = "TroupeExampleLlamaForCausalLM"
PID_DIR_ENV = "TROUPE_EXAMPLE_PID_DIR"


def register() -> None:
    from models.architectures import ModelRegistry
    ModelRegistry.register_model(ARCHITECTURE, "troupe_example_plugins.model:ExampleLlamaForCausalLM")
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
