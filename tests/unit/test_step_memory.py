"""A CPU worker keeps its step tensors' memory mapped: once glibc's mmap and trim thresholds are
raised, a block of 100 MB comes from the heap rather than from a mapping of its own, unless the
user chose malloc's settings or another allocator."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import ctypes, json
from actors.worker import step_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2

def mapped_blocks_while_holding(size):
    block = libc.malloc(size)
    blocks = libc.mallinfo2().hblks
    libc.free(block)
    return blocks

before = mapped_blocks_while_holding(100 << 20)
applied = step_memory.keep_step_heap()
print(json.dumps({"applied": applied, "again": step_memory.keep_step_heap(),
                  "mapped": [before, mapped_blocks_while_holding(100 << 20)]}))
"""


def _probe(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_large_block_comes_from_the_heap_once_the_thresholds_are_raised():
    got = _probe({})
    assert got["applied"] and got["again"]
    assert got["mapped"][0] >= 1 and got["mapped"][1] == got["mapped"][0] - 1     # that block no longer mapped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}, {"LD_PRELOAD": "libjemalloc.so.2"}])
def test_the_users_own_malloc_settings_are_kept(env):
    got = _probe(env)
    assert not got["applied"] and not got["again"] and got["mapped"][1] == got["mapped"][0]
