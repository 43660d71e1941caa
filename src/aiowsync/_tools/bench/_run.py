"""The benchmark's run: cell after cell of the plan (:mod:`~aiowsync._tools.bench._plan`),
contenders alternated sample by sample inside a cell, gap windows the host stole from taken
again."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import traceback
from typing import Any

from aiowsync._util.text import first_line

from ._checks import INTEGRITY_MODE, variant_text
from ._contenders import Contender, RawCopy, RawGloo, RawZmq, TorchRLContender
from ._models import MIB, model_spec, spec_bytes
from ._plan import (
    TORCHRL_MODES,
    TORCHRL_TREES,
    Settings,
    available_bytes,
    footprint,
    plan_batches,
    settle_memory,
)
from ._pool import WorkerPool
from ._probe import host_steal_ms
from ._rounds import rounds
from ._session import AiowsyncSend, AiowsyncSession
from ._torchrl import TorchRLError, TorchRLTree

__all__ = [
    "GAP_RETAKES",
    "Progress",
    "Variant",
    "raw_gloo_rounds",
    "run",
    "run_sync",
    "variants",
]


class Progress:
    """Lines on stderr: every phase change, and the running samples at most every few seconds."""

    def __init__(self, total_cells: int, every: float = 3.0) -> None:
        self.t0 = time.monotonic()
        self.total = total_cells
        self.cell = 0
        self.every = every
        self._last = 0.0

    def say(self, text: str, force: bool = True) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every:
            self._last = now
            m, s = divmod(int(now - self.t0), 60)
            print(
                f"[{m:3d}:{s:02d}] ({self.cell}/{self.total}) {text}", file=sys.stderr, flush=True
            )


Variant = tuple[str, str]
"""A dist cell's (topology, control-channel authentication: "curve" or "off")."""


def variants(transport: str, settings: Settings) -> list[Variant | None]:
    """Each measurement of a cell of ``transport``: one per topology and authentication for
    dist cells (in the order given), one (None) otherwise."""
    if transport != "dist":
        return [None]
    return [(t, a) for t in settings.topologies for a in settings.control_auth]


async def _cell(
    transport: str,
    model: str,
    n: int,
    pool: WorkerPool,
    settings: Settings,
    budget: int,
    progress: Progress,
    variant: Variant | None = None,
    profile: str = "light",
) -> dict[str, Any]:
    spec = model_spec(model)
    nbytes = spec_bytes(spec)
    samples = settings.samples[model]
    limit_name = "raw copy_" if transport == "shm" else "raw gloo broadcast"
    base = footprint(transport, nbytes, n) + footprint(limit_name, nbytes, n)
    out: dict[str, Any] = {
        "model": model,
        "model_bytes": nbytes,
        "tensors": len(spec),
        "workers": n,
        "transport": transport,
        "profile": profile,
        "samples_per_round": samples,
        "gates": list(settings.gates),
        "contenders": [],
        "skipped": [],
        "errors": [],
        "batches": [],
    }
    if variant is not None:
        out["topology"], out["control_auth"] = variant
    label = f"{model} x{n} {transport}{variant_text(out)} [{profile}]"
    if base > budget:
        out["skipped"].append(
            {
                "contender": f"every {transport} contender",
                "reason": f"needs ~{base / 2**30:.1f} GiB; the budget is {budget / 2**30:.1f} GiB",
            }
        )
        progress.say(f"{label}: skipped ({out['skipped'][0]['reason']})")
        return out
    trees = TORCHRL_TREES[transport] if settings.torchrl else ()
    if trees and profile != "light":
        # TorchRL's workers are processes of its own, which run no policy of ours.
        out["skipped"].append(
            {"contender": "TorchRL", "reason": "measured in the cells of the light profile only"}
        )
        trees = ()
    left_out = [t for t in trees if (model, t) in settings.leave_out]
    trees = tuple(t for t in trees if t not in left_out)
    out["skipped"] += [
        {
            "contender": f"TorchRL {t}",
            "reason": "left out of this run (--quick leaves out the slowest)",
        }
        for t in left_out
    ]
    batches, skipped = plan_batches(trees, base, budget, nbytes, n)
    out["skipped"] += skipped
    out["batches"] = batches
    progress.say(f"{label}: opening aiowsync {transport} session ({nbytes / MIB:.0f} MiB)")
    session = AiowsyncSession(
        transport,
        pool,
        spec,
        n,
        settings.timeout,
        settings.wire_dtype,
        rehome=settings.rehome,
        bucket_bytes=settings.bucket_bytes,
        variant=variant,
        profile=profile,
    )
    ours: list[Contender] = [AiowsyncSend(session, "send()"), AiowsyncSend(session, "publish()")]
    # Timed only: its gaps and reads are those of send().
    other_integrity = AiowsyncSend(session, INTEGRITY_MODE[transport])
    limit: RawCopy | RawGloo
    floors: list[RawZmq] = []
    if transport == "shm":
        ours.append(AiowsyncSend(session, "send(weights)"))
        limit = RawCopy(nbytes)
        floors.append(RawZmq(pool, session.ids, settings.timeout))
    else:
        limit = RawGloo(pool, session.ids, nbytes, settings.timeout)
    theirs: list[Contender] = []
    try:
        await session.open()
        paired = nbytes <= settings.pair_up_to
        if isinstance(limit, RawGloo):
            await limit.open(rounds=raw_gloo_rounds(samples, paired, len(batches), settings))
        for floor in floors:
            await floor.open()
        # Gaps and mixed reads first, before any TorchRL tree of the cell: closing a tree hands
        # gigabytes back at once, and every process of the machine then stalls for tens of ms
        # (30 ms during the first 1 GiB gap phase after the trees closed, 6 ms later on).
        for c in (*ours, limit):
            await c.sample()  # first-send costs (pages, connections) are no gap
        await settle_memory()  # the previous cell's trees may still be handing memory back
        for c in (*ours, limit):
            progress.say(f"{label}: {c.name}: loop gaps, then readers during sends")
            await _measure_gap(c, settings, progress, label)
            await c.measure_tear(settings.tear_sends, settings.tear_max_s)
        for batch in batches or [[]]:
            theirs += await _batch(
                batch,
                model,
                n,
                [*ours, other_integrity, limit, *floors],
                samples,
                settings,
                out,
                progress,
                label,
                paired=paired,
            )
        await session.verify()
        out["policy_reads"] = await session.policy_reads()
        if transport == "shm":  # after many versions were applied: what a worker kept
            out["worker_memory"] = await session.memory()
    except BaseException:
        # The cell's own failure (or a Ctrl-C) is what the report and the caller see: closing
        # after it may fail too (its workers may be gone), and that is only told.
        try:
            await _close_cell(session, limit, floors)
        except Exception as exc:
            progress.say(f"{label}: closing after the failure failed too: {first_line(exc)}")
        raise
    else:
        await _close_cell(session, limit, floors)
    for c in (*ours, other_integrity):
        if isinstance(c, AiowsyncSend):
            c.info = {"integrity": session.integrity(c.mode)}
            if c.mode == "publish()":  # acks included, every publish() sent
                c.info["whole_send_s"] = session.totals
    out["contenders"] = [_row(c) for c in (*ours, other_integrity, limit, *floors, *theirs)]
    return out


async def _close_cell(
    session: AiowsyncSession, limit: RawCopy | RawGloo, floors: list[RawZmq]
) -> None:
    try:
        for floor in floors:
            await floor.close()
        if isinstance(limit, RawGloo):
            await limit.close()
        else:
            limit.close()
    finally:
        await session.close()


def raw_gloo_rounds(samples: int, paired: bool, batches: int, settings: Settings) -> int:
    """How many rounds the raw gloo limit of a cell may take, at most (its receivers are told
    the number up front; the rounds left over run untimed at the end): the warm-up and the gap
    windows, each measured again up to :data:`GAP_RETAKES` times, then per batch of TorchRL
    trees a warm-up and every sample of every gate."""
    per_batch = 1 + samples * len(settings.gates) * (2 if paired else 1)
    return 1 + settings.gap_sends * (1 + GAP_RETAKES) + per_batch * max(1, batches)


async def _batch(
    batch: list[str],
    model: str,
    n: int,
    standing: list[Contender],
    samples: int,
    settings: Settings,
    out: dict[str, Any],
    progress: Progress,
    label: str,
    *,
    paired: bool = False,
) -> list[TorchRLContender]:
    """Open the batch's TorchRL trees, alternate every contender's samples, then measure the
    trees' gaps and mixed reads and close them. Returns the TorchRL contenders.

    ``paired``: each contender's turn is two samples back to back; the second is the sample
    (see :data:`PAIR_UP_TO`)."""
    trees: list[TorchRLTree] = []
    theirs: list[TorchRLContender] = []
    try:
        for name in batch:
            progress.say(f"{label}: starting TorchRL {name} with {n} workers")
            tree = TorchRLTree(name, model, n, settings.timeout)
            trees.append(tree)
            try:
                info = await tree.open()
            except TorchRLError as exc:  # the others, aiowsync's included, still run
                _torchrl_failed(out, progress, label, [name], exc)
                continue
            for mode in TORCHRL_MODES[name]:
                contender = TorchRLContender(tree, mode)
                contender.info = info
                theirs.append(contender)
        everyone = [*standing, *theirs]
        for c in everyone:  # warm-up: first-send costs (pages, connections) are not samples
            await c.sample()
        await rounds(everyone, samples, progress, label, paired, settings.gates)
        for contender in theirs:
            await contender.verify()
            progress.say(f"{label}: {contender.name}: loop gaps, then readers during sends")
            await _measure_gap(contender, settings, progress, label)
            await contender.measure_tear(settings.tear_sends, settings.tear_max_s)
    except TorchRLError as exc:
        _torchrl_failed(out, progress, label, batch, exc)
    finally:
        for tree in trees:
            await tree.close()
    return theirs


def _torchrl_failed(
    out: dict[str, Any], progress: Progress, label: str, batch: list[str], exc: TorchRLError
) -> None:
    out["errors"].append({"batch": batch, "error": str(exc)})
    progress.say(f"{label}: TorchRL {'+'.join(batch)} failed: {first_line(exc)}")


GAP_STEAL_MS = 20.0
"""Gap windows during which the host took this much CPU time from the machine are measured
again (see :func:`_measure_gap`)."""
GAP_RETAKES = 2


async def _measure_gap(c: Contender, settings: Settings, progress: Progress, label: str) -> None:
    """``c.measure_gap``, measured again (at most :data:`GAP_RETAKES` times) while the
    hypervisor took :data:`GAP_STEAL_MS` or more of CPU time from the machine during the
    windows: then every process stops at once, whatever it runs, and the gaps say nothing
    about the contender. The same rule for every contender; the attempts set aside stay in
    the gap's record."""
    set_aside: list[dict[str, Any]] = []
    for attempt in range(1 + GAP_RETAKES):
        before = host_steal_ms()
        await c.measure_gap(settings.gap_sends, settings.idle_s)
        stolen = host_steal_ms() - before
        gap = c.gap
        if gap is None:
            return
        gap["host_steal_ms"] = stolen
        gap["set_aside"] = set_aside
        if stolen < GAP_STEAL_MS or attempt == GAP_RETAKES:
            return
        progress.say(f"{label}: {c.name}: the host took {stolen:.0f} ms of CPU; gaps again")
        set_aside.append({k: v for k, v in gap.items() if k != "set_aside"})


def _row(c: Contender) -> dict[str, Any]:
    return {
        "name": c.name,
        "kind": c.kind,
        "transport": c.transport,
        "samples_s": c.samples,
        "gap_samples_s": c.samples_outside,
        "lead_samples_s": c.samples_lead,
        "after": c.after,
        "busy_samples_s": c.busy,
        "busy_lead_samples_s": c.busy_lead,
        "busy_after": c.busy_after,
        "quiet_wait_s": [w for w, _ in c.quiet],
        "quiet_found": [q for _, q in c.quiet],
        "gap": c.gap,
        "tear": c.tear,
        "notes": c.notes,
        "info": c.info,
    }


async def run(settings: Settings) -> dict[str, Any]:
    """Every cell of the matrix; a JSON-able dict of every sample."""
    cells = settings.cells
    most = max(n for _, n, _ in cells)
    plan = [
        (m, n, t, v, p)
        for m, n, t in cells
        for v in variants(t, settings)
        for p in settings.profiles
    ]
    task = asyncio.current_task()
    if task is not None:  # SIGTERM (a CI job's time limit) closes everything, as Ctrl-C does
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    progress = Progress(len(plan))
    progress.say(f"starting {most} worker processes")
    pool = WorkerPool(most, name="aiowsync-bench-worker")
    results: list[dict[str, Any]] = []
    started = time.time()
    budget = 0
    try:
        await pool.start()
        budget = int(available_bytes() * settings.memory_fraction)
        for model, n, transport, variant, profile in plan:
            progress.cell += 1
            try:
                results.append(
                    await _cell(
                        transport, model, n, pool, settings, budget, progress, variant, profile
                    )
                )
            except Exception:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # stopped (Ctrl-C): no more cells
                text = traceback.format_exc()
                progress.say(
                    f"{model} x{n} {transport} {variant or ''} [{profile}] FAILED:\n{text}"
                )
                failed = {
                    "model": model,
                    "workers": n,
                    "transport": transport,
                    "profile": profile,
                    "failed": text,
                }
                if variant is not None:
                    failed["topology"], failed["control_auth"] = variant
                results.append(failed)
                if progress.cell < len(plan):
                    # A failed session may leave workers in it: go on with a fresh pool.
                    await pool.close()
                    pool = WorkerPool(most, name="aiowsync-bench-worker")
                    await pool.start()
    finally:
        await pool.close()
    return {
        "started": started,
        "seconds": time.time() - started,
        "budget_bytes": budget,
        "load_end": os.getloadavg(),
        "cells": results,
    }


def run_sync(settings: Settings) -> dict[str, Any]:
    try:
        return asyncio.run(run(settings))
    except asyncio.CancelledError:  # by SIGTERM, once every process and file is closed
        raise SystemExit(128 + signal.SIGTERM) from None
