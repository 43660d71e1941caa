"""A receiver with ``reconnect=True`` follows a trainer process that is SIGKILLed and started
again on the same address: real processes, real ZeroMQ, real /dev/shm. (The test takes a
transport: adding "dist" to its parameters runs the same story on gloo.)"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
import torch

import aiowsync
from _workers import SPAWN, make_model, scheme_of, sender_main
from aiowsync._planes.shm.slots import remove_stale_slots
from helpers import eventually

pytestmark = pytest.mark.timeout(240)


def _uniform(tensors: dict[str, torch.Tensor]) -> set[float]:
    return {float(v) for t in tensors.values() for v in t.unique().tolist()}


def _fixed_address(transport: str) -> str:
    """An address a trainer can bind again once the one before is dead."""
    if transport == "shm":
        return f"ipc://@aiowsync-test-follow-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


# The distributed plane follows a restarted trainer through the same code with real gloo
# groups in tests/scheme/test_following.py; one real-process run, on shared memory, keeps the
# suite's time.
@pytest.mark.parametrize("transport", ["shm"])
async def test_a_receiver_follows_a_killed_trainer_to_its_restart(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiowsync")
    bind = _fixed_address(transport)
    beats = (0.2, 10)
    queue = SPAWN.Queue()

    def trainer(value: float) -> Any:
        args = (queue, "small", value, bind, transport, beats)
        return SPAWN.Process(target=sender_main, args=args, daemon=True)

    procs = [trainer(7)]
    procs[0].start()
    model = make_model("small")
    mixed: list[set[float]] = []
    stop = threading.Event()
    try:
        address = await asyncio.to_thread(queue.get, True, 90)
        scheme = scheme_of(transport, address=address, heartbeats=aiowsync.Heartbeats(*beats))
        scheme.init_on_receiver(model=model, worker_idx=0, reconnect=True)

        def read() -> None:
            # What a forward under the guard sees: one trainer's bytes, never a mix.
            while not stop.is_set():
                with scheme.read_guard():
                    seen = _uniform(model.state_dict())
                if len(seen) != 1:
                    mixed.append(seen)
                time.sleep(0.001)

        reader = threading.Thread(target=read, daemon=True)
        async with scheme:
            await scheme.connect(timeout=60)
            assert await asyncio.to_thread(queue.get, True, 30) == "connected"
            reader.start()
            assert (scheme.version, scheme.generation) == (0, 0)
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].join(10)

            # Lost after the heartbeat timeout; meanwhile, and after, the model keeps the
            # killed trainer's bytes and serves them.
            await eventually(lambda: not scheme.connected, within=60, what="the loss is seen")
            assert scheme.ready and scheme.version == 0
            assert _uniform(model.state_dict()) == {7.0}
            async with scheme.lease() as held:
                assert (held.version, held.generation) == (0, 0)
                assert _uniform(held.params()) == {7.0}
            with pytest.raises(aiowsync.WeightSyncTimeout, match="waiting for a sender"):
                await scheme.wait_for_version(1, timeout=0.5)

            # A new trainer on the same address: the receiver joins it without being told.
            queue = SPAWN.Queue()  # the killed one may have died holding the old queue's lock
            procs.append(trainer(9))
            procs[1].start()
            assert await asyncio.to_thread(queue.get, True, 90) == address
            # The new trainer's connect() returns once this worker holds its version 0.
            assert await asyncio.to_thread(queue.get, True, 90) == "connected"
            assert (scheme.version, scheme.generation) == (0, 1)
            assert scheme.connected and scheme.ready
            assert _uniform(model.state_dict()) == {9.0}
            async with scheme.lease() as held:
                assert (held.version, held.generation) == (0, 1)
                assert _uniform(held.params()) == {9.0}
            stop.set()
            reader.join(10)
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)  # its scheme closes: its slot files go
                proc.join(15)
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        remove_stale_slots()  # those of the killed trainer, if no later one swept them
    assert not mixed, mixed[:3]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("aiowsync.receiver")
    ]
    assert len(warned) == 1, warned
    assert f"the sender at {address} was lost" in warned[0]
    assert "the model keeps version 0" in warned[0]
    for pid in (p.pid for p in procs):
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{pid}-")]
