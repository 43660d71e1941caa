"""TorchRL's weight-sync schemes as benchmark contenders, driven through their public API.

Needs torchrl beside aiowsync (``pip install 'aiowsync[bench]'``; torchrl 0.14 pins tensordict
0.14, which aiowsync accepts) and torch kept at the pinned build.

One :class:`TorchRLTree` is one TorchRL scheme (``shared``: ``SharedMemWeightSyncScheme``,
``mp``: ``MultiProcessWeightSyncScheme``, ``distributed``: ``DistributedWeightSyncScheme`` on
gloo) on one model with N worker processes. It lives in a sender process of its own (spawned,
leader of a new process group) that spawns the N workers, because TorchRL's ``send()`` waits
for acks without any timeout and its distributed scheme initialises the *default* process group:
neither may touch the benchmark's own process. The tree stays up while the benchmark alternates
its samples with the other contenders'. Every TorchRL call runs under a ``faulthandler``
watchdog that dumps the stuck stacks and ends the sender; the orchestrator also waits for every
answer with a deadline and kills the whole process group when it is missed.

The sender process's half, and what it measures, is :mod:`._torchrl_sender`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
from multiprocessing.connection import Connection
from typing import Any

from ._torchrl_sender import SCHEMES, sender_main

__all__ = ["SCHEMES", "TorchRLError", "TorchRLTree", "torchrl_status"]


class TorchRLError(RuntimeError):
    """A TorchRL tree failed, hung past its deadline, or answered out of turn."""


def torchrl_status() -> tuple[str | None, str]:
    """(torchrl's version or None, a line saying whether TorchRL contenders can run)."""
    try:
        import torchrl
    except ImportError:
        return None, "torchrl is not installed (pip install 'aiowsync[bench]'): not measured"
    except Exception as exc:  # a broken install must not stop the benchmark
        return None, f"torchrl failed to import ({type(exc).__name__}: {exc}): not measured"
    version = str(getattr(torchrl, "__version__", "?"))
    return version, f"torchrl {version}"


# -- orchestrator side --------------------------------------------------------------------------


class TorchRLTree:
    """The orchestrator's handle on one TorchRL scheme with its sender and workers."""

    def __init__(self, scheme: str, model: str, workers: int, timeout: float = 120.0) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown TorchRL scheme {scheme!r}; choose among {list(SCHEMES)}")
        self.scheme, self.model, self.workers, self.timeout = scheme, model, workers, timeout
        self.info: dict[str, Any] = {}
        self._proc: Any = None
        self._conn: Connection | None = None
        self._fault_path = ""

    async def open(self) -> dict[str, Any]:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        fd, self._fault_path = tempfile.mkstemp(prefix="aiowsync-bench-torchrl-", suffix=".txt")
        os.close(fd)
        args = (theirs, self.scheme, self.model, self.workers, self.timeout, self._fault_path)
        self._proc = ctx.Process(target=sender_main, args=args, daemon=False)
        self._proc.start()
        theirs.close()
        self._conn = mine
        # Spawning N workers that each import torch and torchrl takes a while on a small machine.
        self.info = await self._answer(self.timeout + 30.0 * (1 + self.workers))
        return self.info

    async def _answer(self, timeout: float) -> Any:
        conn = self._conn
        if conn is None:
            raise TorchRLError("the TorchRL tree is not open")
        ready = await asyncio.to_thread(conn.poll, timeout)
        try:
            if not ready:
                raise TorchRLError(f"{self.scheme}: no answer within {timeout:g} s")
            kind, payload = conn.recv()
        except (EOFError, OSError):
            raise TorchRLError(f"{self.scheme}: the sender process died{self._fault()}") from None
        if kind != "ok":
            raise TorchRLError(f"{self.scheme}: {payload}")
        return payload

    def _fault(self) -> str:
        with contextlib.suppress(OSError), open(self._fault_path) as f:
            text = f.read()
            if "Timeout (" in text:  # the watchdog fired: its label and the stacks
                return f"\n{text}"
        return ""

    async def call(self, *msg: Any, timeout: float | None = None) -> Any:
        if self._conn is None:
            raise TorchRLError("the TorchRL tree is not open")
        self._conn.send(msg)
        return await self._answer(self.timeout + 10 if timeout is None else timeout)

    async def close(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            if conn is not None and proc.is_alive():
                with contextlib.suppress(OSError, TorchRLError):
                    await self.call("close", timeout=30)
            await asyncio.to_thread(proc.join, self.timeout)
        finally:
            self._proc = self._conn = None
            if proc.pid is not None:  # whatever is left of the tree: a hung sender, its workers
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.is_alive():
                proc.join(10)
            if conn is not None:
                conn.close()
            with contextlib.suppress(OSError):
                os.unlink(self._fault_path)
