"""Control channels: real ZeroMQ sockets on loopback, and the in-memory twin where it applies."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import pickle
import random
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import uvloop
import zmq

import aiowsync
from aiowsync._channel import (
    ChannelFactory,
    MemoryChannelFactory,
    ReceiverChannel,
    SenderChannel,
    ZmqChannelFactory,
    is_loopback_address,
)
from aiowsync._protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    SENDER_INDEX,
    Ack,
    Bye,
    Connection,
    Heartbeat,
    Hello,
    Message,
    Role,
    State,
    Update,
    Welcome,
    encode,
)
from aiowsync._protocol._codec import MAGIC
from helpers import eventually

pytestmark = pytest.mark.timeout(60)

HEARTBEAT_TIMEOUT = 3.0
WAIT = 5.0  # generous bound for anything that should happen promptly
FINGERPRINT = "5a" * 32
SESSION = "c3" * 16


def hello(worker_idx: int) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION, model_id="m", worker_idx=worker_idx, fingerprint=FINGERPRINT
    )


def welcome(worker_idx: int, version: int = 0) -> Welcome:
    return Welcome(
        proof="0f" * 16, model_id="m", worker_idx=worker_idx, session=SESSION, version=version
    )


@pytest.fixture(params=["zmq", "memory"])
def factory(request: pytest.FixtureRequest) -> ChannelFactory:
    return ZmqChannelFactory() if request.param == "zmq" else MemoryChannelFactory()


def any_address(factory: ChannelFactory) -> str:
    return "tcp://127.0.0.1:0" if isinstance(factory, ZmqChannelFactory) else "mem://0"


@asynccontextmanager
async def channels(
    factory: ChannelFactory, receivers: int = 1
) -> AsyncIterator[tuple[SenderChannel, list[ReceiverChannel]]]:
    """A bound sender and ``receivers`` connected receivers, all closed on the way out."""
    sender = factory.bind(any_address(factory), heartbeat_timeout=HEARTBEAT_TIMEOUT)
    ends: list[ReceiverChannel] = []
    try:
        for _ in range(receivers):
            ends.append(factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT))
        yield sender, ends
    finally:
        for end in ends:
            end.close()
        sender.close()


async def introduce(sender: SenderChannel, receivers: list[ReceiverChannel]) -> list[bytes]:
    """Each receiver says hello; returns the sender-side peer id of each, by index."""
    await asyncio.gather(*(r.send(hello(i), timeout=WAIT) for i, r in enumerate(receivers)))
    peers: dict[int, bytes] = {}
    for _ in receivers:
        peer, message = await sender.recv(timeout=WAIT)
        assert isinstance(message, Hello)
        assert message.worker_idx not in peers
        peers[message.worker_idx] = peer
    assert len(set(peers.values())) == len(receivers)
    return [peers[i] for i in range(len(receivers))]


# -- round trips ------------------------------------------------------------------------------


async def test_handshake_round_trip(factory: ChannelFactory) -> None:
    async with channels(factory) as (sender, [receiver]):
        mine, theirs = Connection(Role.RECEIVER, 4), Connection(Role.SENDER)

        mine.send(hello(4))
        await receiver.send(hello(4), timeout=WAIT)
        peer, got = await sender.recv(timeout=WAIT)
        assert got == hello(4)
        theirs.receive(got)

        theirs.send(welcome(4, version=0))
        await sender.send(peer, welcome(4, version=0), timeout=WAIT)
        reply = await receiver.recv(timeout=WAIT)
        assert reply == welcome(4, version=0)
        mine.receive(reply)

        mine.send(Ack(worker_idx=4, version=0))
        await receiver.send(Ack(worker_idx=4, version=0), timeout=WAIT)
        same_peer, ack = await sender.recv(timeout=WAIT)
        assert same_peer == peer
        theirs.receive(ack)
        assert (mine.state, theirs.state) == (State.LIVE, State.LIVE)

        await sender.send(peer, Update(version=1, params={"slot": 1}), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == Update(version=1, params={"slot": 1})
        assert sender.recv_nowait() is None
        assert sender.dropped == receiver.dropped == 0


async def test_sixteen_receivers_each_get_their_own_reply(factory: ChannelFactory) -> None:
    async with channels(factory, receivers=16) as (sender, receivers):
        peers = await introduce(sender, receivers)
        for i, peer in reversed(list(enumerate(peers))):
            await sender.send(peer, welcome(i, version=100 + i), timeout=WAIT)
        replies = await asyncio.gather(*(r.recv(timeout=WAIT) for r in receivers))
        assert replies == [welcome(i, version=100 + i) for i in range(16)]


async def test_message_to_a_subset_reaches_only_that_subset(factory: ChannelFactory) -> None:
    async with channels(factory, receivers=4) as (sender, receivers):
        peers = await introduce(sender, receivers)
        for i in (0, 2):
            await sender.send(peers[i], Update(version=1), timeout=WAIT)
        assert await receivers[0].recv(timeout=WAIT) == Update(version=1)
        assert await receivers[2].recv(timeout=WAIT) == Update(version=1)
        for i in (1, 3):
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await receivers[i].recv(timeout=0.3)
            assert isinstance(info.value, TimeoutError)
        for peer in peers:
            await sender.send(peer, Update(version=2), timeout=WAIT)
        got = await asyncio.gather(*(r.recv(timeout=WAIT) for r in receivers))
        assert got == [Update(version=2)] * 4  # nothing stale or duplicated was queued


async def test_send_to_an_unknown_peer_fails(factory: ChannelFactory) -> None:
    async with channels(factory) as (sender, [receiver]):
        await introduce(sender, [receiver])
        with pytest.raises(aiowsync.TransportError):
            await sender.send(b"nobody-by-that-name", Update(version=1), timeout=WAIT)


async def test_ipc_transport_round_trip(tmp_path: pathlib.Path) -> None:
    address = f"ipc://{tmp_path}/control.sock"
    assert is_loopback_address(address)
    factory = ZmqChannelFactory()
    sender = factory.bind(address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = None
    try:
        assert sender.address == address
        receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
        [peer] = await introduce(sender, [receiver])
        await sender.send(peer, welcome(0), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == welcome(0)
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()
    assert not os.path.exists(f"{tmp_path}/control.sock")  # ZeroMQ leaves it; the sender not


def test_a_socket_path_of_a_live_sender_or_a_file_is_refused_and_a_stale_one_taken(
    tmp_path: pathlib.Path,
) -> None:
    import socket

    factory = ZmqChannelFactory()
    path = f"{tmp_path}/trainer.sock"
    first = factory.bind(f"ipc://{path}", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        # ZeroMQ would remove the live sender's file and take its workers.
        with pytest.raises(aiowsync.TransportError, match="socket of a live process"):
            factory.bind(f"ipc://{path}", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    finally:
        first.close()
    assert not os.path.exists(path)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a sender that died: its file stays, nobody listens
    stale.close()
    second = factory.bind(f"ipc://{path}", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    second.close()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(aiowsync.TransportError, match="exists and is not a socket"):
        factory.bind(f"ipc://{notes}", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    assert notes.read_text() == "mine"


# -- deadlines and cancellation -------------------------------------------------------------

N_MESSAGES = 40


async def recv_with_style(style: str, recv: Callable[[float | None], Awaitable[Any]]) -> Any:
    """One receive that is very likely cut short; raises TimeoutError or CancelledError."""
    if style == "timeout":
        return await recv(0.001)
    if style == "fail_after":
        with anyio.fail_after(0.001):
            return await recv(None)
    task = asyncio.ensure_future(recv(None))
    await asyncio.sleep(0.001)
    task.cancel()
    return await task


@pytest.mark.parametrize("direction", ["to_receiver", "to_sender"])
@pytest.mark.parametrize("style", ["timeout", "fail_after", "task_cancel"])
async def test_cut_short_receives_lose_no_message(
    factory: ChannelFactory, style: str, direction: str
) -> None:
    async with channels(factory) as (sender, [receiver]):
        [peer] = await introduce(sender, [receiver])

        async def produce() -> None:
            for v in range(1, N_MESSAGES + 1):
                if direction == "to_receiver":
                    await sender.send(peer, Update(version=v), timeout=WAIT)
                else:
                    await receiver.send(Ack(worker_idx=0, version=v), timeout=WAIT)
                await asyncio.sleep(0.003 * (v % 3))

        async def recv_one(timeout: float | None) -> int:
            if direction == "to_receiver":
                message = await receiver.recv(timeout=timeout)
            else:
                _, message = await sender.recv(timeout=timeout)
            assert isinstance(message, Update | Ack)
            return message.version

        got: list[int] = []
        cut_short = 0
        producer = asyncio.ensure_future(produce())
        try:
            deadline = time.monotonic() + 20
            while len(got) < N_MESSAGES and time.monotonic() < deadline:
                try:
                    got.append(await recv_with_style(style, recv_one))
                except (TimeoutError, asyncio.CancelledError):
                    cut_short += 1
            await asyncio.wait_for(producer, WAIT)
        finally:
            producer.cancel()
        assert got == list(range(1, N_MESSAGES + 1))
        assert cut_short > 0, "no receive was ever cut short; the test proved nothing"
        # and the channel still works normally afterwards
        if direction == "to_receiver":
            await sender.send(peer, Update(version=999), timeout=WAIT)
            assert await receiver.recv(timeout=WAIT) == Update(version=999)
        else:
            await receiver.send(Ack(worker_idx=0, version=999), timeout=WAIT)
            assert (await sender.recv(timeout=WAIT))[1] == Ack(worker_idx=0, version=999)


async def test_timed_out_receive_then_next_message_arrives(factory: ChannelFactory) -> None:
    async with channels(factory) as (sender, [receiver]):
        [peer] = await introduce(sender, [receiver])
        started = time.monotonic()
        with pytest.raises(aiowsync.WeightSyncTimeout, match="no message"):
            await receiver.recv(timeout=0.2)
        assert 0.15 <= time.monotonic() - started < 10.0
        with pytest.raises(TimeoutError):
            await sender.recv(timeout=0.05)
        await sender.send(peer, Update(version=1), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == Update(version=1)


async def test_waiters_with_different_deadlines_each_time_out_on_their_own(
    factory: ChannelFactory,
) -> None:
    """One timer serves every waiter of a socket: a short wait that starts while a long one
    is pending still ends on time, and the long one still gets the next message."""
    async with channels(factory) as (sender, [receiver]):
        [peer] = await introduce(sender, [receiver])
        long_wait = asyncio.ensure_future(receiver.recv(timeout=4.0))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await receiver.recv(timeout=0.2)
        assert 0.15 <= time.monotonic() - started < 3.0
        assert not long_wait.done()
        await sender.send(peer, Update(version=1), timeout=WAIT)
        assert await asyncio.wait_for(long_wait, WAIT) == Update(version=1)
        # And a long wait started after a short one timed out still times out, later.
        started = time.monotonic()
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await receiver.recv(timeout=0.3)
        assert 0.25 <= time.monotonic() - started < 3.0


# -- closing --------------------------------------------------------------------------------


async def test_closing_with_messages_in_flight_does_not_hang(factory: ChannelFactory) -> None:
    sender = factory.bind(any_address(factory), heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        [peer] = await introduce(sender, [receiver])
        big = "x" * 60_000
        for v in range(1, 201):  # neither side reads any of these
            await sender.send(peer, Update(version=v, params={"blob": big}), timeout=WAIT)
            await receiver.send(Ack(worker_idx=0, version=v), timeout=WAIT)
        pending_r = asyncio.ensure_future(receiver.recv(timeout=None))
        pending_s = asyncio.ensure_future(sender.recv(timeout=None))
        await asyncio.sleep(0)
    finally:
        started = time.monotonic()
        receiver.close()
        sender.close()
        elapsed = time.monotonic() - started
    assert elapsed < 10.0  # generous: a hang, not a slow host, is what this catches
    # receives that were waiting are told the channel closed, instead of hanging or being
    # handed a cancellation they never asked for (or they had a message already)
    for pending in (pending_r, pending_s):
        try:
            result = await asyncio.wait_for(pending, WAIT)
        except aiowsync.TransportError:
            continue
        assert result is not None
    # closing twice is fine, and a closed channel refuses further use
    receiver.close()
    sender.close()
    with pytest.raises(aiowsync.TransportError):
        await sender.send(peer, Update(version=1000), timeout=1)
    with pytest.raises(aiowsync.TransportError):
        await receiver.send(Ack(worker_idx=0, version=1), timeout=1)
    with pytest.raises(aiowsync.TransportError):
        await receiver.recv(timeout=1)
    with pytest.raises(aiowsync.TransportError):
        await sender.recv(timeout=1)


async def test_pending_receive_is_woken_by_close(factory: ChannelFactory) -> None:
    sender = factory.bind(any_address(factory), heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        await introduce(sender, [receiver])
        pending_r = asyncio.ensure_future(receiver.recv(timeout=None))
        pending_s = asyncio.ensure_future(sender.recv(timeout=None))
        await asyncio.sleep(0.05)
        assert not pending_r.done() and not pending_s.done()
    finally:
        receiver.close()
        sender.close()
    for pending in (pending_r, pending_s):
        with pytest.raises(aiowsync.TransportError, match="closed"):
            await asyncio.wait_for(pending, WAIT)


# -- hostile input --------------------------------------------------------------------------


def garbage_frames() -> list[bytes]:
    rng = random.Random(1234)
    header = MAGIC + bytes([PROTOCOL_VERSION])
    evil = pickle.dumps({"type": "update", "version": 1})
    return [
        rng.randbytes(64),
        evil,
        header + evil,
        b"",
        header + rng.randbytes(32),
        MAGIC + bytes([PROTOCOL_VERSION + 1]) + encode(Bye())[3:],
        encode(Update(version=1)) + b"\x00" * MAX_FRAME,  # over the codec's size limit
    ]


async def collect_until(
    sender: SenderChannel, done: Callable[[list[tuple[bytes, Message]]], bool]
) -> list[tuple[bytes, Message]]:
    got: list[tuple[bytes, Message]] = []
    while not done(got):
        got.append(await sender.recv(timeout=WAIT))
    return got


async def test_garbage_from_a_raw_socket_is_dropped_and_counted() -> None:
    # Without CURVE, which keeps raw sockets out: garbage from a peer that holds the keys.
    factory = ZmqChannelFactory(allow_insecure_bind=True)
    sender = factory.bind("tcp://127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.IDENTITY, b"intruder")
        raw.connect(sender.address)
        await receiver.send(hello(0), timeout=WAIT)
        frames = garbage_frames()
        for frame in frames:
            raw.send(frame)
        raw.send_multipart([b"two", encode(Bye())])  # a valid body behind an extra frame
        raw.send_multipart([encode(Bye()), encode(Bye()), encode(Bye())])
        sentinel = Heartbeat(worker_idx=SENDER_INDEX, version=77)
        raw.send(encode(sentinel))  # after everything else from the intruder
        await receiver.send(Ack(worker_idx=0, version=0), timeout=WAIT)

        got = await collect_until(sender, lambda got: len(got) == 3)
        by_peer: dict[bytes, list[Message]] = {}
        for peer, message in got:
            by_peer.setdefault(peer, []).append(message)
        assert by_peer.pop(b"intruder") == [sentinel]
        [(legit_peer, legit)] = by_peer.items()
        assert legit == [hello(0), Ack(worker_idx=0, version=0)]
        # the intruder's frames were all processed before its sentinel arrived
        assert sender.dropped == len(frames) + 2
        # and the legitimate receiver is still served
        await sender.send(legit_peer, welcome(0), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == welcome(0)
        assert receiver.dropped == 0
    finally:
        raw.close(linger=0)
        ctx.term()
        receiver.close()
        sender.close()


async def test_garbage_injected_into_the_memory_twin_is_dropped_and_counted() -> None:
    factory = MemoryChannelFactory()
    async with channels(factory) as (sender, [receiver]):
        await receiver.send(hello(0), timeout=WAIT)
        frames = garbage_frames()
        for frame in frames:
            factory.inject(sender.address, frame)
        await receiver.send(Ack(worker_idx=0, version=0), timeout=WAIT)
        got = await collect_until(sender, lambda got: len(got) == 2)
        assert [m for _, m in got] == [hello(0), Ack(worker_idx=0, version=0)]
        assert sender.dropped == len(frames)
        assert sender.recv_nowait() is None


async def test_recv_nowait_skips_garbage(factory: ChannelFactory) -> None:
    async with channels(factory) as (sender, [receiver]):
        await receiver.send(hello(0), timeout=WAIT)
        await sender.recv(timeout=WAIT)
        if isinstance(factory, MemoryChannelFactory):
            factory.inject(sender.address, b"junk")
        await receiver.send(Ack(worker_idx=0, version=0), timeout=WAIT)
        got = None
        deadline = time.monotonic() + WAIT
        while got is None and time.monotonic() < deadline:
            got = sender.recv_nowait()
            await asyncio.sleep(0.01)
        assert got is not None and got[1] == Ack(worker_idx=0, version=0)
        assert sender.dropped == (1 if isinstance(factory, MemoryChannelFactory) else 0)


# -- liveness -------------------------------------------------------------------------------


async def test_heartbeats_flow_while_the_event_loop_is_blocked(factory: ChannelFactory) -> None:
    async with channels(factory) as (sender, [receiver]):
        await introduce(sender, [receiver])
        calls: list[tuple[int, float]] = []

        def beat() -> Heartbeat:
            calls.append((threading.get_ident(), time.monotonic()))
            return Heartbeat(worker_idx=0, session=SESSION, version=len(calls))

        receiver.start_heartbeat(beat, 0.05)
        started = time.monotonic()
        time.sleep(1.0)  # the user's own blocking work: no await, the loop is frozen
        stopped = time.monotonic()
        during = [c for c in calls if started <= c[1] <= stopped]
        assert len(during) >= 5, f"only {len(during)} beats while the loop was blocked"
        assert {ident for ident, _ in calls} == {calls[0][0]}
        assert calls[0][0] != threading.get_ident()

        beats: list[Heartbeat] = []
        while len(beats) < len(during):
            _, message = await sender.recv(timeout=WAIT)
            assert isinstance(message, Heartbeat)
            beats.append(message)
        assert all(b.worker_idx == 0 and b.session == SESSION for b in beats)
        versions = [b.version for b in beats]
        assert versions == sorted(versions)


async def test_peer_alive_turns_false_after_the_sender_closes(factory: ChannelFactory) -> None:
    sender = factory.bind(any_address(factory), heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        [peer] = await introduce(sender, [receiver])
        await sender.send(peer, welcome(0), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == welcome(0)
        assert await eventually(lambda: receiver.peer_alive)
        sender.close()
        assert await eventually(lambda: not receiver.peer_alive)
    finally:
        receiver.close()
        sender.close()
    assert not receiver.peer_alive


async def test_a_renewed_connection_is_counted_even_when_nobody_looked_in_between() -> None:
    # A drop and a reconnection that both happen between two looks leave peer_alive True at
    # both looks; only the count tells the receiver that it must announce itself again.
    factory = ZmqChannelFactory()
    sender = factory.bind("tcp://127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    second: SenderChannel | None = None
    try:
        await introduce(sender, [receiver])
        assert await eventually(lambda: receiver.peer_alive)
        assert receiver.connections == 1
        address = sender.address
        sender.close()
        second = factory.bind(address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
        await receiver.send(hello(0), timeout=WAIT)
        _, message = await second.recv(timeout=WAIT)
        assert message == hello(0)
        assert receiver.peer_alive
        assert receiver.connections == 2
    finally:
        receiver.close()
        sender.close()
        if second is not None:
            second.close()


# -- binding --------------------------------------------------------------------------------


async def test_a_non_loopback_bind_is_authenticated_by_default() -> None:
    # Before: refused without keys. Now every tcp bind gets keys of the factory's own.
    factory = ZmqChannelFactory()
    sender = factory.bind("tcp://0.0.0.0:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = None
    try:
        assert factory.curve is not None and factory.curve.server_secret is not None
        port = sender.address.rsplit(":", 1)[1]
        receiver = factory.connect(f"tcp://127.0.0.1:{port}", heartbeat_timeout=HEARTBEAT_TIMEOUT)
        [peer] = await introduce(sender, [receiver])
        await sender.send(peer, welcome(0), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == welcome(0)
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()


async def test_non_loopback_bind_is_allowed_when_asked_for() -> None:
    factory = ZmqChannelFactory(allow_insecure_bind=True)
    sender = factory.bind("tcp://0.0.0.0:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = None
    try:
        match = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", sender.address)
        assert match and int(match.group(1)) > 0
        receiver = factory.connect(
            f"tcp://127.0.0.1:{match.group(1)}", heartbeat_timeout=HEARTBEAT_TIMEOUT
        )
        [peer] = await introduce(sender, [receiver])
        await sender.send(peer, welcome(0), timeout=WAIT)
        assert await receiver.recv(timeout=WAIT) == welcome(0)
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()


async def test_loopback_bind_reports_the_chosen_port() -> None:
    sender = ZmqChannelFactory().bind("tcp://127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", sender.address)
        assert match and int(match.group(1)) > 0
    finally:
        sender.close()


async def test_failed_bind_raises_transport_error_and_leaks_nothing() -> None:
    factory = ZmqChannelFactory()
    sender = factory.bind("tcp://127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                factory.bind(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
            except aiowsync.TransportError as exc:
                assert "cannot bind" in str(exc)
            else:
                pytest.fail("binding a busy port succeeded")
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        sender.close()


def test_connecting_to_an_invalid_endpoint_raises_transport_error() -> None:
    with pytest.raises(aiowsync.TransportError, match="cannot connect"):
        ZmqChannelFactory(curve=aiowsync.CurveKeys.generate()).connect(
            "tcp://no-port-given", heartbeat_timeout=HEARTBEAT_TIMEOUT
        )


async def test_memory_connect_to_nothing_raises_not_connected() -> None:
    with pytest.raises(aiowsync.NotConnectedError):
        MemoryChannelFactory().connect("mem://404", heartbeat_timeout=HEARTBEAT_TIMEOUT)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:0", True),
        ("tcp://127.45.6.7:80", True),
        ("tcp://localhost:9000", True),
        ("tcp://[::1]:9000", True),
        ("ipc:///tmp/aiowsync.sock", True),
        ("inproc://control", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("tcp://192.168.1.20:5555", False),
        ("tcp://128.0.0.1:5555", False),
        ("tcp://example.com:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://localhost.evil.com:5555", False),
        ("not an address", False),
        ("", False),
    ],
)
def test_is_loopback_address(address: str, loopback: bool) -> None:
    assert is_loopback_address(address) is loopback


# -- other event loops ------------------------------------------------------------------------


async def uvloop_round_trip(factory: ChannelFactory) -> list[Message]:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    async with channels(factory, receivers=3) as (sender, receivers):
        peers = await introduce(sender, receivers)
        for i, peer in enumerate(peers):
            await sender.send(peer, welcome(i), timeout=WAIT)
        got = list(await asyncio.gather(*(r.recv(timeout=WAIT) for r in receivers)))
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await receivers[0].recv(timeout=0.05)
        await sender.send(peers[0], Update(version=1), timeout=WAIT)
        got.append(await receivers[0].recv(timeout=WAIT))
        return got


def test_round_trip_under_uvloop(factory: ChannelFactory) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        got = runner.run(asyncio.wait_for(uvloop_round_trip(factory), 20))
    assert got == [welcome(0), welcome(1), welcome(2), Update(version=1)]


# -- messages handed over inline ----------------------------------------------------------------


def beat(n: int) -> Heartbeat:
    return Heartbeat(worker_idx=SENDER_INDEX, session=SESSION, version=n)


async def test_messages_handed_over_while_a_receive_waits_keep_their_order() -> None:
    """The handler takes messages as they arrive; one it leaves comes out of the waiting
    recv(), and nothing later is handed over before that."""
    async with channels(ZmqChannelFactory()) as (sender, (end,)):
        (peer,) = await introduce(sender, [end])
        handed: list[int] = []

        def handler(message: Message) -> bool:
            assert isinstance(message, Heartbeat)
            handed.append(message.version)
            return message.version != 3

        end.take_inline(handler)
        receiving = asyncio.create_task(end.recv(timeout=WAIT))
        await asyncio.sleep(0.05)
        for n in (1, 2, 3):
            await sender.send(peer, beat(n), timeout=WAIT)
        got = await receiving
        assert isinstance(got, Heartbeat) and got.version == 3
        assert handed == [1, 2, 3]
        # Arriving while the next receive waits: handed over, none returned.
        receiving = asyncio.create_task(end.recv(timeout=0.5))
        await asyncio.sleep(0.05)
        for n in (4, 5):
            await sender.send(peer, beat(n), timeout=WAIT)
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await receiving
        assert handed == [1, 2, 3, 4, 5]
        # Stopped, and while no receive waits: everything comes through recv().
        end.take_inline(None)
        await sender.send(peer, beat(6), timeout=WAIT)
        receiving = asyncio.create_task(end.recv(timeout=WAIT))
        await asyncio.sleep(0.05)
        await sender.send(peer, beat(7), timeout=WAIT)
        assert [(await receiving).version, (await end.recv(timeout=WAIT)).version] == [6, 7]  # type: ignore[attr-defined]
        assert handed == [1, 2, 3, 4, 5]


async def test_a_message_whose_handler_fails_comes_out_of_recv(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with channels(ZmqChannelFactory()) as (sender, (end,)):
        (peer,) = await introduce(sender, [end])

        def handler(message: Message) -> bool:
            raise RuntimeError("handler bug")

        end.take_inline(handler)
        receiving = asyncio.create_task(end.recv(timeout=WAIT))
        await asyncio.sleep(0.05)
        await sender.send(peer, beat(1), timeout=WAIT)
        got = await receiving
        assert isinstance(got, Heartbeat) and got.version == 1
        assert "inline handler failed" in caplog.text


def test_a_memory_factory_pickles_within_its_process_only() -> None:
    factory = MemoryChannelFactory()
    assert pickle.loads(pickle.dumps(factory)) is factory
    scheme = aiowsync.WeightSyncScheme("mem://1", plane=aiowsync.MemoryPlane(), channels=factory)
    blob = pickle.dumps(scheme)
    run = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=blob,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert b"TransportError" in run.stderr and b"works within one process" in run.stderr


def test_a_memory_factory_named_by_another_process_is_refused() -> None:
    from aiowsync._channel._memory import _factory

    factory = MemoryChannelFactory()
    token = factory._token
    assert _factory(token) is factory
    forked = f"{os.getpid() + 1}-{token.split('-', 1)[1]}"  # as a forked child would see it
    with pytest.raises(aiowsync.TransportError, match="works within one process"):
        _factory(forked)


def test_closing_a_receiver_whose_beat_thread_is_stuck_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: when the beat thread did not stop within its join timeout, ctx.term() waited for
    # that thread's socket for ever, and close() never returned.
    import threading
    import time

    from aiowsync._channel import _monitor

    monkeypatch.setattr(_monitor, "_JOIN_WAIT", 0.2)
    factory = ZmqChannelFactory()
    sender = factory.bind("tcp://127.0.0.1:0", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    receiver = factory.connect(sender.address, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    release = threading.Event()
    in_beat = threading.Event()

    def stuck_beat() -> Heartbeat:
        in_beat.set()
        release.wait(30)  # a beat that hangs (say, a callback blocked on a lock)
        return Heartbeat(worker_idx=0)

    try:
        receiver.start_heartbeat(stuck_beat, 0.05)
        assert in_beat.wait(10)
        started = time.monotonic()
        receiver.close()
        assert time.monotonic() - started < 5  # before: for ever (until the beat returned)
    finally:
        release.set()
        sender.close()
