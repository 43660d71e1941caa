"""Shared-memory sends to busy workers that read their whole model after each version, against
one flat ``copy_`` of the same bytes.

A trainer (this process) holds ``aiowsync.SharedMemWeightSyncScheme()`` with its defaults and
sends to 4 spawned worker processes. Each worker's event loop runs a task that wakes every
2 ms and, whenever the scheme's version changed since its last look, reads every tensor of the
model once (``t.sum()`` of each, under the read guard), as a policy that runs a forward after
each update would (``--reads once``: after the first version only, then never). Each sample
is ``await scheme.send()`` timed by the caller; the baseline is one ``torch.Tensor.copy_`` of
as many bytes between two flat tensors allocated and touched up front, run right after each
send (sample by sample). The trainer changes its weights before
each send, untimed.

Models (``--models``):

* ``1000t-64MiB``: 500 ``nn.Linear(183, 183)`` layers, 1000 tensors (weights of 131 KiB,
  biases of 732 bytes), 64.2 MiB of float32;
* ``256MiB``: four float32 tensors of 64 MiB.

Reported per model and run: the medians of the sends, of their ``SendResult.stage_seconds``
and of the raw copies, and the ratios of the first two to the third. After each run every
worker must hold the trainer's last weights exactly.

Usage::

    .venv/bin/python benchmarks/bench_busy_shm.py                        # both models, 2 runs
    .venv/bin/python benchmarks/bench_busy_shm.py --models 1000t-64MiB --samples 30
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import aiowsync

MIB = 1 << 20
SPAWN = mp.get_context("spawn")
MODELS = ("1000t-64MiB", "256MiB")


def build(name: str) -> nn.Module:
    """The model ``name``, the same structure in every process (values come by the scheme)."""
    if name == "1000t-64MiB":
        return nn.Sequential(*(nn.Linear(183, 183) for _ in range(500)))
    if name == "256MiB":
        return nn.ParameterList(nn.Parameter(torch.zeros(16 * MIB)) for _ in range(4))
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- a worker -----------------------------------------------------------------------------------


def worker_main(scheme: Any, idx: int, name: str, conn: Any, once: bool) -> None:
    torch.set_num_threads(1)
    asyncio.run(_worker(scheme, idx, name, conn, once))


async def _worker(scheme: Any, idx: int, name: str, conn: Any, once: bool) -> None:
    model = build(name)
    scheme.init_on_receiver(model=model, worker_idx=idx)
    # The module's own tensors, which a switch re-points (state_dict() would give detached
    # ones, left on the bytes of the version before the first switch).
    tensors = [*model.parameters(), *model.buffers()]
    reads = 0

    async def tick() -> None:
        nonlocal reads
        seen = None
        while True:
            await asyncio.sleep(0.002)
            if scheme.version != seen and not (once and reads):
                async with scheme.read_guard():
                    seen = scheme.version
                    with torch.no_grad():
                        for t in tensors:
                            t.sum()
                reads += 1

    async with scheme:
        await scheme.connect(timeout=300)
        busy = asyncio.create_task(tick())
        conn.send("ready")
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command == "stop":
                break
            conn.send((scheme.version, digest(model), reads))
        busy.cancel()


class Pool:
    """``n`` worker processes of ``scheme``, each building model ``name``."""

    def __init__(self, scheme: Any, n: int, name: str, once: bool = False) -> None:
        self.conns, self.procs = [], []
        for i in range(n):
            ours, theirs = SPAWN.Pipe()
            args = (scheme, i, name, theirs, once)
            proc = SPAWN.Process(target=worker_main, args=args, daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    async def ready(self) -> None:
        for c in self.conns:
            await asyncio.to_thread(_recv, c, 300)

    async def states(self) -> list[tuple[int, str, int]]:
        for c in self.conns:
            c.send("state")
        return [await asyncio.to_thread(_recv, c, 120) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("a worker did not answer")
    return conn.recv()


# -- a run --------------------------------------------------------------------------------------


async def one_run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model = build(name)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.uniform_(-1.0, 1.0)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    scheme = aiowsync.SharedMemWeightSyncScheme(switch=args.switch)
    scheme.init_on_sender(model=model, num_workers=args.workers)
    sends: list[float] = []
    stages: list[float] = []
    raws: list[float] = []
    async with scheme:
        pool = Pool(scheme, args.workers, name, once=args.reads == "once")
        try:
            await scheme.connect(timeout=300)
            await pool.ready()
            for k in range(args.warmup + args.samples):
                with torch.no_grad():
                    for t in model.parameters():
                        t.add_(1.0)
                t0 = time.perf_counter()
                result = await scheme.send()
                send_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                dst.copy_(src)
                raw_s = time.perf_counter() - t0
                if k >= args.warmup:  # first sends fault in slots and plans: no samples
                    sends.append(send_s)
                    stages.append(result.stage_seconds)
                    raws.append(raw_s)
            await asyncio.sleep(0.05)  # the readers' last look
            seen = await pool.states()
        finally:
            pool.close()
    want = digest(model)
    send_ms, stage_ms, raw_ms = (statistics.median(x) * 1e3 for x in (sends, stages, raws))
    return {
        "model": name,
        "tensors": len(model.state_dict()),
        "bytes": nbytes,
        "samples": len(sends),
        "send_ms": send_ms,
        "stage_ms": stage_ms,
        "raw_copy_ms": raw_ms,
        "send_ratio": send_ms / raw_ms,
        "stage_ratio": stage_ms / raw_ms,
        "exact": all(v == scheme.version and d == want for v, d, _ in seen),
        "reads_per_worker": [r for _, _, r in seen],
        "all_send_ms": [s * 1e3 for s in sends],
        "all_raw_ms": [s * 1e3 for s in raws],
    }


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name in args.models.split(","):
        for run in range(args.runs):
            row = await one_run(name, args)
            row["run"] = run + 1
            rows.append(row)
            print(
                f"{name:<12} run {run + 1}: send {row['send_ms']:7.2f} ms  "
                f"stage {row['stage_ms']:7.2f} ms  raw copy_ {row['raw_copy_ms']:7.2f} ms  "
                f"send/raw {row['send_ratio']:.2f}x  stage/raw {row['stage_ratio']:.2f}x  "
                f"exact={row['exact']}  reads={row['reads_per_worker']}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--runs", type=int, default=2, help="sessions per model")
    parser.add_argument("--samples", type=int, default=24, help="sends (and raw copies) a run")
    parser.add_argument("--warmup", type=int, default=3, help="sends before the samples")
    parser.add_argument(
        "--switch", default="auto", choices=("auto", "rebind", "remap"), help="the scheme's switch"
    )
    parser.add_argument(
        "--reads",
        default="every",
        choices=("every", "once"),
        help="workers read their model after every version, or after the first one only",
    )
    parser.add_argument("--json", default=None, help="write every run here")
    args = parser.parse_args()
    rows = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    sys.exit(0 if all(r["exact"] for r in rows) else 1)
