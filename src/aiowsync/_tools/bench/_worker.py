"""The body of a benchmark worker process, for aiowsync's schemes and the raw gloo limit.

A worker lives for the whole benchmark and serves one scheme session after another, so that
torch is imported once per process, not once per case. It is driven by tuples over a
``multiprocessing`` pipe (see :class:`~aiowsync._tools.bench._pool.WorkerPool` for the other end):

``("join", scheme, spec, profile)``
    build a fresh model from ``spec`` (every page written), take the scheme (it crosses the
    pipe as its configuration and address, like any scheme handed to a spawned process),
    ``init_on_receiver``, ``async with``, ``connect``, ``gc.collect()``; answer ``("ready", ...)``
    and serve the session's commands until ``("leave",)``, then answer ``("left",)``. With
    ``profile`` ``"policy"``, a :class:`PolicyReads` task runs on the loop for the whole
    session; with ``"light"``, nothing but the session's commands.

In a session:

* ``("tick_start",)``, ``("tick_mark",)``, ``("tick_stop",)``: the event-loop probe;
* ``("read_start",)``, ``("read_stop",)``: readers check every read for a mix of versions, one
  on the event loop and one in a thread holding the read guard; ``read_stop`` answers
  ``("reads", reads, mixed)``;
* ``("mem",)``: private memory; ``("check", version)``: the fingerprint at that version;
* ``("policy",)``: what the policy profile's reads did (``("policy", stats)``, stats None
  under the light profile);
* ``("raw_start", host, port, prefix, rank, size, nbytes, rounds, timeout)`` (answer
  ``("ok",)``) starts :func:`~aiowsync._tools.bench._rawgloo.raw_receive` in a thread beside the
  scheme's receiver; ``("raw_wait", timeout)`` answers ``("raw_done", stats)`` once it ended.

``("echo_start", address)`` (answer ``("ok",)``) connects a ZeroMQ DEALER to the raw zmq
round trip's ROUTER at ``address`` and echoes every message it gets, on the event loop;
``("echo_stop",)`` closes it.

``("exit",)`` (between sessions) ends the process. Any failure is answered with
``("error", traceback_text)``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq
from torch import nn

from ._models import Reader, Spec, build_model, fingerprint, poison_init
from ._probe import Ticker, malloc_trim, private_memory
from ._rawgloo import raw_receive

__all__ = ["POLICY_PERIOD_S", "PolicyReads", "worker_main"]


def worker_main(conn: Connection, worker_idx: int) -> None:
    """Entry point of a spawned worker: serve sessions until told to exit."""
    torch.set_num_threads(1)
    # Everything alive now (torch's module objects...) is never garbage: keep it out of the
    # collector's way, so that gc.collect() costs microseconds instead of ~200 ms.
    gc.collect()
    gc.freeze()
    conn.send(("up", os.getpid(), torch.get_num_threads()))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                return
            if msg[0] != "join":
                conn.send(("error", f"worker {worker_idx}: unexpected {msg[0]!r} between sessions"))
                continue
            try:
                asyncio.run(_session(conn, worker_idx, *msg[1:4]))
            except Exception:
                conn.send(("error", f"worker {worker_idx}:\n{traceback.format_exc()}"))
            gc.collect()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return


class _Echo:
    """The worker's end of the raw zmq round trip: echoes every message on the event loop."""

    def __init__(self, worker_idx: int, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, str(worker_idx).encode())
        self._sock.connect(address)
        self._sock.send(b"hello")
        self._fd = int(self._sock.getsockopt(zmq.FD))
        asyncio.get_running_loop().add_reader(self._fd, self._echo)
        # The descriptor only signals changes seen after the last look at EVENTS: look once.
        self._echo()

    def _echo(self) -> None:
        sock = self._sock
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            sock.send(sock.recv(zmq.NOBLOCK), zmq.NOBLOCK)

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self._fd)
        self._sock.close(linger=0)
        self._ctx.term()


class _Readers:
    """A reader on the event loop and one in a thread under the read guard, both counting the
    reads that saw a mix of two versions."""

    def __init__(self, model: nn.Module, scheme: Any) -> None:
        self.reads = [0, 0]
        self.mixed = [0, 0]
        self._model = model
        self._scheme = scheme
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def _reader(self) -> Reader:
        return Reader(lambda: list(self._model.state_dict().values()), refresh=True)

    async def _on_loop(self) -> None:
        reader = self._reader()
        while not self._stop.is_set():
            self.mixed[0] += reader.mixed()
            self.reads[0] += 1
            await asyncio.sleep(0)

    def _in_thread(self) -> None:
        reader = self._reader()
        guard = self._scheme.read_guard()
        while not self._stop.is_set():
            with guard:
                bad = reader.mixed()
            self.mixed[1] += bad
            self.reads[1] += 1
            time.sleep(0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._on_loop())
        self._thread = threading.Thread(target=self._in_thread, name="bench-reader", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)


POLICY_PERIOD_S = 0.002
"""How often the policy profile's task wakes on a worker's event loop."""


class PolicyReads:
    """The policy profile: a task on the worker's event loop that wakes every
    :data:`POLICY_PERIOD_S` and, once the model runs a version it has not read, reads every
    tensor of it once (a sum of all its bytes, as a forward pass touches every weight), on
    the loop under the read guard, as an actor that runs its policy on its loop would."""

    def __init__(self, model: nn.Module, scheme: Any) -> None:
        self._model = model
        self._scheme = scheme
        self.reads = 0
        self.read_s = 0.0
        self.tensors = 0
        """Tensors of the latest read."""
        self.bytes = 0
        """Bytes of the latest read."""

    async def run(self) -> None:
        guard = self._scheme.read_guard()
        seen = self._scheme.version
        # The module's own tensors, as its forward pass reads them (a switch re-points these
        # very objects): no walk of the module per read.
        tensors = self._tensors()
        nbytes = sum(self.sizes())
        while True:
            await asyncio.sleep(POLICY_PERIOD_S)
            if self._scheme.version == seen:
                continue
            t0 = time.perf_counter()
            async with guard:
                seen = self._scheme.version
                with torch.no_grad():
                    for t in tensors:
                        t.sum()
            self.read_s += time.perf_counter() - t0
            self.reads += 1
            self.tensors, self.bytes = len(tensors), nbytes

    def _tensors(self) -> list[torch.Tensor]:
        return [*self._model.parameters(), *self._model.buffers()]

    def sizes(self) -> list[int]:
        """The byte sizes of the tensors a read reads, in order."""
        return [t.numel() * t.element_size() for t in self._tensors()]

    def stats(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "read_s": self.read_s,
            "tensors": self.tensors,
            "bytes": self.bytes,
        }


async def _session(
    conn: Connection, worker_idx: int, scheme: Any, spec: Spec, profile: str
) -> None:
    # Start from a trimmed heap, so that memory freed by earlier sessions neither counts nor
    # gets silently reused by this session's model.
    gc.collect()
    malloc_trim()
    baseline = private_memory()
    model = build_model(spec, poison_init)
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Sequence[Any]] = asyncio.Queue()
    fd = conn.fileno()

    def readable() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(fd)
            inbox.put_nowait(("leave",))

    ticker = Ticker()
    tick_task: asyncio.Task[None] | None = None
    raw_task: asyncio.Future[dict[str, Any]] | None = None
    readers: _Readers | None = None
    echo: _Echo | None = None
    policy = PolicyReads(model, scheme) if profile == "policy" else None
    policy_task: asyncio.Task[None] | None = None
    async with scheme:
        t0 = time.perf_counter()
        await scheme.connect(timeout=180)
        connect_s = time.perf_counter() - t0
        gc.collect()
        if policy is not None:
            policy_task = asyncio.create_task(policy.run())
        conn.send(("ready", scheme.version, connect_s, baseline))
        loop.add_reader(fd, readable)
        try:
            while True:
                msg = await inbox.get()
                kind = msg[0]
                if kind == "leave":
                    break
                if kind == "tick_start":
                    ticker.mark()
                    tick_task = asyncio.create_task(ticker.run())
                    conn.send(("ok",))
                elif kind == "tick_mark":
                    conn.send(("gap", *ticker.mark()))
                elif kind == "tick_stop":
                    if tick_task is not None:
                        tick_task.cancel()
                        await asyncio.gather(tick_task, return_exceptions=True)
                        tick_task = None
                    conn.send(("ok",))
                elif kind == "read_start":
                    readers = _Readers(model, scheme)
                    readers.start()
                    conn.send(("ok",))
                elif kind == "read_stop":
                    if readers is None:
                        conn.send(("error", f"worker {worker_idx}: no readers started"))
                        continue
                    await readers.stop()
                    conn.send(("reads", readers.reads, readers.mixed))
                    readers = None
                elif kind == "echo_start":
                    if echo is not None:
                        echo.close()
                    echo = _Echo(worker_idx, msg[1])
                    conn.send(("ok",))
                elif kind == "echo_stop":
                    if echo is not None:
                        echo.close()
                        echo = None
                    conn.send(("ok",))
                elif kind == "mem":
                    gc.collect()
                    before = private_memory()
                    trimmed = malloc_trim()
                    after = private_memory()
                    # What the module's objects alone cost (no data): a twin on the meta device.
                    twin = build_model(spec, poison_init, device="meta")
                    with_twin = private_memory()
                    del twin
                    gc.collect()
                    meta_kb = with_twin["own_kb"] - after["own_kb"]
                    conn.send(("mem", baseline, before, after, trimmed, scheme.version, meta_kb))
                elif kind == "policy":
                    if policy_task is not None and policy_task.done():
                        error = "".join(traceback.format_exception(policy_task.exception()))
                        conn.send(("error", f"worker {worker_idx}: the policy ended:\n{error}"))
                        continue
                    conn.send(("policy", None if policy is None else policy.stats()))
                elif kind == "check":
                    version = await scheme.wait_for_version(msg[1], timeout=60)
                    conn.send(("check", version, fingerprint(model)))
                elif kind == "raw_start":
                    if raw_task is not None and not raw_task.done():
                        conn.send(("error", f"worker {worker_idx}: a raw baseline is running"))
                        continue
                    # Policy workers read what each raw round brought, as they read each version.
                    sizes = policy.sizes() if policy is not None else ()
                    receive = functools.partial(raw_receive, reads=sizes)
                    raw_task = asyncio.ensure_future(asyncio.to_thread(receive, *msg[1:]))
                    conn.send(("ok",))
                elif kind == "raw_wait":
                    if raw_task is None:
                        conn.send(("error", f"worker {worker_idx}: no raw baseline started"))
                        continue
                    try:
                        stats = await asyncio.wait_for(asyncio.shield(raw_task), msg[1])
                    except Exception:
                        conn.send(("error", f"worker {worker_idx}:\n{traceback.format_exc()}"))
                    else:
                        conn.send(("raw_done", stats))
                        raw_task = None
                else:
                    conn.send(("error", f"worker {worker_idx}: unknown command {kind!r}"))
        finally:
            loop.remove_reader(fd)
            if policy_task is not None:
                policy_task.cancel()
                await asyncio.gather(policy_task, return_exceptions=True)
            if echo is not None:
                echo.close()
            if readers is not None:
                await readers.stop()
            if tick_task is not None:
                tick_task.cancel()
                await asyncio.gather(tick_task, return_exceptions=True)
            if raw_task is not None:
                # A thread cannot be cancelled: each of its waits ends by its own deadline (or
                # at once, when the root dropped its group).
                await asyncio.wait({raw_task}, timeout=180)
                if raw_task.done() and not raw_task.cancelled():
                    raw_task.exception()  # retrieved: it was reported or nobody asked
    del model, scheme
    gc.collect()
    conn.send(("left",))
