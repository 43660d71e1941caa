"""The metric families, filled at each scrape from what each exported scheme reports then.

A sender's durations, bytes and failures come from its :class:`SendTally`; where each worker
stands is read from ``scheme.workers`` at the scrape. A receiver's figures are read from the
scheme, but for the count of versions it applied, which a hook of the exporter's keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    StateSetMetricFamily,
)

from .._sending.workers import REFUSED, WorkerState, WorkerStatus
from ._tally import SendTally

if TYPE_CHECKING:
    from .._scheme.scheme import WeightSyncScheme

__all__ = ["Families", "ReceiverSource", "SenderSource", "Source"]

log = logging.getLogger("aiowsync.metrics")

STATES: tuple[WorkerState, ...] = get_args(WorkerState)

_READS = 3
"""How many times a scrape reads the worker table before it leaves the workers out: the
sender's loop may change a worker's record while the scrape's thread reads it."""

M, W = ["model_id"], ["model_id", "worker"]


class Families:
    """One scrape's metric families, by name without the ``aiowsync_`` prefix, in the order
    they are exposed."""

    def __init__(self) -> None:
        self.counter: dict[str, CounterMetricFamily] = {}
        self.gauge: dict[str, GaugeMetricFamily] = {}
        self.histogram: dict[str, HistogramMetricFamily] = {}
        self._order: list[Metric] = []

        # The sender: its sends.
        self._histogram(
            "send_seconds", "Wall time of each send that succeeded (SendResult.seconds).", M
        )
        self._histogram(
            "send_stage_seconds",
            "Time each send that succeeded spent copying the weights into the data plane "
            "(SendResult.stage_seconds).",
            M,
        )
        self._counter(
            "sent_bytes", "Bytes staged by the sends that succeeded (SendResult.nbytes).", M
        )
        self._counter("send_failures", "Sends that raised, by the error's class.", [*M, "error"])
        self._counter(
            "send_retries",
            "Further attempts for workers whose transfer failed (SendResult.retries, summed).",
            M,
        )
        self._counter("worker_retries", "Sends that needed another attempt for this worker.", W)
        self._counter("worker_nacks", "Versions this worker failed to apply (its nacks).", W)
        self._counter(
            "digest_failures",
            "Versions this worker refused because its bytes did not match the digest.",
            W,
        )
        # The sender: where its workers stand.
        self._gauge("sender_version", "The latest version sent (-1 before the sender serves).", M)
        self._gauge("sender_serving", "1 while the sender serves (inside async with).", M)
        self._gauge("workers", "Workers in each state.", [*M, "state"])
        self.state = StateSetMetricFamily(
            "aiowsync_worker_state", "Where each worker stands, seen from the sender.", labels=W
        )
        self._order.append(self.state)
        self._gauge("worker_version", "The newest version the worker acknowledged.", W)
        self._gauge("worker_lag", "Versions the worker is behind the latest version sent.", W)
        self._gauge("worker_refused", "1 while the worker's last hello was refused.", W)
        self._gauge("worker_last_heard_seconds", "Seconds since the sender last heard from it.", W)
        self._gauge("worker_leased_versions", "Versions its leases keep in the sender's memory.", W)
        self._counter("sender_dropped_messages", "Control messages the sender dropped.", M)
        # A receiver.
        self._gauge("receiver_version", "The version the receiver's model runs (-1 before one).", W)
        self._gauge(
            "receiver_generation",
            "Which sender its version comes from: 0 for the first, one more for each it followed.",
            W,
        )
        self._counter("receiver_versions_applied", "Versions the receiver switched to.", W)
        self._gauge("receiver_connected", "1 while the receiver's sender is reachable.", W)
        self._gauge("receiver_ready", "1 while connected and running a version.", W)
        self._gauge(
            "receiver_leased_versions", "Versions its leases keep in the sender's memory.", W
        )
        self._counter("receiver_dropped_messages", "Control messages the receiver dropped.", W)

    def _counter(self, name: str, doc: str, labels: list[str]) -> None:
        self.counter[name] = family = CounterMetricFamily(f"aiowsync_{name}", doc, labels=labels)
        self._order.append(family)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> None:
        self.gauge[name] = family = GaugeMetricFamily(f"aiowsync_{name}", doc, labels=labels)
        self._order.append(family)

    def _histogram(self, name: str, doc: str, labels: list[str]) -> None:
        family = HistogramMetricFamily(f"aiowsync_{name}", doc, labels=labels)
        self.histogram[name] = family
        self._order.append(family)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._order)


class Source:
    """One exported scheme: adds its samples to a scrape's families."""

    role: str
    model_id: str
    worker: int | None

    def add_to(self, families: Families) -> None:
        raise NotImplementedError


class SenderSource(Source):
    role = "sender"

    def __init__(self, scheme: WeightSyncScheme, tally: SendTally) -> None:
        self.scheme = scheme
        self.tally = tally
        self.model_id = scheme.model_id
        self.worker = None

    def add_to(self, families: Families) -> None:
        scheme, tally, m = self.scheme, self.tally.snapshot(), [self.model_id]
        c, g, h = families.counter, families.gauge, families.histogram
        h["send_seconds"].add_metric(m, tally.seconds.cumulative(), tally.seconds.total)
        h["send_stage_seconds"].add_metric(
            m, tally.stage_seconds.cumulative(), tally.stage_seconds.total
        )
        c["sent_bytes"].add_metric(m, tally.nbytes)
        c["send_retries"].add_metric(m, tally.retries)
        for error, count in sorted(tally.failures.items()):
            c["send_failures"].add_metric([*m, error], count)
        for worker in range(scheme.num_workers):
            w = [*m, str(worker)]
            c["worker_retries"].add_metric(w, tally.retried[worker])
            c["worker_nacks"].add_metric(w, tally.nacks[worker])
            c["digest_failures"].add_metric(w, tally.digest_failures[worker])
        latest = scheme.version
        g["sender_version"].add_metric(m, latest)
        g["sender_serving"].add_metric(m, int(scheme.connected))
        c["sender_dropped_messages"].add_metric(m, scheme.dropped_messages)
        statuses = _read(lambda: list(scheme.workers.values()))
        if statuses is None:
            log.debug("metrics of %s: the worker table kept changing; left out", self.model_id)
            return
        for state in STATES:
            g["workers"].add_metric([*m, state], sum(s.state == state for s in statuses))
        for status in statuses:
            _add_worker(families, m, status, latest)


def _add_worker(families: Families, m: list[str], status: WorkerStatus, latest: int) -> None:
    g, w = families.gauge, [*m, str(status.worker_idx)]
    families.state.add_metric(w, {s: s == status.state for s in STATES})
    refused = status.state in ("never connected", "lost", "gone") and (
        status.note or ""
    ).startswith(REFUSED)
    g["worker_refused"].add_metric(w, int(refused))
    g["worker_leased_versions"].add_metric(w, len(status.leased))
    if status.last_heard is not None:
        g["worker_last_heard_seconds"].add_metric(w, status.last_heard)
    if status.version is not None:
        g["worker_version"].add_metric(w, status.version)
        g["worker_lag"].add_metric(w, max(0, latest - status.version))


def _read(look: Callable[[], list[WorkerStatus]]) -> list[WorkerStatus] | None:
    for _ in range(_READS):
        try:
            return look()
        except RuntimeError:  # a set or dict changed size while this thread read it
            continue
    return None


class ReceiverSource(Source):
    role = "receiver"

    def __init__(self, scheme: WeightSyncScheme, *, count_applied: bool) -> None:
        self.scheme = scheme
        self.model_id = scheme.model_id
        worker = scheme.worker_idx
        assert worker is not None
        self.worker = worker
        self.count_applied = count_applied
        self.applied = 0
        """Versions switched to since the export began (counted by :meth:`count`)."""

    def count(self, version: int) -> None:
        """The exporter's hook: one more version applied."""
        self.applied += 1

    def add_to(self, families: Families) -> None:
        scheme, c, g = self.scheme, families.counter, families.gauge
        w = [self.model_id, str(self.worker)]
        g["receiver_version"].add_metric(w, scheme.version)
        g["receiver_generation"].add_metric(w, scheme.generation)
        if self.count_applied:
            c["receiver_versions_applied"].add_metric(w, self.applied)
        g["receiver_connected"].add_metric(w, int(scheme.connected))
        g["receiver_ready"].add_metric(w, int(scheme.ready))
        core = scheme._receiver
        leased = 0 if core is None else len(core.leases.pinned())
        g["receiver_leased_versions"].add_metric(w, leased)
        c["receiver_dropped_messages"].add_metric(w, scheme.dropped_messages)
