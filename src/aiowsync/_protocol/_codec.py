"""Encoding and strict decoding of control frames.

A frame is ``MAGIC + protocol version byte + msgpack body``. Decoding never trusts its input:
anything that is not exactly one known, valid message of this protocol version raises
:class:`~aiowsync.ProtocolError` and nothing else. No pickle is involved at any point.
"""

from __future__ import annotations

from typing import Final

import msgspec

from .._exceptions import ProtocolError
from ._messages import PROTOCOL_VERSION, Message

__all__ = ["MAGIC", "MAX_FRAME", "decode", "encode"]

MAGIC: Final = b"AW"
MAX_FRAME: Final = 8 * 1024 * 1024
_HEADER: Final = MAGIC + bytes([PROTOCOL_VERSION])

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Encode one message into a frame."""
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
        raise ProtocolError(
            f"protocol version {view[2]} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        return _decoder.decode(view[3:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise ProtocolError(f"invalid message: {exc!r}") from None
