"""vLLM's prompt embeds (``--enable-prompt-embeds``): a prompt given as the model's input
embeddings, one row per position, instead of tokens. Over HTTP, /v1/completions'
``prompt_embeds`` is the base64 of a ``torch.save``'d tensor of shape (tokens, hidden) (or
(1, tokens, hidden)), or a list of them, each a prompt of its own before any text prompt;
offline, ``{"prompt_embeds": tensor}``. The rows are taken as float32 and checked here; the
engine hashes them into the prompt's blocks (vLLM's extra key) and the worker puts them in place
of the token embeddings of those positions (``embed_input_ids``)."""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

ENABLE_ERROR = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
MAX_REASON_CHARS = 200          # of torch's reason for bytes it could not read (they are the caller's)


def decode_prompt_embeds(data: Any, name: str = "prompt_embeds") -> np.ndarray:
    """The rows of one base64 ``torch.save`` payload (ValueError saying what is wrong with it,
    naming the field ``name``)."""
    return embeds_array(decode_tensor(data, name), name)


def decode_tensor(data: Any, name: str) -> Any:
    """The tensor of one base64 ``torch.save`` payload, read without code (``weights_only``)."""
    if not isinstance(data, (str, bytes)) or not data:
        raise ValueError(f"`{name}` must be a non-empty base64 string (a torch.save'd tensor), "
                         "or a list of them")
    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"`{name}` is not valid base64") from None
    import torch
    try:
        tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:        # noqa: BLE001 -- torch has no one error for "not a tensor file"
        reason = str(exc).strip() or type(exc).__name__
        if len(reason) > MAX_REASON_CHARS:
            reason = f"{reason[:MAX_REASON_CHARS]}... ({len(reason) - MAX_REASON_CHARS} more characters truncated)"
        raise ValueError(f"`{name}` could not be deserialized as a torch tensor: {reason}") from None
    return tensor


def embeds_array(tensor: Any, name: str = "prompt_embeds") -> np.ndarray:
    """A tensor of embeddings (``name``: the field it came as) as the engine takes them:
    (tokens, hidden) float32 rows."""
    import torch
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"`{name}` must be a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.dim() == 3 and tensor.shape[0] == 1:      # a batch of one: unambiguous
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise ValueError(f"`{name}` must be a 2D tensor of shape (num_tokens, hidden_size); "
                         f"got shape {tuple(tensor.shape)}.")
    if not tensor.is_floating_point():
        raise ValueError(f"`{name}` dtype {tensor.dtype} is not a floating-point type, cannot safely "
                         "cast to the model's dtype.")
    if tensor.shape[0] == 0:
        raise ValueError(f"`{name}` has no rows: the prompt is empty")
    rows = tensor.detach().to(torch.float32).contiguous().numpy()
    if not np.isfinite(rows).all():
        raise ValueError(f"`{name}` holds values that are not finite (nan or inf)")
    return rows


def check_hidden_size(rows: np.ndarray, hidden_size: int, name: str = "prompt_embeds") -> None:
    if rows.shape[1] != hidden_size:
        raise ValueError(f"`{name}` hidden_size {rows.shape[1]} does not match the model's hidden_size "
                         f"{hidden_size}.")


def completion_embeds(value: Any) -> list[np.ndarray]:
    """/v1/completions' ``prompt_embeds``: one payload or a list of them, each a prompt."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
    return [decode_prompt_embeds(item) for item in items]
