"""A star of point-to-point gloo sends against gloo's own broadcast, with one I/O thread or two.

The distributed scheme's star sends each bucket to every member with ``send``, so that each
member depends on the sender alone (a broadcast relays through a tree of receivers). Whether
that costs anything depends on how the sender's writes are spread: a gloo device has one I/O
thread, and the scheme's groups get two devices so that two buckets are written at once.

This script takes torch.distributed alone, no aiowsync: rank 0 and ``--workers`` spawned
processes on loopback, in one gloo group per setting. Each sample is one of:

* ``broadcast``: ``pg.broadcast`` of the whole buffer from rank 0;
* ``star``: the buffer in buckets of ``--bucket-mib``, each sent to every member with
  ``pg.send`` (bucket i with tag i), the next bucket posted before waiting for the one before,
  as the scheme's sender does.

Every sample ends when each receiver confirmed with a one-byte send, and each receiver then
sums its buffer (as a worker reads its weights). The two alternate sample by sample. Reported
per setting: the medians and star / broadcast.

Settings (``--devices``): ``1`` (one device), ``1x2`` (one device listed twice: two contexts
on one I/O thread, what the scheme had before), ``2`` (two devices).

Usage::

    .venv/bin/python benchmarks/bench_gloo_star.py                 # 64 MiB, 4 workers
    .venv/bin/python benchmarks/bench_gloo_star.py --devices 1x2,2 --runs 3
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

MIB = 1 << 20
CONFIRM_TAG = 1 << 20
TIMEOUT = datetime.timedelta(seconds=120)


def group(rank: int, size: int, port: int, devices: str) -> Any:
    store = TCPStore("127.0.0.1", port, size, rank == 0, timeout=TIMEOUT)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = TIMEOUT
    make = dist.ProcessGroupGloo.create_device
    if devices == "1x2":
        options._devices = [make(hostname="127.0.0.1")] * 2
    else:
        options._devices = [make(hostname="127.0.0.1") for _ in range(int(devices))]
    return dist.ProcessGroupGloo(store, rank, size, options)


def broadcast_options() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def ranges(nbytes: int, bucket: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + bucket, nbytes)) for lo in range(0, nbytes, bucket)]


def receiver(rank: int, args: argparse.Namespace, port: int, devices: str) -> None:
    torch.set_num_threads(1)
    size = args.workers + 1
    pg = group(rank, size, port, devices)
    buf = torch.zeros(args.mib * MIB, dtype=torch.uint8)
    one = torch.ones(1, dtype=torch.uint8)
    for _ in range(args.warmup + args.samples):
        for mode in ("broadcast", "star"):
            if mode == "broadcast":
                pg.broadcast([buf], broadcast_options()).wait(TIMEOUT)
            else:
                works = [
                    pg.recv([buf[lo:hi]], 0, tag)
                    for tag, (lo, hi) in enumerate(ranges(buf.numel(), args.bucket_mib * MIB))
                ]
                for work in works:
                    work.wait(TIMEOUT)
            pg.send([one], 0, CONFIRM_TAG).wait(TIMEOUT)
            buf.view(torch.float32).sum()


def root(args: argparse.Namespace, port: int, devices: str) -> dict[str, float]:
    size = args.workers + 1
    pg = group(0, size, port, devices)
    buf = torch.empty(args.mib * MIB, dtype=torch.uint8).random_(0, 256)
    confirms = [torch.zeros(1, dtype=torch.uint8) for _ in range(args.workers)]
    times: dict[str, list[float]] = {"broadcast": [], "star": []}
    for k in range(args.warmup + args.samples):
        for mode in ("broadcast", "star"):
            time.sleep(0.05)  # the receivers' reads of the sample before are done
            t0 = time.perf_counter()
            if mode == "broadcast":
                pg.broadcast([buf], broadcast_options()).wait(TIMEOUT)
            else:
                before: list[Any] = []
                for tag, (lo, hi) in enumerate(ranges(buf.numel(), args.bucket_mib * MIB)):
                    posted = [pg.send([buf[lo:hi]], r, tag) for r in range(1, size)]
                    for work in before:
                        work.wait(TIMEOUT)
                    before = posted
                for work in before:
                    work.wait(TIMEOUT)
            works = [pg.recv([c], r, CONFIRM_TAG) for r, c in enumerate(confirms, start=1)]
            for work in works:
                work.wait(TIMEOUT)
            if k >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(v) * 1e3 for mode, v in times.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(args: argparse.Namespace, devices: str) -> dict[str, float]:
    port = free_port()
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(target=receiver, args=(r, args, port, devices), daemon=True)
        for r in range(1, args.workers + 1)
    ]
    for p in procs:
        p.start()
    try:
        return root(args, port, devices)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--mib", type=int, default=64, help="bytes sent, MiB")
    parser.add_argument("--bucket-mib", type=int, default=32, help="the star's buckets, MiB")
    parser.add_argument("--workers", type=int, default=4, help="receiver processes")
    parser.add_argument("--devices", default="1x2,2", help="comma-separated: 1, 1x2, 2, ...")
    parser.add_argument("--runs", type=int, default=2, help="sessions per setting")
    parser.add_argument("--samples", type=int, default=20, help="samples of each per run")
    parser.add_argument("--warmup", type=int, default=2, help="samples of each not counted")
    args = parser.parse_args()
    for run in range(args.runs):
        for devices in args.devices.split(","):
            medians = one_run(args, devices)
            b, s = medians["broadcast"], medians["star"]
            print(
                f"run {run + 1} devices {devices:>3}: broadcast {b:6.1f} ms  star {s:6.1f} ms"
                f"  star/broadcast {s / b:.3f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
