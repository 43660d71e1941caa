"""What several test files share: small models, their comparison, schemes wired up in this
process (on one plane, or on every plane through :class:`Kind`), polling, and running the command
line. Plain functions and classes; fixtures live in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

import aiowsync
from aiowsync._channel import LOCAL_BIND

S = TypeVar("S", bound=aiowsync.WeightSyncScheme)

# Beats every 0.1 s; a loss takes 5 s of silence, which no test using these beats waits for.
BEATS = aiowsync.Heartbeats(interval=0.1, missed=50)


def model(seed: int = 0, *, big: bool = False) -> nn.Module:
    """A small model, staged on the loop; ``big`` adds 4 MiB, so that it is staged in a thread
    and gathered tensor by tensor."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if big:
        m.append(nn.Linear(1024, 1024))
    return m


Weights = nn.Module | Mapping[str, torch.Tensor]
"""A model, or its tensors by name (a state dict, a snapshot, a lease's parameters)."""


def same(a: Weights, b: Weights) -> bool:
    """Whether ``a`` and ``b`` hold the same names, and under each a tensor of the same dtype,
    shape and values: the one comparison of weights in this suite."""
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    # On the CPU: torch.equal refuses tensors of two devices (a CUDA receiver's, say).
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype
        and sa[k].shape == sb[k].shape
        and torch.equal(sa[k].cpu(), sb[k].cpu())
        for k in sa
    )


def bump(m: nn.Module, by: float = 1.0) -> None:
    """Make a new version: add ``by`` to every parameter and one to every integer buffer."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)
        for b in m.buffers():
            if not b.is_floating_point() and b.dtype != torch.bool:
                b.add_(1)


@contextlib.asynccontextmanager
async def system(
    scheme: Callable[..., S],
    n: int = 2,
    *,
    make_model: Callable[[int], nn.Module] = model,
    connect_timeout: float = 10,
    **sender_kw: Any,
) -> AsyncIterator[tuple[S, nn.Module, list[tuple[S, nn.Module]]]]:
    """A sender of ``make_model(0)`` built by ``scheme(**sender_kw)`` and ``n`` connected
    receivers in this process, each a pickled copy into ``make_model(100 + i)``:
    (sender, its model, [(receiver, its model)])."""
    src = make_model(0)
    sender = scheme(**sender_kw)
    sender.init_on_sender(model=src, num_workers=n)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(sender)
        receivers: list[tuple[S, nn.Module]] = []
        for i in range(n):
            r = pickle.loads(pickle.dumps(sender))
            m = make_model(100 + i)
            r.init_on_receiver(model=m, worker_idx=i)
            await stack.enter_async_context(r)
            receivers.append((r, m))
        await asyncio.gather(
            sender.connect(timeout=connect_timeout),
            *(r.connect(timeout=connect_timeout) for r, _ in receivers),
        )
        yield sender, src, receivers


@contextlib.asynccontextmanager
async def pair(
    src: Any,
    mirror: Any,
    *,
    rehome: bool = False,
    heartbeats: aiowsync.Heartbeats = BEATS,
    connect_timeout: float = 20,
    **receiver_kw: Any,
) -> AsyncIterator[tuple[aiowsync.SharedMemWeightSyncScheme, aiowsync.SharedMemWeightSyncScheme]]:
    """A shared-memory sender of ``src`` and one connected receiver into ``mirror``, built from
    the sender's address alone: (sender, receiver)."""
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=heartbeats)
    sender.init_on_sender(model=src, num_workers=1, rehome=rehome)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, **receiver_kw)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(
                sender.connect(timeout=connect_timeout), r.connect(timeout=connect_timeout)
            )
            yield sender, r


def sync_pair() -> tuple[
    aiowsync.WeightSyncScheme, nn.Module, aiowsync.WeightSyncScheme, nn.Module
]:
    """A shared-memory sender of ``model(0)`` and its receiver into ``model(1)``, neither
    entered: (sender, its model, receiver, its model)."""
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=BEATS)
    r.init_on_receiver(model=mirror, worker_idx=0)
    return sender, src, r, mirror


# -- the shared-memory scheme on quick beats ---------------------------------------------------

# Beats every 0.1 s; lost after 2 s of silence (a loaded CI machine can stall a process for
# a few hundred ms, which must not count as a loss).
SHM_BEATS = aiowsync.Heartbeats(interval=0.1, missed=20)


def shm_system(
    n: int = 2, **sender_kw: Any
) -> contextlib.AbstractAsyncContextManager[
    tuple[aiowsync.SharedMemWeightSyncScheme, nn.Module, list[Any]]
]:
    """A shared-memory sender and ``n`` receivers in this process, on quick beats."""
    return system(aiowsync.SharedMemWeightSyncScheme, n, heartbeats=SHM_BEATS, **sender_kw)


def shm_pair(
    src: nn.Module, mirror: nn.Module, **kw: Any
) -> contextlib.AbstractAsyncContextManager[
    tuple[aiowsync.SharedMemWeightSyncScheme, aiowsync.SharedMemWeightSyncScheme]
]:
    """A sender of ``src`` and one receiver into ``mirror``, on quick beats."""
    return pair(src, mirror, heartbeats=SHM_BEATS, **kw)


def slow_writes(sender: aiowsync.SharedMemWeightSyncScheme, seconds: float) -> list[str]:
    """Make each copy into a slot take ``seconds`` longer; returns a log of copy starts/ends."""
    core = sender._sender
    assert core is not None
    plane = core.plane
    original = plane._stage  # type: ignore[attr-defined]  # the copy in the staging thread
    events: list[str] = []

    def stage(slot: int, source: Any) -> None:
        events.append("start")
        time.sleep(seconds)
        original(slot, source)
        events.append("end")

    plane._stage = stage  # type: ignore[attr-defined]
    return events


# -- the distributed scheme ------------------------------------------------------------------


def dist_model(seed: int = 0, width: int = 64) -> nn.Module:
    """A model with integer and boolean buffers, several buckets of the distributed plane."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(width, 3 * width), nn.ReLU(), nn.Linear(3 * width, 7))
    m.register_buffer("steps", torch.arange(5, dtype=torch.int64))
    m.register_buffer("mask", torch.tensor([True, False, True]))
    return m


def dist_system(
    n: int = 2, *, bucket_bytes: int = 4096, **sender_kw: Any
) -> contextlib.AbstractAsyncContextManager[
    tuple[aiowsync.DistributedWeightSyncScheme, nn.Module, list[Any]]
]:
    """A distributed sender of ``dist_model(0)`` and ``n`` receivers in this process."""
    return system(
        aiowsync.DistributedWeightSyncScheme,
        n,
        make_model=dist_model,
        connect_timeout=30,
        bucket_bytes=bucket_bytes,
        heartbeats=BEATS,
        **sender_kw,
    )


def keys_of(sender: aiowsync.WeightSyncScheme) -> aiowsync.ZmqChannelFactory:
    """The channels of a receiver built from ``sender``'s address alone: the CURVE keys the
    sender made for its tcp socket, without their server secret (what a worker is given)."""
    assert sender.address  # bound now if it was not: the keys are made with the socket
    curve = sender.channels.curve  # type: ignore[attr-defined]
    assert curve is not None, "the sender has no keys: it is not bound to a tcp address"
    return aiowsync.ZmqChannelFactory(curve=curve.for_receiver())


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def eventually(predicate: Callable[[], bool], within: float = 5.0, what: str = "") -> bool:
    """Poll ``predicate`` until it holds, for at most ``within`` seconds; past that, fail the
    test naming ``what`` (so a caller that forgets to assert still checks)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    if predicate():
        return True
    raise AssertionError(f"not within {within} s: {what or predicate}")


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m aiowsync ARGS`` in a child process, its output captured as text."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "aiowsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


# -- every plane: the kinds of plane, one suite run over each ------------------------------

# Beats every 50 ms; a worker is lost after 1 s of silence, which a busy host does not reach.
KIND_BEATS = aiowsync.Heartbeats(interval=0.05, missed=20)
# Generous: each is a bound that nothing waits for unless a test means it to.
KIND_TIMEOUTS = aiowsync.Timeouts(handshake=20.0, ack=10.0, transfer=30.0, control=5.0)
CONNECT = 20.0
"""How long a connect in these tests may take (it takes milliseconds)."""
LATE = {"memory": 1.0, "shm": 2.0, "dist": 3.0}
"""The deadline of a send that a test means to time out, by kind: long enough for the other
workers to answer first on a busy host."""
BUCKET = 1024
"""Bucket size of the distributed plane: the small model travels in three buckets."""


# -- the kinds of plane -----------------------------------------------------------------------


class Kind:
    """How one kind of plane builds its schemes; one per test, so the in-memory channel
    factory (which receivers must share with their sender) is the test's own."""

    def __init__(self, name: str) -> None:
        self.name = name
        # The test's receivers share their sender's factory on every kind: on dist, the CURVE
        # keys it makes for its tcp socket are then theirs too.
        self.channels: aiowsync.ChannelFactory | None = {
            "memory": aiowsync.MemoryChannelFactory(),
            "dist": aiowsync.ZmqChannelFactory(),
        }.get(name)
        self.late = LATE[name]

    def plane(
        self, *, inline_bytes: int | None = None, bucket_bytes: int = BUCKET, **kw: Any
    ) -> Any:
        """This kind's plane; ``kw`` are options every plane takes (``max_slots``)."""
        if self.name == "memory":
            return aiowsync.MemoryPlane(
                **({} if inline_bytes is None else {"inline_bytes": inline_bytes}), **kw
            )
        if self.name == "shm":
            return aiowsync.SharedMemPlane(**kw)
        return aiowsync.DistributedPlane(backend="gloo", bucket_bytes=bucket_bytes, **kw)

    def scheme(
        self, address: str | None = None, *, plane: Any = None, **kw: Any
    ) -> aiowsync.WeightSyncScheme:
        kw.setdefault("heartbeats", KIND_BEATS)
        kw.setdefault("timeouts", KIND_TIMEOUTS)
        if self.channels is not None:
            kw.setdefault("channels", self.channels)
        kw.setdefault("bind", LOCAL_BIND if self.name == "shm" else "tcp://127.0.0.1:0")
        return aiowsync.WeightSyncScheme(address, plane=plane or self.plane(), **kw)

    def system(
        self,
        n: int = 2,
        *,
        make: Callable[[int], nn.Module] = model,
        plane: Any = None,
        each: Mapping[int, Mapping[str, Any]] | None = None,
        sender_kw: Mapping[str, Any] | None = None,
        **receiver_kw: Any,
    ) -> contextlib.AbstractAsyncContextManager[System]:
        """A sender of ``make(0)`` (built with ``sender_kw``) and ``n`` connected receivers
        into ``make(100 + i)``, each built from the sender's address with ``receiver_kw`` (and
        ``each[i]`` for worker i)."""
        return _kind_system(
            self, n, make=make, plane=plane, each=each, sender_kw=sender_kw, **receiver_kw
        )


# -- models and their values ------------------------------------------------------------------


def tensors(m: nn.Module) -> list[torch.Tensor]:
    return list(m.state_dict().values())


def fill(m: nn.Module, value: float) -> None:
    """Make every value of the model ``value``, buffers included (boolean ones cannot hold it):
    a read that mixes two versions shows."""
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            if t.dtype != torch.bool:
                t.fill_(value)


def values(m: nn.Module) -> set[float]:
    """The distinct values the model holds (one, for a model made by :func:`fill`)."""
    return set(torch.cat([t.reshape(-1) for t in tensors(m)]).unique().tolist())


def frozen(m: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's tensors by name, as they are now."""
    return {k: v.clone() for k, v in m.state_dict().items()}


def nbytes_of(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(m))


def big_model(seed: int) -> nn.Module:
    return model(seed, big=True)


# -- a sender and its receivers in this process -----------------------------------------------


class Hosted:
    """``async with scheme`` held open by a task of its own, until :meth:`stop`.

    A scheme's task group must be left by the task that entered it, in the reverse order of
    entering; hosting each scheme in its own task lets a test stop any of them at any time.
    """

    def __init__(self, scheme: aiowsync.WeightSyncScheme) -> None:
        self.scheme = scheme
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> aiowsync.WeightSyncScheme:
        entered = asyncio.get_running_loop().create_future()

        async def host() -> None:
            async with self.scheme:
                entered.set_result(None)
                await self._stop.wait()

        self._task = task = asyncio.create_task(host())
        await asyncio.wait([entered, task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # entering failed: its error
        return self.scheme

    async def stop(self) -> None:
        """Leave ``async with``; idempotent."""
        self._stop.set()
        if self._task is not None:
            await self._task


class System:
    """A sender, its model, and receivers ``(scheme, model)``, each hosted in its own task so
    that any of them can leave while the others run."""

    def __init__(self, sender: aiowsync.WeightSyncScheme, src: nn.Module) -> None:
        self.sender = sender
        self.src = src
        self.receivers: list[tuple[aiowsync.WeightSyncScheme, nn.Module]] = []
        self._hosts: dict[int, Hosted] = {}

    def __getitem__(self, i: int) -> tuple[aiowsync.WeightSyncScheme, nn.Module]:
        return self.receivers[i]

    async def enter(self, scheme: aiowsync.WeightSyncScheme) -> None:
        host = Hosted(scheme)
        self._hosts[id(scheme)] = host
        await host.start()

    async def leave(self, i: int) -> None:
        """Worker ``i`` leaves its ``async with``."""
        await self._hosts[id(self.receivers[i][0])].stop()

    async def stop_sender(self) -> None:
        """The sender leaves its ``async with``."""
        await self._hosts[id(self.sender)].stop()

    async def close(self) -> None:
        """Every scheme leaves, the receivers first; the first error is raised after."""
        errors: list[BaseException] = []
        for host in reversed(list(self._hosts.values())):
            try:
                await host.stop()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def versions(self) -> list[int]:
        return [r.version for r, _ in self.receivers]

    async def add(self, kind: Kind, i: int, m: nn.Module, **kw: Any) -> aiowsync.WeightSyncScheme:
        """A receiver of worker ``i`` into ``m``, entered (not connected)."""
        r = kind.scheme(self.sender.address, plane=self.sender.plane, **kw)
        r.init_on_receiver(model=m, worker_idx=i)
        await self.enter(r)
        return r


@contextlib.asynccontextmanager
async def _kind_system(
    kind: Kind,
    n: int = 2,
    *,
    make: Callable[[int], nn.Module] = model,
    plane: Any = None,
    each: Mapping[int, Mapping[str, Any]] | None = None,
    sender_kw: Mapping[str, Any] | None = None,
    **receiver_kw: Any,
) -> AsyncIterator[System]:
    src = make(0)
    sender = kind.scheme(plane=plane, **(sender_kw or {}))
    sender.init_on_sender(model=src, num_workers=n)
    rig = System(sender, src)
    try:
        await rig.enter(sender)
        for i in range(n):
            m = make(100 + i)
            r = await rig.add(kind, i, m, **receiver_kw, **(each or {}).get(i, {}))
            rig.receivers.append((r, m))
        await asyncio.gather(
            sender.connect(timeout=CONNECT),
            *(r.connect(timeout=CONNECT) for r, _ in rig.receivers),
        )
        yield rig
    finally:
        await rig.close()


def switch_waits(r: aiowsync.WeightSyncScheme) -> bool:
    """Whether a switch on receiver ``r`` waits for readers to leave its guard."""
    return bool(r.read_guard()._idle_waiters)


@contextlib.contextmanager
def held(guard: aiowsync.ReadGuard) -> Iterator[None]:
    """Hold the read guard as a forward in a thread would (released however the test ends)."""
    guard.acquire()
    try:
        yield
    finally:
        guard.release()


# -- several models: a policy and a value net ------------------------------------------------


def policy_net(seed: int) -> nn.Module:
    """A small policy with an integer buffer, for schemes of several models."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    m.register_buffer("steps", torch.arange(3, dtype=torch.int64))
    return m


def value_net(seed: int, width: int = 16) -> nn.Module:
    """A small value net; ``width`` other than 16 makes one of another layout."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


@contextlib.asynccontextmanager
async def policy_and_value(
    kind: Kind, n: int = 2, *, each: dict[int, dict[str, Any]] | None = None, **kw: Any
) -> AsyncIterator[tuple[aiowsync.WeightSyncScheme, dict[str, nn.Module], list[Any]]]:
    """A sender of a policy and a value net, and ``n`` connected receivers of their own
    pair; yields (sender, its models, [(receiver, its models), ...])."""
    models = {"policy": policy_net(0), "value": value_net(1)}
    sender = kind.scheme(**kw)
    sender.init_on_sender(models=models, num_workers=n)
    hosts = [Hosted(sender)]
    receivers = []
    try:
        await hosts[0].start()
        for i in range(n):
            mine = {"policy": policy_net(100 + i), "value": value_net(200 + i)}
            options = dict(kw, **(each or {}).get(i, {}))
            factory = options.pop("models_of", None)
            if factory is not None:
                mine = factory(i)
            r = kind.scheme(sender.address, plane=sender.plane, **options)
            r.init_on_receiver(models=mine, worker_idx=i)
            hosts.append(Hosted(r))
            await hosts[-1].start()
            receivers.append((r, mine))
        await asyncio.gather(
            sender.connect(timeout=CONNECT), *(r.connect(timeout=CONNECT) for r, _ in receivers)
        )
        yield sender, models, receivers
    finally:
        for host in reversed(hosts):
            await host.stop()


@contextlib.asynccontextmanager
async def serving(sender: aiowsync.WeightSyncScheme) -> AsyncIterator[aiowsync.WeightSyncScheme]:
    """``sender`` inside its ``async with``, held open by a task of its own (see Hosted)."""
    host = Hosted(sender)
    await host.start()
    try:
        yield sender
    finally:
        await host.stop()


# -- layouts -----------------------------------------------------------------------------------


class Mixed(nn.Module):
    """Parameters and buffers of every awkward kind the layout must carry."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.bn = nn.BatchNorm1d(3)  # running stats plus an int64 0-d num_batches_tracked
        self.fp16 = nn.Parameter(torch.randn(7, dtype=torch.float16))
        self.brain = nn.Parameter(torch.randn(2, 3, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("codes", torch.tensor([-128, 0, 5, 127], dtype=torch.int8))
        self.register_buffer("scale", torch.tensor(2.5))
        self.register_buffer("nothing", torch.empty(0, 4))
        with torch.no_grad():
            self.bn.running_mean.uniform_()
            self.bn.num_batches_tracked.fill_(11)


def buffer_of(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> int | None:
    """Index of the flat buffer whose memory holds ``tensor``, if any."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for i, buf in enumerate(buffers):
        lo = buf.data_ptr()
        if lo <= start and end <= lo + buf.numel():
            return i
    return None


@contextlib.contextmanager
def gloo_group_in_threads(size: int) -> Iterator[list[Any]]:
    """A gloo group of ``size`` ranks (rank 0 the sender), each formed in a thread of this
    process: the groups, by rank. They go with the test, and with them any pending work
    (sends or receives nobody answered), gloo's teardown cancelling it."""
    from torch._C._distributed_c10d import HashStore

    from aiowsync._planes.dist.collectives import new_group

    store = HashStore()
    groups: list[Any] = [None] * size

    def member(rank: int) -> None:
        groups[rank] = new_group("gloo", store, "0123456789abcdef", rank, size, "127.0.0.1", 20)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(g is not None for g in groups), "the group did not form"
    yield groups
