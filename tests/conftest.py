"""Fixtures every test file may use; plain helpers live in helpers.py."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import aiowsync._copy.engine
from aiowsync._copy.engine import CopyPolicy, streams_available
from helpers import Kind


def _own_segments() -> set[str]:
    prefix = f"aiowsync-{os.getpid()}-"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must remove the shared-memory slots it created, even when it fails."""
    before = _own_segments()
    yield
    leaked = _own_segments() - before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.fixture(params=["memory", "shm", "dist"])
def kind(request: pytest.FixtureRequest) -> Kind:
    """Each kind of plane in turn: the in-process twins, real shared memory, real gloo."""
    return Kind(request.param)


_POOL_THREADS = ("AnyIO worker thread", "asyncio_")
"""Threads of the event loop's own pools, which end with the loop, not with the test."""


def _lasting_threads() -> tuple[str, ...]:
    """Helper threads of the process's default copy policy, which copies made without a
    policy of their own use; it is never closed, by design (see ``default_policy``)."""
    policy = aiowsync._copy.engine._default
    if policy is None:
        return ()
    return (f"{policy._copy_name}_", f"{policy._gather_name}_")


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """The test leaves no thread of its own running (use with ``pytest.mark.usefixtures``)."""
    before = set(threading.enumerate())
    yield

    def leaked() -> list[str]:
        ignored = _POOL_THREADS + _lasting_threads()
        return [
            t.name
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(ignored)
        ]

    deadline = time.monotonic() + 10
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not leaked(), f"threads left running: {leaked()}"


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """The test leaves no asyncio task running on its loop."""
    yield
    mine = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not mine and not t.done()]
    assert not left, f"tasks left running: {left}"


@pytest.fixture(params=["streamed", "plain"])
def policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyPolicy]:
    """Run a copy test with non-temporal copies (where built) and with plain ones. The policy
    is also the process's default for the test, for what copies without one (``Layout.pack``,
    ``rehome``)."""
    streamed = request.param == "streamed"
    if streamed and not streams_available():
        pytest.skip("non-temporal copies are not available here")
    made = CopyPolicy(streaming=streamed)
    monkeypatch.setattr(aiowsync._copy.engine, "_default", made)
    try:
        yield made
    finally:
        made.close()
