"""Peers that reach the control socket and misbehave on purpose: the sender and its workers
must stay up, responsive and unaffected. Real ZeroMQ sockets throughout."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from torch import nn

import aiowsync
from aiowsync import ProtocolError
from aiowsync._planes.shm.plane import SharedMemReceiverPlane, SwitchMode
from aiowsync._planes.shm.slots import SHM_DIR, SlotFile, open_slot, pid_alive, remove_stale_slots
from aiowsync._protocol import PROTOCOL_VERSION, Hello, Refuse, TensorDesc, decode, encode
from aiowsync._weights.layout import Layout
from aiowsync._weights.specs import dtype_from_name
from aiowsync.vllm._describe import placeholders
from helpers import rss

pytestmark = pytest.mark.timeout(120)

_COLLIDE = """
import sys, time
import zmq
import aiowsync

# Our sender first, as in a trainer; then an intruder that names itself with the id the
# ROUTER would make up for the next peer that brings none (libzmq starts that counter at
# rand(), which nobody seeds: 0x6b8b4567 in every process), then such a peer. Without
# CURVE, which would keep these raw sockets out: any peer that holds the keys could do this.
insecure = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
channel = insecure.bind("tcp://127.0.0.1:0", heartbeat_timeout=5.0)
ctx = zmq.Context()
socks = []
for k in range(8):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"\\x00" + (0x6B8B4567 + k).to_bytes(4, "big"))
    s.connect(channel.address)
    s.send(b"x")
    socks.append(s)
time.sleep(0.5)
plain = ctx.socket(zmq.DEALER)
plain.connect(channel.address)
plain.send(b"x")
socks.append(plain)
time.sleep(1.0)
for s in socks:
    s.close(linger=0)
ctx.term()
channel.close()
print("survived")
"""


def test_a_peer_naming_itself_like_a_made_up_id_cannot_abort_the_sender() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _COLLIDE], capture_output=True, text=True, timeout=60
    )
    # Before: "Assertion failed: ok (src/socket_base.cpp...)", SIGABRT (returncode -6).
    assert run.returncode == 0 and "survived" in run.stdout, (run.returncode, run.stderr)


def _intruder(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))  # looks like a receiver
    sock.connect(address)
    return sock


async def test_a_flood_of_junk_never_keeps_the_event_loop(caplog: pytest.LogCaptureFixture) -> None:
    # Without CURVE, which would keep the raw socket out: a peer holding the keys could flood.
    insecure = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
    channel = insecure.bind("tcp://127.0.0.1:0", heartbeat_timeout=5.0)
    ctx = zmq.Context()
    raw = _intruder(ctx, channel.address)
    frames = 5000
    try:
        for _ in range(frames):
            raw.send(b"junk")
        # Everything is queued on the sender's side before it starts reading.
        deadline = asyncio.get_running_loop().time() + 30
        while channel.dropped == 0 and not channel._ready(zmq.POLLIN):  # type: ignore[attr-defined]
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        seen: list[int] = []
        stop = False

        async def watch() -> None:
            while not stop:
                seen.append(channel.dropped)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        with caplog.at_level(logging.WARNING, logger="aiowsync.channel"):
            while channel.dropped < frames:
                with pytest.raises(aiowsync.WeightSyncTimeout):
                    await channel.recv(timeout=0.05)
        stop = True
        await watcher
        # The loop got a turn at least every 64 dropped frames (before: none until all 5000
        # were read), and the log got a handful of lines, not one per frame.
        steps = [b - a for a, b in itertools.pairwise(seen)]
        assert steps and max(steps) <= 64, max(steps)
        drops = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert 1 <= len(drops) <= 4, len(drops)
    finally:
        raw.close(linger=0)
        ctx.term()
        channel.close()


def _hello(layout: list[TensorDesc], fingerprint: str = "0" * 64) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION,
        model_id="policy",
        worker_idx=0,
        pid=os.getpid(),
        fingerprint=fingerprint,
        layout=layout,
    )


async def _refusal_for(hello: Hello | bytes, protocol: int = PROTOCOL_VERSION) -> str:
    """Send ``hello`` (or a raw frame) from a raw socket to a running sender; the refusal text
    it gets back, which must come in ``protocol``."""
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    ctx = zmq.Context()
    async with sender:
        raw = _intruder(ctx, sender.address)
        try:
            raw.send(hello if isinstance(hello, bytes) else encode(hello))
            deadline = asyncio.get_running_loop().time() + 20
            while not raw.poll(0):
                assert asyncio.get_running_loop().time() < deadline, "no answer to the hello"
                await asyncio.sleep(0.02)
            frame = raw.recv()
            assert frame[2] == protocol
            answer = decode(frame)
        finally:
            raw.close(linger=0)
            ctx.term()
        assert isinstance(answer, Refuse), answer
        # And the sender still serves: a legitimate worker connects afterwards.
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        r.init_on_receiver(model=nn.Linear(4, 4), worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=20), r.connect(timeout=20))
    return answer.reason


async def test_a_peer_of_another_protocol_version_is_refused_in_its_own_version() -> None:
    # Before: the codec dropped the hello as garbage and the peer waited out its timeout.
    later = PROTOCOL_VERSION + 1
    body = msgspec.msgpack.encode(
        {"type": "hello", "protocol": later, "worker_idx": 0, "a_field_of_later": True}
    )
    reason = await _refusal_for(b"AW" + bytes([later]) + body, protocol=later)
    assert reason == f"protocol {later} is not supported (sender speaks {PROTOCOL_VERSION})"


async def test_a_hello_naming_an_impossible_protocol_is_refused_in_this_version() -> None:
    # 300 fits the hello's field but no frame header: the refusal goes back in this version
    # (before: encoding it raised ValueError in the serve loop, which ended the sender).
    hello = Hello(protocol=300, model_id="policy", worker_idx=0, fingerprint="0" * 64)
    reason = await _refusal_for(hello)
    assert reason == f"protocol 300 is not supported (sender speaks {PROTOCOL_VERSION})"


async def test_a_receiver_refused_by_a_sender_of_another_version_says_so() -> None:
    # A sender of a later release answers this receiver's hello in this receiver's version;
    # even a refusal in its own version is understood.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    r = aiowsync.SharedMemWeightSyncScheme(
        address=f"tcp://127.0.0.1:{port}",
        channels=aiowsync.ZmqChannelFactory(allow_insecure_bind=True),  # a raw ROUTER: no keys
    )
    r.init_on_receiver(model=nn.Linear(4, 4), worker_idx=0)
    refusal = Refuse(reason="protocol 2 is not supported (sender speaks 3)")

    async def answer() -> None:
        deadline = asyncio.get_running_loop().time() + 20
        while not router.poll(0):
            assert asyncio.get_running_loop().time() < deadline, "no hello came"
            await asyncio.sleep(0.02)
        peer, frame = router.recv_multipart()
        assert isinstance(decode(frame), Hello)
        router.send_multipart([peer, encode(refusal, protocol=PROTOCOL_VERSION + 1)])

    try:
        async with r:
            with pytest.raises(aiowsync.RefusedError) as info:
                await asyncio.gather(r.connect(timeout=20), answer())
            assert info.value.reason == refusal.reason
    finally:
        router.close(linger=0)
        ctx.term()


async def test_a_hello_naming_a_huge_model_is_refused_by_its_count() -> None:
    descs = [TensorDesc(f"t{i}", "float32", [1]) for i in range(2000)]
    reason = await _refusal_for(_hello(descs))
    assert "2000 tensors" in reason


async def test_a_hello_larger_than_any_receiver_of_the_model_sends_is_never_read() -> None:
    # Before: a hello of a million layout rows took about a second to decode on the
    # trainer's loop (20 of them stalled it 20.6 s), and each connection could queue 1000
    # frames of 8 MiB. Now the socket cuts off a peer whose message is larger than this
    # model's receivers ever send, before it is read.
    from aiowsync._sending.handshake import hello_limit

    descs = [TensorDesc(f"t{i}", "float32", [1]) for i in range(200_000)]
    frame = encode(_hello(descs))
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    assert len(frame) > hello_limit(sender._sending.layout) + 1024  # type: ignore[union-attr]
    ctx = zmq.Context()
    async with sender:
        raw = _intruder(ctx, sender.address)
        try:
            for _ in range(20):
                raw.send(frame)
            await asyncio.sleep(1.0)
            assert not raw.poll(0)  # no answer: nothing was read
            assert sender.dropped_messages == 0
        finally:
            raw.close(linger=0)
            ctx.term()
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        r.init_on_receiver(model=nn.Linear(4, 4), worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=20), r.connect(timeout=20))


async def test_dtype_names_from_the_wire_never_reach_torch_attributes() -> None:
    # getattr(torch, "has_cuda") warns (an error in this suite), "_dynamo" imports a subsystem.
    for name in ("has_cuda", "_dynamo", "nn", "float64x"):
        with pytest.raises(aiowsync.LayoutMismatchError, match="unknown dtype"):
            dtype_from_name(name)
    assert dtype_from_name("bfloat16") is torch.bfloat16
    reason = await _refusal_for(_hello([TensorDesc("weight", "has_cuda", [4, 4])]))
    assert "unknown dtype" in reason
    # The JSON description a vLLM worker is handed reads dtypes from the same table.
    description = {"wire_dtype": None, "tensors": [["weight", "has_cuda", [4, 4]]]}
    with pytest.raises(ValueError, match="unknown dtype 'has_cuda' in the scheme's description"):
        placeholders(description)
    description["tensors"] = [["weight", "float32", [4, 4]], ["step", "int64", []]]
    description["wire_dtype"] = "bfloat16"
    made = placeholders(description)
    assert (made["weight"].dtype, made["step"].dtype) == (torch.bfloat16, torch.int64)


def test_a_welcome_cannot_make_a_worker_beat_without_pause() -> None:
    from aiowsync._protocol import Welcome

    with pytest.raises(ValueError, match=r"interval must be 0\.01 s to an hour"):
        aiowsync.Heartbeats(interval=0.001)
    with pytest.raises(ValueError, match=r"interval must be 0\.01 s to an hour"):
        aiowsync.Heartbeats(interval=3601)  # what no welcome could carry

    def welcome(interval: float) -> Welcome:
        return Welcome(
            proof="0f" * 16,
            model_id="policy",
            worker_idx=0,
            session="a" * 32,
            version=0,
            heartbeat_interval=interval,
        )

    assert isinstance(decode(encode(welcome(0.01))), Welcome)
    # A sender (or an impostor) announcing a near-zero interval is not believed.
    with pytest.raises(ProtocolError):
        decode(encode(welcome(5e-324)))


@pytest.mark.parametrize("switch", ["remap", "rebind"])
def test_a_slot_path_from_the_wire_is_checked_before_it_is_opened(
    tmp_path: Path, switch: SwitchMode
) -> None:
    layout = Layout.from_weights({f"w{i}": torch.zeros(4) for i in range(80)})
    plane = SharedMemReceiverPlane(switch=switch)
    with pytest.raises(aiowsync.ProtocolError, match="no sender pid"):
        plane.setup(layout, {}, swap=True)
    sender_pid = os.getpid() + 1
    plane.setup(layout, {"owner": sender_pid}, swap=True)
    elsewhere = tmp_path / "not-a-slot.bin"
    elsewhere.write_bytes(b"\x00" * layout.total_bytes)
    # A slot file of this user, but of another sender: mapped by no receiver of this one.
    other = SlotFile.create(0, layout.total_bytes)
    try:
        for path in (
            str(elsewhere),
            "/etc/passwd",
            str(SHM_DIR / "aiowsync-1-ab-0/../x"),
            f"/dev/shm/aiowsync-{sender_pid}-ab-0\n",  # the name pattern is matched whole
        ):
            with pytest.raises(aiowsync.TransportError, match="not an aiowsync"):
                plane.fetch_nowait({"path": path, "nbytes": layout.total_bytes})
        with pytest.raises(aiowsync.TransportError, match="not a slot of this worker's sender"):
            plane.fetch_nowait({"path": other.path, "nbytes": layout.total_bytes})
    finally:
        other.unlink()
        plane.close()


def test_a_slot_name_that_is_a_link_or_someone_elses_file_is_refused() -> None:
    name = SHM_DIR / f"aiowsync-{os.getpid()}-feedbeef-0"
    with tempfile.NamedTemporaryFile() as target:
        target.write(b"\x00" * 64)
        target.flush()
        os.symlink(target.name, name)
        try:
            with pytest.raises(aiowsync.TransportError, match="cannot open"):
                open_slot(str(name), 64)
        finally:
            os.unlink(name)
    if os.geteuid() != 0:
        return
    fd = os.open(name, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o666)
    try:
        os.ftruncate(fd, 64)
        os.fchown(fd, 12345, 12345)
        with pytest.raises(aiowsync.TransportError, match="not a slot file of this user"):
            open_slot(str(name), 64)
    finally:
        os.close(fd)
        os.unlink(name)


@pytest.mark.parametrize("writable", [False, True], ids=["read only", "read-write"])
def test_a_fifo_under_a_slot_name_is_refused_without_a_wait(writable: bool) -> None:
    # Before: a worker's read-only open of a FIFO (put there by a process that took its
    # sender's address) waited until someone wrote to it, its event loop stopped for good.
    name = SHM_DIR / f"aiowsync-{os.getpid()}-{secrets.token_hex(8)}-0"
    os.mkfifo(name, 0o600)
    outcome: list[BaseException | int] = []

    def attempt() -> None:
        try:
            outcome.append(open_slot(str(name), 64, writable=writable))
        except BaseException as exc:
            outcome.append(exc)

    opener = threading.Thread(target=attempt, daemon=True)
    opener.start()
    opener.join(30)
    try:
        assert outcome, "the open of a FIFO waited for a writer"
        assert isinstance(outcome[0], aiowsync.TransportError)
        assert "not a slot file of this user" in str(outcome[0])
    finally:
        if opener.is_alive():  # free the waiting open
            os.close(os.open(name, os.O_WRONLY | os.O_NONBLOCK))
        os.unlink(name)


def test_a_hello_cannot_claim_a_pid_no_process_can_have() -> None:
    # One past the largest pid made os.kill overflow in the sender, for every send after it.
    frame = encode(
        Hello(protocol=PROTOCOL_VERSION, model_id="m", worker_idx=0, fingerprint="0" * 64)
    )
    hostile = frame.replace(b"\xa3pid\x00", b"\xa3pid\xce\x80\x00\x00\x00")
    assert hostile != frame
    with pytest.raises(ProtocolError):
        decode(hostile)
    assert decode(frame).pid == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("pid", [0, -1, 2**31, 99999999999999999999])
def test_pids_no_process_can_have_name_no_process(pid: int) -> None:
    assert pid_alive(pid) is False


def test_a_slot_file_naming_an_impossible_pid_does_not_stop_senders(tmp_path: Path) -> None:
    # Any local user could create such a name in /dev/shm; the sweep of stale slots at every
    # sender's start then raised OverflowError. Ours is removed (its "process" is gone);
    # another user's file is never touched, whatever its name says.
    mine = tmp_path / "aiowsync-99999999999999999999-0-0"
    mine.write_bytes(b"")
    live = tmp_path / f"aiowsync-{os.getpid()}-0-0"
    live.write_bytes(b"")
    assert remove_stale_slots(tmp_path) == [mine.name]
    assert live.exists() and not mine.exists()


def test_no_slot_name_can_be_foretold_from_the_others() -> None:
    # Slot files once shared one run token and differed by index, so the names of the slots
    # a sender would make next were known from its first two: another user created them
    # first, and every send that needed a new slot failed with "File exists".
    files = [SlotFile.create(i, 64) for i in range(4)]
    try:
        tokens = [os.path.basename(f.path).split("-")[2] for f in files]
        assert len(set(tokens)) == len(tokens) and all(len(t) == 16 for t in tokens)
    finally:
        for f in files:
            f.unlink()


def test_the_socket_directory_sweep_removes_only_this_users_dead_senders(tmp_path: Path) -> None:
    from aiowsync._channel._socket_dir import remove_stale_socket_dirs

    dead = tmp_path / "aiowsync-99999999999999999999-0123456789abcdef"  # no such pid
    live = tmp_path / f"aiowsync-{os.getpid()}-0123456789abcdef"
    odd = tmp_path / "aiowsync-1-not-hex\n"
    for d in (dead, live, odd):
        d.mkdir(mode=0o700)
    (dead / "control").touch()
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and odd.exists()
    if os.geteuid() == 0:  # another user's directory is not ours to judge
        theirs = tmp_path / "aiowsync-99999999999999999998-0123456789abcdef"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        assert remove_stale_socket_dirs(str(tmp_path)) == []
        assert theirs.exists()


async def test_a_refusal_hands_no_peer_the_keys_it_did_not_name() -> None:
    # Before: an empty hello was refused with every key, dtype and shape of the model, which
    # is what a forged hello needs.
    reason = await _refusal_for(_hello([]))
    assert "weight" not in reason and "bias" not in reason and "float32" not in reason
    assert "2 key(s) of the sender's model are missing from the receiver's" in reason
    # A receiver that names a key with the wrong shape is told that key's expected shape.
    reason = await _refusal_for(_hello([TensorDesc("weight", "float32", [4, 5])]))
    assert "weight: expected float32[4, 4], got float32[4, 5]" in reason
    assert "1 key(s) of the sender's model are missing" in reason and "bias" not in reason


async def test_a_flood_of_messages_never_keeps_the_trainers_loop() -> None:
    # Before: the serve loop yielded to the event loop only on undecodable frames; a flood of
    # valid frames kept the trainer's loop for as long as it lasted (3.1 s measured).
    from aiowsync._protocol import Heartbeat

    src = nn.Linear(4, 4)
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=src, num_workers=1)
    beat = encode(Heartbeat(worker_idx=0, session="0" * 32, version=0))
    ctx = zmq.Context()
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        mirror = nn.Linear(4, 4)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=20), r.connect(timeout=20))
            intruders = [_intruder(ctx, sender.address) for _ in range(4)]
            rss_before = rss()
            gaps: list[float] = []
            stop = asyncio.Event()

            async def ticker() -> None:
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.001)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            try:
                task = asyncio.create_task(ticker())
                for _ in range(50):  # 4 x 50 x 64 = 12800 well-formed beats of no session
                    for raw in intruders:
                        for _ in range(64):
                            try:
                                raw.send(beat, zmq.NOBLOCK)
                            except zmq.Again:  # the sender's queue for it is full: M2
                                break
                    with torch.no_grad():
                        src.weight.add_(1)
                    result = await sender.send(timeout=30)  # the worker still gets each one
                    assert result.worker_ids == (0,)
                    assert torch.equal(mirror.weight, src.weight)
                stop.set()
                await task
            finally:
                for raw in intruders:
                    raw.close(linger=0)
                ctx.term()
            assert sender.dropped_messages > 0
            # Generous: the loop got a turn every few messages, not once per flood.
            assert max(gaps) < 1.0, max(gaps)
            grown = rss() - rss_before
            assert grown < 100 << 20, grown  # before: 100 junk frames added 728 MiB
            print(f"flood: loop max gap {max(gaps) * 1000:.1f} ms, memory grew {grown >> 20} MiB")
