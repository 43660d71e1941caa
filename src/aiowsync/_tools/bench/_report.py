"""What ``aiowsync bench`` writes: the Markdown table of medians and ratios (with the checks of
:mod:`~aiowsync._tools.bench._checks`) and the PNG plot. The JSON file is the run's dict itself."""

from __future__ import annotations

import statistics
from typing import Any

from ._checks import (
    FLOOR,
    LIMIT,
    PAIRS,
    busy_median,
    cells_of,
    headline_profile,
    lead_median,
    median,
    mixed_reads,
    percentile,
    profile_of,
    reads_of,
    rows_of,
    variant_text,
)

__all__ = ["markdown", "plot"]


def _tear_text(row: dict[str, Any]) -> str:
    mixed, reads = mixed_reads(row), reads_of(row)
    if mixed is None:
        return "-"
    text = f"{mixed} / {reads}"
    phases = ("send", "fill")
    if mixed and row["kind"] == "torchrl":
        split = {p: sum(m.get(p, 0) for m in row["tear"]["mixed"]) for p in phases}
        text += f" (send {split['send']}, fill {split['fill']})"
    return text


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.3f}" if value < 0.01 else f"{value * 1e3:.1f}"


def _gap(row: dict[str, Any]) -> tuple[str, str]:
    gap = row.get("gap")
    if not gap:
        return "-", "-"
    sender = f"{gap['sender_idle_s'] * 1e3:.1f} / {gap['sender_busy_s'] * 1e3:.1f}"
    if not gap["workers_busy_s"]:  # the raw copy has no workers
        return sender, "-"
    workers = f"{max(gap['workers_idle_s']) * 1e3:.1f} / {max(gap['workers_busy_s']) * 1e3:.1f}"
    return sender, workers


def _copies_text(env: dict[str, Any]) -> str:
    copies = env.get("copies")  # runs made before it was recorded do not say
    return f" (staging copies with {copies})" if copies else ""


def _quiet_text(report: dict[str, Any]) -> str:
    """What the report says of the quiet waits before the samples (runs made before they
    existed say nothing)."""
    waits: list[float] = []
    gave_up = 0
    for cell in report["run"]["cells"]:
        for row in cell.get("contenders", []):
            waits += row.get("quiet_wait_s", [])
            gave_up += sum(1 for q in row.get("quiet_found", []) if not q)
    if not waits:
        return ""
    waits.sort()
    return (
        "Under the quiet gate each sample's timed part began once no other task of the "
        "machine was running or "
        "ready to run (three reads of `/proc/loadavg` in a row, 1 ms apart; at most 0.5 s of "
        "waiting, 0.05 s right after a wait that gave up), so that no contender pays for "
        "work a previous turn left running: waits "
        f"{waits[len(waits) // 2] * 1e3:.0f} ms median, {waits[-1] * 1e3:.0f} ms at most; "
        f"{gave_up} of {len(waits)} samples began without finding the machine quiet. "
    )


PROFILE_TEXT = (
    "*Profile*: what aiowsync's workers do beside receiving. *policy*: a task on each "
    "worker's event loop wakes every 2 ms and, once the model runs a version it has not read, "
    "reads every tensor of it once (a sum of all its bytes, on the loop, under the read "
    "guard), as an actor running its policy on its loop would; *light*: nothing else (runs "
    "made before profiles existed are light). TorchRL's workers, processes of its own, are "
    "measured in the light cells only. Both profiles run the probes and readers of the gap "
    "and mixed-read phases during those phases only; a policy worker's loop gaps include its "
    "own reads. "
)


def _gate_text(report: dict[str, Any]) -> str:
    """What the report says of the busy gate, where the run has one."""
    if not any(busy_median(r) for c in cells_of(report) for r in c["contenders"]):
        return ""
    return (
        "*busy*: in the same rounds, every contender's turn once more, its sample started at "
        "once, on the machine as the turn before left it (the policy workers may still be "
        "reading the previous version, a TorchRL tree still busy): the median of those and "
        "its ratio to the limit's. "
    )


def _policy_lines(report: dict[str, Any]) -> list[str]:
    """What the policy workers read, per cell: evidence that they read every tensor."""
    rows = []
    for cell in cells_of(report):
        reads = cell.get("policy_reads")
        if not reads:
            continue
        counts = [r["reads"] for r in reads]
        per_read = sum(r["read_s"] for r in reads) / max(1, sum(counts))
        rows.append(
            f"| {cell['model']}{variant_text(cell)} | {cell['workers']} | {cell['transport']} "
            f"| {min(counts)}-{max(counts)} | {reads[0]['tensors']} "
            f"| {reads[0]['bytes'] / 2**20:.1f} | {per_read * 1e3:.2f} |"
        )
    if not rows:
        return []
    return [
        "",
        "### What the policy workers read",
        "",
        "Reads of every tensor after a new version, per worker over the whole cell (the "
        "phases of the gaps and mixed reads included), and the size of the latest.",
        "",
        "| model | workers | transport | reads per worker | tensors per read | MiB per read "
        "| ms per read, mean |",
        "|---|--:|---|--:|--:|--:|--:|",
        *rows,
    ]


COLUMNS = (
    "model",
    "workers",
    "profile",
    "contender",
    "median ms",
    "p90 ms",
    "n",
    "vs limit",
    "busy median ms",
    "busy vs limit",
    "aiowsync speed-up",
    "sender loop gap",
    "worst worker gap",
    "mixed reads",
)


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        "# aiowsync bench",
        "",
        f"`{env['command']}` on {env['date']}: {env['cpus']} CPUs, "
        f"{env['mem_gib']:.0f} GiB, Python {env['python']}, torch {env['torch']}, "
        f"tensordict {env['tensordict']}, aiowsync {env['aiowsync']}"
        f"{_copies_text(env)}; {env['torchrl_status']}. "
        f"Took {report['run']['seconds'] / 60:.1f} min; load average "
        f"{env['load_start'][0]:.1f} at start, {report['run']['load_end'][0]:.1f} at the end.",
        "",
        "## Checks",
        "",
        "| check | this run | target | |",
        "|---|--:|--:|---|",
    ]
    for c in report["checks"]:
        verdict = {True: "met", False: "**missed**", None: "-"}[c["met"]]
        lines.append(f"| {c['check']} | {c['value']} | {c['target']} | {verdict} |")
    lines += [
        "",
        "## Send latency",
        "",
        "Median of the samples (contenders alternated sample by sample within a cell; *n* "
        "samples each, per gate). "
        f"{_quiet_text(report)}{_gate_text(report)}{PROFILE_TEXT}"
        "*vs limit*: median / the limit's median in the same cell (raw `copy_` of the model's "
        "bytes rounded up to a whole page for one host, "
        "raw gloo broadcast for torch.distributed). *aiowsync speed-up*: the TorchRL "
        "contender's median / the matching aiowsync contender's. *Loop gap*: the longest "
        "interval between wake-ups of a 1 ms sleeper, idle / during sends, in ms (TorchRL's "
        "sender calls `send()` in a thread; its workers have no event loop, so theirs is a "
        "thread's). Gap windows during which the hypervisor took 20 ms or more of CPU time "
        "from the machine (`/proc/stat` steal) are measured again, at most twice, for every "
        "contender alike; the JSON keeps the attempts set aside. "
        "*Mixed reads*: reads that saw two versions / reads, over all workers. "
        f"*{FLOOR}* (one-host cells): a 64-byte ZeroMQ message to each of the same worker "
        "processes and its echo from each worker's event loop, no weights: the least any "
        "update signalled over ZeroMQ costs on this machine at this point of the run. "
        "In cells of models up to 4 MiB each turn of a contender is two sends back to back, "
        "and the sample is the second; the first ones are listed after this table. "
        "A dist cell names its topology and control-channel authentication where they are "
        "not the defaults (star, CURVE keys).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|--:|---|---|" + "--:|" * (len(COLUMNS) - 4),
    ]
    rest = " |" * (len(COLUMNS) - 4)
    for cell in report["run"]["cells"]:
        head = f"| {cell['model']}{variant_text(cell)} | {cell['workers']} | {profile_of(cell)} |"
        if "failed" in cell:
            last = cell["failed"].strip().splitlines()[-1]
            lines.append(f"{head} {cell['transport']}: FAILED ({last}){rest}")
            continue
        rows = rows_of(cell)
        limit = rows.get(LIMIT[cell["transport"]])
        for row in cell["contenders"]:
            med = median(row)
            p90 = percentile(row["samples_s"], 0.9) if row["samples_s"] else None
            base = median(limit) if limit else None
            compared = row is not limit and row["kind"] != "floor"
            vs_limit = f"{med / base:.2f}x" if med and base and compared else ""
            busy = busy_median(row)
            busy_base = busy_median(limit) if limit else None
            busy_vs = f"{busy / busy_base:.2f}x" if busy and busy_base and compared else ""
            n = len(row["samples_s"]) or len(row.get("busy_samples_s") or [])
            speedup = ""
            ours = rows.get(PAIRS.get(row["name"], ""))
            if ours and med and median(ours):
                speedup = f"{med / median(ours):.1f}x"  # type: ignore[operator]
            sender, workers = _gap(row)
            tear = _tear_text(row)
            name = f"**{row['name']}**" if row["kind"] == "aiowsync" else row["name"]
            lines.append(
                f"{head} {name} | {_ms(med)} | {_ms(p90)} | {n} | {vs_limit} | {_ms(busy)} "
                f"| {busy_vs} | {speedup} | {sender} | {workers} | {tear} |"
            )
        for s in cell["skipped"]:
            lines.append(f"{head} {s['contender']}: skipped, {s['reason']}{rest}")
        for e in cell["errors"]:
            first = e["error"].strip().splitlines()[0] if e["error"].strip() else "?"
            lines.append(f"{head} TorchRL {'+'.join(e['batch'])}: failed ({first}){rest}")
    lines += _policy_lines(report)
    lead_lines = [
        f"| {cell['model']}{variant_text(cell)} | {cell['workers']} | {profile_of(cell)} "
        f"| {row['name']} | {_ms(lead)} | {_ms(median(row))} |"
        for cell in cells_of(report)
        for row in cell["contenders"]
        if (lead := lead_median(row)) is not None
    ]
    if lead_lines:
        lines += [
            "",
            "### First sends of each pair",
            "",
            "The first send of each back-to-back pair (timed, but not a sample of the table "
            "above), after the other contenders' turns (their workers idle meanwhile), beside "
            "the second (the sample).",
            "",
            "| model | workers | profile | contender | first of pair, median ms "
            "| second, median ms |",
            "|---|--:|---|---|--:|--:|",
            *lead_lines,
        ]
    lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str | None:
    """Send latency against model size, one line per contender, one panel per worker count,
    of the cells of the headline profile (see :func:`headline_profile`) with the default
    topology and control-channel authentication, or in a run without those the first variant
    run (the other variants of a cell are in the table),
    quiet gate where measured. Returns why no plot was drawn (matplotlib missing, nothing
    measured), or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'aiowsync[bench]'): no plot"
    profile = headline_profile(report)
    measured = [c for c in cells_of(report) if c["contenders"] and profile_of(c) == profile]
    # One variant per line: the default's, or (a run of chains alone) the first one run.
    variant = "" if any(not variant_text(c) for c in measured) else None
    if variant is None and measured:
        variant = variant_text(measured[0])
    cells = [c for c in measured if variant_text(c) == variant]
    workers = sorted({c["workers"] for c in cells})
    if not workers:
        return "no cell measured anything: no plot"
    # Sizes on a categorical axis, smallest first; the 1000-tensor model last, not joined by
    # the lines (it is the same size as 64MiB but a different kind of model).
    few = sorted({(c["model_bytes"], c["model"]) for c in cells if c["tensors"] <= 10})
    many = sorted({c["model"] for c in cells if c["tensors"] > 10})
    position = {name: i for i, (_, name) in enumerate(few)}
    position.update({name: len(few) + i for i, name in enumerate(many)})
    panels = len(workers)
    fig, axes = plt.subplots(1, panels, figsize=(max(9, 6 * panels), 6), squeeze=False)
    names = sorted({r["name"] for c in cells for r in c["contenders"]})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    for ax, n in zip(axes[0], workers, strict=True):
        for name in names:
            points = []
            for c in cells:
                row = rows_of(c).get(name)
                samples = row and (row["samples_s"] or row.get("busy_samples_s"))
                if c["workers"] == n and samples:
                    ms = statistics.median(samples) * 1e3
                    points.append((position[c["model"]], ms, c["tensors"] > 10))
            style = "-" if name.startswith("aiowsync") else ("--" if "raw" in name else ":")
            line = sorted((x, y) for x, y, is_many in points if not is_many)
            if line:
                xs, ys = zip(*line, strict=True)
                ax.plot(xs, ys, style, marker="o", color=colors[name], label=name)
            for x, y, is_many in points:
                if is_many:
                    label = None if line else name
                    ax.plot([x], [y], marker="*", markersize=13, linestyle="none",
                            color=colors[name], label=label)  # fmt: skip
        ax.set_xticks(range(len(position)), [*(m for _, m in few), *many])
        ax.set_xlim(-0.4, len(position) - 0.6)
        ax.set_yscale("log")
        ax.set_title(f"{n} {profile} worker{'s' if n > 1 else ''}")
        ax.set_xlabel("model (star: 1000 tensors)")
        ax.set_ylabel("send latency, median ms (log)")
        ax.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    ncol = 2 if panels == 1 else 4
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol,
               fontsize="small")  # fmt: skip
    rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
