"""``troupe collect-env`` (vLLM's collect-env): a report of the installation and the machine for
bug reports, as text or JSON, with the values of secret-looking variables hidden."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tools import collect_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_report_names_versions_cpu_kernels_and_hides_secrets(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-very-secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    report = collect_env.collect()
    assert report["torch"]["version"] == torch.__version__ and report["packages"]["torch"] == torch.__version__
    assert report["python"] == sys.version.split()[0] and report["cpu"]["cores"] >= 1
    assert report["native_cpu_kernels"] == "built and loaded" or report["native_cpu_kernels"].startswith("unavailable")
    assert report["environment"]["VLLM_API_KEY"] == "<hidden>" and report["environment"]["OMP_NUM_THREADS"] == "2"
    text = collect_env.render(report)
    assert "sk-very-secret" not in text and f"version: {torch.__version__}" in text


def test_the_command_prints_json_with_json():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "collect-env", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) >= {"troupe", "python", "os", "cpu", "torch", "packages", "environment"}
