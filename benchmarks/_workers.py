"""Helpers shared by ``bench_shm.py``, ``bench_dist.py`` and the worker processes they spawn.

* model specs and a builder that turns a spec into an ``nn.Module`` (sender and workers build
  the same architecture from the same spec);
* :class:`Ticker`, the event-loop responsiveness probe (``await asyncio.sleep(0.001)`` in a loop,
  recording the longest interval between two wake-ups);
* :func:`private_memory`, private memory of a process from ``/proc/<pid>/smaps``, with the part
  that belongs to aiowsync's shared-memory slots counted separately;
* :func:`worker_main`, the body of a benchmark worker process;
* :func:`raw_group` and :func:`raw_receive`, a raw gloo broadcast baseline (``bench_dist.py``).

A worker process lives for the whole benchmark and serves one scheme session after another, so
that torch is imported once per process, not once per case. It is driven by small tuples over a
``multiprocessing`` pipe:

``("join", pickled_scheme, spec)``
    build a fresh model from ``spec`` (every page written), receive the pickled scheme,
    ``init_on_receiver``, ``async with``, ``connect``, ``gc.collect()``; answer ``("ready", ...)``
    and serve the session's commands until ``("leave",)``, then answer ``("left",)``.
in a session: ``("tick_start",)``, ``("tick_mark",)``, ``("tick_stop",)``, ``("mem",)``,
``("check", version)``, ``("leave",)``;
``("raw_start", host, port, prefix, rank, size, nbytes, rounds, timeout)`` (answer ``("ok",)``)
starts :func:`raw_receive` in a thread, beside the scheme's receiver, and
``("raw_wait", timeout)`` answers ``("raw_done", stats)`` once it has finished.
``("exit",)`` (between sessions) ends the process.

Any failure is answered with ``("error", traceback_text)``.
"""

from __future__ import annotations

import os

# Must happen before torch is imported: idle OpenMP threads must not spin on the 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio
import ctypes
import gc
import pickle
import random
import re
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

MIB = 1 << 20

# (dotted name, shape, dtype name, is_buffer)
Entry = tuple[str, tuple[int, ...], str, bool]
Spec = list[Entry]


# -- models -------------------------------------------------------------------------------------


def few_large_spec(total_bytes: int) -> Spec:
    """Four float32 matrices of 1/2, 1/4, 1/8 and 1/8 of ``total_bytes``, 1024 columns each."""
    floats = total_bytes // 4
    if floats % (8 * 1024):
        raise ValueError(f"{total_bytes} bytes is not a multiple of 32 KiB")
    rows = [floats // 2 // 1024, floats // 4 // 1024, floats // 8 // 1024, floats // 8 // 1024]
    names = ["layers.0.weight", "layers.1.weight", "layers.2.weight", "head.weight"]
    return [(n, (r, 1024), "float32", False) for n, r in zip(names, rows, strict=True)]


def many_tensors_spec(total_bytes: int, n_tensors: int = 1000, seed: int = 0) -> Spec:
    """``n_tensors`` tensors of varied sizes adding up to exactly ``total_bytes``.

    One tenth are int64 buffers (half scalars like ``num_batches_tracked``, half index tables of
    up to 64 Ki entries); the rest are float32 (weight, bias) pairs whose weight sizes follow a
    log-normal draw, from a few hundred bytes to a few MiB.
    """
    rng = random.Random(seed)
    n_int = n_tensors // 10
    n_blocks = (n_tensors - n_int) // 2
    if n_int + 2 * n_blocks != n_tensors:
        raise ValueError("n_tensors must make whole (weight, bias) pairs after the int64 tenth")
    spec: Spec = []
    used = 0
    for i in range(n_int):
        shape: tuple[int, ...] = () if i % 2 == 0 else (int(2 ** rng.uniform(0, 16)),)
        spec.append((f"stats.{i}.table", shape, "int64", True))
        used += 8 * (shape[0] if shape else 1)
    biases = [rng.randint(16, 2048) for _ in range(n_blocks)]
    used += 4 * sum(biases)
    rest_floats = (total_bytes - used) // 4
    if (total_bytes - used) % 4:
        raise ValueError("the int64 part left a remainder that float32 cannot fill")
    draws = [rng.lognormvariate(0.0, 1.2) for _ in range(n_blocks)]
    scale = rest_floats / sum(draws)
    weights_used = 0
    for i in range(n_blocks):
        if i < n_blocks - 1:
            rows = rng.choice((16, 32, 64, 128, 256, 512))
            cols = max(1, int(draws[i] * scale * 0.98) // rows)
            wshape: tuple[int, ...] = (rows, cols)
            weights_used += rows * cols
        else:  # the last weight takes what is left, so the model is exactly total_bytes
            remainder = rest_floats - weights_used
            if remainder <= 0:
                raise AssertionError("size draw overshot; change the seed")
            wshape = (remainder,)
        spec.append((f"blocks.{i}.weight", wshape, "float32", False))
        spec.append((f"blocks.{i}.bias", (biases[i],), "float32", False))
    if spec_bytes(spec) != total_bytes:
        raise AssertionError(f"spec has {spec_bytes(spec)} bytes, not {total_bytes}")
    return spec


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _, shape, dtype, _ in spec:
        n = 1
        for d in shape:
            n *= d
        total += n * getattr(torch, dtype).itemsize
    return total


def build_model(spec: Spec, init: Callable[[torch.Tensor], None], device: str = "cpu") -> nn.Module:
    """A module holding the spec's tensors under their dotted names; ``init`` fills each one."""
    root = nn.Module()
    with torch.no_grad():
        for name, shape, dtype, is_buffer in spec:
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                child = mod._modules.get(part)
                if child is None:
                    child = nn.Module()
                    mod.add_module(part, child)
                mod = child
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            init(t)
            if is_buffer:
                mod.register_buffer(leaf, t)
            else:
                mod.register_parameter(leaf, nn.Parameter(t))
    return root


def random_init(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.uniform_(-1.0, 1.0)
    else:
        t.random_(0, 1 << 20)


def poison_init(t: torch.Tensor) -> None:
    """Write every page (so a private copy kept by mistake would show in the memory numbers)."""
    t.fill_(-7)


def fingerprint(model: nn.Module) -> list[tuple[str, float, float]]:
    """First and last element of every tensor, by key: enough to see which version a model runs
    once the sender has stamped those elements."""
    out = []
    for key, t in sorted(model.state_dict().items()):
        flat = t.reshape(-1)
        out.append((key, float(flat[0]), float(flat[-1])))
    return out


def stamp(model: nn.Module, base: int) -> None:
    """Write distinct values into the first and last element of every tensor."""
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(model.state_dict().items())):
            flat = t.reshape(-1)
            flat[0] = base + i
            flat[-1] = -(base + i)


# -- event-loop responsiveness ------------------------------------------------------------------


class Ticker:
    """Sleeps ``period`` seconds in a loop and records the longest interval between wake-ups."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.max_gap = 0.0
        self.max_at = 0.0
        self.ticks = 0

    async def run(self) -> None:
        clock = time.perf_counter
        last = clock()
        while True:
            await asyncio.sleep(self.period)
            now = clock()
            gap = now - last
            last = now
            self.ticks += 1
            if gap > self.max_gap:
                self.max_gap, self.max_at = gap, now

    def mark(self) -> tuple[float, int, float]:
        """The longest gap, the tick count and when that gap ended (``time.perf_counter()``,
        the system-wide monotonic clock on Linux) since the last mark (all reset)."""
        out = (self.max_gap, self.ticks, self.max_at)
        self.max_gap, self.ticks, self.max_at = 0.0, 0, 0.0
        return out


# -- memory -------------------------------------------------------------------------------------

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
SHM_PREFIX = "/dev/shm/aiowsync"


def private_memory(pid: int | str = "self") -> dict[str, int]:
    """Private (unshared) memory of a process in KiB.

    ``private_kb``: Private_Clean + Private_Dirty from ``smaps_rollup``; ``shm_kb``: the
    Private_* of mappings of aiowsync slot files (``/dev/shm/aiowsync*``), which count as private
    only when no other process maps those pages; ``own_kb``: the difference, memory that is
    really the process's own.
    """
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    shm = 0
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) > 5 else ""
            elif path.startswith(SHM_PREFIX) and line.startswith(
                ("Private_Clean:", "Private_Dirty:")
            ):
                shm += int(line.split()[1])
    return {"private_kb": total, "shm_kb": shm, "own_kb": total - shm}


def malloc_trim() -> bool:
    """Ask glibc to hand freed heap memory back to the kernel (diagnostic only)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


# -- raw gloo baseline -------------------------------------------------------------------------

RAW_CONFIRM_TAG = 7


def raw_group(store: Any, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A ``ProcessGroupGloo`` of its own on ``store`` under ``prefix``, on loopback like the
    scheme's groups (blocks until all ``size`` ranks joined, at most ``timeout`` seconds)."""
    import datetime

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
) -> dict[str, Any]:
    """Rank ``rank`` of the raw baseline: ``rounds`` times, receive the root's broadcast of one
    flat uint8 buffer of ``nbytes``, then confirm with a one-byte ``send`` to rank 0. Every wait
    has a deadline of ``timeout`` seconds; a root that drops its group makes them fail fast."""
    import datetime

    from torch._C._distributed_c10d import TCPStore

    span = datetime.timedelta(seconds=timeout)
    # Every page touched, like the scheme's slots, and before the group forms: the root's first
    # round (or a send of the scheme racing it) must not pay for this process's page faults.
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.ones(1, dtype=torch.uint8)
    store = TCPStore(host, port, is_master=False, timeout=span)
    pg = raw_group(store, prefix, rank, size, timeout)
    options = broadcast_options()
    wrong = 0
    for r in range(rounds):
        pg.broadcast([buf], options).wait(span)
        pg.send([one], 0, RAW_CONFIRM_TAG).wait(span)
        if (int(buf[0]), int(buf[-1])) != raw_marks(r):  # after the confirm: not timed
            wrong += 1
    return {"rounds": rounds, "wrong": wrong}


# -- the worker process -------------------------------------------------------------------------


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
                asyncio.run(_session(conn, worker_idx, msg[1], msg[2]))
            except Exception:
                conn.send(("error", f"worker {worker_idx}:\n{traceback.format_exc()}"))
            gc.collect()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return


async def _session(conn: Connection, worker_idx: int, blob: bytes, spec: Spec) -> None:
    # Start from a trimmed heap, so that memory freed by earlier sessions neither counts nor
    # gets silently reused by this session's model.
    gc.collect()
    malloc_trim()
    baseline = private_memory()
    model = build_model(spec, poison_init)
    scheme = pickle.loads(blob)
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
    async with scheme:
        t0 = time.perf_counter()
        await scheme.connect(timeout=180)
        connect_s = time.perf_counter() - t0
        gc.collect()
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
                elif kind == "check":
                    version = await scheme.wait_for_version(msg[1], timeout=60)
                    conn.send(("check", version, fingerprint(model)))
                elif kind == "raw_start":
                    if raw_task is not None and not raw_task.done():
                        conn.send(("error", f"worker {worker_idx}: a raw baseline is running"))
                        continue
                    raw_task = asyncio.ensure_future(asyncio.to_thread(raw_receive, *msg[1:]))
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
