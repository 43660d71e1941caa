"""The command line: `python -m aiowsync demo` runs a real trainer and workers."""

from __future__ import annotations

import pytest

from helpers import run_cli


def test_no_command_prints_usage() -> None:
    done = run_cli(timeout=60)
    assert done.returncode == 2
    assert "usage: aiowsync demo" in done.stdout


def test_unknown_command_is_refused() -> None:
    done = run_cli("frobnicate", timeout=60)
    assert done.returncode == 2
    assert "unknown command" in done.stderr


@pytest.mark.slow
def test_small_demo_verifies_every_worker() -> None:
    done = run_cli(
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
