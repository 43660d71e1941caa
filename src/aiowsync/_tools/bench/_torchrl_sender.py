"""The sender process of a TorchRL tree (see :mod:`._torchrl`): it sets up one TorchRL scheme,
spawns its workers, and answers the orchestrator's calls over a pipe.

The sender binds the model like a collector does: an object with the model as ``.policy`` and
one device per worker as ``.policy_device``, given as ``context=`` with ``model_id="policy"``.
Explicit weights (``send(weights)``) are a ``TensorDict`` clone of the model's (a flat
``state_dict`` fails in TorchRL 0.14's ``shared`` and ``distributed`` schemes).

What TorchRL 0.14.1's ``send()`` does: ``shared`` copies the weights into its shared buffer
(nothing when the model is bound: on CPU the model's storage *is* that buffer, moved into shared
memory in place when the scheme was set up, and so are the workers' parameters), then puts
``"receive"`` in each worker's queue and blocks on the acks; ``mp`` passes the weights (each
tensor as a shared-memory handle) through each worker's queue and the worker copies them into
its model; ``distributed`` does a blocking gloo ``send`` of every tensor, worker after worker,
straight into the workers' model tensors. In every mode the worker writes into the tensors its
model runs: a reader can see half of one version and half of the next.

Per sample, the sender fills every element of the weights it will send with the sample number
(the model itself for ``send()``: on ``shared`` that write is already visible to the workers),
then times the ``send()`` call from call to return. Workers are idle during samples; they read
only during the *tearing* rounds: each worker's main thread reads its model in a loop (first
and last element of every tensor) while TorchRL's receiver thread applies updates, and a read
that sees two numbers is mixed. Each read is attributed to the sender's phase (``fill``,
``send`` or ``idle``) seen at its start or end (the higher of the two).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, TextIO

from ._models import SendSources, build_model, fill, model_spec, spec_bytes
from ._probe import Ticker
from ._torchrl_worker import Context, worker_main

__all__ = ["PHASES", "SCHEMES", "sender_main"]

SCHEMES = {
    "shared": "SharedMemWeightSyncScheme",
    "mp": "MultiProcessWeightSyncScheme",
    "distributed": "DistributedWeightSyncScheme",
}
PHASES = ("idle", "send", "fill")  # codes 0, 1, 2: a read seeing two phases counts in the higher


def _ask(conns: list[Connection], msg: tuple[Any, ...], timeout: float) -> list[tuple[Any, ...]]:
    for c in conns:
        c.send(msg)
    out = []
    for c in conns:
        if not c.poll(timeout):
            raise TimeoutError(f"no answer to {msg[0]!r} from a TorchRL worker within {timeout} s")
        out.append(c.recv())
    return out


@contextlib.contextmanager
def _watchdog(fault: TextIO, what: str, seconds: float) -> Iterator[None]:
    """Dump every thread's stack to ``fault`` and exit if the block outlives ``seconds``."""
    fault.seek(0)
    fault.truncate()
    fault.write(f"deadline of {seconds} s missed in: {what}\n")
    fault.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=fault)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _loopback_env() -> None:
    """The distributed scheme's store binds to the host name's address and its default group
    uses MASTER_ADDR: both must stay on loopback (spawned workers inherit the environment)."""
    import ipaddress
    import socket

    addr = socket.gethostbyname(socket.gethostname())
    if not ipaddress.ip_address(addr).is_loopback:
        raise RuntimeError(f"host name resolves to {addr}, not loopback; TorchRL's store uses it")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def _make_scheme(name: str, holder: Context, n: int, ctx: Any, timeout: float) -> Any:
    from torchrl.weight_update import (
        DistributedWeightSyncScheme,
        MultiProcessWeightSyncScheme,
        SharedMemWeightSyncScheme,
    )

    if name == "distributed":
        scheme = DistributedWeightSyncScheme(backend="gloo", timeout=timeout)
        scheme.init_on_sender(model_id="policy", context=holder, num_workers=n)
        return scheme
    cls = SharedMemWeightSyncScheme if name == "shared" else MultiProcessWeightSyncScheme
    scheme = cls()
    scheme.init_on_sender(model_id="policy", context=holder, ctx=ctx)
    return scheme


class _Sender:
    """The TorchRL side of one tree, served over a pipe on an asyncio loop of its own."""

    def __init__(self, scheme_name: str, model: str, n: int, timeout: float, fault: TextIO):
        self.scheme_name, self.model, self.n = scheme_name, model, n
        self.timeout, self.fault = timeout, fault
        self.k = 0  # the last number every element was filled with and sent
        self.conns: list[Connection] = []
        self.procs: list[Any] = []

    def setup(self) -> dict[str, Any]:
        import torch

        spec = model_spec(self.model)
        self.sources = SendSources(build_model(spec, lambda t: fill([t], 0)))
        holder = Context(self.sources.module, self.n)
        if self.scheme_name == "distributed":
            _loopback_env()
        ctx = mp.get_context("spawn")
        self.phase = ctx.RawValue("i", 0)
        with _watchdog(self.fault, "init_on_sender", self.timeout):
            self.scheme = _make_scheme(self.scheme_name, holder, self.n, ctx, self.timeout)
        for i in range(self.n):
            mine, theirs = ctx.Pipe()
            args = (theirs, i, self.scheme, self.scheme_name, self.model, self.n, self.phase)
            p = ctx.Process(target=worker_main, args=args, daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)
        t0 = time.perf_counter()
        with _watchdog(self.fault, "connect", self.timeout):
            self.scheme.connect()
            ready = [self._recv(c) for c in self.conns]
        connect_s = time.perf_counter() - t0
        # Alias probe: a worker that reads what the sender writes without a send shares its memory.
        fill(self.sources.targets("send()"), 1)
        time.sleep(0.05)
        peeks = _ask(self.conns, ("peek",), self.timeout)
        return {
            "scheme_class": SCHEMES[self.scheme_name],
            "model_bytes": spec_bytes(spec),
            "connect_s": connect_s,
            "initial_values": [r[1] for r in ready],
            "aliases_sender_model": [p[1] == [1.0] for p in peeks],
            "sender_threads": torch.get_num_threads(),
        }

    def _recv(self, conn: Connection) -> tuple[Any, ...]:
        if not conn.poll(self.timeout):
            raise TimeoutError(f"no answer from a TorchRL worker within {self.timeout} s")
        return conn.recv()  # type: ignore[no-any-return]

    def _send(self, mode: str) -> None:
        if mode == "send()":
            self.scheme.send()
        else:
            self.scheme.send(self.sources.weights)

    def fill_next(self, mode: str) -> float:
        self.phase.value = 2
        t0 = time.perf_counter()
        self.k += 1
        fill(self.sources.targets(mode), self.k)
        self.phase.value = 1
        return time.perf_counter() - t0

    def sample(self, mode: str) -> dict[str, Any]:
        fill_s = self.fill_next(mode)
        with _watchdog(self.fault, f"{mode} sample {self.k}", self.timeout):
            t0 = time.perf_counter()
            self._send(mode)
            send_s = time.perf_counter() - t0
        self.phase.value = 0
        return {"fill_s": fill_s, "send_s": send_s}

    def verify(self) -> dict[str, Any]:
        peeks = _ask(self.conns, ("peek",), self.timeout)
        return {
            "ok": all(p[1] == [float(self.k)] for p in peeks),
            "expected": self.k,
            "seen": [p[1] for p in peeks],
        }

    async def gap(self, mode: str, sends: int, idle_s: float) -> dict[str, Any]:
        """Loop max gap on this sender (``send()`` run in a thread, the best an asyncio trainer
        can do with a blocking call) and interpreter max gap on every worker."""
        ticker = Ticker()
        task = asyncio.create_task(ticker.run())
        try:
            _ask(self.conns, ("tick_start",), self.timeout)
            await asyncio.sleep(idle_s)
            idle = ticker.mark()[0]
            idle_w = [g[1] for g in _ask(self.conns, ("tick_mark",), self.timeout)]
            busy, busy_w = 0.0, [0.0] * self.n
            for _ in range(sends):
                self.fill_next(mode)
                _ask(self.conns, ("tick_mark",), self.timeout)
                ticker.mark()
                with _watchdog(self.fault, f"{mode} gap send {self.k}", self.timeout):
                    await asyncio.to_thread(self._send, mode)
                self.phase.value = 0
                await asyncio.sleep(2 * ticker.period)  # close the interval spanning the end
                busy = max(busy, ticker.mark()[0])
                marks = _ask(self.conns, ("tick_mark",), self.timeout)
                busy_w = [max(b, g[1]) for b, g in zip(busy_w, marks, strict=True)]
            _ask(self.conns, ("tick_stop",), self.timeout)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return {
            "sender_idle_s": idle,
            "sender_busy_s": busy,
            "workers_idle_s": idle_w,
            "workers_busy_s": busy_w,
        }

    def tear(self, mode: str, sends: int, max_s: float) -> dict[str, Any]:
        """``sends`` sends while the workers read, fewer once ``max_s`` seconds have passed
        (at least one): with readers busy, TorchRL's receiver threads can take many seconds."""
        _ask(self.conns, ("read", self.timeout * (1 + sends)), self.timeout)
        time.sleep(0.1)
        until = time.monotonic() + max_s
        done = 0
        while done < sends and (done == 0 or time.monotonic() < until):
            self.sample(mode)
            done += 1
            time.sleep(0.02)
        time.sleep(0.1)
        stats = _ask(self.conns, ("stop",), self.timeout)
        out = {
            "reads": [dict(zip(PHASES, s[1], strict=True)) for s in stats],
            "mixed": [dict(zip(PHASES, s[2], strict=True)) for s in stats],
        }
        return out | {"verify": self.verify(), "sends": done}

    def close(self) -> None:
        import torch

        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(("exit",))
        for p in self.procs:
            p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        with _watchdog(self.fault, "shutdown", self.timeout):
            if hasattr(self, "scheme"):
                self.scheme.shutdown()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def sender_main(
    conn: Connection, scheme: str, model: str, n: int, timeout: float, fault_path: str
) -> None:
    os.setpgrp()  # the orchestrator kills this group (us and our workers) if we miss a deadline
    with open(fault_path, "w") as fault:
        sender = _Sender(scheme, model, n, timeout, fault)
        try:
            try:
                conn.send(("ok", sender.setup()))
            except Exception:
                conn.send(("error", traceback.format_exc()))
                return
            asyncio.run(_serve(conn, sender))
        finally:
            sender.close()


async def _serve(conn: Connection, sender: _Sender) -> None:
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    try:
        while True:
            await readable.wait()
            readable.clear()
            if not conn.poll():
                continue
            if not await _serve_one(conn, sender):
                return
    finally:
        loop.remove_reader(conn.fileno())


async def _serve_one(conn: Connection, sender: _Sender) -> bool:
    """Answer one command; False once the tree must close."""
    try:
        msg = conn.recv()
    except EOFError:
        return False
    try:
        if msg[0] == "close":
            conn.send(("ok", None))
            return False
        if msg[0] == "sample":
            out: Any = sender.sample(msg[1])
        elif msg[0] == "gap":
            out = await sender.gap(msg[1], msg[2], msg[3])
        elif msg[0] == "tear":
            out = sender.tear(msg[1], msg[2], msg[3])
        elif msg[0] == "verify":
            out = sender.verify()
        else:
            raise ValueError(f"unknown command {msg[0]!r}")
        conn.send(("ok", out))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    return True
