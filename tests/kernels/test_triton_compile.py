"""Every Triton kernel compiles for CUDA (sm_90) through Triton's real compiler, on a
machine without a GPU: catches what the interpreter cannot (GPU-only typing, tl.dot in
bfloat16, loop pipelining, shared-memory limits). Runs compile_for_gpu.py in a child process,
since this process's kernels were built for the interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_for_gpu.py")
KERNELS = {"_store_kv_cache_kernel", "_paged_decode_kernel", "_paged_decode_reduce_kernel", "_paged_prefill_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_sample_kernel", "_apply_bitmask_kernel"}


def test_kernels_compile_for_cuda_targets():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, SCRIPT, "90"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["kernels"]) == KERNELS
    assert summary["max_shared_bytes"] <= 227 * 1024        # fits an H100/H200 SM
