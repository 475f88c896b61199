"""A worker's OpenMP wait setting: a short spin by default, the user's own setting kept."""
from __future__ import annotations

import pytest

from actors.worker.openmp import SPIN_ROUNDS, openmp_env


def test_workers_get_a_short_spin_by_default():
    assert openmp_env({"PATH": "/usr/bin"}) == {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}


@pytest.mark.parametrize("setting", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                     {"GOMP_SPINCOUNT": "infinite"}])
def test_a_users_own_wait_setting_is_left_as_it_is(setting):
    assert openmp_env(setting) == {}
