"""/v1/load_lora_adapter and /v1/unload_lora_adapter exist only when VLLM_ALLOW_RUNTIME_LORA_UPDATING
is 1 or true (any case, spaces around ignored), as in vLLM; otherwise the server has no such routes."""
import pytest

from actors.frontend import lora


@pytest.mark.parametrize("value, allowed", [(None, False), ("0", False), ("false", False), ("yes", False),
                                            ("1", True), ("true", True), (" True ", True), ("TRUE", True)])
def test_the_load_and_unload_endpoints_need_vllm_allow_runtime_lora_updating(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    paths = [path for _, path, _ in lora.routes()]
    assert paths == (["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] if allowed else [])
