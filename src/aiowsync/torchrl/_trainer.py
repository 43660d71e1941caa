"""The trainer's side of the TorchRL adapter, as functions of its plan: connecting while the
collector's worker processes start, which sender a send goes through, a collector without
worker processes, the outcome of ``sync=False`` sends."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._exceptions import ConnectFailedError, WeightSyncError, WeightSyncTimeout, WorkerLostError
from .._scheme.blocking import BlockingScheme
from .._sending.outcome import SendResult
from .._weights.flatten import flatten_weights
from .._weights.layout import Layout
from .._weights.specs import refuse_meta

__all__ = [
    "LOOK_S",
    "Job",
    "apply_locally",
    "connect",
    "jobs",
    "named_as",
    "raise_failed",
    "worker_ids",
]

LOOK_S = 1.0
"""How often the trainer's ``connect()`` looks whether a worker process has ended."""

Job = tuple[int, Any, list[int]]
"""One sender's part of a send: its index, the weights, its own indices of the workers."""


def connect(
    face: BlockingScheme, deadline: float, *, context: Any, limit: float, workers: Sequence[int]
) -> None:
    """``face.connect()`` by ``deadline`` (``limit`` seconds after the first try), looking at
    the collector's worker processes (``context.procs``) every :data:`LOOK_S`: one that
    ended (its environment or policy failed to build) fails the wait at once, instead of at
    the deadline as a worker that never came. ``workers``: the collector's index of each of
    the face's workers, which its errors name."""
    while True:
        left = deadline - time.monotonic()
        try:
            with named_as(workers):
                face.connect(max(min(left, LOOK_S), 0.001))
            return
        except ConnectFailedError:
            raise
        except WeightSyncTimeout as exc:
            ended = _ended_workers(context)
            if ended:
                raise WorkerLostError(
                    "the collector's worker processes ended before they connected ("
                    + ", ".join(f"worker {w}: exit code {code}" for w, code in ended)
                    + "); their own error is in their output",
                    [w for w, _ in ended],
                ) from exc
            if left <= LOOK_S:
                missing = [workers.index(w) for w in exc.worker_ids]
                raise WeightSyncTimeout(
                    f"workers did not connect within {limit:g} s:\n  "
                    + "\n  ".join(_story(face, i, workers[i]) for i in missing),
                    exc.worker_ids,
                ) from None


def _story(face: BlockingScheme, local: int, worker: int) -> str:
    """What the sender knows of collector worker ``worker`` (``face``'s worker ``local``)."""
    status = face.workers[local]
    return f"worker {worker}: {status.state}" + (f" ({status.note})" if status.note else "")


@contextlib.contextmanager
def named_as(workers: Sequence[int]) -> Iterator[None]:
    """Errors raised inside name the collector's workers: ``workers[i]`` for a scheme's
    worker ``i`` (a worker with weights of its own has a scheme of its own, where it is
    worker 0). Their ``worker_ids``, ``acked``, ``reasons`` and ``errors`` are renumbered,
    and a note says how to read the text."""
    try:
        yield
    except WeightSyncError as exc:
        if list(workers) != list(range(len(workers))):
            _renumber(exc, workers)
        raise


def _renumber(exc: WeightSyncError, workers: Sequence[int]) -> None:
    def name(i: int) -> int:
        return workers[i] if 0 <= i < len(workers) else i

    for attr in ("worker_ids", "acked"):
        ids = getattr(exc, attr, None)
        if isinstance(ids, tuple) and ids:
            setattr(exc, attr, tuple(sorted(name(i) for i in ids)))
    for attr in ("reasons", "errors"):
        table = getattr(exc, attr, None)
        if isinstance(table, dict):
            setattr(exc, attr, {name(i): v for i, v in sorted(table.items())})
    exc.add_note(
        "(the workers above are numbered by their own scheme: "
        + ", ".join(f"its worker {i} is the collector's worker {w}" for i, w in enumerate(workers))
        + ")"
    )


def _ended_workers(context: Any) -> list[tuple[int, int]]:
    """(worker index, exit code) of each of a collector's worker processes that ended."""
    procs = getattr(context, "procs", None) or []
    return [
        (w, p.exitcode) for w, p in enumerate(procs) if getattr(p, "exitcode", None) is not None
    ]


def jobs(weights: Any, named: Any, route: list[tuple[int, int]]) -> list[Job]:
    """The senders that a send of ``weights`` to the workers ``named`` (a send's
    ``worker_ids``; None for all) goes through."""
    targets = worker_ids(named, len(route))
    if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
        return _per_worker_jobs(weights, None if named is None else targets, route)
    by_sender: dict[int, list[int]] = {}
    for w in targets:
        k, local = route[w]
        by_sender.setdefault(k, []).append(local)
    return [(k, weights, ids) for k, ids in sorted(by_sender.items())]


def _per_worker_jobs(
    weights: Mapping[int, Any], targets: list[int] | None, route: list[tuple[int, int]]
) -> list[Job]:
    """Each worker's own weights, to the workers the map names; where ``worker_ids`` named
    workers too (``targets``), both must name the same ones, so that no weights given are
    dropped and no named worker is left out without a word."""
    unknown = sorted(set(weights) - set(range(len(route))))
    if unknown:
        raise ValueError(f"weights for workers {unknown}: there are {len(route)}")
    if targets is not None and set(targets) != set(weights):
        raise ValueError(
            f"worker_ids={sorted(set(targets))} and weights for workers {sorted(weights)}: "
            "a map of each worker's weights names the workers it goes to, so give the same "
            "workers (or leave worker_ids out)"
        )
    chosen = sorted(weights)
    senders = [route[w][0] for w in chosen]
    if len(set(senders)) != len(senders):
        raise ValueError(
            "weights of their own for each worker need per_worker_weights=True (or "
            "distinct policy factories): these workers share one copy of the weights"
        )
    return [(route[w][0], weights[w], [route[w][1]]) for w in chosen]


def worker_ids(given: Any, workers: int) -> list[int]:
    """The workers a send names (all of them for None)."""
    if given is None:
        return list(range(workers))
    ids = [given] if isinstance(given, int) else given
    if not isinstance(ids, Sequence) or not all(isinstance(w, int) for w in ids):
        raise ValueError(f"worker_ids={given!r}: aiowsync's TorchRL schemes name workers by index")
    outside = sorted(w for w in ids if not 0 <= w < workers)
    if outside:
        raise ValueError(f"worker_ids {outside}: there are {workers} workers")
    if not ids:
        raise ValueError("worker_ids is empty: name at least one worker, or pass None for all")
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker_ids {list(ids)} names a worker twice")
    return list(ids)


def apply_locally(local: nn.Module, weights: Any, context: Any) -> None:
    """A collector without worker processes: copy ``weights`` into the policy it runs,
    checked whole before a byte moves. None: the trainer's policy, which the collector runs
    a copy of when it moved it to its device."""
    if weights is None:
        weights = getattr(context, "_orig_policy", None)
    if weights is None or weights is local:
        return
    given = flatten_weights(weights)
    Layout.from_weights(local).check(given)
    refuse_meta(given, "they hold no values to copy")  # checked whole before a byte moves
    with torch.no_grad():
        for key, tensor in flatten_weights(local).items():
            tensor.copy_(given[key])


def raise_failed(
    sends: Sequence[tuple[concurrent.futures.Future[SendResult], Sequence[int]]],
    *,
    others: str = "a later send made with sync=False failed too",
) -> None:
    """Raise the error of the first of ``sends`` (ended, each with the collector's indices of
    its scheme's workers) that failed, noting the others (``others``: how)."""
    errors = []
    for future, workers in sends:
        if future.cancelled() or (error := future.exception()) is None:
            continue
        if isinstance(error, WeightSyncError) and list(workers) != list(range(len(workers))):
            _renumber(error, workers)
        errors.append(error)
    if errors:
        for other in errors[1:]:
            ids = getattr(other, "worker_ids", None)
            whose = f" (the collector's workers {list(ids)})" if ids else ""
            errors[0].add_note(f"{others}{whose}: {other}")
        raise errors[0]
