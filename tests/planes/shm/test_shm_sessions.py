"""The shared-memory scheme with receivers in this process (4 of 5): the sender's address across
sessions, and receivers that outlive their sender or wait minutes for it.

Real ZeroMQ sockets and real /dev/shm slots, receivers on the test's event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import re
import subprocess
import sys

import pytest

import aiowsync
from helpers import SHM_BEATS, bump, keys_of, model, same

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
async def test_the_address_is_known_after_init_on_sender_and_kept_across_sessions(
    bind: str | None,
) -> None:
    # DESIGN section 6: scheme.address is read between init_on_sender() and `async with`.
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(
        heartbeats=SHM_BEATS, **({} if bind is None else {"bind": bind})
    )
    sender.init_on_sender(model=src, num_workers=2)
    address = sender.address
    if bind is None:  # a Unix socket in a private directory of its own name
        assert re.fullmatch(rf"ipc:///.+/aiowsync-{os.getpid()}-[0-9a-f]{{16}}/control", address)
    else:
        assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    by_pickle = pickle.loads(pickle.dumps(sender))  # carries the same address
    # Built from the address: on tcp it is also given the sender's keys.
    keys = {} if bind is None else {"channels": keys_of(sender)}
    by_address = aiowsync.SharedMemWeightSyncScheme(address=address, **keys)
    for _session in range(2):
        mirrors = [model(1), model(2)]
        by_pickle.init_on_receiver(model=mirrors[0], worker_idx=0)
        by_address.init_on_receiver(model=mirrors[1], worker_idx=1)
        async with sender, by_pickle, by_address:
            assert sender.address == address
            await asyncio.gather(
                sender.connect(timeout=10),
                by_pickle.connect(timeout=10),
                by_address.connect(timeout=10),
            )
            bump(src)
            result = await sender.send(timeout=5)
            assert result.worker_ids == (0, 1) and all(same(m, src) for m in mirrors)
        # A later session serves on the same address; receivers are made afresh.
        by_pickle = pickle.loads(pickle.dumps(sender))
        by_address = aiowsync.SharedMemWeightSyncScheme(address=address, **keys)


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
def test_an_address_read_but_never_served_is_released(bind: str | None) -> None:

    sender = aiowsync.SharedMemWeightSyncScheme(**({} if bind is None else {"bind": bind}))
    sender.init_on_sender(model=model(0), num_workers=1)
    address = sender.address
    del sender
    gc.collect()
    # The port is free again: a new sender binds exactly it (no ResourceWarning either,
    # warnings being errors in this suite).
    again = aiowsync.SharedMemWeightSyncScheme(bind=address)
    again.init_on_sender(model=model(0), num_workers=1)
    assert again.address == address
    del again
    gc.collect()


def _slots_mapped() -> list[str]:
    """This process's mappings of the slot files of senders in it (its pid in their name)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"/dev/shm/aiowsync-{os.getpid()}-" in line]


async def test_a_second_session_serves_on_the_first_sessions_address() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        first = sender.address  # bound by `async with`, not read before
        assert _slots_mapped()
    # The slots' memory went with the session (an unlinked file's pages stay allocated in
    # /dev/shm while mapped), not with the scheme object, which the caller keeps.
    assert _slots_mapped() == []
    async with sender:
        assert sender.address == first
        assert _slots_mapped()
    assert _slots_mapped() == []


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
async def test_a_later_session_whose_address_is_taken_binds_a_fresh_one(
    caplog: pytest.LogCaptureFixture, bind: str | None
) -> None:
    import socket
    from urllib.parse import urlsplit

    sender = aiowsync.SharedMemWeightSyncScheme(
        heartbeats=SHM_BEATS, **({} if bind is None else {"bind": bind})
    )
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        first = sender.address
    # Something else holds the address now (as a child forked during the session would).
    if bind is None:
        path = first.removeprefix("ipc://")
        os.mkdir(os.path.dirname(path), 0o700)
        squatter = socket.socket(socket.AF_UNIX)
        squatter.bind(path)
    else:
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", urlsplit(first).port))
    with squatter:
        squatter.listen()
        with caplog.at_level(logging.WARNING, logger="aiowsync"):
            async with sender:
                second = sender.address
                keys = {} if bind is None else {"channels": keys_of(sender)}
                r = aiowsync.SharedMemWeightSyncScheme(address=second, **keys)
                mirror = model(1)
                r.init_on_receiver(model=mirror, worker_idx=0)
                async with r:
                    await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
                    assert same(mirror, sender.model)
    assert second != first
    assert any("cannot serve on" in rec.getMessage() for rec in caplog.records)
    if bind is None:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


async def test_a_sender_serves_on_bind_whatever_address_it_was_built_with() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(
        address="tcp://127.0.0.1:1", bind="tcp://127.0.0.1:0", heartbeats=SHM_BEATS
    )
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        assert sender.address != "tcp://127.0.0.1:1"
        assert sender.address.startswith("tcp://127.0.0.1:")


_LONG_RETRIES = r"""
import asyncio, secrets, sys, time, torch, zmq
from torch import nn
import aiowsync
from aiowsync._channel import _zmq

# One reconnection attempt a millisecond instead of ten a second: seconds here stand for the
# minutes after which a receiver's connection monitor used to be full.
plain = _zmq._base_options
def fast_retries(sock, heartbeat_timeout):
    plain(sock, heartbeat_timeout)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
_zmq._base_options = fast_retries

def linear(value):
    m = nn.Linear(4, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m

async def outlive(seconds):
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=linear(1.0), num_workers=1)
    started = asyncio.Event()

    async def serve():
        async with sender:
            started.set()
            await sender.connect(timeout=10)

    serving = asyncio.create_task(serve())
    await started.wait()
    r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
    r.init_on_receiver(model=linear(0.0), worker_idx=0)
    async with r:
        await r.connect(timeout=10)
        await serving  # the sender says goodbye and closes
        # The receiver serves on with the weights it has.
        await asyncio.sleep(seconds)
        assert not r.connected
        t0 = time.monotonic()
    print(f"closed in {time.monotonic() - t0:.2f} s")

async def early(seconds):
    # The worker starts first and keeps trying to reach a trainer that is not there yet.
    address = f"ipc://@aiowsync-test-{secrets.token_hex(8)}"
    mirror = linear(0.0)
    r = aiowsync.SharedMemWeightSyncScheme(address=address)
    r.init_on_receiver(model=mirror, worker_idx=0)
    async with r:
        joining = asyncio.create_task(r.connect(timeout=seconds + 20))
        await asyncio.sleep(seconds)
        sender = aiowsync.SharedMemWeightSyncScheme(bind=address)
        sender.init_on_sender(model=linear(2.0), num_workers=1)
        async with sender:
            await asyncio.gather(sender.connect(timeout=20), joining)
            assert torch.equal(mirror.weight, torch.full((4, 4), 2.0))
            print("joined")

asyncio.run({"outlive": outlive, "early": early}[sys.argv[1]](float(sys.argv[2])))
"""


def _long_retries(case: str) -> str:
    """Run ``case`` of :data:`_LONG_RETRIES` in a process of its own (so that a hang is a
    failed test); its output."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LONG_RETRIES, case, "6"],
            capture_output=True,
            text=True,
            timeout=150,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: hung")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(200)
def test_a_receiver_that_outlives_its_sender_for_minutes_still_closes() -> None:
    # Each reconnection attempt queued an event for the connection monitor, which nothing read
    # once the background task had heard the goodbye; when the queue was full, libzmq's thread
    # waited for room while holding a lock, and closing the receiver waited for that lock
    # forever.
    out = _long_retries("outlive")
    assert out.startswith("closed in ")
    assert float(out.split()[2]) < 4.0  # short of the 5 s join that a hang would wait out


@pytest.mark.timeout(200)
def test_a_worker_that_waits_minutes_for_its_trainer_still_joins() -> None:
    # Before the welcome nothing but the beat thread reads the monitor: events of the failed
    # attempts must not pile up until libzmq's thread stalls and no handshake can happen.
    assert _long_retries("early").strip() == "joined"


def test_a_switch_that_timed_out_leaves_nothing_behind_for_later_releases() -> None:
    from aiowsync._receiving.guard import ReadGuard

    guard = ReadGuard()
    guard.acquire()  # a reader (this thread) holds the guard past the switch's deadline

    async def switch() -> None:
        with pytest.raises(TimeoutError):
            await guard.switch(lambda: None, timeout=0.05)

    asyncio.run(switch())  # and that loop is closed afterwards
    assert guard._idle_waiters == []
    # The last reader out used to call into the closed loop and raise RuntimeError here.
    guard.release()
    assert guard.readers == 0
    assert asyncio.run(guard.switch(lambda: 7, timeout=1)) == 7


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("bind", "served"),
    [
        pytest.param(
            "tcp://[::1]:0",
            r"tcp://\[::1\]:\d+",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
        (f"ipc://@aiowsync-test-{os.getpid()}-[0]", rf"ipc://@aiowsync-test-{os.getpid()}-\[0\]"),
    ],
    ids=["ipv6", "ipc name with brackets"],
)
async def test_a_sender_bound_on_an_unusual_address_serves_its_workers(
    bind: str, served: str
) -> None:
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(bind=bind, heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        assert re.fullmatch(served, sender.address)
        r = pickle.loads(pickle.dumps(sender))
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            bump(src)
            assert (await sender.send(timeout=10)).worker_ids == (0,)
            assert same(mirror, src)
