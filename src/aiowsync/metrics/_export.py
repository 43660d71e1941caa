"""``export(scheme)``: a scheme's metrics in a Prometheus registry, until ``close()``.

All the schemes exported to one registry share one collector there, so that each metric is
exposed once, with a sample per scheme (a registry refuses two collectors of the same names).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

from .._scheme.scheme import WeightSyncScheme
from ._collect import Families, ReceiverSource, SenderSource, Source
from ._tally import DEFAULT_BUCKETS, SendTally, checked_buckets

__all__ = ["Exporter", "export"]


class _Collector:
    """The collector of one registry: every scheme exported to it."""

    def __init__(self) -> None:
        self.sources: list[Source] = []

    def describe(self) -> Iterable[Metric]:
        return list(Families())  # the names, without samples: the registry checks them

    def collect(self) -> Iterable[Metric]:
        families = Families()
        for source in list(self.sources):
            source.add_to(families)
        return [family for family in families if family.samples]


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, _Collector] = weakref.WeakKeyDictionary()
"""The collector each registry holds, while a scheme is exported to it."""
_lock = threading.Lock()


class Exporter:
    """What :func:`export` returns: the scheme's metrics stay in the registry until
    :meth:`close` (or the end of ``with``).

    Closing stops counting the scheme's sends, and takes a receiver's hook away.
    """

    def __init__(
        self, scheme: WeightSyncScheme, registry: CollectorRegistry, source: Source
    ) -> None:
        self.scheme = scheme
        """The exported scheme."""
        self.registry = registry
        """The registry its metrics are in."""
        self._source = source
        self._stop_observing = (
            scheme._observe_sends(source.tally.record) if isinstance(source, SenderSource) else None
        )
        self.closed = False

    def close(self) -> None:
        """Take the scheme's metrics out of the registry; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._stop_observing is not None:
            self._stop_observing()
        if isinstance(self._source, ReceiverSource):
            with contextlib.suppress(ValueError):  # the receiver's fast path comes back
                self.scheme._hooks.remove(self._source.count)
        with _lock:
            collector = _collectors.get(self.registry)
            if collector is None or self._source not in collector.sources:
                return
            collector.sources.remove(self._source)
            if not collector.sources:
                self.registry.unregister(collector)
                del _collectors[self.registry]

    def __enter__(self) -> Exporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        source = self._source
        who = source.role if source.worker is None else f"{source.role} {source.worker}"
        state = "closed" if self.closed else "exporting"
        return f"Exporter({who} of {source.model_id!r}, {state})"


def export(
    scheme: WeightSyncScheme,
    registry: CollectorRegistry | None = None,
    *,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    count_applied: bool = True,
) -> Exporter:
    """Expose ``scheme``'s metrics in ``registry`` (prometheus_client's default registry if
    None), from now until the returned exporter is closed.

    Call it after ``init_on_sender()`` or ``init_on_receiver()``, before or inside
    ``async with``. Every metric and its labels: the Metrics page of the docs. Serve the
    registry with :func:`serve`, or any of prometheus_client's servers.

    Args:
        scheme: a sender or a receiver.
        registry: where the metrics go; several schemes may share one, each with its own
            ``model_id`` (and, for receivers, worker index).
        buckets: senders only: upper bounds, in seconds, of the send and stage duration
            histograms.
        count_applied: receivers only: count the versions applied
            (``aiowsync_receiver_versions_applied_total``) with a hook. A receiver with a
            hook switches each version from its update task, not at once where the update
            arrives: some tens of microseconds more per version. False leaves the counter
            out and the receiver as it was.

    Raises:
        RuntimeError: ``scheme`` is neither a sender nor a receiver yet.
        ValueError: a scheme of the same role, ``model_id`` (and worker index) already
            exports to ``registry``, or ``buckets`` are not increasing positive seconds.
    """
    registry = REGISTRY if registry is None else registry
    source: Source
    if scheme.initialized_on_sender:
        source = SenderSource(scheme, SendTally(checked_buckets(buckets)))
    elif scheme.initialized_on_receiver:
        source = ReceiverSource(scheme, count_applied=count_applied)
    else:
        raise RuntimeError(
            "export() needs a scheme initialised as a sender or a receiver: call "
            "init_on_sender() or init_on_receiver() first"
        )
    with _lock:
        collector = _collectors.get(registry)
        fresh = collector is None
        if collector is None:
            collector = _Collector()
        for other in collector.sources:
            if (other.role, other.model_id, other.worker) == (
                source.role,
                source.model_id,
                source.worker,
            ):
                who = "sender" if source.worker is None else f"receiver {source.worker}"
                raise ValueError(
                    f"a {who} of model_id {source.model_id!r} already exports to this "
                    "registry: give each scheme its own model_id, or each its own registry"
                )
        if fresh:
            registry.register(collector)  # raises if other collectors hold these names
            _collectors[registry] = collector
        collector.sources.append(source)
    if isinstance(source, ReceiverSource) and count_applied:
        scheme.register_hook(source.count)
    return Exporter(scheme, registry, source)
