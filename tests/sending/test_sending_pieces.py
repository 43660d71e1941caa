"""The sender engine's pieces work from the shared state they are given, with no engine."""

from __future__ import annotations

import anyio
import torch

from aiowsync import Heartbeats, MemoryChannelFactory, Timeouts
from aiowsync import _protocol as wire
from aiowsync._planes.digest import Digests
from aiowsync._planes.memory import MemorySenderPlane
from aiowsync._sending.control import ControlLoop
from aiowsync._sending.outcome import Answers
from aiowsync._sending.retries import AnswerRetries
from aiowsync._sending.state import SenderState
from aiowsync._weights.layout import Layout

WAIT = 5.0


def _state() -> SenderState:
    layout = Layout.from_weights({"w": torch.zeros(4)})
    plane = MemorySenderPlane(num_slots=2, max_slots=4, inline_bytes=0)
    return SenderState(
        plane=plane,
        layout=layout,
        num_workers=1,
        model_id="m",
        timeouts=Timeouts(),
        beats=Heartbeats(),
        digests=Digests(layout, plane, enabled=False),
    )


async def test_a_control_loop_refuses_hellos_and_drops_stray_beats_from_its_state_alone() -> None:
    state = _state()
    factory = MemoryChannelFactory()
    state.channel = channel = factory.bind("mem://", heartbeat_timeout=WAIT)
    worker = factory.connect(channel.address, heartbeat_timeout=WAIT)
    loop = ControlLoop(state)
    hello = wire.Hello(
        protocol=wire.PROTOCOL_VERSION,
        model_id="another",
        worker_idx=0,
        fingerprint=state.layout.fingerprint,
    )
    stray = wire.Heartbeat(worker_idx=0, session="0" * 32, version=0, proof="")
    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tasks:
                await tasks.start(loop.serve)
                await worker.send(hello, timeout=WAIT)
                refused = await worker.recv(timeout=WAIT)
                await worker.send(stray, timeout=WAIT)
                while loop.dropped == 0:
                    await anyio.sleep(0.01)
                tasks.cancel_scope.cancel()
    finally:
        worker.close()
        channel.close()
    assert isinstance(refused, wire.Refuse) and "'another'" in refused.reason
    assert state.peers.notes[0].startswith("refused: ")
    assert (loop.refusals, loop.dropped) == (1, 1)


async def test_answer_retries_and_the_state_settle_sends_with_no_engine() -> None:
    state = _state()
    pending = Answers(1, {0})
    state.pending[1] = pending
    retries = AnswerRetries(state, pending, [])
    assert retries.waiting() == {0} and retries.retryable() == []
    assert retries.done()  # no channel: the sender is shut down
    assert not await retries.announce([(0, "0" * 32)], 1, {})
    state.abandon_pending()
    assert pending.done.is_set() and pending.lost == {0} and not pending.waiting
