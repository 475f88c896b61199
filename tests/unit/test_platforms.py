"""Platforms: the worker asks its platform which attention backends to try, whether to pack
linear layers and capture graphs, which dtypes it runs; a ``troupe.platform_plugins`` entry
point can put its own Platform class in place of the built-in one."""
from __future__ import annotations

import pytest

from actors.engine.args import EngineArgs
from actors.runtime import plugins
from actors.runtime.plugins import PLATFORM_PLUGINS
from actors.worker.platforms import CpuPlatform, CudaPlatform, platform_for
from models.packed import OneDNNLinear, PanelLinear
from helpers import save_tiny_llama, save_tiny_tokenizer, write_distribution

MODULE = '''
import os
from actors.worker.platforms import CpuPlatform

class PlainCpu(CpuPlatform):
    attention_backends = ("cpu",)
    packs_linears = False
    dtypes = ("float32",)

def activate():
    return os.environ.get("FAKEPLAT_ACTIVE") and "fakeplat_mod:PlainCpu"

def also():
    return os.environ.get("FAKEPLAT_BOTH") and "fakeplat_mod:PlainCpu"
'''


@pytest.fixture
def platform_plugin(tmp_path, monkeypatch):
    import sys
    write_distribution(tmp_path, f"[{PLATFORM_PLUGINS}]\nfake_platform = fakeplat_mod:activate\n"
                                 "fake_platform_two = fakeplat_mod:also\n", MODULE, "fakeplat")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.reset_for_tests(general_too=False)
    yield monkeypatch
    plugins.reset_for_tests(general_too=False)
    sys.modules.pop("fakeplat_mod", None)


def test_built_in_platforms_serve_without_a_plugin(platform_plugin):
    assert platform_for("cpu") is CpuPlatform and platform_for("cuda") is CudaPlatform
    with pytest.raises(ValueError, match="no platform for device 'tpu'"):
        platform_for("tpu")


def test_a_platform_plugin_replaces_the_built_in_platform_of_its_device(platform_plugin):
    platform_plugin.setenv("FAKEPLAT_ACTIVE", "1")
    assert platform_for("cpu").__name__ == "PlainCpu" and platform_for("cuda") is CudaPlatform
    platform_plugin.setenv("FAKEPLAT_BOTH", "1")
    with pytest.raises(ValueError, match="more than one platform plugin is active: fake_platform, fake_platform_two"):
        platform_for("cpu")


def test_the_worker_takes_its_backend_packing_and_dtypes_from_the_platform(platform_plugin, tmp_path):
    from actors.worker.worker import Worker
    path = save_tiny_tokenizer(save_tiny_llama(tmp_path / "ckpt", 64, 32, 48, 2, 1, 16, 128), 64)
    config = EngineArgs(model=path, multiprocess=False, kv_cache_bytes=1 << 22).create_engine_config()
    packed = lambda w: any(isinstance(m, (PanelLinear, OneDNNLinear)) for m in w.model.modules())   # noqa: E731
    built_in = Worker(config)
    assert built_in.platform is CpuPlatform and packed(built_in)
    platform_plugin.setenv("FAKEPLAT_ACTIVE", "1")
    worker = Worker(config)
    assert worker.platform.__name__ == "PlainCpu" and worker.attn_backend.name == "cpu" and not packed(worker)
    bf16 = EngineArgs(model=path, multiprocess=False, dtype="bfloat16", kv_cache_bytes=1 << 22).create_engine_config()
    with pytest.raises(ValueError, match="dtype 'bfloat16' is not supported on cpu; supported: float32"):
        Worker(bf16)
