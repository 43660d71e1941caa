"""``aiowsync.blocking``: the scheme's API from synchronous code, on a private event loop.

Real shared memory and ZeroMQ throughout: a sender and a receiver in threads of this process
for the behaviour, and a synchronous trainer with two synchronous worker processes for the
whole picture.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
from _workers import SPAWN, blocking_worker_main, digest, make_model
from helpers import BEATS, fill, model, same, sync_pair

pytestmark = pytest.mark.timeout(180)


def _value(m: nn.Module, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(t, value) for k, t in m.state_dict().items()}


def test_a_sync_sender_and_receiver_send_receive_and_fail_as_the_async_api_does() -> None:
    sender, src, r, mirror = sync_pair()
    with aiowsync.blocking(sender) as s, aiowsync.blocking(r) as w:
        w.connect(timeout=30)  # the sender answers from its own loop thread
        s.connect(timeout=30)
        assert w.version == 0 and w.ready and same(mirror, src)
        for version in (1, 2, 3):
            fill(src, float(version))
            result = s.send(timeout=30)
            assert isinstance(result, aiowsync.SendResult)
            assert result.version == version == s.version == w.version
            assert same(mirror, src)
        assert w.wait_for_version(3, timeout=5) == 3
        # Queued in call order, each with its own weights.
        futures = [s.send_soon(weights=_value(src, float(v))) for v in (10, 11, 12)]
        assert [f.result(60).version for f in futures] == [4, 5, 6]
        assert w.version == 6 and all(bool((t == 12).all()) for t in mirror.state_dict().values())
        # The async API's exceptions, unchanged.
        with pytest.raises(aiowsync.LayoutMismatchError):
            s.send(weights={"nope": torch.zeros(1)})
        with pytest.raises(ValueError, match="not in range"):
            s.send(worker_ids=[5])
        with pytest.raises(aiowsync.WeightSyncTimeout, match="not 99"):
            w.wait_for_version(99, timeout=0.2)
        with pytest.raises(RuntimeError, match="pull mode"):
            w.receive(timeout=0.1)
        with w.read_guard():
            assert w.version == 6
        assert s.version == 6
        # Two-phase: back once staged, so the weights may change at once; the outcome later.
        fill(src, 7.0)
        outcome = s.publish(timeout=30)
        fill(src, 99.0)
        assert outcome.result(60).version == 7 == w.version
        assert all(bool((t == 7).all()) for t in mirror.state_dict().values())
        assert s.workers[0].state == "ready" and s.workers[0].version == 7
    # After exit: a clear error, not a hang.
    with pytest.raises(RuntimeError, match="closed"):
        s.send()
    with pytest.raises(RuntimeError, match="closed"):
        w.wait_for_version(1)
    assert not s.connected and not w.connected


def test_pull_mode_through_the_blocking_face() -> None:
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, background=False)
    r.init_on_receiver(model=mirror, worker_idx=0)
    with aiowsync.blocking(sender) as s, aiowsync.blocking(r) as w:
        w.connect(timeout=30)
        s.connect(timeout=30)
        assert w.receive(timeout=0.2) is None
        fill(src, 5.0)
        pending = s.send_soon(timeout=30)
        assert w.receive(timeout=30) == 1
        assert pending.result(30).version == 1 and same(mirror, src)


def test_calls_from_a_running_event_loop_are_refused_rather_than_deadlocking() -> None:
    sender, _, r, _ = sync_pair()
    with aiowsync.blocking(sender) as s:

        async def inside() -> None:
            s.send(timeout=1)

        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(inside())

        async def close_on_its_own_loop() -> None:
            s.close()

        on_loop = asyncio.run_coroutine_threadsafe(close_on_its_own_loop(), s._loop)
        with pytest.raises(RuntimeError, match="own loop thread"):
            on_loop.result(30)
        assert s.version == 0  # still open

        async def enter_inside() -> None:
            with aiowsync.blocking(r):
                pass

        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(enter_inside())


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_an_error_in_the_body_leaves_the_scheme_cleanly(error: type[BaseException]) -> None:
    sender, src, r, mirror = sync_pair()
    threads = set(threading.enumerate())
    with pytest.raises(error), aiowsync.blocking(sender) as s, aiowsync.blocking(r) as w:
        w.connect(timeout=30)
        s.connect(timeout=30)
        raise error("the user's own code")
    assert not sender.connected and not r.connected
    # Both loop threads are gone, and the schemes can be entered again.
    deadline = time.monotonic() + 10
    while any(t.name == "aiowsync-blocking" for t in set(threading.enumerate()) - threads):
        assert time.monotonic() < deadline, "a loop thread outlived its scheme"
        time.sleep(0.02)
    with aiowsync.blocking(sender) as s, aiowsync.blocking(r) as w:
        w.connect(timeout=30)
        s.connect(timeout=30)
        fill(src, 2.0)
        assert s.send(timeout=30).version == 1 and same(mirror, src)


def test_entering_an_uninitialised_scheme_raises_its_error() -> None:
    unready = aiowsync.SharedMemWeightSyncScheme()
    with pytest.raises(RuntimeError, match="init_on_sender"), aiowsync.blocking(unready):
        pass


def test_a_sync_trainer_and_two_sync_workers_never_read_a_torn_model() -> None:
    trainer = make_model("small")
    fill(trainer, 0.0)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.5, 10))
    scheme.init_on_sender(model=trainer, num_workers=2)
    events, stop = SPAWN.Queue(), SPAWN.Event()
    procs = []
    try:
        with aiowsync.blocking(scheme) as s:
            for i in range(2):
                procs.append(
                    SPAWN.Process(
                        target=blocking_worker_main,
                        args=(scheme, i, events, stop),
                        daemon=True,
                    )
                )
                procs[-1].start()
            s.connect(timeout=150)
            ready = [events.get(timeout=60) for _ in range(2)]
            assert sorted(e[1] for e in ready) == [0, 1] and {e[2] for e in ready} == {0}
            for version in range(1, 31):
                fill(trainer, float(version))
                assert s.send(timeout=30).version == version
            fill(trainer, 31.0)
            assert s.send_soon(timeout=30).result(60).version == 31
            time.sleep(0.5)  # a few more reads of the last version
            stop.set()
            done = sorted((events.get(timeout=60) for _ in range(2)), key=lambda e: e[1])
        for _, idx, version, weights, reads, torn, seen in done:
            print(f"worker {idx}: version {version}, {reads} reads, {torn} torn, {seen} seen")
            assert (version, weights) == (31, digest(trainer))
            assert torn == 0 and reads > 0 and seen >= 2
    finally:
        stop.set()
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_blocking_is_the_one_way_to_a_blocking_scheme() -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme()
    with pytest.raises(TypeError, match=r"use aiowsync.blocking\(scheme\)"):
        aiowsync.BlockingScheme(scheme)
    assert isinstance(aiowsync.blocking(scheme), aiowsync.BlockingScheme)


_LEFT_OPEN = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import aiowsync
from helpers import sync_pair

sender, src, r, mirror = sync_pair()
s = aiowsync.blocking(sender).__enter__()  # never closed, nor left by a with block
rb = aiowsync.blocking(r).__enter__()
joined = threading.Thread(target=lambda: s.connect(timeout=30))
joined.start()
rb.connect(timeout=30)
joined.join()
s.send(timeout=30)
print(os.getpid(), sender.address, flush=True)
"""


def test_blocking_schemes_left_open_are_closed_at_interpreter_exit(tmp_path: Any) -> None:
    """A sender's slot files and socket directory go with the process, as when closed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN, tests],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    pid, address = run.stdout.split()
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"aiowsync-{pid}-")] == []
    socket_dir = Path(address.removeprefix("ipc://")).parent
    assert not socket_dir.exists(), address
