"""A send's second step (a ``Finisher``, as ``aiowsync.vllm.VLLMServers`` adds): it runs once
every targeted worker holds the version, sends made at once take it one after another, its
time counts in ``SendResult.seconds``, its error fails the send, and ``publish()`` refuses it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

import aiowsync
from aiowsync._scheme.sender import SenderSession
from helpers import bump, system


class Recorder:
    def __init__(self, receivers: list[aiowsync.WeightSyncScheme], fail_at: int = -1) -> None:
        self.receivers = receivers
        self.fail_at = fail_at
        self.steps: list[tuple[str, int, list[int], list[int]]] = []
        self.checked: list[list[int]] = []

    def check(self, worker_ids: Sequence[int]) -> None:
        if list(worker_ids) == [0]:
            raise ValueError("refused before staging")
        self.checked.append(list(worker_ids))

    async def finish(self, version: int, worker_ids: Sequence[int], deadline: float | None) -> None:
        held = [r.version for r in self.receivers]
        self.steps.append(("begin", version, list(worker_ids), held))
        await asyncio.sleep(0.05)
        if version == self.fail_at:
            raise RuntimeError(f"second step of version {version} failed")
        self.steps.append(("end", version, list(worker_ids), held))


async def test_the_second_step_runs_after_the_acks_whole_and_in_order() -> None:
    scheme = lambda: aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.1, 50))  # noqa: E731
    async with system(scheme, 2) as (sender, src, receivers):
        sending = sender._sending
        assert isinstance(sending, SenderSession)
        step = Recorder([r for r, _ in receivers], fail_at=4)
        sending.finishers.append(step)
        bump(src)
        started = time.perf_counter()
        result = await sender.send()
        assert result.seconds >= 0.05 and result.seconds <= time.perf_counter() - started
        # Both workers held the version when its second step began.
        assert step.steps[:2] == [("begin", 1, [0, 1], [1, 1]), ("end", 1, [0, 1], [1, 1])]
        # Sends made at once: each version's step begins after the one before ended, and
        # while the workers still hold that version (the next is not staged yet).
        bump(src)
        await asyncio.gather(sender.send(), sender.send(worker_ids=[1]))
        assert [s[:3] for s in step.steps[2:]] == [
            ("begin", 2, [0, 1]),
            ("end", 2, [0, 1]),
            ("begin", 3, [1]),
            ("end", 3, [1]),
        ]
        assert step.steps[2][3] == [2, 2] and step.steps[4][3] == [2, 3]
        with pytest.raises(RuntimeError, match="second step of version 4 failed"):
            await sender.send()
        assert [r.version for r, _ in receivers] == [4, 4]  # the transfer itself succeeded
        with pytest.raises(ValueError, match="refused before staging"):
            await sender.send(worker_ids=[0])
        with pytest.raises(RuntimeError, match="publish"):
            await sender.publish()
        sending.finishers.remove(step)
        pending = await sender.publish()
        assert (await pending).version == 5
