"""The garbage collector over a process's life. A process's start-up (torch's and our imports, the
model's weights) leaves a few million long-lived objects that each full collection would walk
again: while it starts, nothing is collected; once it serves, what start-up left is frozen out of
the collector's sight (``gc.freeze``, as vLLM's engine core does once it is up), so a step's
collections walk only what steps create; and at exit, what lives then is frozen too, so the
interpreter's last collection does not walk every module again (half a second with torch)."""
from __future__ import annotations

import gc


def starting() -> None:
    """No collections until :func:`started`: start-up creates objects that live as long as the
    process does."""
    gc.disable()


def started() -> None:
    """Collect once what start-up left behind, freeze the rest, and collect again from now on."""
    gc.collect()
    gc.freeze()
    gc.enable()


def freeze_started() -> None:
    """A process that did not start under :func:`starting` (an engine in the caller's own process,
    a server's frontend): what lives once the engine is up is frozen all the same, as vLLM's engine
    core freezes its heap wherever it runs; whether the collector runs is left as it was."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    """What :func:`freeze_started` froze is the collector's again (an engine in this process shut
    down: its weights and caches are freed with the cycles they are in, as vLLM's shutdown does)."""
    gc.unfreeze()


def collect_all() -> None:
    """Collect what start-up froze too (its cycles included): a process giving memory back (a
    worker going to sleep) lets go of objects that were to live as long as it did."""
    gc.unfreeze()
    gc.collect()


def exiting() -> None:
    """Right before the process exits: freeze what is alive, so exit does not walk it again
    (atexit handlers and the deallocation of what nothing refers to run as usual)."""
    gc.freeze()
