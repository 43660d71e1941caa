"""What a send gives back: its result, or (two-phase) a pending send to await later."""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._exceptions import (
    LostDuringSendError,
    RemoteApplyError,
    WeightSyncError,
    WeightSyncTimeout,
)
from .._util.signal import Flag, Signal

__all__ = ["Answers", "PendingSend", "SendResult", "with_outcome"]

log = logging.getLogger("aiowsync.sender")


@dataclass(frozen=True, slots=True)
class SendResult:
    """What a successful ``send()`` did."""

    version: int
    """The version now live on every targeted worker."""
    worker_ids: tuple[int, ...]
    """The workers that acknowledged it."""
    nbytes: int
    """Bytes staged: those of the models the send moved (all of them but for a partial
    send of several models, which leaves the others as they were), padding included."""
    seconds: float
    """Wall time of the whole call."""
    stage_seconds: float
    """Time spent copying the weights into the data plane."""
    retries: int = 0
    """How many times the version was sent again to workers whose transfer failed (on a
    fresh group, or a fresh chain without a lost member); 0 when the first attempt
    delivered it everywhere."""
    retried: tuple[int, ...] = ()
    """The workers that needed another attempt."""
    superseded: tuple[int, ...] = ()
    """Targeted workers that went straight to a newer version instead (``publish()`` ran
    ahead of them while they lagged): they run a newer version than this one."""
    suspects: tuple[int, ...] = ()
    """Chain members (``topology="chain"``) that passed their own digest check but forwarded
    bytes that failed the next member's: the members after them were sent the version again
    on a chain without them, and later chains put them last, where they forward nothing."""


class PendingSend:
    """A version published with ``scheme.publish()``: staged and announced, with its
    delivery and acknowledgements still under way.

    ``await pending`` gives the :class:`SendResult`, or raises what ``send()`` would have
    raised for it; it may be awaited any number of times, by any task. The trainer's weights
    are free from the moment ``publish()`` returned.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        """The version this send publishes."""
        self._finished = anyio.Event()
        self._result: SendResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the outcome is known (awaiting it then returns at once)."""
        return self._finished.is_set()

    async def wait(self, timeout: float | None = None) -> SendResult:
        """The outcome, as ``await pending`` gives it; ``TimeoutError`` if it is not known
        within ``timeout`` seconds (the send itself goes on, and may be awaited again)."""
        with anyio.fail_after(timeout):
            await self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __await__(self) -> Generator[Any, None, SendResult]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingSend(version={self.version}, {state})"

    async def run(self, outcome: Coroutine[Any, Any, SendResult]) -> None:
        """Run ``outcome`` (the rest of the send) and keep what it gives (in a task group)."""
        try:
            self._result = await outcome
        except anyio.get_cancelled_exc_class():
            self._error = WeightSyncError(
                f"the sender shut down before version {self.version} was acknowledged"
            )
            raise
        except WeightSyncError as exc:
            self._error = exc
            log.debug("published version %d failed: %s", self.version, exc)
        except Exception as exc:  # kept for the awaiting caller, never lost in the group
            self._error = exc
        finally:
            self._finished.set()


@dataclass(slots=True)
class Answers:
    """The answers to one version so far: who is still awaited, who acked, nacked or was
    lost."""

    version: int
    waiting: set[int]
    done: Flag = field(default_factory=Flag)
    acked: set[int] = field(default_factory=set)
    nacks: dict[int, str] = field(default_factory=dict)
    retryable: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    retries: int = 0
    retried: set[int] = field(default_factory=set)
    superseded: set[int] = field(default_factory=set)
    forwarded_by: dict[int, int] = field(default_factory=dict)
    """Chain members whose forwarded bytes failed a member's digest check, by that member."""
    changed: Signal = field(default_factory=Signal)

    @property
    def suspects(self) -> set[int]:
        """Members that forwarded bytes which failed the check, while their own passed (a
        member that failed it too only passed on what it was given)."""
        failed = self.forwarded_by.keys()
        return {k for k in self.forwarded_by.values() if k in self.acked and k not in failed}

    def settle(self, worker: int) -> None:
        self.waiting.discard(worker)
        if not self.waiting:
            self.done.set()
        self.changed.notify()

    def result(self, nbytes: int, seconds: float, stage_seconds: float) -> SendResult:
        """What the send gives once it stopped waiting: its result, or the error that says
        who did not answer, was lost or failed (in that order of precedence; a timeout's text
        also names those lost)."""
        version = self.version
        if missing := sorted(self.waiting):
            message = f"version {version} was not acknowledged in time"
            if self.lost:
                # Those lost are named too: in a chain, their loss is often why the others
                # after them did not answer.
                message += f", and workers {sorted(self.lost)} were lost during the send"
            raise with_outcome(WeightSyncTimeout(message, missing), version, self)
        if self.lost:
            raise with_outcome(
                LostDuringSendError(
                    f"workers were lost during the send of version {version}", self.lost
                ),
                version,
                self,
            )
        if self.nacks:
            raise with_outcome(RemoteApplyError(version, self.nacks), version, self)
        return SendResult(
            version,
            tuple(sorted(self.acked)),
            nbytes,
            seconds,
            stage_seconds,
            retries=self.retries,
            retried=tuple(sorted(self.retried)),
            superseded=tuple(sorted(self.superseded)),
            suspects=tuple(sorted(self.suspects)),
        )

    def reopen(self, workers: list[int]) -> None:
        """``workers`` get another attempt: their failed answers no longer count."""
        if workers:
            self.retries += 1
            self.retried.update(workers)
        for worker in workers:
            self.nacks.pop(worker, None)
            self.retryable.discard(worker)
            self.waiting.add(worker)
        if self.waiting:
            self.done.clear()


def with_outcome(exc: WeightSyncError, version: int, pending: Answers) -> WeightSyncError:
    exc.version = version
    exc.acked = tuple(sorted(pending.acked))
    return exc
