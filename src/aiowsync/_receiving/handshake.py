"""A receiver's side of the handshake (its hello, the sender's welcome or refusal), and giving
back the memory that a first switch in swap mode frees."""

from __future__ import annotations

import os
import socket

from .._channel import ReceiverChannel
from .._exceptions import ProtocolError, RefusedError
from .._protocol import PROTOCOL_VERSION, Heartbeat, Hello, Refuse, Welcome
from .._util.libc import libc
from .._util.pids import pid_namespace
from .._weights.layout import Layout
from .state import ReceiverState

__all__ = ["handshake", "return_freed_memory"]

_HOST = socket.gethostname()[:256]


async def handshake(
    channel: ReceiverChannel,
    state: ReceiverState,
    *,
    layout: Layout,
    model_id: str,
    worker_idx: int,
    timeout: float,
) -> Welcome:
    """Say hello with ``layout`` and wait for the welcome, which starts ``state``'s session.

    Raises :class:`RefusedError` with the sender's reason when it refuses, and
    :class:`ProtocolError` for anything else. The wait for the answer has no deadline of its
    own: the caller bounds the whole handshake.
    """
    hello = Hello(
        protocol=PROTOCOL_VERSION,
        model_id=model_id,
        worker_idx=worker_idx,
        fingerprint=layout.fingerprint,
        layout=layout.descs(),
        pid=os.getpid(),
        host=_HOST,
        pid_ns=pid_namespace(),
    )
    state.conn.send(hello)
    await channel.send(hello, timeout=timeout)
    while True:
        message = await channel.recv(timeout=None)
        if isinstance(message, Heartbeat):
            continue
        state.conn.receive(message)
        if isinstance(message, Refuse):
            raise RefusedError(message.reason)
        if isinstance(message, Welcome):
            if message.worker_idx != worker_idx or message.model_id != model_id:
                raise ProtocolError("welcome names another worker or model")
            state.session = message.session
            state.proof = message.proof
            return message
        raise ProtocolError(f"unexpected {type(message).__name__} during the handshake")


def return_freed_memory() -> None:
    """Give the model's original storage back to the OS after the first swap.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold on the heap, so
    without a trim a swap-mode worker would keep a private copy's worth of freed memory.
    """
    c = libc()
    trim = getattr(c, "malloc_trim", None) if c is not None else None
    if trim is not None:  # not glibc: nothing to trim, or no way to ask
        trim(0)
