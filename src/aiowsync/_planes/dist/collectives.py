"""Collectives on groups of our own: forming one process group on a store, and waiting on
its work with a deadline.

torch's own limits are set far away (gloo's while it connects excepted): every wait here takes
the caller's deadline instead. A group torn down is reaped in a thread of its own.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Any, Literal, TypeAlias

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from aiowsync._exceptions import TransportError

from .store import group_prefix

__all__ = ["Backend", "finish", "new_group", "reap", "seconds_left"]

Backend: TypeAlias = Literal["gloo", "nccl"]

_CONNECT_TIMEOUT = 2.0
"""gloo's own limit while a group forms (see :func:`new_group`)."""

_OP_TIMEOUT = datetime.timedelta(hours=1)
"""The groups' own limit on one send or receive. Deadlines are enforced by each wait instead:
a cached group outlives the deadline of the send that formed it."""


def seconds_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError("the transfer ran out of time")
    return left


_DEVICES = 2
"""gloo devices of a group: on loopback with two cores, two made a star's 64 MiB sends to 4
members 0.81-0.95x gloo's broadcast, against 0.94-1.13x with one (docs/adr/0069)."""


def new_group(
    backend: Backend,
    store: Store,
    name: str,
    rank: int,
    size: int,
    hostname: str,
    timeout: float,
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks under prefix ``name``: blocks until all have joined."""
    # gloo's own timeout also bounds connecting to the members once they have published
    # their addresses, which it tries several times over: a member that died just after
    # publishing held the others for about five times that timeout. So gloo gets a short
    # one, and waiting for members that are slow to join keeps the whole ``timeout``.
    # (The view must outlive the constructor: torch keeps only its C++ half.)
    view = _KeyWaits(store, timeout)
    prefixed = PrefixStore(group_prefix(name), view)
    span = datetime.timedelta(seconds=min(timeout, _CONNECT_TIMEOUT))
    pg: Any
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = span
        # Two devices, so two I/O threads: consecutive buckets (tags) alternate between them,
        # and the sends of one bucket are written while the other's are. (Two entries of one
        # device would be two contexts on that device's single thread.)
        options._devices = [
            dist.ProcessGroupGloo.create_device(hostname=hostname) for _ in range(_DEVICES)
        ]
        pg = dist.ProcessGroupGloo(prefixed, rank, size, options)
    elif backend == "nccl":  # pragma: no cover - needs GPUs
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = span
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, nccl_options)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # ``timeout`` bounded the rendezvous above; from here on each wait has its own deadline.
    set_default = getattr(pg, "_set_default_timeout", None)
    if set_default is not None:
        set_default(_OP_TIMEOUT)
    del view  # the group formed: its members are connected, and the store is not used again
    return pg  # type: ignore[no-any-return]


class _KeyWaits(Store):
    """``store`` whose waits for keys take ``limit`` seconds, whatever limit the caller gives."""

    def __init__(self, store: Store, limit: float) -> None:
        super().__init__()
        self._store = store
        self._limit = datetime.timedelta(seconds=limit)

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        del timeout
        self._store.wait(keys, self._limit)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)


def finish(work: Any, backend: Backend, timeout: float, device: torch.device) -> None:
    """Wait for one send or receive for at most ``timeout`` seconds."""
    # c10d keeps whole milliseconds and reads 0 as "no limit" (the group's own, far longer).
    work.wait(datetime.timedelta(milliseconds=max(1, math.ceil(timeout * 1000))))
    if backend == "nccl":  # pragma: no cover - needs GPUs
        torch.cuda.synchronize(device)


def reap(*objects: Any) -> None:
    """Drop the last references to ``objects`` (process groups, their pending work) in a
    daemon thread: a group torn down closes its connections, so that its other members fail
    at once, but the teardown itself may wait on them."""
    if any(o is not None for o in objects):
        threading.Thread(target=_hold, args=objects, name="aiowsync-reap", daemon=True).start()


def _hold(*objects: Any) -> None:
    """Nothing: the thread's arguments go when it ends, and with them the objects."""
