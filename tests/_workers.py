"""Worker processes for the multi-process tests (spawned, so everything here is importable)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from queue import Empty
from typing import Any

import torch
from torch import nn

import aiowsync
from helpers import fill

SPAWN = mp.get_context("spawn")

LOADED_WITHIN = 75.0
"""How long spawned processes started together may take to import torch and build their
models before they say they have: a bound on the start-up alone, which no connect deadline
includes (their connects start after): several times what six at once take beside two
CPU-bound processes on two cores."""


class BigModel(nn.Module):
    """A few large tensors."""

    def __init__(self, n: int = 3, numel: int = 1 << 20) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(n))
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))


class ManyModel(nn.Module):
    """1000 tensors of varied sizes, with integer and bool buffers."""

    def __init__(self, count: int = 1000) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        sizes = torch.randint(16, 2048, (count - 2,), generator=g).tolist()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in sizes)
        self.register_buffer("counts", torch.arange(37, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(13, dtype=torch.bool))


def make_pair() -> dict[str, nn.Module]:
    """A policy (about 4 MiB in 80 tensors) and a value net (about 10 MiB in 20 tensors), for
    schemes of several models."""
    policy = nn.ParameterList(nn.Parameter(torch.randn(13_107)) for _ in range(80))
    value = nn.ParameterList(nn.Parameter(torch.randn(131_072)) for _ in range(20))
    return {"policy": policy, "value": value}


def make_model(kind: str) -> nn.Module:
    if kind == "pair":
        return nn.ModuleDict(make_pair())
    if kind == "big":
        return BigModel()
    if kind == "many":
        return ManyModel()
    if kind == "small":
        return BigModel(n=2, numel=4096)
    if kind == "mib":
        return BigModel(n=1, numel=1 << 18)
    raise ValueError(kind)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(list(model.state_dict(keep_vars=False).items())):
        h.update(key.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dtype == torch.bool:
                t.copy_(torch.randint(0, 2, t.shape, generator=g).bool())
            elif t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randint(-1000, 1000, t.shape, generator=g))


def _check_uniform(model: nn.Module) -> float | None:
    """The single value every tensor holds, or None if two values are mixed."""
    seen: float | None = None
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dtype == torch.bool:
            continue
        lo, hi = float(t.min()), float(t.max())
        if lo != hi or (seen is not None and lo != seen):
            return None
        seen = lo
    return seen


class ForwardsDamage:
    """A chain member's process group whose sends carry a flipped byte: the member holds the
    right bytes (they passed its check) and forwards wrong ones."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self._kept: list[torch.Tensor] = []  # alive until the group goes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        bad = [t.clone() for t in tensors]
        bad[0][5] ^= 0x5A
        self._kept += bad
        return self._pg.send(bad, dst, tag)


def damage_forwards(only: Callable[[int], bool] = lambda worker: True) -> Callable[[], None]:
    """From now on, the chain members of this process for which ``only(worker)`` holds forward
    damaged bytes (a faulty member); returns what undoes it."""
    from aiowsync._planes.dist import receiver

    real = receiver.receive_and_forward

    def damaging(pg: Any, rank: int, workers: list[int], *args: Any, **kw: Any) -> str:
        if only(workers[rank - 1]):
            pg = ForwardsDamage(pg)
        return real(pg, rank, workers, *args, **kw)

    receiver.receive_and_forward = damaging  # type: ignore[assignment]

    def undo() -> None:
        receiver.receive_and_forward = real

    return undo


def worker_main(
    scheme: aiowsync.WeightSyncScheme | None,
    address: str | None,
    worker_idx: int,
    kind: str,
    events: Any,
    stop: Any,
    options: dict[str, Any],
    loaded: Any = None,
) -> None:
    """Run one receiver until ``stop`` is set, reporting to ``events``:
    ("ready", idx, version, digest), ("version", idx, version, digest), ("done", idx, stats);
    and its index to ``loaded`` once it has imported torch and built its model, before it
    connects.
    """
    torch.set_num_threads(1)
    torch.manual_seed(1000 + worker_idx)
    asyncio.run(_worker(scheme, address, worker_idx, kind, events, stop, options, loaded))


async def _worker(
    scheme: aiowsync.WeightSyncScheme | None,
    address: str | None,
    worker_idx: int,
    kind: str,
    events: Any,
    stop: Any,
    options: dict[str, Any],
    loaded: Any = None,
) -> None:
    if scheme is None:
        kind_of_scheme = (
            aiowsync.DistributedWeightSyncScheme
            if options.get("transport") == "gloo"
            else aiowsync.SharedMemWeightSyncScheme
        )
        keys = options.get("keys")  # the sender's CurveKeys, for a tcp address
        scheme = kind_of_scheme(
            address=address,
            background=options.get("background", True),
            channels=None if keys is None else aiowsync.ZmqChannelFactory(curve=keys),
        )
    if options.get("damages_forwards"):
        damage_forwards()
    model = make_model(kind)
    if isinstance(model, nn.ModuleDict):  # several models, one scheme
        scheme.init_on_receiver(models=dict(model.items()), worker_idx=worker_idx)
    else:
        scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    if loaded is not None:
        loaded.put(worker_idx)
    report_digests = options.get("digests", True)
    tear = options.get("tear", False)
    tear_from = options.get("tear_from", 0)
    """Versions up to this one are not uniform (exact-bytes sends come first): no tear check."""
    stats = {"loop_reads": 0, "thread_reads": 0, "mixed": 0, "wrong_version": 0}

    block_at, block_s = options.get("block", (-1, 0.0))
    """Block the event loop for ``block_s`` in the hook of version ``block_at``."""

    def on_switch(version: int) -> None:
        if report_digests and (not tear or version <= tear_from):
            events.put(("version", worker_idx, version, digest(model)))
        if version == block_at:
            time.sleep(block_s)

    if options.get("hooks", True):
        scheme.register_hook(on_switch)  # (a receiver with hooks switches on its loop only)
    loop_pause = options.get("loop_pause", 0.0)
    """Seconds between two reads on the loop: with a pause the loop waits for events at
    times, and the receiver's waker thread makes the switches that come then."""
    if options.get("count_switchers"):
        _count_switchers(stats)
    async with scheme:
        await scheme.connect(timeout=30)
        events.put(("ready", worker_idx, scheme.version, digest(model) if report_digests else ""))
        stop_thread = threading.Event()
        reader = None
        if tear:
            reader = threading.Thread(
                target=_thread_reader,
                args=(scheme, model, stats, stop_thread, tear_from),
                daemon=True,
            )
            reader.start()
        try:
            while not stop.is_set():
                if tear and scheme.version <= tear_from:
                    await asyncio.sleep(0.005)
                elif tear:
                    value = _check_uniform(model)
                    stats["loop_reads"] += 1
                    if value is None:
                        stats["mixed"] += 1
                    elif value != scheme.version:
                        stats["wrong_version"] += 1
                    await asyncio.sleep(loop_pause)
                elif not scheme.background:
                    got = await scheme.receive(timeout=0.2)
                    if got is not None and not report_digests:
                        events.put(("version", worker_idx, got, ""))
                else:
                    await asyncio.sleep(0.02)
        finally:
            stop_thread.set()
            if reader is not None:
                reader.join(timeout=10)
        stats["connected"] = int(scheme.connected)
        stats["version"] = scheme.version
        events.put(("done", worker_idx, stats))


def _count_switchers(stats: dict[str, int]) -> None:
    """Count, in ``stats``, the switches made on the loop's thread and those made by another
    (the receiver's waker)."""
    from aiowsync._receiving.apply import Applier

    commit = Applier._commit
    main = threading.main_thread()

    def counted(self: Applier, *args: Any, **kwargs: Any) -> None:
        commit(self, *args, **kwargs)
        key = "loop_switches" if threading.current_thread() is main else "waker_switches"
        stats[key] = stats.get(key, 0) + 1

    Applier._commit = counted  # type: ignore[method-assign]


def _thread_reader(
    scheme: aiowsync.WeightSyncScheme,
    model: nn.Module,
    stats: dict[str, int],
    stop: threading.Event,
    tear_from: int,
) -> None:
    guard = scheme.read_guard()
    while not stop.is_set():
        with guard:
            version = scheme.version
            value = _check_uniform(model) if version > tear_from else version
        if version <= tear_from:
            time.sleep(0.005)
            continue
        stats["thread_reads"] += 1
        if value is None:
            stats["mixed"] += 1
        elif value != version:
            stats["wrong_version"] += 1
        time.sleep(0.0005)


class Outbox:
    """A worker's end of its own event pipe (``put`` as on a queue).

    Each worker writes into a pipe of its own: a queue shared by all of them has one write
    lock, and a worker killed or stopped while its feeder thread held it (in the instant
    after the test read its event) kept every other worker's events from arriving."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def put(self, event: tuple[Any, ...]) -> None:
        with self._lock:  # the worker's loop and its threads may both report
            self._conn.send(event)

    def __getstate__(self) -> dict[str, Any]:
        return {"conn": self._conn}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._conn = state["conn"]
        self._lock = threading.Lock()


class Events:
    """The test's side: the events of every worker started, first come first served."""

    def __init__(self) -> None:
        self._readers: list[Any] = []

    def add(self) -> Outbox:
        reader, writer = SPAWN.Pipe(duplex=False)
        self._readers.append(reader)
        return Outbox(writer)

    def get(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The next event; :class:`queue.Empty` after ``timeout`` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp.connection.wait(self._readers, left) if self._readers else []
            for reader in ready:
                try:
                    return reader.recv()  # type: ignore[no-any-return]
                except (EOFError, OSError):  # that worker has exited: nothing more from it
                    self._readers.remove(reader)
                    reader.close()
            if not ready:
                if deadline is None or time.monotonic() >= deadline:
                    raise Empty
                if not self._readers:
                    time.sleep(min(0.05, left or 0.05))

    def get_nowait(self) -> tuple[Any, ...]:
        return self.get(timeout=0)

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers.clear()


class Workers:
    """Spawned receiver processes; always terminated and joined on exit."""

    def __init__(self) -> None:
        self.events = Events()
        self.loaded = SPAWN.Queue()
        """Each worker's index, once it has started and imported torch (see :meth:`started`)."""
        self.stop = SPAWN.Event()
        self.procs: dict[int, Any] = {}
        self.other: list[tuple[Any, ...]] = []

    def start(
        self,
        worker_idx: int,
        kind: str,
        *,
        scheme: Any = None,
        address: str | None = None,
        **options: Any,
    ) -> Any:
        outbox = self.events.add()
        proc = SPAWN.Process(
            target=worker_main,
            args=(scheme, address, worker_idx, kind, outbox, self.stop, options, self.loaded),
            daemon=True,
        )
        proc.start()
        outbox._conn.close()  # the worker holds the write end now: its exit ends the pipe
        self.procs[worker_idx] = proc
        return proc

    def started(self, count: int) -> None:
        """Wait until ``count`` more workers have imported torch and built their models, so
        that a connect deadline started after this bounds their handshakes alone (a busy host
        takes many seconds to start a process)."""
        deadline = time.monotonic() + LOADED_WITHIN
        for _ in range(count):
            left = deadline - time.monotonic()
            try:
                self.loaded.get(timeout=max(0.1, left))
            except Empty:
                raise AssertionError(
                    f"workers did not start within {LOADED_WITHIN:g} s "
                    f"(alive: {[i for i, p in self.procs.items() if p.is_alive()]})"
                ) from None

    def next_event(self, timeout: float = 60) -> tuple[Any, ...]:
        return self.events.get(timeout=timeout)  # type: ignore[no-any-return]

    def collect(self, kind: str, count: int, timeout: float = 60) -> list[tuple[Any, ...]]:
        """The next ``count`` events of ``kind`` (other kinds are kept in ``self.other``)."""
        out: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            if event[0] == kind:
                out.append(event)
            else:
                self.other.append(event)
        return out

    def kill(self, worker_idx: int) -> None:
        proc = self.procs.pop(worker_idx)
        proc.kill()
        proc.join(10)

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs.values():
            proc.join(10)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs.clear()
        self.events.close()


@contextlib.contextmanager
def workers() -> Iterator[Workers]:
    w = Workers()
    try:
        yield w
    finally:
        w.close()


async def connect_all(scheme: aiowsync.WeightSyncScheme, w: Workers, n: int) -> dict[int, str]:
    """Once the ``n`` workers started have loaded, the sender's connect(); then each worker's
    ready report: {worker: digest}."""
    await asyncio.to_thread(w.started, n)
    await asyncio.wait_for(scheme.connect(timeout=60), 90)
    ready = await asyncio.to_thread(w.collect, "ready", n)
    return {e[1]: e[3] for e in ready}


EXACT_SENDS = 10
"""Sends of random values whose bytes every worker reports (a digest) before the tear check."""


async def exact_bytes_then_no_mixed_reads(
    scheme: aiowsync.WeightSyncScheme,
    model: nn.Module,
    kind: str,
    workers_count: int = 4,
    seconds: float = 6.0,
) -> int:
    """Two properties on one set of worker processes (spawning them is most of the cost).

    First, every worker holds the sender's exact bytes at connect and after each of
    :data:`EXACT_SENDS` sends of random values. Then the sender sends back to back for >=
    ``seconds`` and >= 10 sends (version k filled with k) while every worker reads its model
    on its event loop and in a thread holding the read guard: no read may see two versions.
    ``model`` is the sender's, initialised on ``scheme``. Returns the number of back-to-back
    sends.
    """
    n = workers_count
    with workers() as w:
        async with scheme:
            for i in range(n):
                w.start(i, kind, scheme=scheme, tear=True, tear_from=EXACT_SENDS)
            ready = await connect_all(scheme, w, n)
            assert ready == dict.fromkeys(range(n), digest(model))
            for step in range(1, EXACT_SENDS + 1):
                randomize(model, seed=step)
                expected = digest(model)
                result = await scheme.send(timeout=30)
                assert result.version == step
                assert result.worker_ids == tuple(range(n))
                seen = await asyncio.to_thread(w.collect, "version", n)
                assert {(e[1], e[2]) for e in seen} == {(i, step) for i in range(n)}
                assert all(e[3] == expected for e in seen), f"content differs at version {step}"
            started = time.monotonic()
            deadline = started + seconds
            sends = 0
            while time.monotonic() < deadline or sends < 10:  # both, however slow the machine
                version = EXACT_SENDS + sends + 1
                fill(model, version)
                result = await scheme.send(timeout=30)
                sends += 1
                assert result.version == version
            elapsed = time.monotonic() - started
            w.stop.set()
            done = await asyncio.to_thread(w.collect, "done", n)
    reads = [(s["loop_reads"], s["thread_reads"], s["mixed"]) for _, _, s in done]
    print(
        f"{kind}: {sends} sends back to back in {elapsed:.1f} s; per worker (loop reads, "
        f"guarded thread reads, mixed): {reads}"
    )
    for _, idx, stats in done:
        assert stats["loop_reads"] > 0 and stats["thread_reads"] > 0, stats
        assert stats["mixed"] == 0, f"worker {idx} saw a mix of versions: {stats}"
        assert stats["wrong_version"] == 0, f"worker {idx}: {stats}"
        assert stats["version"] == EXACT_SENDS + sends
    return sends


@contextlib.asynccontextmanager
async def on_version_1(
    scheme: aiowsync.WeightSyncScheme, n: int, kind: str = "small"
) -> AsyncIterator[tuple[nn.Module, Workers]]:
    """``n`` spawned receivers of ``scheme``, connected and holding its version 1 of a
    ``kind`` model: (the sender's model, the workers)."""
    model = make_model(kind)
    scheme.init_on_sender(model=model, num_workers=n)
    with workers() as w:
        async with scheme:
            for i in range(n):
                w.start(i, kind, scheme=scheme)
            await connect_all(scheme, w, n)
            randomize(model, 1)
            await scheme.send(timeout=20)
            await asyncio.to_thread(w.collect, "version", n)
            yield model, w


async def arrivals(
    w: Workers, want: dict[int, tuple[int, str]], started: float, within: float
) -> dict[int, float]:
    """Read version reports until each worker of ``want`` reported ``want[worker]`` (version,
    digest), for at most ``within`` seconds: by worker, the seconds from ``started``
    (monotonic) until that report was read. Call it while the send runs, so that each figure
    is how long that worker waited for the version."""
    waited: dict[int, float] = {}
    end = time.monotonic() + within
    while set(waited) != set(want):
        left = end - time.monotonic()
        try:
            event = (await asyncio.to_thread(w.collect, "version", 1, max(0.0, left)))[0]
        except Empty:
            missing = {k: v for k, (v, _) in want.items() if k not in waited}
            raise AssertionError(
                f"within {within:g} s, workers {sorted(missing)} did not report holding the "
                f"sender's bytes of versions {missing}"
            ) from None
        if want.get(event[1]) == (event[2], event[3]):
            waited.setdefault(event[1], time.monotonic() - started)
    return waited


async def send_past_a_stopped_worker(
    scheme: aiowsync.WeightSyncScheme,
    w: Workers,
    want: dict[int, tuple[int, str]],
    deadline: float,
) -> tuple[dict[int, float], aiowsync.LostDuringSendError, float]:
    """Send the next version (within ``deadline`` s) while a worker is stopped: how long each
    worker of ``want`` waited for it (see :func:`arrivals`), the ``LostDuringSendError`` that
    names the stopped one, and the seconds the whole took. The send never outlives this."""
    started = time.monotonic()
    send = asyncio.create_task(scheme.send(timeout=deadline))
    try:
        waited = await arrivals(w, want, started, within=deadline)
        try:
            await send
        except aiowsync.LostDuringSendError as exc:
            return waited, exc, time.monotonic() - started
        raise AssertionError("the send did not name the stopped worker lost")
    finally:
        send.cancel()  # a no-op once it ended
        await asyncio.wait([send])


def waits_text(waited: dict[int, float]) -> str:
    """What :func:`arrivals` gave, as a test prints it."""
    return ", ".join(f"worker {k} {v:.2f} s" for k, v in sorted(waited.items()))


def blocking_worker_main(scheme: Any, worker_idx: int, events: Any, stop: Any) -> None:
    """A synchronous worker: ``aiowsync.blocking`` and a plain loop that reads the model under
    the read guard. Reports ("done", idx, version, digest, reads, torn reads, versions seen)."""
    torch.set_num_threads(1)
    model = make_model("small")
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    reads = torn = 0
    seen: set[int] = set()
    with aiowsync.blocking(scheme) as s:
        s.connect(timeout=120)
        events.put(("ready", worker_idx, s.version, digest(model)))
        while not stop.is_set():
            with s.read_guard(), torch.no_grad():
                version = s.version
                value = _check_uniform(model)
            reads += 1
            seen.add(version)
            if value != float(version):
                torn += 1
            time.sleep(0.0005)
        with s.read_guard():
            final = (s.version, digest(model))
    events.put(("done", worker_idx, *final, reads, torn, len(seen)))


def scheme_of(transport: str, **options: Any) -> aiowsync.WeightSyncScheme:
    """A scheme of ``transport``: "shm", or "dist" (gloo, buckets small enough that a "small"
    model spans several)."""
    if transport == "shm":
        return aiowsync.SharedMemWeightSyncScheme(**options)
    return aiowsync.DistributedWeightSyncScheme(backend="gloo", bucket_bytes=8 << 10, **options)


def fixed_keys() -> tuple[dict[str, str], aiowsync.CurveKeys]:
    """CURVE keys that every sender process of a test serves with (a restarted trainer must
    keep its keys for its workers to follow it): (their fields as strings, the server secret
    included, for :func:`sender_main`, since a pickled ``CurveKeys`` drops it; the keys its
    receivers hold)."""
    keys = aiowsync.CurveKeys.generate()
    assert keys.server_secret is not None and keys.client_secret is not None
    fields = {
        "server_public": keys.server_public,
        "server_secret": keys.server_secret,
        "client_public": keys.client_public,
        "client_secret": keys.client_secret,
    }
    return fields, keys.for_receiver()


def sender_main(
    queue: Any,
    kind: str,
    value: float = 7,
    bind: str | None = None,
    transport: str = "shm",
    beats: tuple[float, int] = (0.5, 10),
    keys: dict[str, str] | None = None,
) -> None:
    """A sender process of a model filled with ``value``, for one worker: puts its address on
    ``queue``, then "connected", then serves until killed. ``keys``: the fields of the CURVE
    keys it serves with (see :func:`fixed_keys`)."""

    async def main() -> None:
        model = make_model(kind)
        fill(model, value)
        options: dict[str, Any] = {"heartbeats": aiowsync.Heartbeats(*beats)}
        if bind is not None:
            options["bind"] = bind
        if keys is not None:
            options["channels"] = aiowsync.ZmqChannelFactory(curve=aiowsync.CurveKeys(**keys))
        scheme = scheme_of(transport, **options)
        scheme.init_on_sender(model=model, num_workers=1)
        async with scheme:
            queue.put(scheme.address)
            await scheme.connect(timeout=60)
            queue.put("connected")
            await asyncio.sleep(3600)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def a_killed_sender(
    transport: str, **receiver_options: Any
) -> AsyncIterator[tuple[aiowsync.WeightSyncScheme, nn.Module, int]]:
    """A sender process (``transport`` "shm" or "dist") of a "small" model filled with 7, a
    connected receiver of it here, then the sender killed with SIGKILL and seen gone by the
    receiver: yields (the receiver, inside its ``async with``; its model; the dead pid)."""
    import signal

    queue = SPAWN.Queue()
    beats = (0.25, 8)
    fields, keys = fixed_keys() if transport == "dist" else (None, None)  # dist: tcp
    proc = SPAWN.Process(
        target=sender_main, args=(queue, "small", 7, None, transport, beats, fields), daemon=True
    )
    proc.start()
    try:
        address = await asyncio.to_thread(queue.get, True, 90)
        model = make_model("small")
        if keys is not None:
            receiver_options["channels"] = aiowsync.ZmqChannelFactory(curve=keys)
        r = scheme_of(
            transport, address=address, heartbeats=aiowsync.Heartbeats(*beats), **receiver_options
        )
        r.init_on_receiver(model=model, worker_idx=0)
        async with r:
            await r.connect(timeout=60)
            assert await asyncio.to_thread(queue.get, True, 30) == "connected"
            assert r.connected and r.version == 0
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            proc.join(10)
            # Lost once the heartbeat limit has passed since the drop, even for a receiver
            # that nobody asked meanwhile: its first look says so. (The slack is for the
            # monitor thread, which takes the drop in within a second on an idle host.)
            await asyncio.sleep(killed + beats[0] * beats[1] + 5 - time.monotonic())
            assert not r.connected
            yield r, model, proc.pid
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def forked_worker_main(scheme: aiowsync.WeightSyncScheme, events: Any) -> None:
    """What a user's worker does first, in a process forked from the trainer: report the
    error it meets (or that it met none)."""
    try:
        scheme.init_on_receiver(model=make_model("small"), worker_idx=0)
    except RuntimeError as exc:
        events.put(("refused", str(exc)))
    else:
        events.put(("accepted", ""))


async def _told(told: Callable[[float], Any], stop: Any, what: str) -> Any:
    """What ``told(seconds)`` gives once it gives something (it raises or returns None
    while it has nothing); None if ``stop`` is set first."""
    deadline = time.monotonic() + LOADED_WITHIN
    while not stop.is_set():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not told within {LOADED_WITHIN:g} s")
        with contextlib.suppress(Empty):
            if (got := await asyncio.to_thread(told, 0.1)) is not None:
                return got
    return None


def relay_main(
    root: aiowsync.WeightSyncScheme,
    relay_idx: int,
    leaves: int,
    go: Any,
    events: Any,
    stop: Any,
) -> None:
    """A relay process: a receiver of ``root`` (as worker ``relay_idx``) relaying to a
    shared-memory sender of ``leaves`` leaves; reports ("address", relay_idx, address), waits
    for ``go``, then reports ("relay ready", relay_idx, version) once connected, and serves
    until ``stop`` is set.

    Set ``go`` once its leaves have loaded: the relay's first version waits for them only
    for about ``root``'s ack timeout, which must not be spent on their start-up.
    """
    torch.set_num_threads(1)

    async def main() -> None:
        model = make_model("small")
        root.init_on_receiver(model=model, worker_idx=relay_idx)
        local = aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.2, 10))
        local.init_on_sender(model=model, num_workers=leaves)
        root.relay_to(local)
        async with local:  # the usual order: the leaves' sender first, then the upstream
            events.put(("address", relay_idx, local.address))
            if not await _told(lambda s: go.wait(s) or None, stop, f"relay {relay_idx}"):
                return
            async with root:
                await root.connect(timeout=60)
                await local.connect(timeout=60)
                events.put(("relay ready", relay_idx, local.version))
                while not stop.is_set():
                    await asyncio.sleep(0.05)

    asyncio.run(main())


def leaf_main(tag: int, worker_idx: int, inbox: Any, events: Any, stop: Any) -> None:
    """A leaf of a relay: a shared-memory receiver of a "small" model; reports ("loaded",
    tag, pid), then connects to the address it is given on ``inbox`` and reports ("leaf", tag,
    version, digest) when it has and at every switch.

    Its connect starts when it is given the address, so that its deadline bounds the
    handshake (its relay's own connect included) and not its start-up or its siblings'.
    """
    torch.set_num_threads(1)

    async def main() -> None:
        model = make_model("small")
        events.put(("loaded", tag, os.getpid()))
        address = await _told(lambda s: inbox.get(True, s), stop, f"leaf {tag}")
        if address is None:
            return
        scheme = aiowsync.SharedMemWeightSyncScheme(address=address)
        scheme.init_on_receiver(model=model, worker_idx=worker_idx)
        scheme.register_hook(lambda v: events.put(("leaf", tag, v, digest(model))))
        async with scheme:
            await scheme.connect(timeout=60)
            events.put(("leaf", tag, scheme.version, digest(model)))
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(main())
