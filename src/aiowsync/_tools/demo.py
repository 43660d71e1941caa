"""``aiowsync demo``: a trainer and several worker processes on shared memory.

The trainer changes its weights and sends them; each worker runs forward passes on its event
loop while new versions arrive, and a checker thread holding the read guard hashes the weights
it sees and compares them with the trainer's hash of the same version.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._scheme.shared_mem import SharedMemWeightSyncScheme


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def _digest(model: nn.Module, wire: torch.dtype | None = None) -> str:
    """A hash of the model's bytes; with ``wire``, of its floats as they arrive through that
    wire dtype (cast there and back)."""
    h = hashlib.blake2b(digest_size=8)
    for t in model.state_dict().values():
        if wire is not None and t.is_floating_point():
            t = t.to(wire).to(t.dtype)
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _StallMeter:
    """Largest gap between two ticks of a 1 ms sleeper on the running loop."""

    def __init__(self) -> None:
        self.max_gap = 0.0

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last - 0.001)
            last = now


def _worker(scheme: SharedMemWeightSyncScheme, idx: int, width: int, depth: int, out: Any) -> None:
    torch.set_num_threads(1)
    asyncio.run(_worker_async(scheme, idx, width, depth, out))


async def _worker_async(
    scheme: SharedMemWeightSyncScheme, idx: int, width: int, depth: int, out: Any
) -> None:
    model = _model(width, depth)
    scheme.init_on_receiver(model=model, worker_idx=idx)
    meter = _StallMeter()
    stats = {"switches": 0, "forwards": 0, "checked": 0, "mismatched": 0}
    scheme.register_hook(lambda v: stats.__setitem__("switches", stats["switches"] + 1))
    stop = threading.Event()

    def checker() -> None:
        while not stop.wait(0.5):
            with scheme.read_guard():
                version, digest = scheme.version, _digest(model)
            out.put(("check", idx, version, digest))
            stats["checked"] += 1

    async with scheme:
        await scheme.connect(timeout=60)
        out.put(("ready", idx, scheme.version, _digest(model)))
        ticker = asyncio.create_task(meter.run())
        thread = threading.Thread(target=checker, daemon=True)
        thread.start()
        obs = torch.randn(16, width)
        try:
            # Until the trainer says goodbye (or is lost).
            while scheme.connected:
                with torch.no_grad():
                    model(obs)
                stats["forwards"] += 1
                await asyncio.sleep(0.002)
        finally:
            stop.set()
            thread.join(5)
            ticker.cancel()
        with scheme.read_guard():
            out.put(("check", idx, scheme.version, _digest(model)))
        out.put(("done", idx, scheme.version, stats, meter.max_gap))


async def _trainer(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    model = _model(args.width, args.depth)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    wire = getattr(torch, args.wire_dtype) if args.wire_dtype else None
    scheme = SharedMemWeightSyncScheme(wire_dtype=wire)
    scheme.init_on_sender(model=model, num_workers=args.workers, rehome=True)
    expected: dict[int, str] = {0: _digest(model, wire)}
    procs = []
    meter = _StallMeter()
    latencies: list[float] = []
    print(
        f"aiowsync demo: {nbytes / 2**20:.1f} MiB model, {args.workers} workers, "
        f"{args.sends} sends over shared memory"
        + (f", floats travelling as {args.wire_dtype}" if wire is not None else ""),
        flush=True,
    )
    async with scheme:
        try:
            for i in range(args.workers):
                p = ctx.Process(target=_worker, args=(scheme, i, args.width, args.depth, out))
                p.start()
                procs.append(p)
            print(
                f"  started {args.workers} worker processes (spawned: each imports torch, "
                "which takes a few seconds)",
                flush=True,
            )
            watch = asyncio.create_task(_show_joining(scheme))
            try:
                await scheme.connect(timeout=120)
            finally:
                watch.cancel()
            print(f"  {args.workers} workers connected at {scheme.address}, all on version 0")
            ticker = asyncio.create_task(meter.run())
            for step in range(1, args.sends + 1):

                def train_step() -> None:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p), alpha=1e-3)

                await asyncio.to_thread(train_step)
                expected[step] = await asyncio.to_thread(_digest, model, wire)
                result = await scheme.send(timeout=30)
                latencies.append(result.seconds)
                if step % max(1, args.sends // 10) == 0 or step == args.sends:
                    print(
                        f"  sent version {result.version:4d} to workers "
                        f"{list(result.worker_ids)} in {result.seconds * 1e3:6.2f} ms"
                    )
                await asyncio.sleep(args.interval)
            ticker.cancel()
        finally:
            # Leaving the scheme says goodbye to the workers; they then report and exit.
            pass
    reports: dict[int, Any] = {}
    checks: dict[int, list[tuple[int, str]]] = {i: [] for i in range(args.workers)}
    deadline = time.monotonic() + 60
    while len(reports) < args.workers and time.monotonic() < deadline:
        try:
            event = await asyncio.to_thread(out.get, True, 1.0)
        except Exception:
            continue
        if event[0] in ("check", "ready"):
            checks[event[1]].append((event[2], event[3]))
        elif event[0] == "done":
            reports[event[1]] = event
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return _summary(args, expected, checks, reports, latencies, meter.max_gap)


async def _show_joining(scheme: SharedMemWeightSyncScheme) -> None:
    """Every two seconds while workers join: how many are where (from ``scheme.workers``)."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(2.0)
        states = [s.state for s in scheme.workers.values()]
        ready = states.count("ready")
        rest = ", ".join(
            f"{states.count(k)} {'not connected yet' if k == 'never connected' else k}"
            for k in dict.fromkeys(states)
            if k != "ready"
        )
        print(
            f"  {time.monotonic() - started:4.0f} s: {ready} of {len(states)} workers connected"
            + (f" ({rest})" if rest else ""),
            flush=True,
        )


def _summary(
    args: argparse.Namespace,
    expected: dict[int, str],
    checks: dict[int, list[tuple[int, str]]],
    reports: dict[int, Any],
    latencies: list[float],
    trainer_gap: float,
) -> int:
    lat = sorted(latencies)
    p50 = statistics.median(lat) * 1e3
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
    print()
    print("| worker | final version | versions seen | checks | mismatches | loop max stall |")
    print("|-------:|--------------:|--------------:|-------:|-----------:|---------------:|")
    ok = len(reports) == args.workers
    for i in range(args.workers):
        rows = checks[i]
        bad = sum(1 for v, d in rows if expected.get(v) != d)
        if i not in reports:
            print(f"| {i} | (no report) | | | | |")
            ok = False
            continue
        _, _, version, stats, gap = reports[i]
        ok = ok and bad == 0 and version == args.sends
        print(
            f"| {i} | {version} | {stats['switches']} | {len(rows)} | {bad} | {gap * 1e3:.1f} ms |"
        )
    print()
    print(
        "final version: the version the worker ran when the trainer left; versions seen: "
        "switches it made;\nchecks: hashes of its weights taken by a thread under the read "
        "guard; mismatches: hashes\nthat differ from the trainer's hash of the same version "
        "(a torn or wrong read); loop max stall:\nthe longest the worker's event loop waited "
        "beyond a 1 ms sleep while it ran forwards."
    )
    print()
    print(f"send latency: p50 {p50:.2f} ms, p99 {p99:.2f} ms over {len(lat)} sends")
    print(f"trainer event loop max stall: {trainer_gap * 1e3:.1f} ms")
    print("content verified on every worker: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse's error names
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="aiowsync demo",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=_at_least(1), default=4, help="worker processes to start")
    parser.add_argument("--sends", type=_at_least(1), default=40, help="versions the trainer sends")
    parser.add_argument("--width", type=_at_least(1), default=1024, help="hidden width of the MLP")
    parser.add_argument("--depth", type=_at_least(0), default=4, help="hidden layers of the MLP")
    parser.add_argument("--interval", type=_seconds, default=0.05, help="seconds between sends")
    parser.add_argument(
        "--wire-dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="send floats in this dtype (halving the bytes); the fp32 workers copy each "
        "version with a cast (default: as they are)",
    )
    args = parser.parse_args(argv)
    return asyncio.run(_trainer(args))


if __name__ == "__main__":
    sys.exit(main())
