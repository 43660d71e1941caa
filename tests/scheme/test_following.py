"""A receiver built with ``reconnect=`` follows its sender across restarts: it keeps and
serves its version while no sender is there, says so once, and joins the next sender as a
fresh receiver would, switching whole. In one process, on every kind of plane; the
shared-memory test with real processes and SIGKILL is in tests/planes/shm."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

import aiowsync
from helpers import CONNECT, Hosted, Kind, eventually, fill, model, values


def _sender(kind: Kind, value: float, bind: str | None) -> aiowsync.WeightSyncScheme:
    src = model(0)
    fill(src, value)
    sender = kind.scheme(**({} if bind is None else {"bind": bind}))
    sender.init_on_sender(model=src, num_workers=1)
    return sender


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "(reconnect)" in r.getMessage()
    ]


@pytest.mark.parametrize("mode", ["auto", "copy"])
async def test_a_receiver_follows_its_sender_to_a_new_one(
    kind: Kind, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """memory: the new sender binds the same address (reconnect=True); shm: it binds a fresh
    one, which the function gives as an address; dist: the function gives its scheme. In
    copy mode the new sender's version goes into the private copy the model does not run."""
    caplog.set_level(logging.INFO, logger="aiowsync")
    bind = "mem://follow" if kind.name == "memory" else None
    senders: list[aiowsync.WeightSyncScheme] = []

    def where() -> Any:
        if not senders:
            return None
        return senders[-1].address if kind.name == "shm" else senders[-1]

    first = _sender(kind, 1.0, bind)
    senders.append(first)
    hosts = [Hosted(first)]
    await hosts[0].start()
    mirror = model(100)
    r = kind.scheme(first.address, plane=first.plane, apply_mode=mode)
    r.init_on_receiver(model=mirror, worker_idx=0, reconnect=True if bind else where)
    mixed: list[set[float]] = []
    stop = threading.Event()

    def read() -> None:
        # A forward under the guard sees one sender's version whole, or the other's.
        while not stop.is_set():
            with r.read_guard():
                seen = values(mirror)
            if len(seen) != 1:
                mixed.append(seen)

    reader = threading.Thread(target=read, daemon=True)
    try:
        async with r:
            await asyncio.gather(first.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            reader.start()
            for step in (2.0, 3.0):
                fill(first.model, step)
                await first.send()
            assert (r.version, r.generation, values(mirror)) == (2, 0, {3.0})
            private = r._receiver.applier.private
            assert (private is None) == (mode != "copy")

            kept = r.lease()  # held across the change of sender
            await kept.__aenter__()
            await hosts[0].stop()  # the trainer goes (with a goodbye here)
            senders.clear()
            await eventually(lambda: not r.connected, what="the receiver sees its sender gone")
            # It keeps its version and serves it: ready, leases on that version's bytes.
            assert r.ready and r.version == 2 and values(mirror) == {3.0}
            async with r.lease() as held:
                assert (held.version, held.generation) == (2, 0)
                assert {float(t.unique()) for t in held.params().values()} == {3.0}
            waiting = asyncio.create_task(r.wait_for_version(5, timeout=60))
            await asyncio.sleep(0.3)  # tries fail meanwhile: nothing to join
            assert not waiting.done() and not r.connected and r.ready

            second = _sender(kind, 9.0, bind)
            hosts.append(Hosted(second))
            await hosts[1].start()
            senders.append(second)
            await second.connect(timeout=CONNECT)  # returns once the receiver rejoined
            # Its version, as a fresh receiver gets it: version 0 of a new generation.
            assert await waiting == 0
            assert (r.version, r.generation, values(mirror)) == (0, 1, {9.0})
            if mode == "copy":  # the same two private copies, not two more
                assert r._receiver.applier.private is private
            assert r.connected and r.ready and r.address == second.address
            fill(second.model, 10.0)
            result = await second.send()
            assert result.version == 1 and values(mirror) == {10.0}
            assert await r.wait_for_version(1, timeout=5) == 1
            async with r.lease() as held:
                assert (held.version, held.generation) == (1, 1)
            # The lease taken before still reads the first sender's version, whole.
            assert (kept.version, kept.generation) == (2, 0)
            assert {float(t.unique()) for t in kept.params().values()} == {3.0}
            await kept.__aexit__(None, None, None)
    finally:
        stop.set()
        if reader.is_alive():
            reader.join(10)
        for host in reversed(hosts):
            await host.stop()
    assert not mixed, mixed[:3]
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "keeps version 2" in warned[0] and first.address in warned[0]
    joined = [m.getMessage() for m in caplog.records if "joined the sender" in m.getMessage()]
    assert len(joined) == 1 and "version 0 (generation 1) replaces version 2" in joined[0]


async def test_reconnect_is_refused_where_it_cannot_work() -> None:
    kind = Kind("memory")
    sender = _sender(kind, 1.0, None)
    pull = kind.scheme("mem://1", background=False)
    with pytest.raises(ValueError, match="reconnect= needs background=True"):
        pull.init_on_receiver(model=model(1), worker_idx=0, reconnect=True)
    with pytest.raises(TypeError, match="reconnect must be True, False or a function"):
        kind.scheme("mem://1").init_on_receiver(model=model(1), worker_idx=0, reconnect=3)  # type: ignore[arg-type]
    # A relay's leaves count in the root's numbers, which a new root starts again.
    shared = model(2)
    upstream = kind.scheme("mem://1")
    upstream.init_on_receiver(model=shared, worker_idx=0, reconnect=True)
    local = kind.scheme()
    local.init_on_sender(model=shared, num_workers=1)
    with pytest.raises(ValueError, match="cannot follow its sender across restarts"):
        upstream.relay_to(local)
    del sender


async def test_a_failing_function_is_logged_once_and_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aiowsync")
    kind = Kind("memory")
    senders: list[aiowsync.WeightSyncScheme] = []

    async def where() -> str:  # async: awaited on the receiver's loop
        if not senders:
            raise RuntimeError("no trainer registered yet")
        return senders[-1].address

    first = _sender(kind, 1.0, None)
    senders.append(first)
    hosts = [Hosted(first)]
    await hosts[0].start()
    mirror = model(100)
    r = kind.scheme(first.address, plane=first.plane)
    r.init_on_receiver(model=mirror, worker_idx=0, reconnect=where)
    try:
        async with r:
            await asyncio.gather(first.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            await hosts[0].stop()
            senders.clear()
            await eventually(lambda: not r.connected, what="the sender seen gone")
            await asyncio.sleep(1.0)  # several tries, each asking the function
            second = _sender(kind, 9.0, None)  # elsewhere: only the function knows where
            hosts.append(Hosted(second))
            await hosts[1].start()
            senders.append(second)
            await second.connect(timeout=CONNECT)
            assert (r.version, r.generation, values(mirror)) == (0, 1, {9.0})
            assert r.address == second.address != first.address
    finally:
        for host in reversed(hosts):
            await host.stop()
    failed = [m for m in _warnings(caplog) if "reconnect's function failed" in m]
    assert failed == [
        "worker 0: reconnect's function failed: RuntimeError: no trainer registered yet; "
        "trying again (reconnect)"
    ]


async def test_leases_keep_working_while_a_join_that_switched_the_model_is_tried_again(
    kind: Kind,
) -> None:
    """A hook fails on the new sender's version after the switch: the model runs that
    version, and its leases are taken on it while the next tries fail too."""
    senders: list[aiowsync.WeightSyncScheme] = []
    failing = threading.Event()
    failed = threading.Event()

    def hook(version: int) -> None:
        if failing.is_set():
            failed.set()
            raise RuntimeError("the hook failed")

    first = _sender(kind, 1.0, None)
    senders.append(first)
    hosts = [Hosted(first)]
    await hosts[0].start()
    mirror = model(100)
    r = kind.scheme(first.address, plane=first.plane, apply_mode="swap")
    r.init_on_receiver(
        model=mirror,
        worker_idx=0,
        reconnect=lambda: senders[-1] if kind.name == "dist" else senders[-1].address,
    )
    r.register_hook(hook)
    try:
        async with r:
            await asyncio.gather(first.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            await hosts[0].stop()
            await eventually(lambda: not r.connected, what="the sender seen gone")
            failing.set()
            second = _sender(kind, 9.0, None)
            senders.append(second)
            hosts.append(Hosted(second))
            await hosts[1].start()
            await eventually(failed.is_set, within=CONNECT, what="a join whose hook failed")
            assert (r.version, r.generation, values(mirror)) == (0, 1, {9.0}) and r.ready
            for _ in range(3):  # the tries go on failing meanwhile
                async with r.lease() as held:
                    assert (held.version, held.generation) == (0, 1)
                    assert {float(t.unique()) for t in held.params().values()} == {9.0}
                await asyncio.sleep(0.2)
            failing.clear()  # the next try joins
            await eventually(lambda: r.connected, within=CONNECT, what="the join")
            assert (r.version, r.generation, values(mirror)) == (0, 1, {9.0})
    finally:
        for host in reversed(hosts):
            await host.stop()


async def test_a_receiver_that_joins_the_same_sender_again_keeps_its_lease_whole() -> None:
    """The receiver breaks with its sender while the sender lives on (here as on a protocol
    error it saw) and joins it again from the same process. A lease taken before keeps its
    bytes while the sender sends on, and the sender's slots go back into use once the model
    runs a version of the new connection."""
    kind = Kind("shm")
    # Two slots: without the old connection's pins, the leased one is rewritten at once.
    sender = kind.scheme(plane=aiowsync.SharedMemPlane(num_slots=2, max_slots=4))
    src = model(0)
    fill(src, 2.0)
    sender.init_on_sender(model=src, num_workers=1)
    host = Hosted(sender)
    await host.start()
    mirror = model(100)
    r = kind.scheme(sender.address, apply_mode="swap")
    r.init_on_receiver(model=mirror, worker_idx=0, reconnect=True)
    try:
        async with r:
            await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            async with r.lease() as kept:
                first = r._receiver
                first._state.bye = "simulated: the sender broke the protocol"
                first.notify()
                await eventually(
                    lambda: r._receiver is not first and r.connected,
                    within=CONNECT,
                    what="the receiver joined the sender again",
                )
                assert (r.generation, values(mirror)) == (0, {2.0})
                for value in (3.0, 4.0, 5.0, 6.0):
                    fill(src, value)
                    await sender.send(timeout=CONNECT)
                assert values(mirror) == {6.0}
                assert kept.version == 0
                assert {float(t.unique()) for t in kept.params().values()} == {2.0}
    finally:
        await host.stop()
