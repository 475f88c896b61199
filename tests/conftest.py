import os

import pytest

from actors.worker.openmp import load_torch_with_short_spin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# This process runs models too, beside the servers the tests start: its OpenMP threads spin as
# briefly as a worker's, or every server step that shares a core with them waits out their spin.
load_torch_with_short_spin()


@pytest.fixture(scope="module", autouse=True)
def each_module_gives_back_the_memory_it_freed():
    """Many modules load engines in this process one after the other; glibc keeps what they free
    in its heap (the freed weights and KV caches come back as many medium blocks), and over the
    whole suite that grew the process past this machine's 24 GiB. After each module: collect,
    then hand the free heap back to the system (malloc_trim; nothing where the C library is not
    glibc).

    What is still alive then (the imported modules, torch's and transformers' among them, and
    what the session keeps) is frozen out of the collector's sight: each full collection walked
    all of it again, 0.3 s each, an eighth of this process's time in the in-process tests."""
    yield
    import ctypes
    import gc
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.fixture
def child_env():
    """Environment for child nodes that import test modules."""
    return {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "unit"),
                                           os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="session", autouse=True)
def interpreter_rounds_bfloat16_like_the_gpu():
    """Triton's interpreter narrows float32 to bfloat16 by dropping the low bits (rounding toward
    zero); a GPU's conversion rounds to nearest even, as torch does. Under TRITON_INTERPRET=1 the
    kernels' bfloat16 results are made to round like on the GPU, so that comparisons with torch
    measure the kernels, not the interpreter."""
    from kernels.triton import interpreting
    if not interpreting():
        yield
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast_impl = getattr(builder, "cast_impl", None)
    if cast_impl is None:          # another Triton's interpreter: leave it as it is
        yield
        return

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            narrowed = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(narrowed.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = rounding_cast
    yield
    builder.cast_impl = cast_impl


def pytest_unconfigure(config):
    """What the modules froze is handed back to the collector before this process exits, so that
    the objects of the libraries' native bindings (Triton's, xgrammar's) are freed at exit, not
    reported as leaked."""
    import gc
    gc.unfreeze()
