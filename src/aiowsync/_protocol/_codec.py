"""Encoding and strict decoding of control frames.

A frame is ``MAGIC + protocol version byte + msgpack body``. Decoding never trusts its input:
anything that is not exactly one known, valid message of this protocol version raises
:class:`~aiowsync.ProtocolError` and nothing else. No pickle is involved at any point.

Two messages cross versions, so that peers of different versions part with a reason instead
of a timeout: a ``hello`` of another version decodes to a :class:`Hello` that carries that
version (and nothing else the sender could trust), which the sender refuses, answering in the
hello's own version; a ``refuse`` decodes whatever its version. Every version keeps these two
tags, and ``refuse`` its one ``reason`` field.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .._exceptions import ProtocolError
from ._messages import PROTOCOL_VERSION, Hello, Message, Refuse, Text, WorkerIndex

__all__ = ["MAGIC", "MAX_FRAME", "decode", "encode"]

_NO_FINGERPRINT: Final = "0" * 64

MAGIC: Final = b"AW"
MAX_FRAME: Final = 64 * 1024 * 1024
_HEADER: Final = MAGIC + bytes([PROTOCOL_VERSION])

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


class _AnyHello(msgspec.Struct, frozen=True, tag="hello"):
    """What is read of a hello of another version: its worker index, if it names one."""

    worker_idx: WorkerIndex = 0


class _AnyRefuse(msgspec.Struct, frozen=True, tag="refuse"):
    reason: Text


_foreign: msgspec.msgpack.Decoder[_AnyHello | _AnyRefuse] = msgspec.msgpack.Decoder(
    _AnyHello | _AnyRefuse
)


def encode(message: Message, *, protocol: int = PROTOCOL_VERSION) -> bytes:
    """Encode one message into a frame. ``protocol``: another version's header, for the
    refusal of a peer of that version only."""
    if protocol != PROTOCOL_VERSION:
        if not isinstance(message, Refuse) or not 0 <= protocol <= 255:
            raise ValueError("only a refusal is sent in another protocol version")
        return MAGIC + bytes([protocol]) + _encoder.encode(message)
    return _HEADER + _encoder.encode(message)


def decode(frame: bytes | bytearray | memoryview, *, max_size: int = MAX_FRAME) -> Message:
    """Decode one frame, or raise :class:`ProtocolError` saying why it was rejected."""
    size = len(frame)
    if size > max_size:
        raise ProtocolError(f"frame of {size} bytes exceeds the {max_size}-byte limit")
    view = memoryview(frame)
    if size < len(_HEADER) or bytes(view[:2]) != MAGIC:
        raise ProtocolError("frame does not start with the aiowsync magic")
    if view[2] != PROTOCOL_VERSION:
        return _decode_foreign(view[2], view[3:])
    try:
        return _decoder.decode(view[3:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise ProtocolError(f"invalid message: {exc!r}") from None


def _decode_foreign(protocol: int, body: memoryview) -> Message:
    """A hello or a refusal of another protocol version; anything else is rejected."""
    try:
        message = _foreign.decode(body)
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        ValueError,
        TypeError,
        RecursionError,
        OverflowError,
    ):
        raise ProtocolError(
            f"protocol version {protocol} is not supported (this side speaks {PROTOCOL_VERSION})"
        ) from None
    if isinstance(message, _AnyRefuse):
        return Refuse(reason=message.reason)
    return Hello(
        protocol=protocol, model_id="", worker_idx=message.worker_idx, fingerprint=_NO_FINGERPRINT
    )
