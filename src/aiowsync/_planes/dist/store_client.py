"""The client of the distributed plane's store (:mod:`aiowsync._planes.dist.store`), for torch
to form process groups through."""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import threading
import time
from typing import Any

from torch._C._distributed_c10d import Store

from .store import (
    CHECK,
    GET,
    MAGIC,
    MAX_REQUEST,
    NONCE,
    OK,
    SET,
    TIMEOUT,
    WAIT,
    pack,
    proof,
    unpack,
)

__all__ = ["StoreClient"]


class StoreClient(Store):
    """A client of :class:`StoreServer`, for torch to form process groups through.

    Blocking, one request at a time; it connects (again) on the first request after it was
    made or its connection broke. ``timeout`` bounds each request whose caller gives none.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.secret = secret
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._call(SET, [key.encode(), data], self._timeout)

    def get(self, key: str) -> bytes:
        return self._call(GET, [key.encode(), _ms(self._timeout)], self._timeout)[0]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        self._call(WAIT, [_ms(seconds), *(k.encode() for k in keys)], seconds)

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [k.encode() for k in keys], self._timeout)[0] == b"1"

    def close(self) -> None:
        """End the connection for good; a request waiting on it fails at once. Never blocks:
        a request in flight closes the socket as it fails."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _call(self, op: int, parts: list[bytes], seconds: float) -> list[bytes]:
        deadline = time.monotonic() + seconds + 5.0  # the store answers a timed-out wait
        request = pack(op, parts)
        with self._lock:
            # A connection that broke while idle shows only when used: every request is
            # idempotent, so it is made once more on a new connection.
            for fresh in (self._sock is None, True):
                try:
                    sock = self._connected(deadline)
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    sock.sendall(request)
                    status, length = struct.unpack("!BI", _read(sock, 5))
                    if length > MAX_REQUEST:
                        raise ConnectionError("the store's answer is too long")
                    reply = unpack(_read(sock, length))
                    break
                except (OSError, struct.error, ValueError) as exc:
                    self._drop()
                    if fresh or self._closed or isinstance(exc, TimeoutError):
                        where = f"{self.host}:{self.port}"
                        raise RuntimeError(f"the sender's store at {where}: {exc}") from exc
        if status == OK:
            return reply
        text = reply[0].decode(errors="replace") if reply else "no reason given"
        # RuntimeError, as torch's own stores raise: callers treat it as a failed transfer.
        if status == TIMEOUT:
            raise RuntimeError(f"the sender's store: {text}")
        raise RuntimeError(f"the sender's store refused a request: {text}")

    def _connected(self, deadline: float) -> socket.socket:
        if self._closed:
            raise ConnectionError("the client is closed")
        if self._sock is not None:
            return self._sock
        sock = socket.create_connection(
            (self.host, self.port), timeout=max(0.001, deadline - time.monotonic())
        )
        self._sock = sock  # from here on, close() can interrupt the handshake
        if self._closed:
            raise ConnectionError("the client is closed")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _read(sock, len(MAGIC) + NONCE)
        if not hello.startswith(MAGIC):
            raise ConnectionError("the port does not serve an aiowsync store")
        sock.sendall(proof(self.secret, hello[len(MAGIC) :]))
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _ms(seconds: float) -> bytes:
    return str(max(1, min(3_600_000, int(seconds * 1000)))).encode()


def _read(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
