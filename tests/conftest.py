import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def child_env():
    """Environment for child nodes that import test modules."""
    return {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "unit"),
                                           os.environ.get("PYTHONPATH", "")])}
