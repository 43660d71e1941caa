"""How long busy workers take to answer the trainer, by the path the answer takes.

This measures the floor under a shared-memory send's acks, without weights. The trainer (this
process) sends a small message to every worker of a group and times, on its event loop, the
wait for all of their answers. Each worker is a spawned process whose event loop runs a task
that wakes every 2 ms and, after each message, keeps its loop busy for ``--work-ms`` of CPU (a
stand-in for a policy reading its new weights, which a worker starts as soon as it switched).
So the workers that answer first take the cores from those still to answer, as in a real send.

Paths (``--paths``), one group of ``--workers`` processes each, taking turns sample by sample:

* ``zmq-loop``: a ZeroMQ DEALER per worker to the trainer's ROUTER over a Unix socket, read
  and answered on the worker's event loop (pyzmq's asyncio sockets). A message crosses
  ZeroMQ's I/O thread on each side, as aiowsync's control messages do;
* ``unix-loop``: a Unix ``SOCK_SEQPACKET`` socket read and answered by the worker's loop;
* ``unix-thread``: the same socket, read and answered by a thread of the worker's own that
  blocks on it (the loop still does the work after each message);
* ``unix-thread-short``: that thread asks Linux for a 0.1 ms time slice
  (``sched_setattr`` with ``sched_runtime``, Linux 6.12 or later; no privilege needed), so that
  a wake-up need not wait for a busy process's slice to end.

Reported per path: the median and 90th percentile of the round trip (all workers answered).
Every path's trainer side is the same event loop; only where the workers answer from changes.

Usage::

    .venv/bin/python benchmarks/bench_wakeups.py                    # 4 workers, 8 ms of work
    .venv/bin/python benchmarks/bench_wakeups.py --work-ms 0 --samples 200
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import tempfile
import threading
import time
from typing import Any

import zmq
import zmq.asyncio

SPAWN = mp.get_context("spawn")
PATHS = ("zmq-loop", "unix-loop", "unix-thread", "unix-thread-short")
STOP = b"stop"
WAIT = 60.0
"""Seconds any single wait of this script may take before it gives up."""
SHORT_SLICE_NS = 100_000
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine())


def ask_short_slice() -> str | None:
    """Give the calling thread a 0.1 ms slice; None, or why it could not."""
    if _SCHED_SETATTR is None:
        return f"no sched_setattr number known for {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    # struct sched_attr: size, policy (SCHED_OTHER), flags, nice, priority, runtime (the
    # slice asked for, in ns), deadline, period, util_min, util_max.
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQII", 56, 0, 0, 0, 0, SHORT_SLICE_NS, 0, 0, 0, 0)
    )
    if libc.syscall(_SCHED_SETATTR, 0, attr, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _short_slice_in_a_thread() -> str | None:
    """Whether this machine gives a thread a short slice (asked in a thread that then ends)."""
    why: list[str | None] = []
    thread = threading.Thread(target=lambda: why.append(ask_short_slice()))
    thread.start()
    thread.join(WAIT)
    return why[0] if why else "the probe did not finish"


def work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# -- a worker -----------------------------------------------------------------------------------


async def _ticking() -> None:
    while True:
        await asyncio.sleep(0.002)


async def _zmq_worker(address: str, work_s: float) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send(b"hello")
        while True:
            message = await asyncio.wait_for(sock.recv(), WAIT)
            if message == STOP:
                return
            await sock.send(message)
            work(work_s)
    finally:
        sock.close()
        ctx.term()


async def _unix_loop_worker(sock: socket.socket, work_s: float) -> None:
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    while True:
        message = await asyncio.wait_for(loop.sock_recv(sock, 64), WAIT)
        if message in (STOP, b""):
            return
        await loop.sock_sendall(sock, message)
        work(work_s)


async def _unix_thread_worker(sock: socket.socket, work_s: float, short: bool) -> None:
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    problem: list[str] = []

    def answer() -> None:
        try:
            if short and (why := ask_short_slice()) is not None:
                problem.append(f"no short slice: {why}")
                return
            sock.settimeout(WAIT)
            while True:
                message = sock.recv(64)
                if message in (STOP, b""):
                    return
                sock.send(message)
                loop.call_soon_threadsafe(work, work_s)
        except OSError as exc:
            problem.append(str(exc))
        finally:
            loop.call_soon_threadsafe(ended.set)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        await asyncio.wait_for(ended.wait(), None)
    finally:
        thread.join(WAIT)
    if problem:
        raise RuntimeError(problem[0])


async def _worker(path: str, address: str, work_s: float) -> None:
    ticking = asyncio.create_task(_ticking())
    try:
        if path == "zmq-loop":
            await _zmq_worker(address, work_s)
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(WAIT)
            sock.connect(address)
            if path == "unix-loop":
                await _unix_loop_worker(sock, work_s)
            else:
                await _unix_thread_worker(sock, work_s, short=path == "unix-thread-short")
    finally:
        ticking.cancel()


def worker_main(path: str, address: str, work_s: float) -> None:
    asyncio.run(_worker(path, address, work_s))


# -- the trainer --------------------------------------------------------------------------------


class Group:
    """``n`` workers answering by ``path``, and the trainer's end of their sockets."""

    def __init__(self, path: str, n: int, folder: str, work_s: float) -> None:
        self.path, self.n = path, n
        self.samples: list[float] = []
        self.procs: list[Any] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._listener: socket.socket | None = None
        self._peers: list[Any] = []
        address = f"{folder}/{path}"
        if path == "zmq-loop":
            self._ctx = zmq.asyncio.Context()
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{address}"
            self._router.bind(address)
        else:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._listener.bind(address)
            self._listener.listen(n)
            self._listener.setblocking(False)
        for _ in range(n):
            proc = SPAWN.Process(target=worker_main, args=(path, address, work_s), daemon=True)
            proc.start()
            self.procs.append(proc)

    async def join(self) -> None:
        """Wait for every worker to connect."""
        loop = asyncio.get_running_loop()
        for _ in range(self.n):
            if self._router is not None:
                peer, _ = await asyncio.wait_for(self._router.recv_multipart(), WAIT)
                self._peers.append(peer)
            else:
                assert self._listener is not None
                conn, _ = await asyncio.wait_for(loop.sock_accept(self._listener), WAIT)
                conn.setblocking(False)
                self._peers.append(conn)

    async def round_trip(self, number: int) -> float:
        message = number.to_bytes(8, "little")
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        if self._router is not None:
            for peer in self._peers:
                await self._router.send_multipart([peer, message])
            for _ in self._peers:
                await asyncio.wait_for(self._router.recv_multipart(), WAIT)
        else:
            for conn in self._peers:
                await loop.sock_sendall(conn, message)
            for conn in self._peers:
                await asyncio.wait_for(loop.sock_recv(conn, 64), WAIT)
        return time.perf_counter() - start

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for peer in self._peers:
            try:
                if self._router is not None:
                    await self._router.send_multipart([peer, STOP])
                else:
                    await loop.sock_sendall(peer, STOP)
            except (OSError, zmq.ZMQError):
                pass

    def close(self) -> None:
        for proc in self.procs:
            proc.join(WAIT)
            if proc.is_alive():
                proc.kill()
                proc.join(WAIT)
        for peer in self._peers:
            if isinstance(peer, socket.socket):
                peer.close()
        if self._listener is not None:
            self._listener.close()
        if self._router is not None:
            self._router.close()
        if self._ctx is not None:
            self._ctx.term()

    def failed(self) -> list[int]:
        return [p.exitcode for p in self.procs if p.exitcode not in (0, None)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"unknown paths {unknown}: choose among {', '.join(PATHS)}")
    unavailable = {}
    if "unix-thread-short" in paths and (why := _short_slice_in_a_thread()) is not None:
        paths.remove("unix-thread-short")
        unavailable["unix-thread-short"] = why
    work_s = args.work_ms / 1e3
    with tempfile.TemporaryDirectory(prefix="aiowsync-wakeups-") as folder:
        groups = [Group(path, args.workers, folder, work_s) for path in paths]
        try:
            for group in groups:
                await group.join()
            for number in range(args.warmup + args.samples):
                for group in groups:
                    # Long enough for the work of the round before to end, as between sends.
                    await asyncio.sleep(args.gap_ms / 1e3)
                    took = await group.round_trip(number)
                    if number >= args.warmup:
                        group.samples.append(took)
            for group in groups:
                await group.stop()
        finally:
            for group in groups:
                group.close()
    rows = {}
    for group in groups:
        if group.failed():
            raise SystemExit(f"{group.path}: workers exited with {group.failed()}")
        ordered = sorted(group.samples)
        rows[group.path] = {
            "median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "samples": len(ordered),
        }
    return {
        "workers": args.workers,
        "work_ms": args.work_ms,
        "paths": rows,
        "unavailable": unavailable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated")
    parser.add_argument("--workers", type=int, default=4, help="worker processes per path")
    parser.add_argument(
        "--work-ms", type=float, default=8.0, help="CPU a worker spends after a message"
    )
    parser.add_argument("--samples", type=int, default=100, help="round trips per path")
    parser.add_argument("--warmup", type=int, default=5, help="round trips before the samples")
    parser.add_argument("--gap-ms", type=float, default=30.0, help="pause before each round trip")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.workers < 1 or args.samples < 1 or args.work_ms < 0:
        parser.error("--workers and --samples must be at least 1, --work-ms at least 0")
    result = asyncio.run(run(args))
    print(f"{args.workers} workers per path, {args.work_ms:g} ms of work after each message")
    print(f"{'path':<18} {'median ms':>10} {'p90 ms':>8}")
    for path, row in result["paths"].items():
        print(f"{path:<18} {row['median_ms']:>10.2f} {row['p90_ms']:>8.2f}")
    for path, why in result["unavailable"].items():
        print(f"{path:<18} not measured: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
