"""Round-trip latency of the control channel: aiowsync's ZeroMQ channels against raw pyzmq.

One round trip is what a receiver and the sender exchange on every update: the receiver sends a
tiny message (an ``Ack``), the sender receives it and answers with another (a ``Heartbeat``),
and the receiver receives that answer. Both ends live in this process and are driven by one
asyncio event loop over tcp loopback, each end with its own ZeroMQ context (its own I/O thread),
as two processes would be.

Contenders, measured in the same run and alternated round by round so that drift of the machine
(frequency, other tenants) hits all of them alike:

* ``aiowsync``: ``ZmqChannelFactory`` channels, ``send(..., timeout=)`` / ``recv(timeout=)``,
  which encode and decode real protocol messages.
* ``raw``: a ``zmq.asyncio`` ROUTER/DEALER pair, ``await send_multipart`` /
  ``await recv_multipart`` of byte payloads of exactly the encoded messages' sizes. The sockets
  get the same options as aiowsync's (linger, ZMTP heartbeats), so the two differ only in the
  Python layer.
* ``raw+codec`` (informational): the raw pair, plus aiowsync's ``encode``/``decode`` of the same
  messages. Its distance from ``raw`` is the cost of the codec; its distance from ``aiowsync``
  is the cost of the channel's receive path.

Target: aiowsync's median <= 1.5x raw's median.

Reading the numbers: a round trip crosses threads four times (event loop -> ZeroMQ I/O thread
-> the other context's I/O thread -> event loop, twice), so how fast an idle CPU wakes up
weighs on it more than the Python layer does; compare contenders within one run only (the load
average at the start and end is printed and recorded). The ``cpu us`` column (the event-loop
thread's CPU time per round trip) is the Python layer's cost without the wake-ups; under CPU
contention it becomes latency.

Environment: ``OMP_WAIT_POLICY=PASSIVE`` is set (unless already set) before torch is imported
(aiowsync imports torch), as for every benchmark on the shared 2-core machine; torch does no
work here, so its thread count is left alone.

Usage::

    .venv/bin/python benchmarks/bench_channel.py            # ~15 s
    .venv/bin/python benchmarks/bench_channel.py --uvloop
    .venv/bin/python benchmarks/bench_channel.py --quick
    .venv/bin/python benchmarks/bench_channel.py --profile 3000   # cProfile the aiowsync path
"""

from __future__ import annotations

import os

# Must happen before torch is imported (aiowsync imports it): idle OpenMP threads must not spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from aiowsync import Heartbeats, Timeouts
from aiowsync._channel import ZmqChannelFactory
from aiowsync._protocol import Ack, Heartbeat, decode, encode

LOOPBACK = "tcp://127.0.0.1:0"
HEARTBEAT_TIMEOUT = Heartbeats().timeout  # aiowsync's default liveness
OP_TIMEOUT = Timeouts().control  # the deadline the schemes give one control message
TARGET_RATIO = 1.5

ACK = Ack(worker_idx=0, version=1)
BEAT = Heartbeat(worker_idx=-1, session="", version=1)


# -- contenders ---------------------------------------------------------------------------------


class Contender:
    """One way of doing a round trip; ``round_trip`` returns the message the receiver got."""

    name: str

    async def round_trip(self) -> object:
        raise NotImplementedError

    def check(self, reply: object) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class AiowsyncPair(Contender):
    name = "aiowsync"

    def __init__(self) -> None:
        factory = ZmqChannelFactory()
        self.tx = factory.bind(LOOPBACK, heartbeat_timeout=HEARTBEAT_TIMEOUT)
        self.rx = factory.connect(self.tx.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)

    async def round_trip(self) -> object:
        await self.rx.send(ACK, timeout=OP_TIMEOUT)
        peer, _ = await self.tx.recv(timeout=OP_TIMEOUT)
        await self.tx.send(peer, BEAT, timeout=OP_TIMEOUT)
        return await self.rx.recv(timeout=OP_TIMEOUT)

    def check(self, reply: object) -> None:
        if reply != BEAT:
            raise AssertionError(f"aiowsync round trip returned {reply!r}, expected {BEAT!r}")

    def close(self) -> None:
        self.rx.close()
        self.tx.close()


def _options(sock: zmq.Socket[Any]) -> None:
    """The options aiowsync's channels set (see ``_zmq._base_options``)."""
    ms = int(HEARTBEAT_TIMEOUT * 1000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms // 3)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ms)


class RawPair(Contender):
    name = "raw"

    def __init__(self) -> None:
        self.up = encode(ACK)  # same sizes as what aiowsync puts on the wire
        self.down = encode(BEAT)
        self.ctx_tx = zmq.asyncio.Context()
        self.ctx_rx = zmq.asyncio.Context()
        self.router = self.ctx_tx.socket(zmq.ROUTER)
        self.dealer = self.ctx_rx.socket(zmq.DEALER)
        _options(self.router)
        _options(self.dealer)
        self.router.bind(LOOPBACK.replace(":0", ":*"))
        self.dealer.connect(self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    async def round_trip(self) -> object:
        await self.dealer.send_multipart([self.up])
        peer, _ = await self.router.recv_multipart()
        await self.router.send_multipart([peer, self.down])
        return await self.dealer.recv_multipart()

    def check(self, reply: object) -> None:
        if reply != [self.down]:
            raise AssertionError(f"raw round trip returned {reply!r}")

    def close(self) -> None:
        self.dealer.close(linger=0)
        self.router.close(linger=0)
        self.ctx_rx.term()
        self.ctx_tx.term()


class RawCodecPair(RawPair):
    """Raw sockets, but the messages are encoded and decoded as aiowsync does."""

    name = "raw+codec"

    async def round_trip(self) -> object:
        await self.dealer.send_multipart([encode(ACK)])
        peer, frame = await self.router.recv_multipart()
        decode(frame)
        await self.router.send_multipart([peer, encode(BEAT)])
        (frame,) = await self.dealer.recv_multipart()
        return decode(frame)

    def check(self, reply: object) -> None:
        if reply != BEAT:
            raise AssertionError(f"raw+codec round trip returned {reply!r}")


# -- measurement --------------------------------------------------------------------------------


async def timed(round_trip: Callable[[], Awaitable[object]], n: int) -> list[int]:
    """Nanoseconds of each of ``n`` consecutive round trips."""
    clock = time.perf_counter_ns
    out = [0] * n
    for i in range(n):
        t0 = clock()
        await round_trip()
        out[i] = clock() - t0
    return out


async def timed_round(round_trip: Callable[[], Awaitable[object]], n: int) -> tuple[list[int], int]:
    """Wall time of each round trip, and the event-loop thread's CPU time for all of them.

    The CPU time shows the Python layer's cost even where it overlaps with waiting for the
    ZeroMQ I/O threads and so stays out of the latency.
    """
    cpu0 = time.thread_time_ns()
    wall = await timed(round_trip, n)
    return wall, time.thread_time_ns() - cpu0


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (0 <= q <= 100) of already sorted values."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(rounds: list[list[int]], cpu_ns: list[int]) -> dict[str, Any]:
    us = sorted(ns / 1000 for r in rounds for ns in r)
    round_medians = [statistics.median(r) / 1000 for r in rounds]
    return {
        "loop_thread_cpu_us_per_round_trip": sum(cpu_ns) / 1000 / len(us),
        "samples": len(us),
        "median_us": statistics.median(us),
        "p99_us": percentile(us, 99),
        "p90_us": percentile(us, 90),
        "p10_us": percentile(us, 10),
        "min_us": us[0],
        "max_us": us[-1],
        "mean_us": statistics.fmean(us),
        "round_medians_us": round_medians,
    }


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    contenders: list[Contender] = [AiowsyncPair(), RawPair()]
    if not args.no_codec_baseline:
        contenders.append(RawCodecPair())
    try:
        for c in contenders:  # connect, check correctness, then warm up
            c.check(await asyncio.wait_for(c.round_trip(), 10))
            await timed(c.round_trip, args.warmup)
            c.check(await c.round_trip())
        samples: dict[str, list[list[int]]] = {c.name: [] for c in contenders}
        cpu: dict[str, list[int]] = {c.name: [] for c in contenders}
        for r in range(args.rounds):
            # rotate the order every round so that no contender always runs first
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for c in order:
                gc.collect()
                wall, cpu_ns = await timed_round(c.round_trip, args.round_trips)
                samples[c.name].append(wall)
                cpu[c.name].append(cpu_ns)
        profile_text = await profile(contenders[0], args.profile) if args.profile else None
    finally:
        for c in contenders:
            c.close()

    results = {name: summarize(rounds, cpu[name]) for name, rounds in samples.items()}
    raw = results["raw"]["median_us"]
    ratios = {name: res["median_us"] / raw for name, res in results.items() if name != "raw"}
    per_round = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(samples["aiowsync"], samples["raw"], strict=True)
    ]
    return {
        "benchmark": "channel round trip (Ack up, Heartbeat down) over tcp loopback",
        "config": {
            "rounds": args.rounds,
            "round_trips_per_round": args.round_trips,
            "warmup": args.warmup,
            "event_loop": "uvloop" if args.uvloop else "asyncio",
            "op_timeout_s": OP_TIMEOUT,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
            "frame_bytes": {"up": len(encode(ACK)), "down": len(encode(BEAT))},
        },
        "environment": environment(load_at_start),
        "results": results,
        "ratio_vs_raw_median": ratios,
        "aiowsync_vs_raw_per_round": per_round,
        "target": {
            "aiowsync_over_raw_median_max": TARGET_RATIO,
            "met": ratios["aiowsync"] <= TARGET_RATIO,
        },
        "profile": profile_text,
    }


async def profile(contender: Contender, n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    await timed(contender.round_trip, n)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def environment(load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        # other processes on a 2-core machine change these results a lot: keep the load with them
        "loadavg_1_5_15_at_start": load_at_start,
        "loadavg_1_5_15_at_end": os.getloadavg(),
    }


def print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"\nchannel round trip over tcp loopback, {cfg['event_loop']} loop, "
        f"{cfg['rounds']} rounds x {cfg['round_trips_per_round']} round trips per contender"
    )
    env = report["environment"]
    print(
        f"load average (1 min) {env['loadavg_1_5_15_at_start'][0]:.2f} at start, "
        f"{env['loadavg_1_5_15_at_end'][0]:.2f} at end"
    )
    header = f"{'contender':<11}{'median us':>11}{'p99 us':>10}{'p10 us':>9}{'p90 us':>9}"
    header += f"{'min us':>9}{'x raw':>8}{'cpu us':>8}   round medians (us)"
    print(header)
    print("-" * len(header))
    for name, res in report["results"].items():
        ratio = report["ratio_vs_raw_median"].get(name, 1.0)
        rounds = " ".join(f"{m:.1f}" for m in res["round_medians_us"])
        print(
            f"{name:<11}{res['median_us']:>11.1f}{res['p99_us']:>10.1f}{res['p10_us']:>9.1f}"
            f"{res['p90_us']:>9.1f}{res['min_us']:>9.1f}{ratio:>8.2f}"
            f"{res['loop_thread_cpu_us_per_round_trip']:>8.1f}   {rounds}"
        )
    print("(cpu us: the event-loop thread's CPU time per round trip, I/O threads excluded)")
    per_round = report["aiowsync_vs_raw_per_round"]
    target = report["target"]
    print(
        f"\naiowsync/raw median: {report['ratio_vs_raw_median']['aiowsync']:.2f}x "
        f"(per round {min(per_round):.2f}-{max(per_round):.2f}x); "
        f"target <= {target['aiowsync_over_raw_median_max']}x: "
        f"{'met' if target['met'] else 'MISSED'}"
    )
    if report["profile"]:
        print("\ncProfile of the aiowsync round trips:\n")
        print(report["profile"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument(
        "--round-trips", type=int, default=2000, help="round trips per contender per round"
    )
    p.add_argument("--warmup", type=int, default=1000, help="untimed round trips per contender")
    p.add_argument("--quick", action="store_true", help="2 rounds x 300 round trips, short warmup")
    p.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's loop")
    p.add_argument("--no-codec-baseline", action="store_true", help="skip the raw+codec contender")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the benchmark, cProfile N aiowsync round trips and print the top functions",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/channel.json"),
        help="where to write the results (default bench-results/channel.json)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.round_trips, args.warmup = 2, 300, 100
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        report = loop.run_until_complete(benchmark(args))
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
