"""The contenders of ``aiowsync bench``, as the orchestrator sees them.

A contender takes timed samples (one send of the model to every worker, or one raw transfer of
the same bytes); where it has workers, it can also measure its event-loop gaps and count mixed
reads. Here: the base class, the limits (raw copy, raw gloo, raw zmq) and TorchRL's contenders,
each in a :class:`~aiowsync._tools.bench._torchrl.TorchRLTree`. aiowsync's own live in
:mod:`~aiowsync._tools.bench._session`, in the orchestrator's event loop, with the
:class:`~aiowsync._tools.bench._pool.WorkerPool`'s processes as receivers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import torch
import zmq

from aiowsync._channel._socket_dir import claim_socket_dir, remove_owned_socket_dir
from aiowsync._channel._zmq import LOCAL_BIND, resolve_local

from ._models import raw_copy_bytes
from ._pool import WorkerPool
from ._probe import Ticker, wait_quiet
from ._rawgloo import RawRoot
from ._torchrl import TorchRLTree

__all__ = [
    "Contender",
    "RawCopy",
    "RawGloo",
    "RawZmq",
    "TorchRLContender",
]


class Contender:
    """One line of the report: a name, its timed samples and what else it measured."""

    kind = "limit"  # "aiowsync" | "limit" | "torchrl"

    def __init__(self, name: str, transport: str) -> None:
        self.name = name
        self.transport = transport
        self.samples: list[float] = []
        self.gap: dict[str, Any] | None = None
        self.tear: dict[str, Any] | None = None
        self.notes: list[str] = []
        self.info: dict[str, Any] | None = None  # what setting it up reported
        self.samples_outside: list[float] = []  # timed during the gap probe, not alternated
        self.samples_lead: list[float] = []  # the first of each back-to-back pair (small models)
        self.after: list[str] = []  # per sample, the contender whose turn came just before
        self.quiet: list[tuple[float, bool]] = []  # per sample: waited (s), machine found quiet
        self.busy: list[float] = []  # samples of the busy gate: started without waiting
        self.busy_lead: list[float] = []  # ... the first of each pair
        self.busy_after: list[str] = []
        self.pool: WorkerPool | None = None  # the processes whose event loops receive, if any
        self.ids: list[int] = []
        self.timeout = 120.0

    def prepare(self) -> None:
        """Untimed work before each sample: the trainer's own (filling its weights)."""

    async def timed(self) -> float:
        """The timed part of one sample, in seconds."""
        raise NotImplementedError

    async def sample(self) -> float:
        self.prepare()
        return await self.timed()

    async def sample_when_quiet(self, most: float) -> float:
        """:meth:`sample`, its timed part started once the machine is quiet, waiting at most
        ``most`` seconds (see :func:`wait_quiet`); the wait is recorded in :attr:`quiet`."""
        self.prepare()
        self.quiet.append(await wait_quiet(most))
        return await self.timed()

    async def measure_gap(self, sends: int, idle_s: float) -> None:
        """Event-loop max gaps of this process and of the receiving workers, over an idle
        window of ``idle_s`` seconds, then over ``sends`` samples (each one marked alone, so
        that the untimed work between them does not count)."""
        pool, ids = self.pool, self.ids
        ticker = Ticker()
        task = asyncio.create_task(ticker.run())

        async def marks() -> list[float]:
            if pool is None:
                return []
            return [m[1] for m in await pool.ask(ids, ("tick_mark",), "gap", self.timeout)]

        try:
            if pool is not None:
                await pool.ask(ids, ("tick_start",), "ok", self.timeout)
            ticker.mark()
            await asyncio.sleep(idle_s)
            idle = ticker.mark()[0]
            idle_w = await marks()
            busy, busy_w = 0.0, [0.0] * len(idle_w)
            for _ in range(sends):
                self.prepare()
                await marks()
                ticker.mark()
                self.samples_outside.append(await self.timed())
                # The interval that spans the sample's end closes at the ticker's next wake-up.
                await asyncio.sleep(2 * ticker.period)
                busy = max(busy, ticker.mark()[0])
                busy_w = [max(b, g) for b, g in zip(busy_w, await marks(), strict=True)]
            if pool is not None:
                await pool.ask(ids, ("tick_stop",), "ok", self.timeout)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.gap = {
            "sender_idle_s": idle,
            "sender_busy_s": busy,
            "workers_idle_s": idle_w,
            "workers_busy_s": busy_w,
        }

    async def measure_tear(self, sends: int, max_s: float) -> None:
        """Mixed reads on the workers during ``sends`` sends, or as many as ``max_s`` seconds
        allow, at least one (nothing for the limits: no worker holds a model)."""


# -- the limits ---------------------------------------------------------------------------------


class RawCopy(Contender):
    """``dst.copy_(src)`` of one flat uint8 tensor of the model's bytes, rounded up to a whole
    page (see :func:`~aiowsync._tools.bench._models.raw_copy_bytes`), on the loop thread."""

    def __init__(self, nbytes: int) -> None:
        super().__init__("raw copy_", "shm")
        self.nbytes = raw_copy_bytes(nbytes)
        self.info = {"bytes": self.nbytes, "model_bytes": nbytes}
        self.src = torch.empty(self.nbytes, dtype=torch.uint8).random_(0, 256)
        self.dst = torch.zeros(self.nbytes, dtype=torch.uint8)

    async def timed(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def close(self) -> None:
        copied = bool(self.samples) and torch.equal(self.src[-4096:], self.dst[-4096:])
        del self.src, self.dst
        if self.samples and not copied:
            raise AssertionError("the raw copy did not copy")


class RawGloo(Contender):
    """One gloo broadcast of a flat buffer of the model's bytes to the same worker processes,
    then a one-byte confirmation from each (they run it in a thread beside their session)."""

    def __init__(self, pool: WorkerPool, ids: list[int], nbytes: int, timeout: float) -> None:
        super().__init__("raw gloo broadcast", "dist")
        from torch._C._distributed_c10d import TCPStore

        self.workers, self.pool, self.ids, self.timeout = pool, pool, ids, timeout
        self.opened = False
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.root = RawRoot(self.store, nbytes, timeout)

    async def open(self, rounds: int) -> None:
        self.opened = True  # from here on the receivers may hold a raw round to be waited for
        await self.root.open(self.workers, self.ids, rounds)

    async def timed(self) -> float:
        return await self.root.round()

    async def close(self) -> None:
        if not self.opened:
            return
        try:
            wrong = await self.root.close(self.workers, self.ids)
            if wrong:
                raise AssertionError(f"{wrong} raw gloo rounds delivered the wrong bytes")
        finally:
            self.root.drop()
            del self.store


class RawZmq(Contender):
    """The control plane's floor: a small message from a ZeroMQ ROUTER on this loop to each
    of the same worker processes, echoed by a DEALER on each worker's event loop, until every
    echo is back, over the transport the shared-memory scheme binds by default. No weights
    move: it is what any ZeroMQ-signalled update costs at least on this machine, in the same
    alternation as the other contenders."""

    kind = "floor"
    MESSAGE = b"x" * 64  # about the size of an update instruction

    def __init__(self, pool: WorkerPool, ids: list[int], timeout: float) -> None:
        super().__init__("raw zmq round trip", "shm")
        self.workers, self.pool, self.ids, self.timeout = pool, pool, ids, timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # The same transport as the shared-memory scheme's control socket by default.
        address = resolve_local(LOCAL_BIND)
        self._socket_dir = claim_socket_dir(address)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._opened = False

    async def open(self) -> None:
        self._opened = True
        self._readable = asyncio.Event()
        self._fd = int(self._sock.getsockopt(zmq.FD))
        asyncio.get_running_loop().add_reader(self._fd, self._readable.set)
        await self.workers.ask(self.ids, ("echo_start", self.address), "ok", self.timeout)
        # Each worker says hello once connected; after that, sends to it are routable.
        pending = set(self.ids)
        deadline = time.monotonic() + self.timeout
        while pending:
            frames = await self._recv(deadline)
            pending.discard(int(frames[0]))

    async def _recv(self, deadline: float) -> list[bytes]:
        sock = self._sock
        while not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._readable.clear()
            await asyncio.wait_for(self._readable.wait(), max(0.0, deadline - time.monotonic()))
        return sock.recv_multipart(zmq.NOBLOCK)

    async def timed(self) -> float:
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        for i in self.ids:
            self._sock.send_multipart([str(i).encode(), self.MESSAGE], zmq.NOBLOCK)
        for _ in self.ids:
            frames = await self._recv(deadline)
            if frames[1] != self.MESSAGE:
                raise AssertionError(f"worker {frames[0]!r} echoed something else")
        return time.perf_counter() - t0

    async def close(self) -> None:
        try:
            if self._opened:
                asyncio.get_running_loop().remove_reader(self._fd)
                await self.workers.ask(self.ids, ("echo_stop",), "ok", self.timeout)
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
            if self._socket_dir is not None:
                remove_owned_socket_dir(self._socket_dir)


# -- TorchRL ------------------------------------------------------------------------------------


class TorchRLContender(Contender):
    """One send mode of a :class:`TorchRLTree` (both modes of ``shared`` share one tree)."""

    kind = "torchrl"
    LABEL: ClassVar[dict[str, str]] = {
        "shared": "SharedMem",
        "mp": "MultiProcess",
        "distributed": "Distributed",
    }

    def __init__(self, tree: TorchRLTree, mode: str) -> None:
        transport = "dist" if tree.scheme == "distributed" else "shm"
        super().__init__(f"TorchRL {self.LABEL[tree.scheme]} {mode}", transport)
        self.tree = tree
        self.mode = mode

    async def timed(self) -> float:
        out = await self.tree.call("sample", self.mode)
        return float(out["send_s"])

    async def verify(self) -> None:
        """Note it when the workers do not hold the last number sent."""
        out = await self.tree.call("verify")
        if not out["ok"]:
            self.notes.append(f"workers held {out['seen']}, expected {out['expected']}")

    async def measure_gap(self, sends: int, idle_s: float) -> None:
        self.gap = await self.tree.call(
            "gap", self.mode, sends, idle_s, timeout=self.tree.timeout * (sends + 1)
        )

    async def measure_tear(self, sends: int, max_s: float) -> None:
        limit = max_s + self.tree.timeout * 3
        out = await self.tree.call("tear", self.mode, sends, max_s, timeout=limit)
        if not out["verify"]["ok"]:
            self.notes.append(f"after tearing rounds the workers held {out['verify']['seen']}")
        self.tear = {"reads": out["reads"], "mixed": out["mixed"], "sends": out["sends"]}
