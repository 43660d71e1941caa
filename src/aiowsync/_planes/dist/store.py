"""The rendezvous store of the distributed plane: open to holders of a secret only, and bounded.

Process groups form in a key-value store: every member writes its address under the group's
name and reads the others'. torch's ``TCPStore`` answers anyone who reaches its port, keeps
whatever it is sent, and lists its keys on request; so an outsider could read which groups
form and where their members listen, grow the trainer's memory without bound, and break group
formation with keys of its own. This store replaces it:

- A connection gets a random challenge and must answer with its HMAC under the sender's
  secret, which receivers learn from the welcome (so only peers the control channel let in
  know it). Nothing else is read before that answer, which must come within a few seconds;
  a bounded number of connections may be waiting to answer at once, and the others are closed
  on arrival.
- It holds only what groups need: keys of the groups the sender announced (and of no other),
  one per member and device, each value a few kilobytes at most. A dropped group's keys go
  with it.
- It does only what gloo asks of a store (set, get, wait and check). Nothing lists keys.

The server runs an event loop of its own in a daemon thread; the client that the sender and
each receiver hand to torch is in :mod:`aiowsync._planes.dist.store_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiowsync._exceptions import TransportError

__all__ = [
    "CHECK",
    "GET",
    "MAGIC",
    "MAX_REQUEST",
    "NONCE",
    "OK",
    "SET",
    "TIMEOUT",
    "WAIT",
    "StoreServer",
    "group_prefix",
    "pack",
    "proof",
    "unpack",
]

log = logging.getLogger("aiowsync.dist")

MAGIC = b"aiowsync-store-1\n"
NONCE = 16
_PROOF = 32  # an HMAC-SHA256
_HANDSHAKE = 5.0
"""Seconds a connection has to answer the challenge."""
_MAX_PENDING = 64
"""Connections that may be waiting to answer the challenge at once."""
MAX_REQUEST = 64 * 1024
_MAX_KEY = 256
_MAX_VALUE = 4096
"""A member's address as gloo writes it is about 170 bytes."""
_MAX_DEVICES = 8
"""Keys a member may write per group (gloo writes one per device; we use two)."""

SET, GET, WAIT, CHECK = 1, 2, 3, 4
OK, ERROR, TIMEOUT = 0, 1, 2
_KEY = re.compile(r"aiowsync/([0-9a-f]{16})//(\d{1,3})/(\d{1,6})")


def group_prefix(name: str) -> str:
    """The prefix under which group ``name`` forms."""
    return f"aiowsync/{name}/"


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def pack(op: int, parts: Sequence[bytes]) -> bytes:
    body = struct.pack("!H", len(parts)) + b"".join(struct.pack("!I", len(p)) + p for p in parts)
    return struct.pack("!BI", op, len(body)) + body


def unpack(body: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("!H", body)
    parts, at = [], 2
    for _ in range(count):
        (size,) = struct.unpack_from("!I", body, at)
        at += 4
        if at + size > len(body):
            raise ValueError("a part runs past the end of the message")
        parts.append(body[at : at + size])
        at += size
    if at != len(body):
        raise ValueError("bytes after the last part")
    return parts


class _StoreError(Exception):
    """A request the store refuses (its text goes back to the client)."""


class StoreServer:
    """The sender's store: a TCP listener on ``host`` served by a thread of its own."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.secret = secrets.token_bytes(32)
        self.port = 0
        self.refused = 0
        """Connections closed for a wrong or missing answer to the challenge."""
        self._lock = threading.Lock()
        self._groups: dict[str, int] = {}  # announced group -> its size
        self._values: dict[str, bytes] = {}
        self._pending: dict[asyncio.Task[Any], None] = {}
        """Connections still to answer the challenge, oldest first."""
        self._waiters: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None

    # -- the sender's side --------------------------------------------------------------------

    def open(self) -> None:
        """Start listening; :attr:`port` says where."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.host, 0))
            listener.listen(256)
        except BaseException:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, sock=listener, limit=MAX_REQUEST)
                )
                self._loop = loop
            except BaseException as exc:
                failed.append(exc)
                listener.close()
                loop.close()
                return
            finally:
                started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="aiowsync-store", daemon=True)
        self._thread.start()
        if not started.wait(10) or failed:
            raise TransportError(f"the store could not start: {failed[0] if failed else 'hung'}")

    def allow(self, name: str, size: int) -> None:
        """Accept the keys of group ``name`` of ``size`` members."""
        with self._lock:
            self._groups[name] = size

    def forget(self, name: str) -> None:
        """Drop group ``name`` and its keys."""
        prefix = group_prefix(name)
        with self._lock:
            self._groups.pop(name, None)
            for key in [k for k in self._values if k.startswith(prefix)]:
                del self._values[key]
        self._wake()

    def held_keys(self) -> list[str]:
        """The keys held (for tests and diagnostics, on the sender only)."""
        with self._lock:
            return list(self._values)

    def close(self) -> None:
        """Stop serving and end every connection (waits a few seconds at most)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.get_running_loop().stop()

        with contextlib.suppress(RuntimeError):  # the loop is gone already
            asyncio.run_coroutine_threadsafe(stop(), loop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the store's thread -------------------------------------------------------------------

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if await self._admitted(reader, writer):
                while True:
                    op, length = struct.unpack("!BI", await reader.readexactly(5))
                    if length > MAX_REQUEST:
                        return
                    reply = await self._answer(op, await reader.readexactly(length))
                    writer.write(reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:  # let go while answering, or the store closes
            self.refused += 1
        except Exception as exc:  # a bad request ends its connection, never the store
            log.debug("store connection closed: %s", exc)
        finally:
            writer.close()

    async def _admitted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the peer answered the challenge. When too many peers are still answering,
        the one waiting longest is let go: silent connections cannot keep members out."""
        if len(self._pending) >= _MAX_PENDING:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.cancel()
        me = asyncio.current_task()
        assert me is not None
        self._pending[me] = None
        try:
            nonce = secrets.token_bytes(NONCE)
            writer.write(MAGIC + nonce)
            answer = await asyncio.wait_for(reader.readexactly(_PROOF), _HANDSHAKE)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            answer = b""
        finally:
            self._pending.pop(me, None)
        if not hmac.compare_digest(answer, proof(self.secret, nonce)):
            self.refused += 1
            return False
        return True

    async def _answer(self, op: int, body: bytes) -> bytes:
        try:
            parts = unpack(body)
            if op == SET and len(parts) == 2:
                self._set(self._key(parts[0]), parts[1])
                return pack(OK, [])
            if op == GET and len(parts) == 2:
                key = self._key(parts[0])
                await self._until([key], _millis(parts[1]))
                with self._lock:
                    value = self._values.get(key)
                if value is None:
                    raise _StoreError(f"key {key!r} is gone (its group was dropped)")
                return pack(OK, [value])
            if op == WAIT and parts:
                keys = [self._key(p) for p in parts[1:]]
                await self._until(keys, _millis(parts[0]))
                return pack(OK, [])
            if op == CHECK:
                keys = [self._key(p) for p in parts]
                with self._lock:
                    held = all(k in self._values for k in keys)
                return pack(OK, [b"1" if held else b"0"])
            raise _StoreError(f"unknown request {op} with {len(parts)} parts")
        except TimeoutError as exc:
            return pack(TIMEOUT, [str(exc).encode()])
        except (_StoreError, ValueError, struct.error) as exc:
            return pack(ERROR, [str(exc).encode()])

    def _key(self, raw: bytes) -> str:
        if len(raw) > _MAX_KEY:
            raise _StoreError("key too long")
        key = raw.decode("ascii", errors="replace")
        match = _KEY.fullmatch(key)
        if match is None:
            raise _StoreError(f"key {key[:80]!r} is not one a group writes")
        name, device, rank = match[1], int(match[2]), int(match[3])
        with self._lock:
            size = self._groups.get(name)
        if size is None:
            raise _StoreError(f"no group {name} is forming")
        if device >= _MAX_DEVICES or rank >= size:
            raise _StoreError(f"key {key!r} is out of group {name}'s range")
        return key

    def _set(self, key: str, value: bytes) -> None:
        if len(value) > _MAX_VALUE:
            raise _StoreError(f"a value of {len(value)} bytes is more than a member's address")
        with self._lock:
            self._values[key] = value
        self._resolve()

    async def _until(self, keys: list[str], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        loop = asyncio.get_running_loop()
        groups = {key.split("/")[1] for key in keys}
        while True:
            with self._lock:
                if all(k in self._values for k in keys):
                    return
                if dropped := sorted(groups - self._groups.keys()):
                    # A member was lost while the group formed: its other members learn it
                    # now, not at their forming limit, and their retry forms a fresh group.
                    raise _StoreError(f"group {dropped[0]} was dropped while it formed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {seconds:.1f} s waiting for keys {keys}")
            waiter = loop.create_future()
            self._waiters.add(waiter)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, left)
            self._waiters.discard(waiter)


def _millis(raw: bytes) -> float:
    value = int(raw)
    if not 0 <= value <= 3_600_000:
        raise _StoreError(f"a wait of {value} ms is out of range")
    return value / 1000
