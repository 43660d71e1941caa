"""The plan of ``aiowsync bench``: its cells of (model, worker count, transport), the samples
each takes, the run's settings, and what each contender group holds in memory, so that a cell's
TorchRL trees are packed into batches that fit what the machine has."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from ._models import MIB

__all__ = [
    "FULL_SAMPLES",
    "GATES",
    "PAIR_UP_TO",
    "PROFILES",
    "QUICK_CELLS",
    "QUICK_LEAVE_OUT",
    "QUICK_SAMPLES",
    "TORCHRL_MODES",
    "TORCHRL_TREES",
    "Cell",
    "Settings",
    "available_bytes",
    "footprint",
    "matrix",
    "plan_batches",
    "settle_memory",
]

FULL_SAMPLES = {"1MiB": 30, "64MiB": 10, "256MiB": 6, "1GiB": 4, "1000t-64MiB": 10}
QUICK_SAMPLES = {"1MiB": 10, "64MiB": 4, "256MiB": 3, "1GiB": 2, "1000t-64MiB": 4}
TORCHRL_TREES = {"shm": ("shared", "mp"), "dist": ("distributed",)}
TORCHRL_MODES = {
    "shared": ("send()", "send(weights)"),
    "mp": ("send()",),
    "distributed": ("send()",),
}
PAIR_UP_TO = 4 * MIB
"""Models up to this size are sampled in back-to-back pairs: each contender sends twice in a
row and the second send is the sample. Such a send takes about a millisecond, and alone it
mostly measures how fast the workers wake after the other contenders' turns (twice as long
here as back to back); the first of each pair is kept too, as ``lead_samples_s``."""
PROCESS_BYTES = 400 * MIB  # what a process that imported torch (and torchrl) holds


PROFILES = ("policy", "light")
"""What aiowsync's workers do beside receiving. ``policy``: a task on each worker's event loop
wakes every 2 ms and reads every tensor of the model once after each new version
(:class:`~aiowsync._tools.bench._worker.PolicyReads`). ``light``: nothing but the
benchmark's own commands (probes and readers, during their phases only)."""
GATES = ("quiet", "busy")
"""When a sample's timed part starts. ``quiet``: once the machine is quiet
(:func:`~aiowsync._tools.bench._probe.wait_quiet`); ``busy``: at once, whatever still runs."""


Cell = tuple[str, int, str]  # (model, workers, transport)
QUICK_CELLS: tuple[Cell, ...] = (
    ("64MiB", 4, "shm"),
    ("1000t-64MiB", 4, "shm"),
    ("64MiB", 4, "dist"),
)


def matrix(
    models: tuple[str, ...], workers: tuple[int, ...], transports: tuple[str, ...]
) -> tuple[Cell, ...]:
    """Every (model, workers, transport), models outermost."""
    return tuple((m, n, t) for m in models for n in workers for t in transports)


@dataclasses.dataclass(frozen=True)
class Settings:
    cells: tuple[Cell, ...]
    samples: dict[str, int] = dataclasses.field(default_factory=lambda: dict(FULL_SAMPLES))
    gap_sends: int = 3
    tear_sends: int = 5
    tear_max_s: float = 15.0
    idle_s: float = 0.5
    timeout: float = 120.0
    torchrl: bool = True
    memory_fraction: float = 0.8
    pair_up_to: int = PAIR_UP_TO
    leave_out: tuple[tuple[str, str], ...] = ()
    """(model, TorchRL tree) pairs not run, e.g. ``("1000t-64MiB", "mp")``."""
    wire_dtype: str | None = None
    """aiowsync's schemes send floats in this dtype (the workers' models stay float32 and
    copy each version with a cast)."""
    rehome: bool = False
    """aiowsync's senders re-home their model (``init_on_sender(..., rehome=True)``)."""
    bucket_bytes: int | None = None
    """The distributed scheme's bucket size (its default when None)."""
    topologies: tuple[str, ...] = ("star",)
    """The distributed scheme's topologies: each dist cell is measured once per topology."""
    control_auth: tuple[str, ...] = ("curve",)
    """The dist cells' control channel: ``"curve"`` (the default, keys of the scheme's own)
    or ``"off"`` (``allow_insecure_bind=True``); each dist cell is measured once per entry."""
    profiles: tuple[str, ...] = PROFILES
    """What aiowsync's workers do beside receiving: each cell is measured once per profile."""
    gates: tuple[str, ...] = GATES
    """When a sample starts: each round takes one sample of every contender per gate."""


QUICK_LEAVE_OUT: tuple[tuple[str, str], ...] = (("1000t-64MiB", "mp"),)
"""What ``--quick`` leaves out: TorchRL's MultiProcess scheme on the 1000-tensor model takes
about 3 s a send here, and a minute of the quick run, for a contender no check uses."""


def footprint(what: str, nbytes: int, n: int) -> int:
    """Rough peak bytes one contender group holds (beyond the worker pool's processes)."""
    per_model = {
        "shm": 5,  # the sender's model, the weights clone, up to three slots
        "raw copy_": 2,
        "dist": 2 * n + 3,  # two slots per receiver, the sender's model and slot, the clone
        "raw gloo broadcast": n + 1,
        # workers build their own model before TorchRL rebinds (shared) or fills it
        "shared": n + 2,
        "mp": n + 2,
        "distributed": n + 2,
    }[what]
    procs = n + 1 if what in TORCHRL_MODES else 0
    return per_model * nbytes + procs * PROCESS_BYTES


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def settle_memory(step: float = 0.25, most: float = 10.0, slack: int = 64 * MIB) -> None:
    """Wait (``most`` seconds at most) until the memory available stops growing: processes
    that just ended are still handing theirs back."""
    last = available_bytes()
    deadline = time.monotonic() + most
    while time.monotonic() < deadline:
        await asyncio.sleep(step)
        now = available_bytes()
        if now - last < slack:
            return
        last = now


def plan_batches(
    trees: tuple[str, ...], base: int, budget: int, nbytes: int, n: int
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """TorchRL trees packed into batches that fit beside the aiowsync session and the limit."""
    batches: list[list[str]] = []
    skipped: list[dict[str, Any]] = []
    current: list[str] = []
    used = base
    for tree in trees:
        need = footprint(tree, nbytes, n)
        if base + need > budget:
            skipped.append(
                {
                    "contender": tree,
                    "reason": f"needs ~{(base + need) / 2**30:.1f} GiB "
                    f"with the rest of its cell; the budget is {budget / 2**30:.1f} GiB",
                }
            )
            continue
        if used + need > budget and current:
            batches.append(current)
            current, used = [], base
        current.append(tree)
        used += need
    if current:
        batches.append(current)
    return batches, skipped
