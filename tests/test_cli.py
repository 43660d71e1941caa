"""The command line: its dispatch in this process, and `python -m aiowsync demo` running a real
trainer and workers."""

from __future__ import annotations

import pytest

from aiowsync.__main__ import main
from helpers import run_cli


def test_no_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: aiowsync demo" in capsys.readouterr().out


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


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
