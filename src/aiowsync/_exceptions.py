"""Every error aiowsync raises, in one shallow tree keyed by cause.

Third-party errors (zmq, c10d, OS) are translated into these at the edge so that callers only
ever need to catch :class:`WeightSyncError`.

May import: nothing of aiowsync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = [
    "ConnectError",
    "ConnectFailedError",
    "ExperimentalWarning",
    "LayoutMismatchError",
    "LostDuringSendError",
    "NotConnectedError",
    "ProtocolError",
    "RefusedError",
    "RemoteApplyError",
    "SenderGoneError",
    "SlotsFull",
    "TransportError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WorkerLostError",
]


def _ids(worker_ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(worker_ids)))


class WeightSyncError(Exception):
    """Base class of every error raised by aiowsync.

    Errors raised by ``send()`` after a version was announced also carry ``version`` (the
    version that was sent) and ``acked`` (the workers that now run it).
    """

    version: int | None = None
    acked: tuple[int, ...] = ()


class ProtocolError(WeightSyncError):
    """A control message was malformed, oversized, unknown or arrived out of state."""


class TransportError(WeightSyncError):
    """The control channel or a data plane failed (socket closed, peer unreachable, I/O error)."""


class NotConnectedError(TransportError):
    """The operation needs a live connection that does not exist (yet, or any more)."""


class SenderGoneError(NotConnectedError):
    """A receiver's sender said goodbye (``closed`` is True) or was lost (False).

    Raised at once by ``wait_for_version`` and ``receive`` from then on. The model keeps the
    version it runs, ``version``; ``reason`` is the sender's goodbye or what the receiver saw.
    """

    def __init__(self, worker_idx: int, version: int, reason: str, *, closed: bool) -> None:
        self.version = version
        self.reason = reason
        self.closed = closed
        what = "closed" if closed else "was lost"
        super().__init__(
            f"the sender {what} ({reason}); worker {worker_idx} keeps version {version}"
        )


class ConnectError(WeightSyncError):
    """The handshake could not be completed."""


class RefusedError(ConnectError):
    """The sender refused this receiver; ``reason`` holds the sender's explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused by sender: {reason}")
        self.reason = reason


class LayoutMismatchError(WeightSyncError, ValueError):
    """Weights do not match the layout they are checked against.

    ``differences`` lists one human-readable line per differing key.
    """

    def __init__(self, differences: Iterable[str], *, context: str = "weights") -> None:
        self.differences = tuple(differences)
        lines = "\n  ".join(self.differences)
        super().__init__(f"{context} do not match the layout:\n  {lines}")


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A deadline passed; ``worker_ids`` names the workers that had not answered."""

    def __init__(self, message: str, worker_ids: Iterable[int] = ()) -> None:
        self.worker_ids = _ids(worker_ids)
        if self.worker_ids:
            message = f"{message} (workers {list(self.worker_ids)})"
        super().__init__(message)


class ConnectFailedError(ConnectError, WeightSyncTimeout):
    """The sender's ``connect()`` cannot succeed: every worker still missing was refused (its
    model does not match, it could not start its receiver) or is lost.

    Raised as soon as that is known, not at the deadline; ``worker_ids`` names the missing
    workers and ``reasons`` says, by worker, why. It is also a :class:`WeightSyncTimeout`, the
    error the wait would have ended with, so code that caught that still catches it.
    """

    def __init__(self, message: str, reasons: Mapping[int, str]) -> None:
        ids = _ids(reasons)
        WeightSyncError.__init__(self, message)
        self.worker_ids = ids
        self.reasons = dict(sorted(reasons.items()))


class WorkerLostError(WeightSyncError):
    """A targeted worker is known to be lost (missed heartbeats or disconnected)."""

    def __init__(self, message: str, worker_ids: Iterable[int] = ()) -> None:
        self.worker_ids = _ids(worker_ids)
        super().__init__(f"{message} (workers {list(self.worker_ids)})")


class LostDuringSendError(WorkerLostError, WeightSyncTimeout):
    """A targeted worker was lost while a ``send()`` waited for it.

    It will never acknowledge, so this is also a :class:`WeightSyncTimeout` (and a
    ``TimeoutError``), raised once the loss is known instead of at the deadline (with the
    distributed scheme, once the transfer to the others has ended too). The workers that did
    acknowledge are in ``acked`` and run the new version.
    """

    def __init__(self, message: str, worker_ids: Iterable[int] = ()) -> None:
        ids = _ids(worker_ids)
        WeightSyncError.__init__(self, f"{message} (workers {list(ids)})")
        self.worker_ids = ids


class SlotsFull(WeightSyncError):
    """No slot is free for a new version: every slot holds a version still in use (a worker
    runs it, has not answered it yet, or leases it) and ``max_slots`` exist already.

    ``send()`` and ``publish()`` wait for one to be released while a worker may still release
    it (an answer to come, a lease held), and raise this at their stage deadline; at once when
    only the versions the workers run are in use (a lagging worker moves on only when a
    version is sent to it). Nothing is staged or announced: ``version`` is None.
    """


class RemoteApplyError(WeightSyncError):
    """One or more receivers failed to apply an update; ``errors`` maps worker index to text."""

    def __init__(self, version: int, errors: Mapping[int, str]) -> None:
        self.version = version
        self.errors = dict(sorted(errors.items()))
        self.worker_ids = tuple(self.errors)
        detail = "; ".join(f"worker {w}: {text}" for w, text in self.errors.items())
        super().__init__(f"version {version} was not applied by {list(self.worker_ids)}: {detail}")


class ExperimentalWarning(UserWarning):
    """A feature that has not yet been proven where it is meant to run (``backend="nccl"``)."""
