"""Operating a scheme: what the trainer sees of its workers, and failures that explain
themselves (the exact text each side reads)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
from torch import nn

import aiowsync
from _workers import forked_worker_main, make_model, randomize, workers
from helpers import eventually, model

pytestmark = pytest.mark.timeout(120)

BEATS = aiowsync.Heartbeats(interval=0.05, missed=20)
TIMEOUTS = aiowsync.Timeouts(handshake=20.0, ack=10.0, transfer=30.0, control=5.0)


def memory_pair(
    channels: aiowsync.MemoryChannelFactory, address: str | None = None
) -> aiowsync.WeightSyncScheme:
    return aiowsync.WeightSyncScheme(
        address,
        plane=aiowsync.MemoryPlane(),
        channels=channels,
        heartbeats=BEATS,
        timeouts=TIMEOUTS,
    )


async def test_the_worker_table_and_a_connect_timeout_that_says_why_each_worker_is_missing() -> (
    None
):
    channels = aiowsync.MemoryChannelFactory()
    sender = memory_pair(channels)
    src = model(0)
    sender.init_on_sender(model=src, num_workers=3)
    assert [s.state for s in sender.workers.values()] == ["never connected"] * 3
    async with sender:
        good = memory_pair(channels, sender.address)
        good.init_on_receiver(model=model(1), worker_idx=0)
        wider = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
        wrong = memory_pair(channels, sender.address)
        wrong.init_on_receiver(model=wider, worker_idx=1)
        async with good, wrong:
            await good.connect(timeout=20)
            with pytest.raises(aiowsync.RefusedError):
                await wrong.connect(timeout=20)
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await sender.connect(timeout=0.5)
            assert str(info.value) == (
                "workers did not connect within 0.5 s (workers [1, 2]):\n"
                "  worker 1: refused: the receiver's model does not match the sender's:\n"
                "    0.bias: expected float32[32], got float32[33]\n"
                "    0.weight: expected float32[32, 16], got float32[33, 16]\n"
                "    2.weight: expected float32[4, 32], got float32[4, 33]\n"
                "  worker 2: never said hello"
            )
            assert info.value.worker_ids == (1, 2)
            table = sender.workers
            assert len(table) == 3 and list(table) == [0, 1, 2]
            ready, refused, silent = table[0], table[1], table[2]
            assert (ready.state, ready.version, ready.in_flight) == ("ready", 0, None)
            assert ready.pid == os.getpid() and ready.host == socket.gethostname()
            assert ready.last_heard is not None and ready.last_heard < 10
            assert refused.state == "never connected" and refused.pid is None
            assert refused.note is not None and refused.note.startswith(
                "refused: the receiver's model does not match the sender's:"
            )
            assert silent == aiowsync.WorkerStatus(
                2, "never connected", None, None, None, None, None, None
            )
            result = await sender.send(worker_ids=[0])
            assert table[0].version == result.version == 1
        # Worker 0 left with a goodbye: gone, and why.
        assert await eventually(lambda: sender.workers[0].state == "gone", within=20)
        assert sender.workers[0].note == "said goodbye (receiver closing)"
        assert sender.workers[0].version == 1
    with pytest.raises(KeyError):
        sender.workers[3]
    receiver = memory_pair(channels, "mem://x")
    receiver.init_on_receiver(model=model(2), worker_idx=0)
    with pytest.raises(RuntimeError, match="workers is the sender's view"):
        _ = receiver.workers


async def test_connect_fails_as_soon_as_every_missing_worker_was_refused() -> None:
    """One refused worker among four: the sender's ``connect()`` says so at once, not at its
    deadline, and a send to that worker says it was refused and why."""
    channels = aiowsync.MemoryChannelFactory()
    sender = memory_pair(channels)
    sender.init_on_sender(model=model(0), num_workers=4)
    wider = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
    async with sender:
        goods = [memory_pair(channels, sender.address) for _ in range(3)]
        for i, good in enumerate(goods):
            good.init_on_receiver(model=model(i + 1), worker_idx=i)
        wrong = memory_pair(channels, sender.address)
        wrong.init_on_receiver(model=wider, worker_idx=3)
        async with goods[0], goods[1], goods[2], wrong:
            waiting = asyncio.create_task(sender.connect(timeout=60))
            for good in goods:
                await good.connect(timeout=20)
            with pytest.raises(aiowsync.RefusedError):
                await wrong.connect(timeout=20)
            refused_at = time.monotonic()
            with pytest.raises(aiowsync.ConnectFailedError) as info:
                await asyncio.wait_for(waiting, 30)
            # Nothing but the loop's own turns lies between: far from the 60 s deadline.
            assert time.monotonic() - refused_at < 10
            assert isinstance(info.value, aiowsync.WeightSyncTimeout)
            assert info.value.worker_ids == (3,)
            assert list(info.value.reasons) == [3]
            assert str(info.value).startswith(
                "workers [3] cannot connect, each refused or lost:\n"
                "  worker 3: refused: the receiver's model does not match the sender's:\n"
                "    0.bias: expected float32[32], got float32[33]\n"
            )
            with pytest.raises(aiowsync.WorkerLostError) as lost:
                await sender.send(worker_ids=[0, 3])
            assert str(lost.value).startswith(
                "cannot send: workers [3] were refused when they said hello (worker 3: "
                "refused: the receiver's model does not match the sender's:"
            )
            assert "call `await scheme.connect()` first" not in str(lost.value)
            result = await sender.send(worker_ids=[0, 1, 2])
            assert result.worker_ids == (0, 1, 2)


async def test_a_trainer_with_one_refused_worker_among_four_real_ones_fails_fast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real processes over shared memory: worker 3 builds another model. The trainer's
    ``connect(timeout=60)`` raises soon after the refusal, naming worker 3 and the mismatch."""
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=make_model("small"), num_workers=4)
    caplog.set_level("WARNING", logger="aiowsync.sender")
    async with scheme:
        with workers() as w:
            for i in range(3):
                w.start(i, "small", scheme=scheme)
            w.start(3, "mib", scheme=scheme)
            await asyncio.to_thread(w.started, 4)
            with pytest.raises(aiowsync.ConnectFailedError) as info:
                await scheme.connect(timeout=60)
            raised = time.time()
            refusals = [r for r in caplog.records if r.getMessage().startswith("refused worker 3")]
            assert len(refusals) == 1
            gap = raised - refusals[0].created
            print(f"connect() raised {gap:.3f} s after the refusal")
            assert gap < 20  # generous for a busy host; it is the other workers' joins
            assert info.value.worker_ids == (3,)
            assert str(info.value).startswith(
                "workers [3] cannot connect, each refused or lost:\n"
                "  worker 3: refused: the receiver's model does not match the sender's:\n"
            )
            assert [scheme.workers[i].state for i in range(4)] == ["ready"] * 3 + [
                "never connected"
            ]


async def test_connect_waits_for_a_worker_lost_before_it_and_fails_on_one_lost_during_it() -> None:
    """A worker already lost when ``connect()`` starts may be restarting, so it is waited for;
    one that leaves while ``connect()`` waits ends the wait at once."""
    channels = aiowsync.MemoryChannelFactory()
    sender = memory_pair(channels)
    sender.init_on_sender(model=model(0), num_workers=2)
    async with sender:
        first = memory_pair(channels, sender.address)
        first.init_on_receiver(model=model(1), worker_idx=0)
        async with first:
            await first.connect(timeout=20)
        assert await eventually(lambda: sender.workers[0].state == "gone", within=20)
        # Lost before the call: a new process under index 0 is what it waits for.
        waiting = asyncio.create_task(sender.connect(timeout=60))
        again = memory_pair(channels, sender.address)
        again.init_on_receiver(model=model(2), worker_idx=0)
        leaving = memory_pair(channels, sender.address)
        leaving.init_on_receiver(model=model(3), worker_idx=1)
        async with again:
            async with leaving:
                await leaving.connect(timeout=20)
            await again.connect(timeout=20)
            with pytest.raises(aiowsync.ConnectFailedError) as info:
                await asyncio.wait_for(waiting, 30)
            assert info.value.worker_ids == (1,)
            assert info.value.reasons == {1: "said goodbye (receiver closing)"}
            assert sender.workers[0].state == "ready"


def _compress(states: list[str]) -> list[str]:
    out: list[str] = []
    for state in states:
        if not out or out[-1] != state:
            out.append(state)
    return out


async def test_the_worker_table_through_a_worker_killed_and_restarted() -> None:
    """Real processes over shared memory; the table is read every few milliseconds."""
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.25, 8))
    m = make_model("small")
    scheme.init_on_sender(model=m, num_workers=1)
    seen: list[str] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            seen.append(scheme.workers[0].state)
            await asyncio.sleep(0.005)

    with workers() as w:
        async with scheme:
            watcher = asyncio.create_task(watch())
            try:
                w.start(0, "small", scheme=scheme)
                await asyncio.to_thread(w.started, 1)  # start-up counts for no deadline
                await scheme.connect(timeout=60)
                randomize(m, 1)
                await scheme.send(timeout=30)
                assert scheme.workers[0].version == 1
                pid = scheme.workers[0].pid
                assert pid is not None and pid != os.getpid()
                w.kill(0)
                assert await eventually(lambda: scheme.workers[0].state == "gone", within=60)
                assert scheme.workers[0].version == 1  # what it last held
                w.start(0, "small", scheme=scheme)
                await asyncio.to_thread(w.started, 1)
                await scheme.connect(timeout=60)
                assert scheme.workers[0].pid not in (None, pid)
                assert scheme.workers[0].version == 1
            finally:
                stop.set()
                await watcher
            seen.append(scheme.workers[0].state)
    states = _compress(seen)
    print("worker 0 went through:", " -> ".join(states))
    assert states[0] == "never connected" and states[-1] == "ready"
    # After its death it reads lost (until its process is seen gone) or gone at once.
    middle = states[1 : states.index("gone")]
    assert "ready" in middle and set(middle) <= {"connecting", "ready", "lost"}
    after = states[states.index("gone") + 1 :]
    assert set(after) <= {"connecting", "ready"} and after[-1] == "ready"


async def test_a_worker_forked_from_the_trainer_is_told_to_spawn_and_the_trainer_hears_why() -> (
    None
):
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.25, 8))
    scheme.init_on_sender(model=make_model("small"), num_workers=1)
    async with scheme:
        fork = mp.get_context("fork")
        events = fork.Queue()
        proc = fork.Process(target=forked_worker_main, args=(scheme, events))
        proc.start()
        try:
            kind, text = await asyncio.to_thread(events.get, True, 60)
        finally:
            proc.join(30)
        assert kind == "refused"
        assert text == (
            f"this process ({proc.pid}) was forked from the trainer (process {os.getpid()}) "
            "and holds the trainer's own sender, not a receiver's copy of the scheme: start "
            "worker processes with the 'spawn' start method "
            "(multiprocessing.get_context('spawn')), or build the worker's scheme from the "
            "sender's address"
        )
        assert scheme.workers[0].note == f"refused: it could not start its receiver: {text}"
        with pytest.raises(aiowsync.ConnectFailedError) as info:
            await scheme.connect(timeout=60)
        assert str(info.value) == (
            "workers [0] cannot connect, each refused or lost:\n"
            f"  worker 0: refused: it could not start its receiver: {text}"
        )


@pytest.mark.parametrize(
    ("given", "told"),
    [
        ({"timeouts": 5}, "timeouts must be aiowsync.Timeouts(...), got 5"),
        ({"heartbeats": 0.5}, "heartbeats must be aiowsync.Heartbeats(...), got 0.5"),
        ({"background": "false"}, "background must be True or False, got 'false'"),
        ({"channels": "zmq"}, "channels must be a ChannelFactory, got str"),
    ],
)
def test_options_of_the_wrong_type_are_refused_when_the_scheme_is_built(
    given: dict[str, object], told: str
) -> None:
    # Before, each was taken: timeouts=5 failed at connect() with an AttributeError, and
    # background="false" counted as true.
    with pytest.raises(TypeError) as info:
        aiowsync.SharedMemWeightSyncScheme(**given)  # type: ignore[arg-type]
    assert str(info.value) == told


def test_a_copy_pickled_before_its_sender_had_an_address_says_so() -> None:
    import pickle

    early = pickle.loads(pickle.dumps(aiowsync.SharedMemWeightSyncScheme()))
    with pytest.raises(ValueError, match="pickled before its sender had an address"):
        early.init_on_receiver(model=nn.Linear(2, 2), worker_idx=0)
    with pytest.raises(ValueError, match="pass address= or unpickle it"):
        aiowsync.SharedMemWeightSyncScheme().init_on_receiver(model=nn.Linear(2, 2), worker_idx=0)


async def test_workers_numbered_from_one_are_named_in_the_trainers_error() -> None:
    # Before, the trainer's timeout said only "worker 0: never said hello": why worker 2
    # was refused (its index is out of range) was in the log alone.
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=nn.Linear(4, 4), num_workers=2)
    async with sender:
        one = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        one.init_on_receiver(model=nn.Linear(4, 4), worker_idx=1)
        two = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        two.init_on_receiver(model=nn.Linear(4, 4), worker_idx=2)
        async with one, two:
            told, _, refused = await asyncio.gather(
                sender.connect(timeout=3),
                one.connect(timeout=20),
                two.connect(timeout=20),
                return_exceptions=True,
            )
    assert isinstance(refused, aiowsync.RefusedError)
    assert "indices run from 0 to num_workers - 1" in str(refused)
    assert isinstance(told, aiowsync.WeightSyncTimeout) and told.worker_ids == (0,)
    assert str(told).endswith(
        "worker 0: never said hello\n  also refused: a worker that named index 2 (worker "
        "index 2 is out of range(0, 2): indices run from 0 to num_workers - 1)"
    )


async def test_a_worker_that_cannot_apply_its_first_version_is_named_with_why() -> None:
    # Before, the trainer's connect() error and the worker table said only "its connection
    # is closed": the reason the worker gave (a hook that failed) was in the log alone.
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    worker = aiowsync.SharedMemWeightSyncScheme(address=sender.address)

    def hook(version: int) -> None:
        raise RuntimeError("the KV cache could not be reset")

    worker.register_hook(hook)
    worker.init_on_receiver(model=nn.Linear(4, 4), worker_idx=0)
    async with sender, worker:
        told, failed = await asyncio.gather(
            sender.connect(timeout=20), worker.connect(timeout=20), return_exceptions=True
        )
    assert isinstance(failed, aiowsync.ConnectError)
    assert isinstance(told, aiowsync.ConnectFailedError)
    why = "it could not apply version 0: RuntimeError: the KV cache could not be reset"
    assert why in str(told)
    assert why in (sender.workers[0].note or "")


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("garbage", "no transport: it must start with tcp:// or ipc://"),
        ("localhost:5555", "no transport: it must start with tcp:// or ipc://"),
        ("tcp://localhost", "tcp needs HOST:PORT"),
        ("tcp://127.0.0.1:99999", "bad port '99999'"),
        ("tcp://127.0.0.1:\u0665\u0665", "bad port '\u0665\u0665'"),  # Arabic-Indic digits
        ("tcp://127.0.0.1:\u00b2", "bad port '\u00b2'"),
        ("tcp://127.0.0.1:0", "port 0 is for binding; connect to the port the sender reports"),
        ("udp://127.0.0.1:5555", "unknown transport 'udp'"),
        ("ipc://@*", "ipc://@* is for binding; connect to the address the sender reports"),
        ("ipc://*", "ipc://* is for binding; connect to the address the sender reports"),
    ],
)
def test_a_bad_address_is_refused_when_the_scheme_is_built(address: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        aiowsync.SharedMemWeightSyncScheme(address=address)
    assert str(info.value) == (
        f"{address!r} is not a control address ({problem}); use tcp://HOST:PORT "
        "(e.g. tcp://127.0.0.1:5555, tcp://[::1]:5555; port 0 binds a free one), "
        "ipc:///path/to/socket, ipc://@abstract-name (Linux), ipc://* to bind a fresh socket "
        "in a private directory, or ipc://@* a fresh abstract one"
    )


def test_good_addresses_and_binds_are_accepted() -> None:
    for address in (
        "tcp://127.0.0.1:5555",
        "tcp://[::1]:1",
        "tcp://host-a.example:80",
        "ipc:///tmp/x.sock",
        "ipc://@name",
    ):
        aiowsync.SharedMemWeightSyncScheme(address=address)
    for bind in ("tcp://*:0", "tcp://0.0.0.0:5555", "ipc://@*", "tcp://127.0.0.1:0"):
        aiowsync.WeightSyncScheme(plane=aiowsync.MemoryPlane(), bind=bind)
    with pytest.raises(ValueError, match="bad host"):
        aiowsync.SharedMemWeightSyncScheme(bind="tcp://a b:1")
    with pytest.raises(ValueError, match="in-process channels: they look like mem://1"):
        memory_pair(aiowsync.MemoryChannelFactory(), "tcp://127.0.0.1:5555")


async def test_a_receiver_takes_weights_as_the_sender_does() -> None:
    channels = aiowsync.MemoryChannelFactory()
    sender = memory_pair(channels)
    src = model(0)
    sender.init_on_sender(model=src, num_workers=1)
    target = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    receiver = memory_pair(channels)
    with pytest.raises(ValueError, match="give model= or weights=, not both"):
        receiver.init_on_receiver(model=model(1), weights=target, worker_idx=0)
    async with sender:
        receiver = memory_pair(channels, sender.address)
        receiver.init_on_receiver(weights=target, worker_idx=0)
        async with receiver:
            await asyncio.gather(sender.connect(timeout=20), receiver.connect(timeout=20))
            assert all(torch.equal(target[k], v) for k, v in src.state_dict().items())


async def test_misuse_of_a_sender_says_what_to_do() -> None:
    channels = aiowsync.MemoryChannelFactory()
    sender = memory_pair(channels)
    sender.init_on_sender(model=model(0), num_workers=2)
    with pytest.raises(RuntimeError) as outside:
        await sender.send()
    assert str(outside.value) == (
        "send() runs inside `async with scheme:` (enter it, then `await scheme.connect()`, "
        "then send)"
    )
    with pytest.raises(RuntimeError, match=r"^publish\(\) runs inside `async with scheme:`"):
        await sender.publish()
    async with sender:
        r = memory_pair(channels, sender.address)
        r.init_on_receiver(model=model(1), worker_idx=0)
        async with r:
            await r.connect(timeout=20)
            with pytest.raises(aiowsync.WorkerLostError) as early:
                await sender.send()
            assert str(early.value) == (
                "cannot send: workers [1] have not connected yet: call `await "
                "scheme.connect()` first, which waits until every worker holds version 0 "
                "(workers [1])"
            )
            assert (await sender.send(worker_ids=[0])).version == 1
        assert await eventually(lambda: sender.workers[0].state == "gone", within=20)
        with pytest.raises(aiowsync.WorkerLostError) as lost:
            await sender.send(worker_ids=[0])
        assert str(lost.value) == (
            "cannot send: workers [0] are lost (worker 0: said goodbye (receiver closing)); "
            "leave them out with worker_ids= until they rejoin (workers [0])"
        )
