"""What an exporter counts between scrapes: what each send came to, and versions applied.

The sender's event loop records; the HTTP server's thread reads a copy at each scrape. Each
tally has a lock of its own, held for a few additions or one copy.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._exceptions import RemoteApplyError, WeightSyncError
from .._sending.outcome import SendResult

__all__ = ["DEFAULT_BUCKETS", "Histogram", "SendTally", "checked_buckets"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
"""Upper bounds of the duration histograms, in seconds: from a small model over shared memory
(half a millisecond) to a large one over the network (minutes)."""

_DIGEST = "DigestMismatch:"
"""How a receiver's nack begins when the bytes it fetched were not those the sender digested
(a nack carries ``Type: message`` of the receiver's error)."""


@dataclass(slots=True)
class Histogram:
    """Counts of observed values under each bound, and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """One per bound, and a last one for values above every bound (not cumulative)."""
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # A bound counts the values up to and including it, as Prometheus's ``le`` does.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of values <= le)`` for each bound, then ``+Inf``: the buckets in the
        form Prometheus exposes."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


@dataclass(slots=True)
class SendTally:
    """What the sends of one sender came to, since the exporter began."""

    bounds: tuple[float, ...] = DEFAULT_BUCKETS
    seconds: Histogram = field(init=False)
    """``SendResult.seconds`` of each send that succeeded."""
    stage_seconds: Histogram = field(init=False)
    """``SendResult.stage_seconds`` of each send that succeeded."""
    nbytes: int = 0
    retries: int = 0
    """``SendResult.retries``, summed: further attempts for workers whose transfer failed."""
    retried: Counter[int] = field(default_factory=Counter)
    """By worker, the sends that needed another attempt for it."""
    failures: Counter[str] = field(default_factory=Counter)
    """By error class, the sends that raised a :class:`WeightSyncError`."""
    nacks: Counter[int] = field(default_factory=Counter)
    """By worker, versions it failed to apply, as a :class:`RemoteApplyError` names them."""
    digest_failures: Counter[int] = field(default_factory=Counter)
    """By worker, the nacks that say its bytes differed from the sender's digest."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.seconds = Histogram(self.bounds)
        self.stage_seconds = Histogram(self.bounds)

    def record(self, outcome: SendResult | Exception) -> None:
        """Count what one send came to. Errors other than aiowsync's (a wrong argument, a
        send outside ``async with``) say nothing about the fleet and are not counted."""
        with self._lock:
            if isinstance(outcome, SendResult):
                self.seconds.observe(outcome.seconds)
                self.stage_seconds.observe(outcome.stage_seconds)
                self.nbytes += outcome.nbytes
                self.retries += outcome.retries
                self.retried.update(outcome.retried)
            elif isinstance(outcome, WeightSyncError):
                self.failures[type(outcome).__name__] += 1
                if isinstance(outcome, RemoteApplyError):
                    for worker, text in outcome.errors.items():
                        self.nacks[worker] += 1
                        if text.startswith(_DIGEST):
                            self.digest_failures[worker] += 1

    def snapshot(self) -> SendTally:
        """A copy that later sends leave alone (for one scrape)."""
        with self._lock:
            taken = SendTally(
                bounds=self.bounds,
                nbytes=self.nbytes,
                retries=self.retries,
                retried=Counter(self.retried),
                failures=Counter(self.failures),
                nacks=Counter(self.nacks),
                digest_failures=Counter(self.digest_failures),
            )
            taken.seconds = self.seconds.copy()
            taken.stage_seconds = self.stage_seconds.copy()
            return taken


def checked_buckets(buckets: Sequence[float]) -> tuple[float, ...]:
    """``buckets`` as histogram bounds: positive, finite, increasing, at least one."""
    bounds = tuple(float(b) for b in buckets)
    if not bounds or any(not 0 < b < float("inf") for b in bounds):
        raise ValueError(f"buckets must be positive finite seconds, got {list(buckets)!r}")
    if list(bounds) != sorted(set(bounds)):
        raise ValueError(f"buckets must increase, got {list(buckets)!r}")
    return bounds
