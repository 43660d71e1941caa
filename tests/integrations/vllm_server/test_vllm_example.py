"""examples/vllm_rollouts.py runs as the docs say: its own CPU vLLM server, a trainer and a
client, and every response checked against the version it names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _vllm import START_LIMIT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(START_LIMIT_S) + 300)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_rollouts.py"


def test_the_example_checks_every_response_and_succeeds(tmp_path: Path) -> None:
    before = _server_files()
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


def _server_files() -> set[str]:
    """vLLM's engine queues and Intel OpenMP's registration files in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "__KMP_REGISTERED_LIB_"))}
