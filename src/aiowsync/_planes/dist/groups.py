"""Process groups of our own, and the store they form in.

The sender runs a store (:mod:`aiowsync._planes.dist.store`, bound to the data host only and
open only to holders of its secret) and creates one process group per set of receivers it sends
to, with itself as rank 0. A group is named by a random token and used as a prefix in the store, so
groups never collide and the user's default group is never touched. Groups are cached by
their members (worker index and session, so a restarted worker gets new groups); a group whose
collective failed is dropped at once, which closes its connections and makes every member's
pending receive fail quickly instead of timing out. A dropped group's keys leave the store.

Every blocking call here runs in a worker thread and has a deadline.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias
from urllib.parse import urlsplit

from torch._C._distributed_c10d import Store

from aiowsync._exceptions import TransportError

from ..base import Member, Params
from .collectives import Backend, new_group, reap, seconds_left
from .store import StoreServer
from .store_client import StoreClient

__all__ = [
    "FORM_TIMEOUT",
    "Group",
    "ReceiverGroups",
    "SenderGroups",
    "Topology",
    "host_of",
    "local_ip_towards",
]

log = logging.getLogger("aiowsync.dist")

Topology: TypeAlias = Literal["star", "chain"]
"""How a version travels to a group's members: from the sender to each (star), or from each
member to the next (chain)."""

FORM_TIMEOUT = 10.0
"""The longest a new group of a send may take to form, whatever the transfer's deadline: a
member that never joins fails the transfer early, so that its retry on a fresh group still has
time. A group that brings a joining worker up to date has no retry, and may take its whole
deadline (a worker starting beside many others on a busy host may be slow to join)."""

_STORE_TIMEOUT = 60.0
"""The sender's limit on one store request; every wait that matters has its own deadline."""

_MAX_GROUPS = 8
"""Idle groups each side keeps: each holds connections to all its members."""

_DEAD_NAMES = 256
"""Names of failed groups a receiver remembers, so that an update naming one fails at once."""


def host_of(address: str) -> str:
    """The host part of a ``tcp://host:port`` address."""
    host = (urlsplit(address).hostname or "").strip("[]")
    if not host:
        raise ValueError(f"no host in address {address!r}")
    return host


def local_ip_towards(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


@dataclass(slots=True)
class Group:
    """One of the sender's groups: the route a transfer to its members takes."""

    name: str
    members: tuple[Member, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)
    dropped: bool = False
    users: int = 0  # routes handed out whose transfer has not ended
    pg: Any = None
    last_used: float = 0.0
    patient: bool = False
    """It brings a joining worker up to date: it may take the transfer's whole deadline to
    form (there is no second attempt to leave time for)."""

    @property
    def workers(self) -> list[int]:
        return [w for w, _ in self.members if w >= 0]


class SenderGroups:
    """The sender's store and its cache of groups, with itself as rank 0 of each."""

    def __init__(self, *, backend: Backend, host: str, form_timeout: float) -> None:
        self.backend: Backend = backend
        self.host = host
        self.form_timeout = form_timeout
        self.port = 0
        self.last: set[int] = set()
        """Workers that chains put last (they forwarded bytes that were not the sender's)."""
        self._table: dict[tuple[Member, ...], Group] = {}
        self._lock = threading.Lock()
        self.store = StoreServer(host)
        self._client: StoreClient | None = None
        self._closed = False

    @property
    def secret(self) -> bytes:
        """What receivers answer the store's challenge with (it travels in the welcome)."""
        return self.store.secret

    def open(self) -> None:
        """Start the store; :attr:`port` says where receivers reach it."""
        self.store.open()
        self.port = self.store.port
        self._client = StoreClient(self.host, self.port, self.store.secret, _STORE_TIMEOUT)

    def route(self, members: Sequence[Member], purpose: str = "") -> Group:
        """The group for ``members``, created on first use and not evicted until :meth:`done`
        was called for it (``purpose`` keeps groups of different uses apart)."""
        # Sorted, so that the same members make the same group (and chain order), but the
        # members kept from forwarding come last.
        key = (*sorted(members, key=lambda m: (m[0] in self.last, m)), (-1, purpose))
        with self._lock:
            group = self._table.get(key)
            if group is None:
                group = Group(secrets.token_hex(8), key, patient=purpose == "join")
                self._table[key] = group
                self.store.allow(group.name, len(group.workers) + 1)
            group.last_used = time.monotonic()
            group.users += 1
            self._evict()
        return group

    def params(self, group: Group, timeout: float) -> Params:
        """What the members of ``group`` need to take part in a transfer on it."""
        return {
            "group": group.name,
            "members": ",".join(str(w) for w in group.workers),
            "timeout_ms": max(1, int(timeout * 1000)),
            "form_ms": max(1, int(self._form_within(group, timeout) * 1000)),
        }

    def _form_within(self, group: Group, left: float) -> float:
        """How long ``group`` may take to form when ``left`` seconds of its deadline remain."""
        return left if group.patient else min(left, self.form_timeout)

    def run(self, group: Group, deadline: float, send: Callable[[Any], None]) -> None:
        """``send(pg)`` on ``group``'s process group, formed first if it is new; one transfer
        on a group at a time."""
        if not group.lock.acquire(timeout=seconds_left(deadline)):
            raise TransportError("another transfer on the same group did not finish in time")
        try:
            with self._lock:
                if group.dropped:
                    raise TransportError("its group was torn down after an earlier failure")
                pg = group.pg
            if pg is None:
                form = self._form_within(group, seconds_left(deadline))
                size = len(group.workers) + 1
                pg = new_group(
                    self.backend, self._need_store(), group.name, 0, size, self.host, form
                )
                with self._lock:
                    if group.dropped:  # dropped while it formed: never reuse its name
                        raise TransportError("its group was torn down while it formed")
                    group.pg = pg
            send(pg)
        finally:
            group.last_used = time.monotonic()
            group.lock.release()

    def done(self, group: Group, *, failed: bool) -> None:
        """The transfer on a route from :meth:`route` ended; a failed one's group is no
        longer handed out (call :meth:`drop` next, outside any exception handler)."""
        with self._lock:
            # Out of the table before it counts as unused: route() must not hand it out.
            if failed and self._table.get(group.members) is group:
                self._table.pop(group.members)
            group.users -= 1

    def drop(self, group: Group) -> None:
        """Let ``group``'s connections go, so that its other members fail fast."""
        with self._lock:
            if self._table.get(group.members) is group:
                self._table.pop(group.members)
            pg = group.pg
            self._retire(group)
        # The last reference, let go outside the lock: its connections close, members fail fast.
        del pg

    def forget(self, worker: int) -> None:
        """Drop every group that counts ``worker`` (lost, replaced or gone)."""
        with self._lock:
            for key in [k for k in self._table if any(w == worker for w, _ in k)]:
                self._retire(self._table.pop(key))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            groups = list(self._table.values())
            self._table.clear()
            client, self._client = self._client, None
        for group in groups:
            group.pg = None
        if client is not None:
            client.close()
        self.store.close()

    def _need_store(self) -> Store:
        client = self._client
        if client is None or self._closed:
            raise TransportError("the distributed plane is closed")
        return client

    def _evict(self) -> None:
        idle = sorted((g for g in self._table.values() if g.users == 0), key=lambda g: g.last_used)
        while len(self._table) > _MAX_GROUPS and idle:
            group = idle.pop(0)
            self._table.pop(group.members, None)
            self._retire(group)

    def _retire(self, group: Group) -> None:
        """Mark ``group`` dropped, let its connections go and its keys leave the store (call
        with the lock held). A dropped group's name is never used again."""
        if not group.dropped:
            self.store.forget(group.name)
        group.dropped, group.pg = True, None


class ReceiverGroups:
    """A receiver's connection to the sender's store and the groups it joined, by name."""

    def __init__(self, backend: Backend) -> None:
        self.backend: Backend = backend
        self._store: StoreClient | None = None
        self._table: dict[str, tuple[Any, float]] = {}
        self._dead: dict[str, None] = {}  # names of groups that failed (oldest first)
        self._closed = False
        self._lock = threading.Lock()

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def cached(self, name: str) -> Any:
        """The process group joined as ``name``, or None."""
        with self._lock:
            entry = self._table.get(name)
        return None if entry is None else entry[0]

    def join(
        self,
        store_at: tuple[str, int, bytes],
        name: str,
        rank: int,
        size: int,
        hostname: str,
        deadline: float,
        form: float,
    ) -> Any:
        """Join group ``name`` as ``rank``, blocking until all ``size`` ranks have, for at
        most ``form`` seconds. ``store_at`` is the store's host, port and secret."""
        store = self._need_store(*store_at)
        return new_group(
            self.backend, store, name, rank, size, hostname, min(seconds_left(deadline), form)
        )

    def keep(self, name: str, pg: Any) -> None:
        """Cache ``pg`` after a transfer on it succeeded (unless closed meanwhile)."""
        with self._lock:
            if self._closed:
                return  # the group goes with its caller, not into a cache
            self._table[name] = (pg, time.monotonic())
            while len(self._table) > _MAX_GROUPS:
                self._discard(min(self._table, key=lambda n: self._table[n][1]))

    def discard(self, name: str, *also: Any) -> None:
        """Forget group ``name`` for good; its process group (and ``also``: the failed
        transfer's own references to it) is let go in a thread of its own, since tearing it
        down can take a while and the caller's failure must be reported now."""
        with self._lock:
            entry = self._discard(name)
        reap(entry, *also)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._table.clear()
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _need_store(self, host: str, port: int, secret: bytes) -> StoreClient:
        """The client for the store at ``host:port``; it connects on its first request (and
        again after its connection broke), outside any lock of ours."""
        with self._lock:
            if self._closed:
                raise TransportError("the receiver is closed")
            store = self._store
            if store is None or (store.host, store.port, store.secret) != (host, port, secret):
                self._store = store = StoreClient(host, port, secret, _STORE_TIMEOUT)
            return store

    def _discard(self, name: str) -> Any:
        """Forget group ``name`` for good (call with the lock held); its cache entry.

        Its connections close, and its name is remembered as dead: a group's rendezvous keys
        stay in the store, so joining a second group under the same name would hang. An
        update naming it fails at once instead, and the sender retries on a fresh group.
        """
        entry = self._table.pop(name, None)
        self._dead[name] = None
        while len(self._dead) > _DEAD_NAMES:
            self._dead.pop(next(iter(self._dead)))
        return entry
