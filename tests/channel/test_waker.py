"""The waker: a thread that handles a receiver's messages while its event loop waits for events,
and never while the loop runs anything; and the short slices of the threads on a message's way.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import pytest
import uvloop

from aiowsync._channel import ZmqChannelFactory
from aiowsync._channel._waker import Waker, wakers_enabled
from aiowsync._protocol import SENDER_INDEX, Heartbeat, Message
from aiowsync._util import sched
from helpers import eventually

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_threads")]

WAIT = 10.0


class Pipe:
    """A descriptor to wake the waker with, and what its handler saw each time."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.turns: list[tuple[str, bool]] = []
        self.busy = False  # set by a loop callback while it runs
        self.then: Callable[[], None] = lambda: None

    def handle(self) -> None:
        os.read(self.r, 64)
        self.turns.append((threading.current_thread().name, self.busy))
        self.then()

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_waker_runs_only_while_the_loop_waits_for_events() -> None:
    """A message that comes while a callback runs on the loop (a forward, say) is handled once
    that callback is over, never during it; one that comes while the loop idles is handled by
    the waker at once, and the loop learns of what the handler left it."""
    loop = asyncio.get_running_loop()
    pipe = Pipe()
    waker = Waker(loop, pipe.r, pipe.handle, "aiowsync-waker-test")
    try:
        # The loop idles: the waker handles the message.
        os.write(pipe.w, b"1")
        await eventually(lambda: len(pipe.turns) == 1, WAIT)
        assert pipe.turns == [("aiowsync-waker-test", False)]

        # The loop runs a callback for 0.3 s; the message comes 0.1 s into it.
        def forward() -> None:
            pipe.busy = True
            threading.Timer(0.1, os.write, (pipe.w, b"2")).start()
            time.sleep(0.3)
            pipe.busy = False

        loop.call_soon(forward)
        await asyncio.sleep(0)
        await eventually(lambda: len(pipe.turns) == 2, WAIT)
        assert pipe.turns[1][1] is False  # not while the callback ran

        # What the handler schedules on the loop runs without another event.
        done: asyncio.Future[threading.Thread] = loop.create_future()
        pipe.then = lambda: done.set_result(threading.current_thread())
        os.write(pipe.w, b"3")
        thread = await asyncio.wait_for(done, WAIT)
        assert thread.name == "aiowsync-waker-test"
    finally:
        waker.stop()
        await eventually(lambda: not waker._thread.is_alive(), WAIT)
        pipe.close()


async def test_a_loop_that_never_idles_still_gets_its_messages() -> None:
    """A loop whose tasks keep it busy (never waiting in its selector for long) would win
    nearly every race for its gate: after a moment the loop handles the message itself."""
    loop = asyncio.get_running_loop()
    pipe = Pipe()
    waker = Waker(loop, pipe.r, pipe.handle, "aiowsync-waker-test")
    try:
        written_at = 0.0

        def write() -> None:
            nonlocal written_at
            written_at = time.monotonic()
            os.write(pipe.w, b"x")

        threading.Timer(0.1, write).start()
        end = time.monotonic() + 2.0
        handled_at = None
        while time.monotonic() < end:  # busy, yet passing through its selector each turn
            await asyncio.sleep(0)
            if pipe.turns and handled_at is None:
                handled_at = time.monotonic()
        assert handled_at is not None and handled_at - written_at < 1.0
        assert pipe.turns[0][1] is False
    finally:
        waker.stop()
        await eventually(lambda: not waker._thread.is_alive(), WAIT)
        pipe.close()


async def test_a_stopped_waker_ends_and_leaves_no_descriptor() -> None:
    loop = asyncio.get_running_loop()
    before = open_fds()
    pipe = Pipe()
    waker = Waker(loop, pipe.r, pipe.handle, "aiowsync-waker-test")
    waker.stop()
    waker.stop()  # idempotent
    await eventually(lambda: not waker._thread.is_alive(), WAIT)
    os.write(pipe.w, b"x")
    await asyncio.sleep(0.05)
    assert pipe.turns == []
    pipe.close()
    assert open_fds() == before


async def test_a_failed_waker_tells_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    """A waker whose handler raises ends, and the loop hears of it (the channel then watches
    its descriptor on the loop again)."""
    loop = asyncio.get_running_loop()
    pipe = Pipe()
    told: asyncio.Future[threading.Thread] = loop.create_future()

    def broken() -> None:
        raise RuntimeError("handler bug")

    pipe.then = broken
    waker = Waker(
        loop, pipe.r, pipe.handle, "aiowsync-waker-test",
        lambda: told.set_result(threading.current_thread()),
    )  # fmt: skip
    try:
        os.write(pipe.w, b"x")
        assert await asyncio.wait_for(told, WAIT) is threading.main_thread()
        await eventually(lambda: not waker._thread.is_alive(), WAIT)
        assert "waker failed" in caplog.text and "handler bug" in caplog.text
    finally:
        waker.stop()
        pipe.close()


def test_a_waker_whose_loop_closed_ends() -> None:
    loop = asyncio.new_event_loop()
    pipe = Pipe()
    try:
        waker = loop.run_until_complete(_start(loop, pipe))
        os.write(pipe.w, b"x")  # the loop no longer runs: the waker cannot get its turn
    finally:
        loop.close()
    deadline = time.monotonic() + WAIT
    while waker._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not waker._thread.is_alive()
    assert pipe.turns == []
    waker.stop()
    pipe.close()


async def _start(loop: asyncio.AbstractEventLoop, pipe: Pipe) -> Waker:
    return Waker(loop, pipe.r, pipe.handle, "aiowsync-waker-test")


def test_wakers_are_left_out_where_they_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.new_event_loop()
    try:
        assert wakers_enabled(loop)
        loop.set_debug(True)  # asyncio refuses loop calls from other threads then
        assert not wakers_enabled(loop)
        loop.set_debug(False)
        monkeypatch.setenv("AIOWSYNC_WAKER", "0")
        assert not wakers_enabled(loop)
    finally:
        loop.close()
    monkeypatch.delenv("AIOWSYNC_WAKER")
    other = uvloop.new_event_loop()  # no selector to wrap
    try:
        assert not wakers_enabled(other)
    finally:
        other.close()


async def test_a_receiver_hands_messages_over_from_its_waker_without_spinning() -> None:
    """Through real sockets: a beat that comes while the receiver's loop idles is handed to
    the inline handler by the waker; an idle waker uses next to no CPU."""
    factory = ZmqChannelFactory()
    sender = factory.bind("ipc://*", heartbeat_timeout=5.0)
    receiver = factory.connect(sender.address, heartbeat_timeout=5.0)
    try:
        await receiver.send(Heartbeat(worker_idx=0, session="ab" * 16), timeout=WAIT)
        peer, _ = await sender.recv(timeout=WAIT)
        handed: list[tuple[int, str]] = []

        def handler(message: Message) -> bool:
            assert isinstance(message, Heartbeat)
            handed.append((message.version, threading.current_thread().name))
            return True

        receiver.take_inline(handler)
        waiting = asyncio.create_task(receiver.recv(timeout=None))
        await asyncio.sleep(0.05)
        waker = receiver._waker  # type: ignore[attr-defined]
        assert waker is not None and waker._thread.is_alive()
        cpu_before = _thread_cpu(waker._thread)
        await asyncio.sleep(0.5)
        assert _thread_cpu(waker._thread) - cpu_before < 0.1  # asleep, not spinning
        for n in range(1, 4):
            beat = Heartbeat(worker_idx=SENDER_INDEX, session="ab" * 16, version=n)
            await sender.send(peer, beat, timeout=WAIT)
            await eventually(lambda n=n: len(handed) == n, WAIT)  # type: ignore[misc]
        assert [v for v, _ in handed] == [1, 2, 3]
        # The loop idled meanwhile; the waker may still lose a race to it now and then.
        assert any(name == "aiowsync-waker" for _, name in handed)
        waiting.cancel()
    finally:
        receiver.close()
        sender.close()
    await eventually(lambda: not waker._thread.is_alive(), WAIT)


def _thread_cpu(thread: threading.Thread) -> float:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_short_slice_lasts_as_long_as_the_outermost_block() -> None:
    before = sched._get(0)
    if before is None:
        pytest.skip("sched_getattr is not available here")
    with sched.short_slice_while():
        assert sched._get(0) == (before[0], before[1], sched.SHORT_SLICE_NS)
        with sched.short_slice_while():
            pass
        assert sched._get(0) == (before[0], before[1], sched.SHORT_SLICE_NS)
    assert sched._get(0) == before
