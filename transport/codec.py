"""Envelopes on the wire: a fixed msgspec header, the msgspec body, then raw array frames.

Wire format of one envelope (one ZMQ multipart message):
    [header, body, raw_0, raw_1, ...]
numpy arrays and torch tensors inside a message body are encoded as a small descriptor
(dtype, shape, frame index); their bytes travel zero-copy in their own frame. Arrays under
``INLINE_BYTES`` are inlined in the body (ZMQ copies small frames anyway).
"""
from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

INLINE_BYTES = 4096

# Envelope kinds.
TELL, ASK, REPLY, ERROR = 0, 1, 2, 3


class Header(msgspec.Struct, array_like=True):
    kind: int
    dst: str              # destination actor (empty for replies)
    src_node: str         # node that receives the reply
    src: str              # sending actor, for tracing and error messages
    msg_id: int
    call_id: int          # matches a reply to its ask; 0 for a tell
    msg_type: str
    trace_id: int
    parent_span: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)


def _torch():
    return sys.modules.get("torch")


class Codec:
    """Encodes and decodes message bodies, moving large arrays into side frames.

    Not re-entrant: one encode or decode at a time (one event loop per process)."""

    def __init__(self) -> None:
        self._out: list[Any] | None = None
        self._in: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}

    # -- encoding --------------------------------------------------------------------------
    def encode(self, header: Header, msg: Any) -> list[Any]:
        self._out = []
        try:
            body = self._encoder.encode(msg)
            return [_header_encoder.encode(header), body, *self._out]
        finally:
            self._out = None

    def _enc_hook(self, obj: Any) -> Any:
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            return self._pack("t", dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return self._pack("n", arr.dtype.str, list(arr.shape), arr)
        raise TypeError(f"cannot encode {type(obj).__name__} in a message")

    def _pack(self, kind: str, dtype: str, shape: list[int], arr: np.ndarray) -> list[Any]:
        if arr.nbytes < INLINE_BYTES or self._out is None:
            return [kind, dtype, shape, arr.tobytes()]
        self._out.append(memoryview(arr).cast("B"))
        return [kind, dtype, shape, len(self._out) - 1]

    # -- decoding --------------------------------------------------------------------------
    def decoder(self, typ: Any) -> msgspec.msgpack.Decoder:
        dec = self._decoders.get(typ)
        if dec is None:
            dec = self._decoders[typ] = msgspec.msgpack.Decoder(typ, dec_hook=self._dec_hook)
        return dec

    def decode(self, typ: Any, frames: list[Any]) -> Any:
        """Decode ``frames[0]`` (the body) as ``typ``; ``frames[1:]`` hold raw array bytes."""
        self._in = frames[1:]
        try:
            return self.decoder(typ).decode(_buffer(frames[0]))
        finally:
            self._in = []

    def _dec_hook(self, typ: Any, obj: Any) -> Any:
        if not (isinstance(obj, list) and len(obj) == 4 and obj[0] in ("t", "n")):
            raise TypeError(f"expected an array descriptor for {typ}, got {type(obj).__name__}")
        kind, dtype, shape, data = obj
        buf = data if isinstance(data, (bytes, bytearray)) else _buffer(self._in[data])
        if kind == "n":
            arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            torch = _torch()
            return torch.from_numpy(arr) if torch is not None and typ is torch.Tensor else arr
        import torch
        if len(buf) == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        flat = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf,
                                dtype=getattr(torch, dtype))
        return flat.reshape(shape)


def decode_header(frame: Any) -> Header:
    return _header_decoder.decode(_buffer(frame))


def _buffer(frame: Any) -> Any:
    """The bytes of a ZMQ frame (zero-copy) or of a plain bytes-like object."""
    return getattr(frame, "buffer", frame)
