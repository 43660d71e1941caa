"""The distributed plane after a receive failed on the receiver's side: the next send finds a
fresh group at once, and a receiver that leaves mid-receive lets its process exit.

Real gloo groups and real ZeroMQ; a failure is injected where a receiver hashes what arrived,
and a stuck sender is one whose transfer thread waits before sending a byte.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import aiowsync
from aiowsync._planes.dist import plane as plane_module
from aiowsync._planes.dist.receiver import DistReceiverPlane
from helpers import BEATS, bump, dist_model, dist_system, same

pytestmark = pytest.mark.timeout(120)


async def test_a_receive_that_failed_after_its_bytes_came_leaves_no_dead_group_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker 1 fails once the sender's transfer went through (so the sender's collective did
    not fail). It let go of the group: the sender must not hand that group out again, where
    the next send would stall on a link (5 s) and fail within a 3 s deadline."""
    hasher = DistReceiverPlane._hasher
    armed = threading.Event()

    def failing(self: DistReceiverPlane, choice: list[int]) -> Callable[[int], None]:
        arrived = hasher(self, choice)
        last = len(self.buckets.ranges)  # the trailer: the sender's digest

        def hash_or_fail(index: int) -> None:
            if self._worker_idx == 1 and index == last and armed.is_set():
                armed.clear()
                raise RuntimeError("injected: the receive failed after its last byte")
            arrived(index)

        return hash_or_fail

    monkeypatch.setattr(DistReceiverPlane, "_hasher", failing)
    async with dist_system(2) as (sender, src, receivers):
        armed.set()
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError, match="injected") as failed:
            await sender.send(timeout=20)
        assert failed.value.worker_ids == (1,) and failed.value.acked == (0,)
        for _ in range(2):
            bump(src)
            result = await sender.send(timeout=3)
            assert result.worker_ids == (0, 1) and result.retries == 0
            assert all(same(mirror, src) for _, mirror in receivers)


RECEIVER = """
import asyncio, pickle, sys, time
sys.path.insert(0, {tests!r})
from helpers import dist_model

async def main():
    with open({path!r}, "rb") as f:
        scheme = pickle.load(f)
    scheme.init_on_receiver(model=dist_model(1), worker_idx=0)
    async with scheme:
        await scheme.connect(timeout=60)
        print("connected", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # a receive waits on the stuck sender
    print("left", flush=True)

asyncio.run(main())
"""


async def test_a_receiver_that_leaves_during_a_stuck_receive_exits_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Its abandoned receive waits out the send's deadline (60 s here) in a thread that must
    not hold up the process's exit."""
    release, formed = threading.Event(), threading.Event()

    def stuck(*args: Any, **kwargs: Any) -> None:
        formed.set()  # the group formed: every member joined it
        release.wait(60)

    src = dist_model(0)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=4096, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        path = tmp_path / "scheme.pkl"
        path.write_bytes(pickle.dumps(sender))
        tests = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        code = RECEIVER.format(tests=tests, path=str(path))
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            await sender.connect(timeout=90)
            assert await asyncio.to_thread(proc.stdout.readline) == "connected\n"
            monkeypatch.setattr(plane_module, "send_buckets", stuck)
            bump(src)
            send = asyncio.ensure_future(sender.send(timeout=60))
            assert await asyncio.to_thread(formed.wait, 60)
            await asyncio.sleep(0.5)  # the worker's receive thread waits on the stuck sender
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert await asyncio.to_thread(proc.stdout.readline) == "left\n"
            left = time.monotonic()
            code = await asyncio.to_thread(proc.wait, 40)
            assert code == 0
            assert time.monotonic() - left < 20  # was the send's 60 s, less what had passed
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        with pytest.raises(aiowsync.WeightSyncError):
            await send
