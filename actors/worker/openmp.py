"""How a CPU worker's OpenMP threads wait between parallel regions.

GNU OpenMP (the runtime torch and our C kernels share) keeps each idle thread spinning for up to
300,000 rounds after a parallel region before it sleeps: milliseconds, between every pair of
regions of a step. With a core to each thread that costs nothing; once another process wants one
of those cores (the server's own front end and engine core, a second engine, anything else on the
machine) the spinning threads hold it off for whole scheduler slices at every region, and a decode
step of a few dozen milliseconds takes more than a second. A short spin keeps the quiet machine's
speed (the next region mostly starts within it) and sleeps soon enough for the busy one.

The runtime reads its settings once, when it loads (``import torch``), so they go into the
environment a worker process starts with. A worker in the caller's own process (the offline API's
default) gets them while torch loads, if torch is not loaded yet. A user's own ``OMP_WAIT_POLICY``
or ``GOMP_SPINCOUNT`` is left as it is.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

log = logging.getLogger("troupe.worker")

SPIN_ENV = "GOMP_SPINCOUNT"
USER_SETTINGS = ("OMP_WAIT_POLICY", SPIN_ENV)
SPIN_ROUNDS = 3000      # about 0.1 ms on the CPUs measured (README "A busy machine")


def openmp_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a worker process's environment adds for its OpenMP runtime: a bounded spin, unless
    ``environ`` already says how its threads should wait."""
    if any(name in environ for name in USER_SETTINGS):
        return {}
    return {SPIN_ENV: str(SPIN_ROUNDS)}


def load_torch_with_short_spin() -> bool:
    """For a worker in this process: loads torch (and with it the OpenMP runtime our kernels share)
    with the bounded spin, then puts the environment back, so what this process starts later sees
    it as the user left it. Returns whether the spin was applied: not when the user set a wait
    policy, nor when torch was loaded before (its runtime has read its settings already)."""
    added = openmp_env()
    if "torch" in sys.modules:
        if added:
            log.debug("torch was loaded before the engine: its OpenMP threads keep libgomp's default spin "
                      "(set %s=%d before importing torch to bound it)", SPIN_ENV, SPIN_ROUNDS)
        return False
    os.environ.update(added)
    try:
        import torch  # noqa: F401
    finally:
        for name in added:
            os.environ.pop(name, None)
    return bool(added)
