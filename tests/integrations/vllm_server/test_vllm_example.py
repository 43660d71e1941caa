"""examples/vllm_rollouts.py runs as the docs say: its own CPU vLLM server, a trainer and a
client, and every response checked against the version it names."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _vllm import START_LIMIT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(START_LIMIT_S) + 300)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_rollouts.py"


def test_the_example_checks_every_response_and_succeeds(tmp_path: Path) -> None:
    before, sockets_before = _server_files(), _sockets()
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--start-limit", str(START_LIMIT_S)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        capture_output=True,
        text=True,
        timeout=START_LIMIT_S + 240,
    )
    if run.returncode != 0:  # the whole report (the trainer's warnings, then FAILED: ...)
        pytest.fail(
            f"exit {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n"
            f"--- stderr\n{run.stderr[-8000:]}",
            pytrace=False,
        )
    assert "mismatches=0" in run.stdout
    assert "OK: every response was generated on one whole version the trainer sent" in run.stdout
    # The server's engine queues and OpenMP files go with it, also those of killed processes.
    left = sorted(_server_files() - before)
    assert not left, f"the example left these in /dev/shm: {left}"
    # So do the socket files of vLLM's processes (in their temporary directory).
    left = sorted(_sockets() - sockets_before)
    assert not left, f"the example left these sockets in {tempfile.gettempdir()}: {left}"


def _sockets() -> set[str]:
    """Socket files in the temporary directory, where vLLM makes its ipc:// sockets unless
    told otherwise."""
    with os.scandir(tempfile.gettempdir()) as entries:
        return {e.name for e in entries if _is_socket(e)}


def _is_socket(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:  # gone meanwhile
        return False


def _server_files() -> set[str]:
    """vLLM's engine queues and Intel OpenMP's registration files in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "__KMP_REGISTERED_LIB_"))}
