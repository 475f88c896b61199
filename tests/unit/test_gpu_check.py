"""tools/gpu_check runs unattended: its CPU dry run goes through every part and reports the
issue's criteria, and a second device call (which carries the model's rest, so the machine's
`.gpu_carry` no longer holds the first part) still finds the first part it stashed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tools.gpu_check.__main__ as gpu_check
from models.resolve import default_gguf_path
from tools.gpu_check.prepare import trim_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_second_call_finds_the_first_part_stashed_by_the_first(tmp_path, monkeypatch):
    carry, stash = tmp_path / "carry", tmp_path / "stash"
    (carry / "first" / "wheels").mkdir(parents=True)
    (carry / "first" / "smollm2.gguf").write_bytes(b"GGUF first part")
    (carry / "first" / "wheels" / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"wheel")
    monkeypatch.setattr(gpu_check, "CARRY", str(carry))
    monkeypatch.setattr(gpu_check, "STASH", str(stash))
    assert gpu_check._carried("smollm2.gguf") == str(carry / "first" / "smollm2.gguf")
    gpu_check._stash()                                      # the first call
    (carry / "first" / "smollm2.gguf").unlink()             # the second call's carry replaced it
    (carry / "first" / "wheels" / "gguf-0.19.0-py3-none-any.whl").unlink()
    (carry / "first" / "wheels").rmdir()
    (carry / "first").rmdir()
    assert gpu_check._carried("smollm2.gguf") == str(stash / "smollm2.gguf")
    assert (stash / "smollm2.gguf").read_bytes() == b"GGUF first part"
    assert gpu_check._carried("wheels") == str(stash / "wheels")


def test_without_either_part_nothing_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CARRY", str(tmp_path / "carry"))
    monkeypatch.setattr(gpu_check, "STASH", str(tmp_path / "stash"))
    assert gpu_check._carried("smollm2.gguf") is None


@pytest.mark.slow
def test_dry_run_goes_through_every_part_and_reports_the_criteria(tmp_path):
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    model = str(tmp_path / "smollm2-2-layers.gguf")     # the plumbing of a cut model, as prepare.py cuts it
    trim_gguf(default_gguf_path(), model, [0, 1])
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--dry-run", "--out", str(tmp_path),
                           "--model", model, "--skip", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (report, proc.stderr[-2000:])
    assert report["ok"] is True
    assert report["model"] == {"path": model, "source": "cut SmolLM2 (prepare.py)"}
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    for part in ("parity", "bench", "offline", "quant_kernels", "variants"):
        assert report[part]["status"] == "passed" and (tmp_path / f"{part}.log").exists()
    parity = report["parity"]["result"]
    assert parity["prompts"] == 5 and parity["f32_graphs_vs_cpu_f32"]["equal"] == 5
    assert parity["forced_logprob_error"]["gpu_f32"]["max"] == 0.0     # the dry run compares f32 with itself
    assert parity["forced_logprob_error"]["cpu_bf16"]["positions"] > 0
    c = report["criteria"]
    assert c["parity_first16_equal"] == "5/5" and c["gpu_tests_pass"] is None
    assert c["offline_graphs_over_eager"] > 0
    assert c["variants_vs_bf16"]["awq@1"] > 0
    assert all(v["fp8"] >= 0 for v in c["quant_kernels_speedup"].values())
