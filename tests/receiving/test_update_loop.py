"""The update loop on its own: made from a state, an applier and the leased versions, with no
engine, a memory channel standing in for the sender."""

from __future__ import annotations

import pytest
from torch import nn

import aiowsync
from aiowsync._channel import ReceiverChannel, SenderChannel
from aiowsync._config import Heartbeats, Timeouts
from aiowsync._planes.base import ReceiverContext
from aiowsync._protocol import Heartbeat, Update
from aiowsync._receiving.apply import Applier
from aiowsync._receiving.guard import ReadGuard
from aiowsync._receiving.state import ReceiverState
from aiowsync._receiving.updates import UpdateLoop
from aiowsync._weights.layout import Layout

PROOF = "the sender's proof"


def _loop(
    channels: aiowsync.MemoryChannelFactory,
) -> tuple[UpdateLoop, ReceiverState, Applier, SenderChannel]:
    sender = channels.bind("mem://0", heartbeat_timeout=5)
    model = nn.Linear(4, 2)
    targets = dict(model.state_dict())
    state = ReceiverState(
        worker_idx=0, address=sender.address, timeouts=Timeouts(), beats=Heartbeats()
    )
    channel: ReceiverChannel = channels.connect(sender.address, heartbeat_timeout=5)
    state.channel, state.session, state.proof = channel, "session", PROOF
    context = ReceiverContext(address=sender.address, worker_idx=0, tensors=targets)
    applier = Applier(
        plane=aiowsync.MemoryPlane().receiver(context),
        layout=Layout.from_weights(model),
        targets=targets,
        mode="swap",
        guard=ReadGuard(),
        hooks=[],
        timeouts=Timeouts(),
        on_switch=state.notify,
    )
    return UpdateLoop(state, applier, lambda: ()), state, applier, sender


async def test_an_update_without_the_senders_proof_is_refused_and_the_sender_counts_as_gone() -> (
    None
):
    channels = aiowsync.MemoryChannelFactory()
    loop, state, applier, sender = _loop(channels)
    (peer,) = sender.peers  # type: ignore[attr-defined]
    await sender.send(peer, Update(version=1, proof="someone else's"), timeout=1)
    with pytest.raises(aiowsync.SenderGoneError):
        await loop.receive(timeout=5)
    _close(state, sender)
    assert state.impostors == 1 and state.bye is not None and not state.said_bye
    assert applier.version == -1


async def test_only_a_beat_with_the_senders_proof_confirms_the_connection() -> None:
    channels = aiowsync.MemoryChannelFactory()
    loop, state, _, sender = _loop(channels)
    (peer,) = sender.peers  # type: ignore[attr-defined]
    beat = Heartbeat(worker_idx=0, session="session", version=0, proof="a guess")
    await sender.send(peer, beat, timeout=1)
    assert await loop.receive(timeout=0.3) is None
    assert state.confirmed == -1
    await sender.send(
        peer, Heartbeat(worker_idx=0, session="session", version=0, proof=PROOF), timeout=1
    )
    assert await loop.receive(timeout=0.3) is None
    assert state.confirmed == state.channel.connections  # type: ignore[union-attr]
    _close(state, sender)


def _close(state: ReceiverState, sender: SenderChannel) -> None:
    if state.channel is not None:
        state.channel.close()
    sender.close()
