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
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, TextIO

from ._models import SendSources, build_model, fill, model_spec, spec_bytes
from ._probe import Ticker
from ._torchrl_worker import Context, worker_main

__all__ = ["SCHEMES", "TorchRLError", "TorchRLTree", "torchrl_status"]

SCHEMES = {
    "shared": "SharedMemWeightSyncScheme",
    "mp": "MultiProcessWeightSyncScheme",
    "distributed": "DistributedWeightSyncScheme",
}
PHASES = ("idle", "send", "fill")  # codes 0, 1, 2: a read seeing two phases counts in the higher


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


# -- sender process -----------------------------------------------------------------------------


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


def _sender_main(
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
        self._proc = ctx.Process(target=_sender_main, args=args, daemon=False)
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
