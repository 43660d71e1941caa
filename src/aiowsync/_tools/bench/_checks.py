"""The checks of ``aiowsync bench`` against the project's targets, and the small readings of a
run's dict (medians, ratios, mixed reads) that the report shares with them."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FLOOR",
    "INTEGRITY_MODE",
    "LIMIT",
    "PAIRS",
    "busy_median",
    "cells_of",
    "headline_profile",
    "integrity_rows",
    "checks",
    "lead_median",
    "median",
    "mixed_reads",
    "percentile",
    "profile_of",
    "reads_of",
    "rows_of",
    "variant_text",
]

# TorchRL contender -> the aiowsync contender it is compared with
PAIRS = {
    "TorchRL SharedMem send()": "aiowsync shm send()",
    "TorchRL SharedMem send(weights)": "aiowsync shm send(weights)",
    "TorchRL MultiProcess send()": "aiowsync shm send()",
    "TorchRL Distributed send()": "aiowsync dist send()",
}
LIMIT = {"shm": "raw copy_", "dist": "raw gloo broadcast"}
FLOOR = "raw zmq round trip"
GAP_SLACK_S = 0.010
MEMORY_FRACTION = 0.10
MEMORY_JUDGED_FROM = 64 << 20
INTEGRITY_MODE = {"shm": "send() +digest", "dist": "send() -digest"}
"""Per transport, the ``send()`` whose integrity is not the scheme's default: digests carried
and checked on shared memory (off by default there), left out on torch.distributed (on by
default there). The row named ``send()`` is always the scheme with its defaults."""
INTEGRITY_COST = {"shm": None, "dist": 1.05}
"""The most a send with digests may take, as a multiple of the same send without (None: no
target; on one host hashing is most of a send, which is why digests are off there)."""


def integrity_rows(transport: str) -> tuple[str, str]:
    """The names of a cell's rows with integrity on and off, in that order."""
    plain = f"aiowsync {transport} send()"
    other = f"aiowsync {transport} {INTEGRITY_MODE[transport]}"
    return (other, plain) if transport == "shm" else (plain, other)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile, interpolated between the two nearest samples."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(row: dict[str, Any]) -> float | None:
    return statistics.median(row["samples_s"]) if row["samples_s"] else None


def lead_median(row: dict[str, Any]) -> float | None:
    lead = row.get("lead_samples_s") or []
    return statistics.median(lead) if lead else None


def rows_of(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in cell.get("contenders", [])}


def cells_of(report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from (c for c in report["run"]["cells"] if "failed" not in c)


def variant_text(cell: dict[str, Any]) -> str:
    """What sets a dist cell apart from the default (star, CURVE): "" for the default."""
    parts = []
    if cell.get("topology", "star") != "star":
        parts.append(cell["topology"])
    if cell.get("control_auth", "curve") != "curve":
        parts.append("control auth off")
    return f" ({', '.join(parts)})" if parts else ""


def profile_of(cell: dict[str, Any]) -> str:
    """What the cell's workers did beside receiving (runs made before profiles existed had
    light workers)."""
    return str(cell.get("profile", "light"))


def headline_profile(report: dict[str, Any]) -> str:
    """The profile the checks judge aiowsync's sends on: ``policy`` where the run has it."""
    return "policy" if any(profile_of(c) == "policy" for c in cells_of(report)) else "light"


def _find_cell(
    report: dict[str, Any], model: str, n: int, transport: str, profile: str
) -> dict[str, Any] | None:
    """The first cell of (model, n, transport, profile) on the defaults (star, CURVE)."""
    for cell in cells_of(report):
        if (cell["model"], cell["workers"], cell["transport"], profile_of(cell)) == (
            model,
            n,
            transport,
            profile,
        ) and not variant_text(cell):
            return cell
    return None


def busy_median(row: dict[str, Any]) -> float | None:
    """The median of the samples taken without waiting for a quiet machine."""
    busy = row.get("busy_samples_s") or []
    return statistics.median(busy) if busy else None


def _ratio(
    cell: dict[str, Any] | None, top: str, bottom: str, *, busy: bool = False
) -> float | None:
    if cell is None:
        return None
    rows = rows_of(cell)
    if top not in rows or bottom not in rows:
        return None
    of = busy_median if busy else median
    a, b = of(rows[top]), of(rows[bottom])
    return a / b if a and b else None


def _busy_text(cell: dict[str, Any] | None, top: str, bottom: str) -> str:
    """`` (busy: 1.23x)``, the same ratio of the busy gate's medians, where there are any."""
    ratio = _ratio(cell, top, bottom, busy=True)
    return "" if ratio is None else f" (busy: {ratio:.2f}x)"


def mixed_reads(row: dict[str, Any]) -> int | None:
    tear = row.get("tear")
    if not tear:
        return None
    return sum(sum(m.values()) for m in tear["mixed"])


def reads_of(row: dict[str, Any]) -> int | None:
    tear = row.get("tear")
    if not tear:
        return None
    return sum(sum(r.values()) for r in tear["reads"])


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, judged on this run: ``met`` is None where not measured."""
    out: list[dict[str, Any]] = []

    def check(what: str, value: float | None, bound: float, fmt: str, higher: bool) -> None:
        met = None if value is None else (value >= bound if higher else value <= bound)
        shown = "not measured" if value is None else fmt.format(value)
        sign = ">=" if higher else "<="
        out.append(
            {"check": what, "value": shown, "target": f"{sign} {fmt.format(bound)}", "met": met}
        )

    head = headline_profile(report)
    for model, bound in (("256MiB", 3.0), ("1000t-64MiB", 10.0)):
        check(
            f"{model} x4: TorchRL SharedMem send(weights) / aiowsync shm send(weights) [light]",
            _ratio(
                _find_cell(report, model, 4, "shm", "light"),
                "TorchRL SharedMem send(weights)",
                "aiowsync shm send(weights)",
            ),
            bound,
            "{:.1f}x",
            True,
        )
    for model, transport, bound in (
        ("256MiB", "shm", 1.3),
        ("1000t-64MiB", "shm", 1.5),
        ("64MiB", "dist", 1.1),
        ("256MiB", "dist", 1.1),
        ("1000t-64MiB", "dist", 1.2),
    ):
        cell = _find_cell(report, model, 4, transport, head)
        modes = ("send()", "send(weights)") if transport == "shm" else ("send()",)
        for mode in modes:
            name = f"aiowsync {transport} {mode}"
            check(
                f"{model} x4: {name} / {LIMIT[transport]} [{head}]",
                _ratio(cell, name, LIMIT[transport]),
                bound,
                "{:.2f}x",
                False,
            )
            out[-1]["value"] += _busy_text(cell, name, LIMIT[transport])
    for transport in ("shm", "dist"):
        # Two-phase sends: how long the trainer is held before it may touch its weights.
        cell = _find_cell(report, "256MiB", 4, transport, head)
        rows = rows_of(cell) if cell else {}
        held, whole = (
            rows.get(f"aiowsync {transport} publish()"),
            rows.get(f"aiowsync {transport} send()"),
        )
        held_s = median(held) if held else None
        whole_s = median(whole) if whole else None
        shown = "not measured"
        if held_s is not None and whole_s:
            shown = (
                f"{held_s * 1e3:.1f} ms held / {whole_s * 1e3:.1f} ms send() = "
                f"{held_s / whole_s:.2f}x"
            )
        out.append(
            {
                "check": f"256MiB x4: aiowsync {transport} publish(): trainer held, "
                f"against the whole send() [{head}]",
                "value": shown,
                "target": "none",
                "met": None,
            }
        )
    for model in ("64MiB", "256MiB", "1000t-64MiB"):
        for transport in ("shm", "dist"):
            # What integrity costs: the same session's sends with and without digests.
            on, off = integrity_rows(transport)
            what = f"{model} x4: aiowsync {transport} send(), integrity on / integrity off [{head}]"
            cell = _find_cell(report, model, 4, transport, head)
            ratio = _ratio(cell, on, off)
            most = INTEGRITY_COST[transport]
            if most is None:
                shown = "not measured" if ratio is None else f"{ratio:.2f}x"
                out.append({"check": what, "value": shown, "target": "none", "met": None})
            else:
                check(what, ratio, most, "{:.2f}x", False)
            out[-1]["value"] += _busy_text(cell, on, off)
    cell = _find_cell(report, "1MiB", 4, "shm", head)
    floor = rows_of(cell).get(FLOOR) if cell else None
    floor_p50 = median(floor) if floor else None
    for mode in ("send()", "send(weights)"):
        name = f"aiowsync shm {mode}"
        row = rows_of(cell).get(name) if cell else None
        value = median(row) if row else None
        check(
            f"1MiB x4: {name} p50 (ms), second of two sends back to back [{head}]",
            None if value is None else value * 1e3,
            1.0,
            "{:.2f}",
            False,
        )
        if value is not None and floor_p50 is not None:
            # The same run's floor for any update signalled over ZeroMQ, beside the figure.
            out[-1]["value"] += f" ({FLOOR}: {floor_p50 * 1e3:.2f})"
        lead = lead_median(row) if row else None
        if lead is not None:
            out[-1]["value"] += f" (first of each pair: {lead * 1e3:.2f})"
    slacks: tuple[tuple[str, float | None], ...] = (("shm", GAP_SLACK_S), ("dist", None))
    for transport, slack in slacks:
        worst = _worst_gap(report, "1GiB", transport)
        what = (
            f"1GiB {transport}: aiowsync loop max gap during sends above idle (ms), worst "
            "process [light]"
        )
        if slack is None:  # no target: shown so that it is not hidden
            shown = "not measured" if worst is None else f"{worst * 1e3:.1f}"
            out.append({"check": what, "value": shown, "target": "none", "met": None})
        else:
            check(what, None if worst is None else worst * 1e3, slack * 1e3, "{:.1f}", False)
        aside = _set_aside(report, "1GiB", transport)
        if aside and out and out[-1]["check"] == what:
            out[-1]["value"] += (
                f" (measured again: {len(aside)} window pair(s) in which the host took "
                f"{', '.join(f'{ms:.0f}' for ms in aside)} ms of CPU)"
            )
    out += _auth_costs(report)
    mixed = [
        m
        for c in cells_of(report)
        for r in c["contenders"]
        if r["kind"] == "aiowsync" and (m := mixed_reads(r)) is not None
    ]
    check("aiowsync mixed reads, every cell", sum(mixed) if mixed else None, 0, "{:.0f}", False)
    # Below 64 MiB a tenth of the model is under the noise of the interpreter's own heap.
    kept = [
        m["fraction_of_model"]
        for c in cells_of(report)
        if c.get("model_bytes", 0) >= MEMORY_JUDGED_FROM
        for m in c.get("worker_memory", [])
    ]
    check(
        "aiowsync shm: private memory a worker kept, worst, of the model's bytes",
        max(kept) if kept else None,
        MEMORY_FRACTION,
        "{:.1%}",
        False,
    )
    return out


AUTH_COST = 1.05
"""The most a dist send() with CURVE on its control channel (the default) may take, as a
multiple of the same send without (``allow_insecure_bind=True``)."""


def _auth_costs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """For each dist (model, workers, topology) measured both with CURVE and without
    (``--control-auth``): the median of ``send()`` with it / without it, every sample of
    each pooled; and the same of the medians taken as multiples of each cell's raw gloo."""
    groups: dict[tuple[str, int, str, str], dict[str, list[dict[str, Any]]]] = {}
    for cell in cells_of(report):
        if cell["transport"] == "dist" and "control_auth" in cell:
            key = (cell["model"], cell["workers"], cell["topology"], profile_of(cell))
            groups.setdefault(key, {}).setdefault(cell["control_auth"], []).append(cell)
    out = []
    for (model, n, topology, profile), by_auth in groups.items():
        if set(by_auth) != {"curve", "off"}:
            continue
        pooled, relative = {}, {}
        for auth, cells in by_auth.items():
            rows = [rows_of(c) for c in cells]
            sends = [r["aiowsync dist send()"] for r in rows if "aiowsync dist send()" in r]
            pooled[auth] = statistics.median(s for row in sends for s in row["samples_s"])
            relative[auth] = statistics.median(
                _ratio(c, "aiowsync dist send()", LIMIT["dist"]) or float("nan") for c in cells
            )
        ratio = pooled["curve"] / pooled["off"]
        out.append(
            {
                "check": f"{model} x{n} dist {topology}: send() with CURVE (default) / "
                f"without (allow_insecure_bind=True) [{profile}]",
                "value": f"{ratio:.3f}x ({pooled['curve'] * 1e3:.2f} / "
                f"{pooled['off'] * 1e3:.2f} ms; as multiples of the cells' raw gloo: "
                f"{relative['curve']:.3f} / {relative['off']:.3f} = "
                f"{relative['curve'] / relative['off']:.3f}x; "
                f"{len(by_auth['curve'])} + {len(by_auth['off'])} cells)",
                "target": f"<= {AUTH_COST:.2f}x",
                "met": ratio <= AUTH_COST,
            }
        )
    return out


def _worst_gap(report: dict[str, Any], model: str, transport: str) -> float | None:
    """The largest excess of a busy max gap over the idle one, over the aiowsync contenders'
    sender and workers in the light cells of ``model`` on ``transport`` (a policy worker's own
    reads on its loop are gaps of its own)."""
    worst: float | None = None
    for cell in cells_of(report):
        if (cell["model"], cell["transport"], profile_of(cell)) != (model, transport, "light"):
            continue
        for row in cell["contenders"]:
            gap = row.get("gap")
            if row["kind"] != "aiowsync" or not gap:
                continue
            over = [gap["sender_busy_s"] - gap["sender_idle_s"]]
            over += [
                b - i for b, i in zip(gap["workers_busy_s"], gap["workers_idle_s"], strict=True)
            ]
            worst = max(over) if worst is None else max(worst, *over)
    return worst


def _set_aside(report: dict[str, Any], model: str, transport: str) -> list[float]:
    """The host steal (ms) of every gap measurement of the aiowsync contenders that was set
    aside and taken again in the light cells of ``model`` on ``transport``."""
    return [
        a.get("host_steal_ms", 0.0)
        for cell in cells_of(report)
        if (cell["model"], cell["transport"], profile_of(cell)) == (model, transport, "light")
        for row in cell["contenders"]
        if row["kind"] == "aiowsync" and row.get("gap")
        for a in row["gap"].get("set_aside", [])
    ]
