"""The pooling model's head (vLLM's ``Pooler``, for ``--runner pooling``): each pooling
request's last-layer hidden states (after the final norm), chunk by chunk as its prompt is
computed, turned into its answer once the prompt is done: the last token's (LAST), the first's
(CLS), their mean (MEAN), every token's (ALL, task token_embed), or the step tag's (STEP, a
process reward model's); then put through a
sentence-transformers checkpoint's Dense projections, its first ``dimensions`` kept (a Matryoshka
model's) and L2-normalized unless ``use_activation`` is off; or, for a classifier (task
classify; token_classify: every token's), its score head's label scores. A model may pool in
its own way: SPLADE's sparse vocabulary weights (the model's ``sparse_head``), BGE-M3's per-token
heads (ModelPooling's ``token_heads``). Sums run in float32 whatever the model's dtype."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from actors.engine.pooling import DenseLayer, PoolingParams, TokenHead

_ACTIVATIONS = {"identity": torch.nn.Identity, "tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "sigmoid": torch.nn.Sigmoid,
                "silu": torch.nn.SiLU, "swish": torch.nn.SiLU, "gelu": torch.nn.GELU,
                "gelu_pytorch_tanh": lambda: torch.nn.GELU(approximate="tanh"),
                "gelu_new": lambda: torch.nn.GELU(approximate="tanh"),
                "gelu_fast": lambda: torch.nn.GELU(approximate="tanh")}


class _QuickGELU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def dense_projector(layers: tuple[DenseLayer, ...]) -> torch.nn.Sequential | None:
    """A sentence-transformers checkpoint's Dense projections (float32, as vLLM's head dtype),
    their weights read from each layer's file (``linear.weight`` as sentence-transformers saves
    it, or ``weight`` / ``dense.weight``); None without any."""
    if not layers:
        return None
    modules: list[torch.nn.Module] = []
    for layer in layers:
        if layer.weights.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(layer.weights, "pt") as f:      # its own tensors only (a model's file holds more)
                wanted = [k for k in f.keys() if k in (layer.key, "linear.weight", "weight", "dense.weight",
                                                      "linear.bias", "bias", "dense.bias")]
                state = {k: f.get_tensor(k) for k in wanted}
        else:
            state = torch.load(layer.weights, map_location="cpu", weights_only=True)
        key = next((k for k in (layer.key, "linear.weight", "weight", "dense.weight") if k and k in state), None)
        if key is None:
            raise ValueError(f"{layer.weights}: no Dense weight (linear.weight) in it")
        linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias, dtype=torch.float32)
        with torch.no_grad():
            linear.weight.copy_(state[key].float())
            if layer.bias:
                linear.bias.copy_(state[key.replace("weight", "bias")].float())
        modules.append(linear)
        modules.append(_QuickGELU() if layer.activation == "quick_gelu" else _ACTIVATIONS[layer.activation]())
    return torch.nn.Sequential(*modules).eval()


class Pooler:
    """``head``: a classifier's score layer (hidden -> labels), for task "classify": its scores
    calibrated (``(s - logit_mean) / logit_sigma``, vLLM's) and, with ``use_activation``, put
    through ``activation`` (sigmoid, softmax or identity)."""

    def __init__(self, head: torch.nn.Module | None = None, activation: str = "softmax",
                 logit_mean: float | None = None, logit_sigma: float | None = None,
                 projector: torch.nn.Module | None = None, step_after_head: bool = False,
                 sparse: torch.nn.Module | None = None, token_heads: tuple[TokenHead, ...] = ()) -> None:
        # a request whose prompt spans several steps: what its chunks have added up so far
        # (MEAN: the sum of rows; CLS: the first row; ALL: the rows)
        self.partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        self.step_ids: dict[str, list[torch.Tensor]] = {}      # STEP: the token ids of its chunks so far
        self.head, self.activation = head, activation
        self.logit_mean, self.logit_sigma = logit_mean, logit_sigma
        self.projector = projector        # an embedding's Dense projections (sentence-transformers')
        # STEP's columns picked from the head's scores (a reward model's), else from the hidden rows
        self.step_after_head = step_after_head
        # a sparse embedding model's own pooling of task embed (SPLADE's: (rows, token ids) -> vocab weights)
        self.sparse = sparse
        # a model's own per-token heads (BGE-M3's), by task: (head, its settings)
        self.token_heads = {h.task: (dense_projector((h.layer,)), h) for h in token_heads}

    def needs_token_ids(self, params: PoolingParams) -> bool:
        """Whether ``add`` takes the chunk's token ids for this request."""
        return (params.pooling_type == "STEP" or (self.sparse is not None and params.task == "embed")
                or self._own(params))

    def _own(self, params: PoolingParams) -> bool:
        """Whether the request's task is one of the model's own heads' (or joins them)."""
        return bool(self.token_heads) and (params.task in self.token_heads or params.task == "embed&token_classify")

    def add(self, rid: str, params: PoolingParams, rows: torch.Tensor, start: int, num_prompt: int,
            token_ids: np.ndarray | None = None) -> np.ndarray | None:
        """Chunk ``rows`` (n, hidden) of positions [start, start + n) of a prompt of
        ``num_prompt`` tokens (``token_ids``: theirs, where ``needs_token_ids``); the request's answer
        once the chunk ends the prompt, else None."""
        kind, done = params.pooling_type, start + len(rows) >= num_prompt
        if self.sparse is not None and params.task == "embed":
            return self._sparse(rid, rows, token_ids, done)
        if self._own(params):
            return self._own_heads(rid, params, rows, token_ids, done)
        if kind == "LAST":
            if not done:
                return None
            pooled = rows[-1].float()
        elif kind == "CLS":
            if start == 0:
                self.partial[rid] = rows[0].float()
            if not done:
                return None
            pooled = self.partial.pop(rid)
        elif kind == "MEAN":
            total = rows.float().sum(0)
            if rid in self.partial:
                total += self.partial.pop(rid)
            if not done:
                self.partial[rid] = total
                return None
            pooled = total / num_prompt
        elif kind in ("ALL", "STEP"):
            chunks = self.partial.setdefault(rid, [])
            chunks.append(rows.float())
            if kind == "STEP":
                if token_ids is None or len(token_ids) != len(rows):
                    raise ValueError("STEP pooling needs the chunk's token ids")
                self.step_ids.setdefault(rid, []).append(torch.as_tensor(np.asarray(token_ids)))
            if not done:
                return None
            pooled = torch.cat(self.partial.pop(rid))
            if kind == "STEP":
                pooled = self._steps(pooled, torch.cat(self.step_ids.pop(rid)), params)
        else:
            raise ValueError(f"pooling type {kind!r} is not supported")
        if params.task in ("classify", "token_classify"):     # one row, or one per token
            return self._classify(pooled, params.use_activation, params if kind == "STEP" else None).cpu().numpy()
        if self.projector is not None:
            with torch.no_grad():
                pooled = self.projector(pooled)
        if params.dimensions is not None:
            pooled = pooled[..., :params.dimensions]
        if params.use_activation:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().numpy()

    def _whole(self, rid: str, rows: torch.Tensor, token_ids: np.ndarray | None,
               done: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the prompt's rows, its token ids) once its last chunk is in; None before."""
        if token_ids is None or len(token_ids) != len(rows):
            raise ValueError("this pooling needs the chunk's token ids")
        self.partial.setdefault(rid, []).append(rows)
        self.step_ids.setdefault(rid, []).append(torch.as_tensor(np.asarray(token_ids)))
        if not done:
            return None
        return torch.cat(self.partial.pop(rid)), torch.cat(self.step_ids.pop(rid))

    def _sparse(self, rid: str, rows: torch.Tensor, token_ids: np.ndarray | None, done: bool) -> np.ndarray | None:
        """The sparse model's vector of the whole prompt (not normalized, as vLLM leaves SPLADE's)."""
        whole = self._whole(rid, rows, token_ids, done)
        if whole is None:
            return None
        with torch.no_grad():
            return self.sparse(*whole).float().cpu().numpy()

    def _own_heads(self, rid: str, params: PoolingParams, rows: torch.Tensor, token_ids: np.ndarray | None,
                   done: bool) -> np.ndarray | None:
        """A task of the model's own heads over the whole prompt: the head's rows (filtered,
        activated); embed&token_classify: the CLS embedding then the token_classify rows, joined
        (vLLM's BGE-M3)."""
        whole = self._whole(rid, rows, token_ids, done)
        if whole is None:
            return None
        rows, ids = whole[0].float(), whole[1]
        with torch.no_grad():
            if params.task != "embed&token_classify":
                return self._head(params.task, rows, ids, params.use_activation).cpu().numpy()
            dense = F.normalize(rows[0], dim=-1) if params.use_activation else rows[0]
            return torch.cat([dense, self._head("token_classify", rows, ids, params.use_activation)]).cpu().numpy()

    def _head(self, task: str, rows: torch.Tensor, ids: torch.Tensor, activate: bool) -> torch.Tensor:
        head, spec = self.token_heads[task]
        if spec.drop_first is not None and len(ids) and int(ids[0]) == spec.drop_first:
            rows, ids = rows[1:], ids[1:]
        if spec.drop_last is not None and len(ids) and int(ids[-1]) == spec.drop_last:
            rows, ids = rows[:-1], ids[:-1]
        out = head(rows)
        if activate:
            out = F.normalize(out, p=2, dim=-1) if spec.activation == "normalize" else torch.relu(out)
        return out.squeeze(-1) if out.shape[-1] == 1 else out

    def forget(self, req_ids: list[str]) -> None:
        """Drop finished, aborted or preempted requests (a preempted one starts over)."""
        for rid in req_ids:
            self.partial.pop(rid, None)
            self.step_ids.pop(rid, None)

    def _steps(self, rows: torch.Tensor, token_ids: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """STEP pooling (vLLM's): the rows of the step tag's tokens; before the head, the
        columns asked for too (after it, for a reward model: ``_classify``)."""
        if params.step_tag_id is not None:
            rows = rows[token_ids == params.step_tag_id]
        if params.returned_token_ids and not self.step_after_head:
            rows = rows[:, list(params.returned_token_ids)]
        return rows

    def _classify(self, pooled: torch.Tensor, activate: bool, step: PoolingParams | None = None) -> torch.Tensor:
        if self.head is None:
            raise ValueError("this model has no score head to classify with (--convert classify)")
        with torch.no_grad():
            scores = self.head(pooled.float())          # score heads are float32 (vLLM's head dtype)
        if step is not None and step.returned_token_ids and self.step_after_head:
            scores = scores[:, list(step.returned_token_ids)]
        if self.logit_mean is not None:
            scores = scores - self.logit_mean
        if self.logit_sigma is not None:
            scores = scores / self.logit_sigma
        if not activate or self.activation == "identity":
            return scores
        sigmoid = self.activation == "sigmoid" or (self.activation == "auto" and scores.shape[-1] < 2)
        return torch.sigmoid(scores) if sigmoid else torch.softmax(scores, dim=-1)
