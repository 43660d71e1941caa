"""Send latency of the distributed scheme on gloo against a raw gloo broadcast of the same bytes.

Contenders, measured in the same run, in the same worker processes, alternating sample by
sample (aiowsync, raw, raw, aiowsync, ...) so that drift of the shared machine hits both alike:

* ``aiowsync``: a ``DistributedWeightSyncScheme(backend="gloo", bucket_bytes=...)`` sender in
  this process, given the model at ``init_on_sender``; ``await scheme.send()`` is timed on the
  event loop from the call to its return, i.e. until every receiver has received the whole
  version (every bucket), switched its model to it and its ack came back over ZeroMQ. That
  includes the announcement, packing the model into the sender's slot (overlapped with the
  wire bucket by bucket), the broadcasts, the receivers' switch and the acks, and the hops
  between the event loops and the threads doing the blocking work on both sides;
* ``aiowsync re-homed``: the same with ``init_on_sender(..., rehome=True)`` (the sender's
  tensors are views of one flat buffer), for the 1000-tensor model;
* ``raw gloo``: the limit. A ``ProcessGroupGloo`` of its own (own ``TCPStore`` and prefix, not
  the default group; loopback like the scheme's groups) spanning this process (rank 0) and the
  same receiver processes (ranks 1..n), which run it in a thread beside their aiowsync
  receiver. Timed on rank 0, inside the thread that runs it: ``pg.broadcast([buf]).wait()`` of
  ONE flat uint8 buffer of exactly the model's byte count, then a one-byte ``recv`` from every
  receiver (each receiver ``send``\\s it as soon as its own broadcast completed). So both
  contenders end when every receiver has confirmed holding all the bytes. Also recorded (JSON,
  and the details table): the time until the root's broadcast ``wait()`` returned (bytes
  handed to the sockets, not yet received), and the time as seen from the event loop
  (``asyncio.to_thread`` hop included). The scheme moves its layout's bytes, which for the
  1000-tensor model include 18 KiB of alignment padding; the raw buffer is the exact model size.

TorchRL's ``DistributedWeightSyncScheme`` is measured beside these by ``aiowsync bench``.

Models: ``64MiB`` and ``256MiB`` (four float32 matrices of 1/2, 1/4, 1/8, 1/8 of the size) and
``1000t-64MiB`` (1000 tensors of varied sizes, a tenth of them int64 buffers, exactly 64 MiB),
sent to 4 receivers (``--workers``; ``--more-workers`` adds 1 and 8). A bucket-size sweep
(``--sweep-mb``) sends the 256MiB model to the first worker count with each bucket size, every
sweep session again against its own interleaved raw baseline, in two passes (the second in
reverse order, ``--sweep-passes``) whose samples are pooled.

Correctness is checked once per session: the sender stamps the first and last element of every
tensor, sends, and every receiver must report exactly those values at that version; every raw
round writes marks into the first and last byte, which every receiver checks (untimed).

Heartbeats: the library default, ``Heartbeats(interval=0.5, missed=3)`` (``--heartbeat-missed``
changes ``missed``). Receivers beat from the welcome on, so bringing a 256MiB model up to date
(about 1.1 s here) does not get them declared lost during ``connect()``.

Environment: ``OMP_WAIT_POLICY=PASSIVE`` is set (unless already set) before torch is imported,
here and in the workers, so that idle OpenMP threads sleep instead of spinning on the 2-core
machine; receivers call ``torch.set_num_threads(1)`` (they only receive and read weights); the
sender keeps torch's default thread count. Other processes on the machine are not controlled:
the load average at start and end is recorded.

Targets (to 4 receivers, default bucket): 64MiB and 256MiB <= 1.1x raw; 1000t-64MiB (plain and
re-homed) <= 1.2x the raw flat broadcast. Ratios are of medians.

Usage::

    .venv/bin/python benchmarks/bench_dist.py                   # everything, 4-7 min
    .venv/bin/python benchmarks/bench_dist.py --quick           # 64MiB + 1000t, < 2 min
    .venv/bin/python benchmarks/bench_dist.py --models 256MiB --bucket-mb 64 --no-sweep
    .venv/bin/python benchmarks/bench_dist.py --more-workers    # also 1 and 8 receivers
"""

from __future__ import annotations

import os

# Must happen before torch is imported: idle OpenMP threads must not spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore

import _workers as w
import aiowsync
from aiowsync._tools.bench._pool import WorkerError, WorkerPool
from bench_shm import summarize

MIB = 1 << 20
MODELS: dict[str, Callable[[], w.Spec]] = {
    "64MiB": lambda: w.few_large_spec(64 * MIB),
    "256MiB": lambda: w.few_large_spec(256 * MIB),
    "1000t-64MiB": lambda: w.many_tensors_spec(64 * MIB),
}
DEFAULT_ITERS = {"64MiB": 30, "256MiB": 16, "1000t-64MiB": 30}
QUICK_ITERS = {"64MiB": 8, "256MiB": 4, "1000t-64MiB": 8}
SWEEP_MODEL = "256MiB"
DEFAULT_SWEEP = "4,16,32,64,whole"
AIO, REHOMED, RAW = "aiowsync", "aiowsync re-homed", "raw gloo"
TIMEOUT = 120.0  # every send, collective, rendezvous and worker answer has this deadline
HEARTBEAT_MISSED = 3

# (model, workers) -> bound on median(aiowsync) / median(raw), for every aiowsync variant
TARGETS: dict[tuple[str, int], float] = {
    ("64MiB", 4): 1.1,
    ("256MiB", 4): 1.1,
    ("1000t-64MiB", 4): 1.2,
}


# -- one session --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    workers: int
    rehome: bool
    bucket_bytes: int
    iters: int
    warmup: int
    purpose: str  # "main" or "sweep"
    sweep_pass: int = 0  # 1, 2, ...: which pass of the bucket sweep counts this session; 0: none

    @property
    def variant(self) -> str:
        return REHOMED if self.rehome else AIO


class Model:
    def __init__(self, name: str) -> None:
        self.name = name
        self.spec = MODELS[name]()
        self.nbytes = w.spec_bytes(self.spec)
        self.stamp_base = 1000

    def build(self) -> nn.Module:
        """A fresh sender model (re-homing changes a model for good, so each session has one)."""
        torch.manual_seed(0)
        return w.build_model(self.spec, w.random_init)


async def run_session(
    pool: WorkerPool, store: Any, model: Model, case: Case, args: argparse.Namespace
) -> dict[str, Any]:
    ids = list(range(case.workers))
    timeout = args.timeout
    module = model.build()
    scheme = aiowsync.DistributedWeightSyncScheme(
        backend="gloo",
        bucket_bytes=case.bucket_bytes,
        heartbeats=aiowsync.Heartbeats(interval=0.5, missed=args.heartbeat_missed),
    )
    scheme.init_on_sender(model=module, num_workers=case.workers, rehome=case.rehome)
    out: dict[str, Any] = {
        "purpose": case.purpose,
        "model": model.name,
        "model_bytes": model.nbytes,
        "tensors": len(model.spec),
        "workers": case.workers,
        "rehome": case.rehome,
        "bucket_bytes": case.bucket_bytes,
        "buckets": -(-model.nbytes // case.bucket_bytes),
        "iters": case.iters,
        "warmup": case.warmup,
        "sweep_pass": case.sweep_pass,
    }
    raw = w.RawRoot(store, model.nbytes, timeout)
    joined = raw_open = False
    t_start = time.perf_counter()
    async with scheme:
        try:
            for i in ids:  # after `async with`: the address the scheme carries is bound
                pool.conns[i].send(("join", scheme, model.spec))
            joined = True
            await scheme.connect(timeout=timeout)
            for i in ids:
                await pool.expect(i, "ready", timeout=timeout)
            out["connect_s"] = time.perf_counter() - t_start

            await raw.open(pool, ids, case.warmup + case.iters)
            raw_open = True

            async def send() -> float:
                t0 = time.perf_counter_ns()
                await scheme.send(timeout=timeout)
                return (time.perf_counter_ns() - t0) / 1e6

            async def raw_round() -> tuple[float, float, float]:
                t0 = time.perf_counter_ns()
                bcast, total = await raw.round_split()
                return bcast * 1e3, total * 1e3, (time.perf_counter_ns() - t0) / 1e6

            out.update(await measure(send, raw_round, case))

            # correctness: every receiver must run exactly the stamped values at the new version
            model.stamp_base += 1000
            w.stamp(module, model.stamp_base)
            result = await scheme.send(timeout=timeout)
            expected = w.fingerprint(module)
            checks = await pool.ask(ids, ("check", result.version), "check", timeout)
            bad = [i for i, c in zip(ids, checks, strict=True) if c[2] != expected]
            if bad:
                raise AssertionError(f"workers {bad} do not hold version {result.version}")
            out["verified_version"] = result.version
            wrong = await raw.close(pool, ids)
            raw_open = False
            if wrong:
                raise AssertionError(f"{wrong} raw rounds delivered the wrong bytes")
            out["raw_rounds_verified"] = raw.rounds * len(ids)
        finally:
            if raw_open:
                raw.drop()  # receivers still inside a raw round fail fast; their error is moot
            if joined:
                for i in ids:
                    with contextlib.suppress(OSError):  # a dead worker's pipe is broken
                        pool.conns[i].send(("leave",))
                left = [await pool.drain_until(i, "left", timeout=timeout) for i in ids]
                if not all(left):
                    raise WorkerError(
                        f"workers {[i for i, ok in zip(ids, left, strict=True) if not ok]} "
                        "did not leave the session"
                    )
    out["session_s"] = time.perf_counter() - t_start
    return out


async def measure(
    send: Callable[[], Awaitable[float]],
    raw_round: Callable[[], Awaitable[tuple[float, float, float]]],
    case: Case,
) -> dict[str, Any]:
    """Warm-up pairs, then ``iters`` pairs whose order alternates (send first on even rounds)."""
    samples: dict[str, list[float]] = {case.variant: [], RAW: []}
    warm: dict[str, list[float]] = {case.variant: [], RAW: []}
    raw_bcast: list[float] = []
    raw_loop: list[float] = []
    for _ in range(case.warmup):
        warm[case.variant].append(await send())
        warm[RAW].append((await raw_round())[1])
    for r in range(case.iters):
        gc.collect()  # untimed, so that a collection never lands inside a sample
        for item in (case.variant, RAW) if r % 2 == 0 else (RAW, case.variant):
            if item == RAW:
                bcast, total, loop = await raw_round()
                samples[RAW].append(total)
                raw_bcast.append(bcast)
                raw_loop.append(loop)
            else:
                samples[item].append(await send())
    raw = summarize(samples[RAW])
    raw["bcast_only_median_ms"] = summarize(raw_bcast)["median_ms"]
    raw["from_loop_median_ms"] = summarize(raw_loop)["median_ms"]
    aio = summarize(samples[case.variant])
    aio["ratio_vs_raw"] = aio["median_ms"] / raw["median_ms"]
    aio["p10_ratio_vs_raw_p10"] = aio["p10_ms"] / raw["p10_ms"]
    return {
        "results": {case.variant: aio, RAW: raw},
        "samples_ms": {**samples, "raw bcast only": raw_bcast, "raw from loop": raw_loop},
        "warmup_ms": warm,
    }


# -- targets and sweep --------------------------------------------------------------------------


def judge(sessions: list[dict[str, Any]], default_bucket: int) -> list[dict[str, Any]]:
    verdicts = []
    for k, s in enumerate(sessions):
        bound = TARGETS.get((s["model"], s["workers"]))
        if bound is None or s["purpose"] != "main" or "results" not in s:
            continue
        name = REHOMED if s["rehome"] else AIO
        ratio = s["results"][name]["ratio_vs_raw"]
        note = "" if s["bucket_bytes"] == default_bucket else " (non-default bucket)"
        verdicts.append(
            {
                "target": f"{s['model']} to {s['workers']} receivers, {name}, "
                f"{s['bucket_bytes'] // MIB} MiB buckets{note}: median <= {bound}x raw",
                "value": ratio,
                "bound": bound,
                "met": ratio <= bound,
                "session": k,
            }
        )
    return verdicts


def sweep_summary(sessions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per bucket size, every pass's samples pooled: median send, median raw, their ratio."""
    points: dict[int, list[dict[str, Any]]] = {}
    for s in sessions:
        if s.get("sweep_pass") and "results" in s:
            points.setdefault(s["bucket_bytes"], []).append(s)
    if not points:
        return None
    rows = []
    for bucket, group in sorted(points.items()):
        aio = summarize([x for s in group for x in s["samples_ms"][AIO]])
        raw = summarize([x for s in group for x in s["samples_ms"][RAW]])
        rows.append(
            {
                "bucket_bytes": bucket,
                "buckets": group[0]["buckets"],
                "samples": aio["samples"],
                "median_ms": aio["median_ms"],
                "p10_ms": aio["p10_ms"],
                "p90_ms": aio["p90_ms"],
                "raw_median_ms": raw["median_ms"],
                "ratio_vs_raw": aio["median_ms"] / raw["median_ms"],
                "ratio_per_pass": [s["results"][AIO]["ratio_vs_raw"] for s in group],
            }
        )
    best = min(rows, key=lambda r: r["ratio_vs_raw"])
    for r in rows:
        r["ratio_vs_best"] = r["ratio_vs_raw"] / best["ratio_vs_raw"]
    return {"model": SWEEP_MODEL, "rows": rows, "best_bucket_bytes": best["bucket_bytes"]}


# -- output -------------------------------------------------------------------------------------


def bucket_text(nbytes: int, model_bytes: int) -> str:
    return "whole" if nbytes >= model_bytes else f"{nbytes / MIB:g} MiB"


def print_report(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"\ngloo send latency, sender torch threads {env['sender_torch_threads']} (default), "
        f"receivers torch.set_num_threads(1); OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; "
        f"{env['cpus']} CPUs; load avg {env['loadavg_start'][0]:.2f} at start, "
        f"{env.get('loadavg_end', (float('nan'),))[0]:.2f} at end; torch {env['torch']}\n"
    )
    print(
        "| model | recv | bucket | contender | n | median ms | p10 ms | p90 ms | min ms "
        "| max ms | x raw | target |"
    )
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|---|")
    verdicts = {v["session"]: v for v in report["targets"]}
    for k, s in enumerate(report["sessions"]):
        if "results" not in s:
            print(f"| {s['model']} | {s['workers']} | | ERROR: {s.get('error', '?')} |")
            continue
        if s["purpose"] != "main":
            continue
        bucket = bucket_text(s["bucket_bytes"], s["model_bytes"])
        for name, r in s["results"].items():
            ratio = target = ""
            if name != RAW:
                ratio = f"{r['ratio_vs_raw']:.2f}"
                v = verdicts.get(k)
                if v is not None:
                    target = f"<= {v['bound']}x: {'met' if v['met'] else 'MISSED'}"
            print(
                f"| {s['model']} | {s['workers']} | {bucket if name != RAW else 'flat'} | {name} "
                f"| {r['samples']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} | {r['p90_ms']:.1f} "
                f"| {r['min_ms']:.1f} | {r['max_ms']:.1f} | {ratio} | {target} |"
            )
    print(
        "\naiowsync: `await scheme.send()` on the sender's loop until every receiver acked. raw "
        "gloo: rank 0's\nbroadcast of one flat buffer plus a 1-byte confirmation from every "
        "receiver, timed in the thread\nrunning it. Samples alternate between the two."
    )

    print("\ndetails (medians, ms)")
    print(
        "| model | recv | bucket | contender | first send | raw bcast only "
        "| raw from loop | connect s |"
    )
    print("|---|--:|--:|---|--:|--:|--:|--:|")
    for s in report["sessions"]:
        if "results" not in s:
            continue
        name = REHOMED if s["rehome"] else AIO
        raw = s["results"][RAW]
        first = s["warmup_ms"][name][0] if s["warmup_ms"][name] else float("nan")
        print(
            f"| {s['model']} | {s['workers']} | {bucket_text(s['bucket_bytes'], s['model_bytes'])} "
            f"| {name} | {first:.1f} | {raw['bcast_only_median_ms']:.1f} "
            f"| {raw['from_loop_median_ms']:.1f} | {s['connect_s']:.1f} |"
        )

    print(
        "(first send: the session's first send(), a warm-up that also forms the send group; raw "
        "bcast only: rank 0's\nbroadcast wait() alone, bytes handed to the sockets; raw from "
        "loop: the raw round timed around\nasyncio.to_thread on the event loop)"
    )

    sweep = report.get("sweep")
    if sweep:
        print(f"\nbucket sweep: {sweep['model']} to {report['config']['sweep_workers']} receivers")
        print(
            "| bucket | buckets | n | median ms | p10 ms | p90 ms | raw median ms | x raw "
            "| x raw per pass | vs best |"
        )
        print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        model_bytes = w.spec_bytes(MODELS[sweep["model"]]())
        for r in sweep["rows"]:
            passes = ", ".join(f"{x:.2f}" for x in r["ratio_per_pass"])
            print(
                f"| {bucket_text(r['bucket_bytes'], model_bytes)} | {r['buckets']} "
                f"| {r['samples']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} "
                f"| {r['p90_ms']:.1f} | {r['raw_median_ms']:.1f} | {r['ratio_vs_raw']:.2f} "
                f"| {passes} | {r['ratio_vs_best']:.2f} |"
            )
        print(
            f"best: {bucket_text(sweep['best_bucket_bytes'], model_bytes)} (lowest ratio of the "
            "pooled median send to the pooled median of\nits sessions' own interleaved raw "
            "baselines; passes alternate the order of the sizes)"
        )

    print("\ntargets")
    for v in report["targets"]:
        print(f"  {'met   ' if v['met'] else 'MISSED'}  {v['target']}  ({v['value']:.3f})")


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"head": git("rev-parse", "HEAD"), "dirty_src": git("status", "--porcelain", "src")}


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "sender_torch_threads": torch.get_num_threads(),
        "worker_torch_threads": 1,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_start": os.getloadavg(),
        "git": git_state(),
    }


# -- main ---------------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[Case]:
    iters = QUICK_ITERS if args.quick else DEFAULT_ITERS
    bucket = int(args.bucket_mb * MIB)
    cases = []
    for name in args.models:
        for n in args.workers:
            for rehome in (False, True) if name.startswith("1000t") else (False,):
                cases.append(
                    Case(name, n, rehome, bucket, args.iters or iters[name], args.warmup, "main")
                )
    # Each pass visits every bucket size, the second in reverse order, so that drift over the
    # sweep does not favour the sizes measured first; a main case of the same setup stands in
    # for that size in the first pass.
    sweep_n = args.workers[0]
    total = w.spec_bytes(MODELS[SWEEP_MODEL]())
    sizes = sorted({total if mb == "whole" else int(float(mb) * MIB) for mb in args.sweep_mb})
    for k in range(1, args.sweep_passes + 1):
        for b in sizes if k % 2 else sizes[::-1]:
            main = [
                i
                for i, c in enumerate(cases)
                if c.purpose == "main"
                and (c.model, c.workers, c.rehome, c.bucket_bytes)
                == (SWEEP_MODEL, sweep_n, False, b)
            ]
            if k == 1 and main:
                cases[main[0]] = dataclasses.replace(cases[main[0]], sweep_pass=1)
                continue
            cases.append(
                Case(SWEEP_MODEL, sweep_n, False, b, args.sweep_iters, args.warmup, "sweep", k)
            )
    return cases


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = plan(args)
    report: dict[str, Any] = {
        "benchmark": "DistributedWeightSyncScheme(gloo).send() vs raw gloo broadcast, same bytes",
        "config": {
            "models": args.models,
            "workers": args.workers,
            "bucket_bytes": int(args.bucket_mb * MIB),
            "sweep_mb": args.sweep_mb,
            "sweep_passes": args.sweep_passes,
            "sweep_workers": args.workers[0],
            "warmup": args.warmup,
            "quick": args.quick,
            "timeout_s": args.timeout,
            "heartbeats": {"interval_s": 0.5, "missed": args.heartbeat_missed},
            "cases": [c.__dict__ for c in cases],
        },
        "environment": environment(),
        "sessions": [],
    }
    t_start = time.perf_counter()
    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    pool = WorkerPool(max(c.workers for c in cases))
    try:
        await pool.start()
        report["environment"]["worker_pids"] = pool.pids
        print(f"{len(pool.pids)} receivers up in {time.perf_counter() - t_start:.1f} s", flush=True)
        gc.collect()
        gc.freeze()  # torch's own objects are never garbage: keep them out of each collection
        models: dict[str, Model] = {}
        for case in cases:
            model = models.setdefault(case.model, Model(case.model))
            t0 = time.perf_counter()
            try:
                session = await run_session(pool, store, model, case, args)
            except Exception as exc:  # keep what was measured; the pool is closed below
                report["sessions"].append(
                    {**case.__dict__, "model_bytes": model.nbytes, "error": f"{exc!r}"[:2000]}
                )
                print(f"  {case.model} {case.workers} receivers: FAILED: {exc!r}", flush=True)
                break  # the workers' state is unknown: stop here, keep what was measured
            report["sessions"].append(session)
            r = session["results"][case.variant]
            print(
                f"  {case.model:<12} {case.workers} recv {case.variant:<18} bucket "
                f"{bucket_text(case.bucket_bytes, model.nbytes):>7}: p50 {r['median_ms']:.1f} ms, "
                f"{r['ratio_vs_raw']:.2f}x raw ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    finally:
        await pool.close()
        del store
    report["environment"]["loadavg_end"] = os.getloadavg()
    report["elapsed_s"] = time.perf_counter() - t_start
    default_bucket = int(args.bucket_mb * MIB)
    report["targets"] = judge(report["sessions"], default_bucket)
    report["sweep"] = sweep_summary(report["sessions"])
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="64MiB + 1000t-64MiB, few samples, no sweep (< 2 min)"
    )
    p.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated models among {','.join(MODELS)} (default: all; --quick: 64MiB,"
        "1000t-64MiB)",
    )
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated receiver counts (default 4); the sweep uses the first",
    )
    p.add_argument("--more-workers", action="store_true", help="also run 1 and 8 receivers")
    p.add_argument(
        "--bucket-mb", type=float, default=32.0, help="bucket size of the main cases (default 32)"
    )
    p.add_argument(
        "--sweep-mb",
        type=lambda s: [] if s == "" else s.split(","),
        default=None,
        help=f"bucket sizes in MiB for the {SWEEP_MODEL} sweep, 'whole' = one bucket "
        f"(default {DEFAULT_SWEEP}; --quick: none)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the bucket sweep")
    p.add_argument(
        "--iters", type=int, default=None, help="timed pairs per case (default by model)"
    )
    p.add_argument(
        "--sweep-iters", type=int, default=None, help="timed pairs per sweep point and pass"
    )
    p.add_argument(
        "--sweep-passes",
        type=int,
        default=2,
        help="passes over the sweep's sizes, alternating their order (default 2)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed pairs per case (default 2)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="deadline of every wait, s")
    p.add_argument(
        "--heartbeat-missed",
        type=int,
        default=HEARTBEAT_MISSED,
        help=f"beats of 0.5 s a receiver may miss before it counts as lost (default "
        f"{HEARTBEAT_MISSED}, the library's)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/dist.json"),
        help="where to write every sample (default bench-results/dist.json)",
    )
    args = p.parse_args(argv)
    if args.models is None:
        args.models = ["64MiB", "1000t-64MiB"] if args.quick else list(MODELS)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose among {list(MODELS)}")
    if args.workers is None:
        args.workers = [4]
    if args.more_workers:
        args.workers = [args.workers[0], *sorted({1, 8, *args.workers} - {args.workers[0]})]
    if any(n < 1 for n in args.workers):
        p.error("receiver counts must be positive")
    if args.bucket_mb <= 0:
        p.error("--bucket-mb must be positive")
    if args.sweep_mb is None:
        args.sweep_mb = [] if args.quick else DEFAULT_SWEEP.split(",")
    if args.no_sweep:
        args.sweep_mb = []
    for mb in args.sweep_mb:
        if mb != "whole":
            try:
                if float(mb) <= 0:
                    raise ValueError
            except ValueError:
                p.error(f"--sweep-mb: {mb!r} is neither a positive number nor 'whole'")
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.sweep_passes < 1:
        p.error("--sweep-passes must be at least 1")
    if args.sweep_iters is None:
        args.sweep_iters = 4 if args.quick else 8
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 1 if any("error" in s for s in report["sessions"]) else 0


if __name__ == "__main__":
    sys.exit(main())
