"""Small helpers shared by the tests."""
import asyncio


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh uvloop event loop with a deadline."""
    import uvloop
    return uvloop.run(asyncio.wait_for(coro, timeout))
