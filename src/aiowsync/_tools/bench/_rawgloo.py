"""The raw gloo limit: one broadcast of a flat buffer of the model's bytes from rank 0 to the
same receiver processes, followed by a one-byte confirmation from each receiver (so that, like a
``send()``, a round ends when every receiver holds the bytes)."""

from __future__ import annotations

import asyncio
import datetime
import gc
import secrets
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["RAW_CONFIRM_TAG", "RawRoot", "Workers", "raw_group", "raw_marks", "raw_receive"]


class Workers(Protocol):
    """What the root needs of the receivers' processes: the three calls of a
    :class:`~aiowsync._tools.bench._pool.WorkerPool` (which imports the worker, which imports
    this module: the protocol keeps the import one way)."""

    def tell(self, i: int, msg: tuple[Any, ...]) -> None: ...

    async def expect(self, i: int, kind: str, timeout: float = ...) -> tuple[Any, ...]: ...

    async def ask(
        self, ids: Sequence[int], msg: tuple[Any, ...], kind: str, timeout: float = ...
    ) -> list[tuple[Any, ...]]: ...


RAW_CONFIRM_TAG = 7


def raw_group(store: Any, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A ``ProcessGroupGloo`` of its own on ``store`` under ``prefix``, on loopback like the
    scheme's groups (blocks until all ``size`` ranks joined, at most ``timeout`` seconds)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)


def broadcast_options() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def raw_marks(round_no: int) -> tuple[int, int]:
    """What the root writes into the first and last byte of its buffer before round ``round_no``."""
    return round_no % 251, (round_no * 31 + 7) % 253


def raw_receive(
    host: str,
    port: int,
    prefix: str,
    rank: int,
    size: int,
    nbytes: int,
    rounds: int,
    timeout: float,
    *,
    reads: Sequence[int] = (),
) -> dict[str, Any]:
    """Rank ``rank`` of the raw baseline: ``rounds`` times, receive the root's broadcast of one
    flat uint8 buffer of ``nbytes``, then confirm with a one-byte ``send`` to rank 0. Every wait
    has a deadline of ``timeout`` seconds; a root that drops its group makes them fail fast.
    With ``reads`` (the byte sizes of the model's tensors, in order), every byte received is
    read once after each confirmation, tensor by tensor, as a policy worker reads each version
    of the scheme's: the same work, in as many pieces, beside the same rounds."""
    from torch._C._distributed_c10d import TCPStore

    span = datetime.timedelta(seconds=timeout)
    # Every page touched, like the scheme's slots, and before the group forms: the root's first
    # round (or a send of the scheme racing it) must not pay for this process's page faults.
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.ones(1, dtype=torch.uint8)
    pieces = _pieces(buf, reads)
    store = TCPStore(host, port, is_master=False, timeout=span)
    pg = raw_group(store, prefix, rank, size, timeout)
    options = broadcast_options()
    wrong = 0
    for r in range(rounds):
        pg.broadcast([buf], options).wait(span)
        pg.send([one], 0, RAW_CONFIRM_TAG).wait(span)
        if (int(buf[0]), int(buf[-1])) != raw_marks(r):  # after the confirm: not timed
            wrong += 1
        with torch.no_grad():
            for piece in pieces:
                piece.sum()
    return {"rounds": rounds, "wrong": wrong}


def _pieces(buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of ``buf`` of ``sizes`` bytes (float32 where the size allows)."""
    pieces, at = [], 0
    for size in sizes:
        piece = buf[at : at + size]
        aligned = piece.numel() % 4 == 0 and at % 4 == 0
        pieces.append(piece.view(torch.float32) if aligned else piece)
        at += size
    return pieces


class RawRoot:
    """Rank 0 of a raw gloo group over some :class:`Workers`, for a fixed
    number of rounds (the receivers run :func:`raw_receive` in a thread beside their session)."""

    def __init__(self, store: Any, nbytes: int, timeout: float) -> None:
        self.store = store
        self.nbytes = nbytes
        self.timeout = timeout
        self.buf = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
        self.pg: Any = None
        self.rounds = 0
        self.done = 0
        self.confirm: list[torch.Tensor] = []

    async def open(self, pool: Workers, ids: list[int], rounds: int) -> None:
        self.rounds = rounds
        prefix = f"raw/{secrets.token_hex(8)}/"
        port = int(self.store.port)
        size = len(ids) + 1
        for rank, i in enumerate(ids, start=1):
            pool.tell(
                i,
                (
                    "raw_start",
                    "127.0.0.1",
                    port,
                    prefix,
                    rank,
                    size,
                    self.nbytes,
                    rounds,
                    self.timeout,
                ),
            )
        for i in ids:
            await pool.expect(i, "ok", timeout=self.timeout)
        self.pg = await asyncio.to_thread(raw_group, self.store, prefix, 0, size, self.timeout)
        self.confirm = [torch.zeros(1, dtype=torch.uint8) for _ in ids]
        self.options = broadcast_options()

    def _round(self) -> tuple[int, int]:
        span = datetime.timedelta(seconds=self.timeout)
        t0 = time.perf_counter_ns()
        self.pg.broadcast([self.buf], self.options).wait(span)
        t1 = time.perf_counter_ns()
        works = [self.pg.recv([c], rank, RAW_CONFIRM_TAG) for rank, c in enumerate(self.confirm, 1)]
        for work in works:
            work.wait(span)
        return t1 - t0, time.perf_counter_ns() - t0

    async def round_split(self) -> tuple[float, float]:
        """One round, in seconds on rank 0: until the root's broadcast returned (bytes handed
        to the sockets), and until the last receiver's confirmation arrived."""
        if self.done >= self.rounds:
            raise RuntimeError(f"all {self.rounds} raw rounds were used")
        first, last = raw_marks(self.done)
        self.buf[0], self.buf[-1] = first, last
        self.done += 1
        bcast_ns, total_ns = await asyncio.to_thread(self._round)
        return bcast_ns / 1e9, total_ns / 1e9

    async def round(self) -> float:
        """One round; seconds from the broadcast's start to the last confirmation, on rank 0."""
        return (await self.round_split())[1]

    def drop(self) -> None:
        # The last reference: its connections close, so receivers still waiting fail at once.
        self.pg = None
        gc.collect()

    async def close(self, pool: Workers, ids: list[int]) -> int:
        """Run the rounds left (untimed), end the group and return how many rounds delivered
        wrong bytes on the receivers."""
        while self.pg is not None and self.done < self.rounds:
            await self.round()
        self.drop()
        answers = await pool.ask(ids, ("raw_wait", self.timeout), "raw_done", self.timeout + 10)
        return sum(int(a[1]["wrong"]) for a in answers)
