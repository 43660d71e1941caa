"""What a receiver's beats say holds it up: a blocked event loop, a version being applied, a
pull-mode receiver outside ``receive()``."""

from __future__ import annotations

import asyncio
import threading
import time

from aiowsync._receiving.activity import STALLED_S, Activity


def test_a_blocked_loop_is_seen_from_the_beat_thread_and_a_turning_one_is_not() -> None:
    activity = Activity()
    loop = asyncio.new_event_loop()
    release = threading.Event()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        activity.bind(loop)
        # A loop that turns answers each look before the next beat.
        for _ in range(3):
            assert activity.text() == ""
            time.sleep(STALLED_S + 0.1)
        # Blocked: the look left at one beat has not run by the next.
        loop.call_soon_threadsafe(release.wait, 30)
        time.sleep(0.1)
        assert activity.text() == ""  # leaves a look behind the blocking call
        time.sleep(STALLED_S + 0.2)
        activity.applying = 7
        text = activity.text()
        assert text.startswith("its event loop has not run for ")
        assert text.endswith(" s, applying version 7")
        release.set()
        deadline = time.monotonic() + 30
        while activity.text().startswith("its event loop"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert activity.text() == "applying version 7"
        activity.applying = None
        assert activity.text() == ""
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert activity.text() == ""  # a closed loop is never looked at


def test_a_pull_mode_receiver_outside_receive_says_so() -> None:
    activity = Activity()
    activity.pull = True
    activity.enter_receive()
    assert activity.text() == ""
    activity.leave_receive()
    assert activity.text().startswith("pull mode: not in receive() for ")
