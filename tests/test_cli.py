"""The command line: `python -m aiowsync demo` runs a real trainer and workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "aiowsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_no_command_prints_usage() -> None:
    done = _run(timeout=60)
    assert done.returncode == 2
    assert "usage: aiowsync demo" in done.stdout


def test_unknown_command_is_refused() -> None:
    done = _run("frobnicate", timeout=60)
    assert done.returncode == 2
    assert "unknown command" in done.stderr


@pytest.mark.slow
def test_small_demo_verifies_every_worker() -> None:
    done = _run(
        "demo",
        "--workers",
        "2",
        "--sends",
        "5",
        "--width",
        "64",
        "--depth",
        "1",
        "--interval",
        "0.01",
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "content verified on every worker: yes" in done.stdout
    assert "| 0 | 5 |" in done.stdout and "| 1 | 5 |" in done.stdout
