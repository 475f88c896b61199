import asyncio
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh uvloop event loop with a deadline."""
    import uvloop
    return uvloop.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def child_env():
    """Environment for child nodes that import test modules."""
    return {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "unit"),
                                           os.environ.get("PYTHONPATH", "")])}
