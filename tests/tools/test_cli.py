"""The command line: its dispatch in this process, and `python -m aiowsync demo` running a real
trainer and workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aiowsync
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


def test_version_and_usage_list_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"aiowsync {aiowsync.__version__}\n"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "doctor", "clean", "--version"):
        assert f"aiowsync {command}" in out


def test_demo_help_gives_every_option_a_text_and_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for option, default in (("--workers", 4), ("--sends", 40), ("--interval", 0.05)):
        line = next(line for line in out.splitlines() if line.strip().startswith(option))
        assert f"(default: {default})" in line


@pytest.mark.parametrize(
    ("option", "value"),
    [("--sends", "0"), ("--workers", "0"), ("--width", "-1"), ("--interval", "-0.5")],
)
def test_demo_refuses_counts_it_cannot_run_with_naming_the_option(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be" in capsys.readouterr().err


def test_doctor_judges_shared_memory_against_the_model_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from aiowsync._tools.doctor import findings

    small = findings(1 << 20, workers=2, shm=Path("/dev/shm"))
    assert next(f.what for f in small) == "shared memory (/dev/shm)"
    assert main(["doctor", "--model-bytes", "1MiB", "--workers", "2"]) in (0, 1)
    out = capsys.readouterr().out
    assert "shared memory (/dev/shm)" in out and "open files" in out and "OpenMP" in out
    missing = findings(1 << 20, workers=2, shm=tmp_path / "none")[0]
    assert missing.level == "fail" and "cannot be read" in missing.detail


def test_doctor_in_a_container_sized_shared_memory_says_what_to_raise() -> None:
    """A private mount namespace with a 64 MiB tmpfs on /dev/shm, as a container has."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")
    cmd = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f"{sys.executable} -m aiowsync doctor --model-bytes 256MiB --workers 4"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120
    )
    if "mount" in done.stderr and done.returncode != 0 and "shared memory" not in done.stdout:
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "[FAIL] shared memory (/dev/shm): 64.0 MiB in all, 64.0 MiB free; a sender of a "
        "256.0 MiB model needs 512.0 MiB for its 2 slots, and 1.0 GiB leaves room for the slots "
        "added while workers lag\n"
        "       fix: give /dev/shm at least 1.0 GiB: in docker, `docker run --shm-size=1g ...`"
    ) in done.stdout


@pytest.mark.parametrize(("soft", "hard"), [(1024, 8192), (2048, 2048)])
def test_doctors_open_files_fix_raises_the_limit_that_holds_it(soft: int, hard: int) -> None:
    # Before, with the hard limit at 2048 the fix printed was `ulimit -n 2048`: the limit
    # the shell already had, which followed changed nothing.
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from aiowsync.__main__ import main\n"
        "sys.exit(main(['doctor', '--model-bytes', '1MiB', '--workers', '8']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "open files" in line)
    assert lines[at].startswith("[WARN] open files: this shell may open")
    fix = lines[at + 1]
    if soft < hard:
        assert fix == (
            f"       fix: `ulimit -n {hard}` before starting the trainer, or LimitNOFILE= in its "
            "systemd unit"
        )
    else:
        assert fix.startswith("       fix: raise the hard limit to 65536 (as root `ulimit -Hn")


@pytest.mark.parametrize("bad", [["--workers", "0"], ["--workers", "-3"], ["--slots", "1"]])
def test_doctor_refuses_counts_no_scheme_can_have(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["doctor", *bad])
    assert info.value.code == 2


def test_clean_removes_slots_of_dead_senders_only(capsys: pytest.CaptureFixture[str]) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Path(f"/dev/shm/aiowsync-{gone.pid}-abcdef-0")
    alive = Path(f"/dev/shm/aiowsync-{os.getpid()}-abcdef-7")
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    try:
        assert main(["clean"]) == 0
        out = capsys.readouterr().out
        assert f"removed {dead}" in out and not dead.exists()
        assert alive.exists() and str(alive) not in out
    finally:
        dead.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)
