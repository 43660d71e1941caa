"""The inference-server example for real: two uvicorn server processes, each an aiowsync
receiver, a trainer process sending versions, and an httpx client checking every response
against greedy decoding recomputed offline with the weights of the version it reports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ("fastapi", "uvicorn", "transformers", "httpx")
MISSING = [m for m in EXTRA if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        bool(MISSING) and not os.environ.get("AIOWSYNC_REQUIRE_EXTRAS"),
        reason=f"the server extra is not installed (no {', '.join(MISSING)})",
    ),
]


Run = tuple[subprocess.CompletedProcess[str], dict[str, Any]]
"""The example's run: its output and its figures."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The example run once with ``--restart``: the steady and updating phases, then the
    trainer SIGKILLed while it sends and a new one started (the servers follow it)."""
    tmp_path = tmp_path_factory.mktemp("serving")
    out = tmp_path / "figures.json"
    script = str(ROOT / "examples" / "inference_server.py")
    args = ["--requests", "40", "--versions", "20", "--restart", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=tmp_path,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done, json.loads(out.read_text())


def test_every_response_matches_greedy_decoding_on_the_version_it_reports(
    run: Run,
) -> None:
    done, figures = run
    # Readiness is held until version 0: both servers answered 503 first, requests too.
    assert all(n >= 1 for n in figures["not_ready_answers"])
    assert figures["generate_before_ready"] == 503
    assert figures["versions_sent"] >= 20 and figures["trainer_exit"] == 0
    assert figures["failed"] == 0 and figures["requests"] >= 120
    assert figures["mismatches"] == 0
    # The check can tell versions apart, and requests did run while the model moved on.
    assert figures["distinct_outputs_of_one_prompt"] >= 2
    assert len(figures["versions_answered"]) >= 3
    assert figures["most_versions_within_one_request"] >= 3
    assert figures["p99_ms_during_updates"] > 0 and figures["p99_ms_without_updates"] > 0
    assert "OK: every response matches its version's greedy decoding" in done.stdout


def test_the_servers_follow_a_killed_trainer_to_a_new_one_without_failing_a_request(
    run: Run,
) -> None:
    done, figures = run
    print({k: v for k, v in figures.items() if k.startswith(("restart", "versions_sent"))})
    # Requests went on from the kill until the new trainer sent versions: none failed, the
    # first ones on the killed trainer's last version, the later ones on the new trainer's.
    assert figures["restart_failed"] == 0
    assert figures["restart_answered_by_trainer_0"] >= 1
    assert figures["restart_answered_by_trainer_1"] >= 1
    assert figures["versions_sent_after_restart"] >= 5
    # Both trainers' versions answered, each checked against its own trainer's weights (a
    # request may or may not start while the new trainer's version 0 is the latest: its next
    # versions follow within 50 ms).
    answered = figures["versions_answered"]
    assert any(v.startswith("0:") for v in answered)
    assert any(v.startswith("1:") for v in answered)
    assert figures["restart_s_from_kill"] >= figures["restart_s_from_new_trainer_bound"] > 0
    # Each server warned once of the killed trainer (and once of the new one's goodbye).
    lost = [line for line in done.stderr.splitlines() if "was lost" in line]
    assert len(lost) == 2 and all("(reconnect)" in line for line in lost)
