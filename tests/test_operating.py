"""Operating a scheme: what the trainer sees of its workers, and failures that explain
themselves (the exact text each side reads)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
from torch import nn

import aiowsync
from _workers import SPAWN, make_model, randomize, workers
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
        receiver.workers


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
                await scheme.connect(timeout=150)
                randomize(m, 1)
                await scheme.send(timeout=30)
                assert scheme.workers[0].version == 1
                pid = scheme.workers[0].pid
                assert pid is not None and pid != os.getpid()
                w.kill(0)
                assert await eventually(
                    lambda: scheme.workers[0].state == "gone", within=60
                )
                assert scheme.workers[0].version == 1  # what it last held
                w.start(0, "small", scheme=scheme)
                await scheme.connect(timeout=150)
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
