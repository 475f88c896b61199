"""A worker's OpenMP wait setting: a short spin by default (a worker process's environment, or
while torch loads for a worker in this process), the user's own setting kept."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.worker.openmp import SPIN_ROUNDS, USER_SETTINGS, openmp_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_workers_get_a_short_spin_by_default():
    assert openmp_env({"PATH": "/usr/bin"}) == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}


@pytest.mark.parametrize("setting", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                     {"GOMP_SPINCOUNT": "infinite"}])
def test_a_users_own_wait_setting_is_left_as_it_is(setting):
    assert openmp_env(setting) == {}



def openmp_settings(code: str, **env: str) -> tuple[str, str]:
    """Runs ``code`` in a fresh interpreter (the user's wait settings removed, ``env`` added) whose
    OpenMP runtime prints its settings as it loads; returns its stdout and stderr."""
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    run = subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout, run.stderr


LOAD = ("import os; from actors.worker.openmp import load_torch_with_short_spin; "
        "print(load_torch_with_short_spin(), os.environ.get('GOMP_SPINCOUNT'))")


def test_torch_loaded_for_a_worker_in_this_process_spins_briefly_and_the_environment_is_put_back():
    out, err = openmp_settings(LOAD)
    assert f"GOMP_SPINCOUNT = '{SPIN_ROUNDS}'" in err
    assert out.split() == ["True", "None"]


def test_a_users_own_spin_setting_reaches_the_runtime_of_a_worker_in_this_process():
    out, err = openmp_settings(LOAD, GOMP_SPINCOUNT="50000")
    assert "GOMP_SPINCOUNT = '50000'" in err
    assert out.split() == ["False", "50000"]


def test_torch_loaded_before_keeps_its_runtimes_settings():
    out, err = openmp_settings("import torch; " + LOAD)
    assert "GOMP_SPINCOUNT = " in err and f"GOMP_SPINCOUNT = '{SPIN_ROUNDS}'" not in err
    assert out.split() == ["False", "None"]
