"""The orchestrator's end of the benchmark's long-lived worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from ._worker import worker_main

__all__ = ["WorkerError", "WorkerPool"]


class WorkerError(RuntimeError):
    """A worker process answered with an error, the wrong answer, nothing in time, or died."""


class WorkerPool:
    """``n`` spawned worker processes, each serving one scheme session after another; their
    answers arrive on the running event loop (a reader callback per pipe)."""

    def __init__(self, n: int, name: str = "bench-worker") -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.inbox: list[asyncio.Queue[tuple[Any, ...]]] = []
        self.pids: list[int] = []
        self.threads: list[int] = []
        self._loop = asyncio.get_running_loop()
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, i), name=f"{name}-{i}", daemon=True)
            self.procs.append(proc)
            self.conns.append(parent)
            self.inbox.append(asyncio.Queue())
            proc.start()
            child.close()
            self._loop.add_reader(parent.fileno(), self._readable, i)

    def __len__(self) -> int:
        return len(self.procs)

    def _readable(self, i: int) -> None:
        try:
            msg = self.conns[i].recv()
        except (EOFError, OSError):
            self._loop.remove_reader(self.conns[i].fileno())
            msg = ("error", f"worker {i} (pid {self.procs[i].pid}) closed its pipe / died")
        self.inbox[i].put_nowait(msg)

    def tell(self, i: int, msg: tuple[Any, ...]) -> None:
        self.conns[i].send(msg)

    async def expect(self, i: int, kind: str, timeout: float = 120.0) -> tuple[Any, ...]:
        try:
            msg = await asyncio.wait_for(self.inbox[i].get(), timeout)
        except TimeoutError:
            raise WorkerError(f"worker {i}: no {kind!r} answer within {timeout:g} s") from None
        if msg[0] == "error":
            raise WorkerError(msg[1])
        if msg[0] != kind:
            raise WorkerError(f"worker {i}: expected {kind!r}, got {msg[0]!r}")
        return msg

    async def ask(
        self, ids: Sequence[int], msg: tuple[Any, ...], kind: str, timeout: float = 120.0
    ) -> list[tuple[Any, ...]]:
        for i in ids:
            self.conns[i].send(msg)
        return [await self.expect(i, kind, timeout) for i in ids]

    async def drain_until(self, i: int, kind: str, timeout: float) -> bool:
        """Discard answers until ``kind`` (True) or an error, death or the deadline (False)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await asyncio.wait_for(self.inbox[i].get(), left)
            except TimeoutError:
                return False
            if msg[0] == kind:
                return True
            if msg[0] == "error" and not self.procs[i].is_alive():
                return False
        return False

    async def start(self, timeout: float = 300.0) -> None:
        for i in range(len(self.procs)):
            up = await self.expect(i, "up", timeout=timeout)
            self.pids.append(up[1])
            self.threads.append(up[2])

    async def leave(self, ids: Sequence[int], timeout: float) -> None:
        """End the workers' current session (a dead worker's pipe is broken: skipped)."""
        for i in ids:
            with contextlib.suppress(OSError):
                self.conns[i].send(("leave",))
        left = [await self.drain_until(i, "left", timeout=timeout) for i in ids]
        if not all(left):
            missing = [i for i, ok in zip(ids, left, strict=True) if not ok]
            raise WorkerError(f"workers {missing} did not leave the session")

    async def close(self) -> None:
        for conn in self.conns:
            try:
                self._loop.remove_reader(conn.fileno())
                conn.send(("exit",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            await asyncio.to_thread(proc.join, max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
