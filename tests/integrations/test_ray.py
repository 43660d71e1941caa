"""Rollout workers as Ray async actors on a real local Ray cluster, on shared memory and on
torch.distributed (gloo): every actor holds each version's exact bytes, and nothing of the
cluster, the actors or their shared memory is left once the example ends."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(760),
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None and not os.environ.get("AIOWSYNC_REQUIRE_EXTRAS"),
        reason="the ray extra is not installed",
    ),
]

RAY_PROCESSES = ("ray::", "raylet", "gcs_server", "plasma_store", "dashboard")


def ray_processes() -> list[str]:
    """Command lines of the Ray processes running on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile
        if any(name in cmdline for name in RAY_PROCESSES):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def test_two_async_rollout_actors_hold_every_version_on_both_transports(tmp_path: Path) -> None:
    if ray_processes():
        pytest.skip(f"another Ray cluster runs on this machine: {ray_processes()[:2]}")
    shm_before = set(os.listdir("/dev/shm"))
    # Ray keeps each session's logs and a socket under its temporary directory (/tmp/ray by
    # default) after the cluster ends: here, one of the test's own, gone after it. Short, for
    # the socket paths within it.
    ray_tmp = tempfile.mkdtemp(prefix="ray-")
    try:
        run = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "ray_rollouts.py"), "--sends", "10"],
            cwd=tmp_path,
            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE", RAY_TMPDIR=ray_tmp),
            capture_output=True,
            text=True,
            timeout=700,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    reports = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("[")))
    assert [r["transport"] for r in reports] == ["shm", "dist"]
    for r in reports:
        # Checked after each of the 10 sends, on each of the 2 actors (the example raises on
        # the first actor that holds another version or other bytes).
        assert r["sends"] == 10 and r["actors_checked_exact"] == 20, r
        assert all(steps > 0 for steps in r["rollouts_per_actor"]), r  # they were busy
        assert r["actors_dead_after_kill"] == 3, r  # the trainer and both rollout actors
    # Nothing of the cluster is left, and no shared memory.
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes() == []
    # Only aiowsync's slots are the example's to judge: other programs on the machine make
    # their own files there meanwhile (OpenMP's registrations, multiprocessing's semaphores).
    # A slot of another live process (another test running beside this one) is not this
    # run's either: a leak is a slot whose creator has exited.
    left = {
        f
        for f in set(os.listdir("/dev/shm")) - shm_before
        if f.startswith("aiowsync-") and not _creator_alive(f)
    }
    assert left == set()


def _creator_alive(name: str) -> bool:
    """An aiowsync slot's name carries its creator's pid (``aiowsync-PID-...``)."""
    parts = name.split("-")
    if len(parts) < 2 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
