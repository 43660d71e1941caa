from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
