"""Worker extensions for tests/e2e/test_worker_extension.py (--worker-extension-cls), as an RL
framework writes them: methods every worker gains, called by name through collective_rpc."""
from __future__ import annotations

import torch


class NormScaler:
    """Reads and changes the served weights from inside the workers."""

    def norm_sum(self) -> float:
        return float(self.get_model().layers[0].input_layernorm.weight.sum())

    def scale_norm(self, factor: float) -> str:
        """The first layer's attention input scaled: its softmax sharpens, the tokens change."""
        with torch.no_grad():
            self.get_model().layers[0].input_layernorm.weight.mul_(factor)
        return f"tp{self.tp_rank}"


class Clashing:
    def reload_weights(self) -> None:      # the worker has one
        pass
