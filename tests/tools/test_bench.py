"""`aiowsync bench`: a real small run end to end, the plan, the checks and the report."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aiowsync._tools.bench import _parse, main
from aiowsync._tools.bench._checks import LIMIT, checks
from aiowsync._tools.bench._models import MIB, Reader, fill, model_spec, spec_bytes
from aiowsync._tools.bench._plan import QUICK_CELLS, footprint, matrix, plan_batches
from aiowsync._tools.bench._report import markdown, plot
from helpers import run_cli

HAS_TORCHRL = importlib.util.find_spec("torchrl") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
GIB = 1 << 30


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_run_writes_every_sample_a_table_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ("--models", "1MiB", "--workers", "2", "--samples", "3", "--no-torchrl")
    done = run_cli("bench", *args, "--out", str(out), timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(1/4) 1MiB x2 shm [policy]" in done.stderr  # progress while it runs

    report = json.loads((out / "bench.json").read_text())
    cells = report["run"]["cells"]
    # By default each cell once per workers' profile, policy (the headline) first.
    assert [(c["model"], c["workers"], c["transport"], c["profile"]) for c in cells] == [
        ("1MiB", 2, "shm", "policy"),
        ("1MiB", 2, "shm", "light"),
        ("1MiB", 2, "dist", "policy"),
        ("1MiB", 2, "dist", "light"),
    ]
    shm = [
        "aiowsync shm send()",
        "aiowsync shm publish()",
        "aiowsync shm send(weights)",
        "aiowsync shm send() +digest",
        "raw copy_",
        "raw zmq round trip",
    ]
    dist = [
        "aiowsync dist send()",
        "aiowsync dist publish()",
        "aiowsync dist send() -digest",
        "raw gloo broadcast",
    ]
    assert [[r["name"] for r in c["contenders"]] for c in cells] == [shm, shm, dist, dist]
    for cell in cells:
        assert cell["model_bytes"] == MIB and not cell["errors"]
        assert cell["gates"] == ["quiet", "busy"]
        for row in cell["contenders"]:
            # Both gates, every round: 3 samples after the quiet wait, 3 without waiting.
            for key in ("samples_s", "busy_samples_s"):
                assert len(row[key]) == 3 and all(0 < s < 60 for s in row[key])
            assert len(row["quiet_wait_s"]) == 3 and len(row["busy_after"]) == 3
            # 1 MiB: every sample is the second of two sends back to back; the first is kept.
            for key in ("lead_samples_s", "busy_lead_samples_s"):
                assert len(row[key]) == 3 and all(0 < s < 60 for s in row[key])
            if row["kind"] == "floor" or row["name"].endswith("digest"):  # timed only
                assert row["gap"] is None and row["tear"] is None
                continue
            gap = row["gap"]
            workers = 0 if row["name"] == "raw copy_" else 2
            assert len(gap["workers_busy_s"]) == workers and gap["sender_busy_s"] > 0
            if row["kind"] != "aiowsync":
                assert row["tear"] is None  # no model on the workers to read
                continue
            for reads, mixed in zip(row["tear"]["reads"], row["tear"]["mixed"], strict=True):
                assert reads["loop"] > 0 and reads["guarded thread"] > 0
                assert mixed == {"loop": 0, "guarded thread": 0}
    # send() is the scheme's defaults: digests on over torch.distributed, off on one host.
    integrity = {r["name"]: r["info"]["integrity"] for c in cells for r in c["contenders"]
                 if r["kind"] == "aiowsync"}  # fmt: skip
    assert integrity == {
        "aiowsync shm send()": False, "aiowsync shm publish()": False,
        "aiowsync shm send(weights)": False, "aiowsync shm send() +digest": True,
        "aiowsync dist send()": True, "aiowsync dist publish()": True,
        "aiowsync dist send() -digest": False,
    }  # fmt: skip
    assert "left out: --no-torchrl" in report["env"]["torchrl_status"]

    text = (out / "bench.md").read_text()
    assert "| 1MiB | 2 | policy | **aiowsync shm send()** |" in text
    assert "| 1MiB | 2 | light | **aiowsync shm send()** |" in text
    assert "| 1MiB | 2 | policy | **aiowsync dist publish()** |" in text
    # Each publish() sample is the time the trainer was held; its whole sends are kept too.
    for cell in cells:
        row = next(r for r in cell["contenders"] if r["name"].endswith("publish()"))
        assert row["info"]["whole_send_s"] and all(0 < s < 60 for s in row["info"]["whole_send_s"])
    assert "| 1MiB | 2 | light | raw gloo broadcast |" in text
    assert "| 1MiB | 2 | policy | raw copy_ |" in text
    assert "| 1MiB | 2 | policy | raw zmq round trip |" in text
    # The policy workers read every tensor of every version they ran: all the model's bytes.
    for cell in cells:
        reads = cell["policy_reads"]
        if cell["profile"] == "light":
            assert reads is None
            continue
        assert len(reads) == 2
        for r in reads:
            assert r["tensors"] == 4 and r["bytes"] == MIB and r["reads"] >= 3
    assert "### What the policy workers read" in text
    assert "| 1MiB | 2 | shm |" in text
    assert "### First sends of each pair" in text
    assert "| aiowsync mixed reads, every cell | 0 | <= 0 | met |" in text
    # What a worker kept is measured in every one-host cell (judged from 64 MiB on).
    assert all(m["fraction_of_model"] > -1 for m in cells[0]["worker_memory"])
    assert len(cells[0]["worker_memory"]) == 2 and "worker_memory" not in cells[2]
    if HAS_MATPLOTLIB:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no plot" in text and not (out / "bench.png").exists()


def test_arguments() -> None:
    assert _parse(["--quick"]).cells == QUICK_CELLS
    cells = _parse(["--quick", "--workers", "2,3", "--transports", "shm"]).cells
    assert cells == matrix(("1MiB", "64MiB", "256MiB", "1GiB", "1000t-64MiB"), (2, 3), ("shm",))
    assert len(_parse([]).cells) == 5 * 3 * 2
    options = _parse(["--quick", "--rehome", "--bucket-mib", "8"])
    assert options.rehome and options.bucket_mib == 8
    for bad in (["--models", "2GiB"], ["--workers", "x"], ["--workers", "0"],
                ["--transports", "nccl"], ["--samples", "0"], ["--bucket-mib", "0"],
                # An unset variable in a script (an empty value) is no default: refused.
                ["--models", ""], ["--workers", ""], ["--transports", ""], ["--gates", ","],
                ["--timeout", "0"], ["--timeout", "-5"], ["--timeout", "nan"]):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            _parse(bad)
        assert info.value.code == 2


def test_dist_cells_are_measured_once_per_topology_and_control_auth() -> None:
    from aiowsync._tools.bench._plan import Settings
    from aiowsync._tools.bench._run import variants

    args = _parse(["--topologies", "star,chain", "--control-auth", "curve,off,off,curve"])
    assert args.topologies == ("star", "chain")
    assert args.control_auth == ("curve", "off", "off", "curve")
    assert _parse([]).topologies == ("star",) and _parse([]).control_auth == ("curve",)
    settings = Settings(cells=(), topologies=("star", "chain"), control_auth=("curve", "off"))
    assert variants("shm", settings) == [None]
    assert variants("dist", settings) == [
        ("star", "curve"), ("star", "off"), ("chain", "curve"), ("chain", "off"),
    ]  # fmt: skip
    for bad in (["--topologies", "ring"], ["--control-auth", "none"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_the_cost_of_curve_is_judged_on_the_pooled_samples_of_both() -> None:
    def dist_cell(topology: str, auth: str, send_ms: float) -> dict[str, Any]:
        return {
            "model": "64MiB", "model_bytes": 64 * MIB, "tensors": 4, "workers": 4,
            "transport": "dist", "topology": topology, "control_auth": auth,
            "skipped": [], "errors": [],
            "contenders": [
                _row("aiowsync dist send()", "aiowsync", [send_ms] * 3, mixed=0),
                _row("raw gloo broadcast", "limit", [40.0] * 3),
            ],
        }  # fmt: skip

    cells = [
        dist_cell("star", "curve", 41.0),
        dist_cell("star", "off", 40.0),
        dist_cell("chain", "curve", 50.0),
        dist_cell("chain", "off", 40.0),
    ]
    report: dict[str, Any] = {"run": {"cells": cells}}
    star = _check({"checks": checks(report)}, "64MiB x4 dist star: send() with CURVE")
    assert star["met"] is True and star["value"].startswith("1.025x (41.00 / 40.00 ms")
    assert star["target"] == "<= 1.05x"
    chain = _check({"checks": checks(report)}, "64MiB x4 dist chain: send() with CURVE")
    assert chain["met"] is False and chain["value"].startswith("1.250x")
    env = {"command": "aiowsync bench", "date": "2026-12-06", "cpus": 2, "mem_gib": 24,
           "python": "3.11", "torch": "2.13.0", "tensordict": "0.14.3", "aiowsync": "0.1.0",
           "torchrl_status": "torchrl 0.14.1", "load_start": [0.5, 0.5, 0.5]}  # fmt: skip
    report = {"env": env, "run": {**report["run"], "seconds": 60, "load_end": [1.0] * 3}}
    report["checks"] = checks(report)
    text = markdown(report)
    assert "| 64MiB | 4 | light | **aiowsync dist send()** | 41.0 |" in text
    assert "| 64MiB (control auth off) | 4 | light | **aiowsync dist send()** | 40.0 |" in text
    assert "| 64MiB (chain, control auth off) | 4 | light |" in text


def test_send_is_the_default_integrity_and_the_other_setting_is_a_row_of_its_own() -> None:
    """The ``send()`` row is the scheme as a user builds it: digests on over torch.distributed,
    off on one host; the other setting is the row that names it, and the cost check divides
    integrity on by integrity off on each transport (target 1.05x on dist only)."""
    from aiowsync._tools.bench._checks import INTEGRITY_MODE, integrity_rows

    assert INTEGRITY_MODE == {"shm": "send() +digest", "dist": "send() -digest"}
    assert integrity_rows("dist") == ("aiowsync dist send()", "aiowsync dist send() -digest")
    assert integrity_rows("shm") == ("aiowsync shm send() +digest", "aiowsync shm send()")

    def cell(transport: str, on_ms: float, off_ms: float) -> dict[str, Any]:
        on, off = integrity_rows(transport)
        return {
            "model": "64MiB", "model_bytes": 64 * MIB, "tensors": 4, "workers": 4,
            "transport": transport, "skipped": [], "errors": [],
            "contenders": [
                _row(on, "aiowsync", [on_ms] * 3, mixed=0),
                _row(off, "aiowsync", [off_ms] * 3, mixed=0),
                _row(LIMIT[transport], "limit", [off_ms] * 3),
            ],
        }  # fmt: skip

    report: dict[str, Any] = {"run": {"cells": [cell("dist", 84.0, 80.0), cell("shm", 30, 6)]}}
    found = checks(report)
    dist = _check({"checks": found}, "64MiB x4: aiowsync dist send(), integrity on / integrity off")
    assert dist["value"] == "1.05x" and dist["target"] == "<= 1.05x" and dist["met"] is True
    shm = _check({"checks": found}, "64MiB x4: aiowsync shm send(), integrity on / integrity off")
    assert shm["value"] == "5.00x" and shm["target"] == "none" and shm["met"] is None
    # The limit check divides the default send(), digests on, by the raw broadcast.
    limit = _check({"checks": found}, "64MiB x4: aiowsync dist send() / raw gloo broadcast")
    assert limit["value"] == "1.05x"


def test_models_are_the_advertised_sizes() -> None:
    assert spec_bytes(model_spec("1GiB")) == GIB
    many = model_spec("1000t-64MiB")
    assert len(many) == 1000 and spec_bytes(many) == 64 * MIB - 70  # ten int64 scalars -> bool
    assert sum(1 for e in many if e[2] == "bool") == 10
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("3MiB")


async def test_the_raw_copy_moves_whole_pages_of_at_least_the_models_bytes() -> None:
    """The 1000-tensor model's 64 MiB less 70 bytes is rounded up to a page: torch's copy of
    that odd length runs slower than the same bytes can move (docs/benchmarks.md)."""
    from aiowsync._tools.bench._contenders import RawCopy
    from aiowsync._tools.bench._models import raw_copy_bytes

    assert [raw_copy_bytes(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    odd = spec_bytes(model_spec("1000t-64MiB"))
    assert raw_copy_bytes(odd) == 64 * MIB
    for n in (MIB, 3 * 4096 + 5):
        raw = RawCopy(n)
        assert raw.nbytes == raw_copy_bytes(n) == raw.src.numel() == raw.dst.numel()
        assert raw.info == {"bytes": raw.nbytes, "model_bytes": n}
        raw.samples.append(await raw.sample())
        assert torch.equal(raw.dst, raw.src)  # every byte of the limit was copied
        raw.close()


def test_the_raw_gloo_receivers_read_the_model_tensor_by_tensor() -> None:
    """A policy worker's raw receiver reads what a round brought in the pieces the model's
    tensors have, every byte once, as the worker reads each version of the scheme's."""
    from aiowsync._tools.bench._rawgloo import _pieces

    buf = torch.arange(64, dtype=torch.uint8)
    pieces = _pieces(buf, [16, 6, 2, 40])
    assert [(p.dtype, p.numel()) for p in pieces] == [
        (torch.float32, 4),
        (torch.uint8, 6),  # not a whole number of floats
        (torch.uint8, 2),
        (torch.float32, 10),
    ]
    together = torch.cat([p.view(torch.uint8) for p in pieces])
    assert torch.equal(together, buf)  # each byte in one piece, in order
    assert pieces[0].data_ptr() == buf.data_ptr()  # views, not copies
    assert _pieces(buf, []) == []


def test_reader_sees_a_mix_of_two_fills() -> None:
    tensors = [torch.zeros(4), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)]
    reader = Reader(lambda: tensors, refresh=False)
    fill(tensors, 3)
    assert not reader.mixed()
    tensors[1][-1] = 4
    assert reader.mixed()
    fill(tensors, 5)
    tensors[2][0] = False  # a bool from an even fill beside odd numbers
    assert reader.mixed()


def test_plan_keeps_within_the_memory_budget() -> None:
    budget = 18 * GIB
    # 1 GiB to 8 workers: the distributed scheme alone needs two slots on each worker
    base = footprint("dist", GIB, 8) + footprint("raw gloo broadcast", GIB, 8)
    assert base > budget
    # small models: both TorchRL trees fit beside aiowsync in one batch
    small = footprint("shm", 64 * MIB, 4) + footprint("raw copy_", 64 * MIB, 4)
    assert plan_batches(("shared", "mp"), small, budget, 64 * MIB, 4) == ([["shared", "mp"]], [])
    # 1 GiB to 4 workers: one tree at a time
    big = footprint("shm", GIB, 4) + footprint("raw copy_", GIB, 4)
    batches, skipped = plan_batches(("shared", "mp"), big, budget, GIB, 4)
    assert batches == [["shared"], ["mp"]] and skipped == []
    # a tree that cannot fit at all is skipped, with the reason
    batches, skipped = plan_batches(("shared",), big, 10 * GIB, GIB, 8)
    assert batches == [] and skipped[0]["contender"] == "shared"
    assert "budget is 10.0 GiB" in skipped[0]["reason"]


def _row(name: str, kind: str, ms: list[float], mixed: int | None = None) -> dict[str, Any]:
    tear = None
    if mixed is not None:
        tear = {"reads": [{"send": 100}], "mixed": [{"send": mixed}]}
    return {"name": name, "kind": kind, "transport": "shm", "samples_s": [m / 1e3 for m in ms],
            "gap": None, "tear": tear, "notes": [], "info": None}  # fmt: skip


def _report(ours_ms: float, theirs_ms: float, their_mixed: int) -> dict[str, Any]:
    cell = {
        "model": "256MiB", "model_bytes": 256 * MIB, "tensors": 4, "workers": 4,
        "transport": "shm", "skipped": [], "errors": [],
        "contenders": [
            _row("aiowsync shm send(weights)", "aiowsync", [ours_ms] * 3, mixed=0),
            _row("raw copy_", "limit", [30.0, 31.0, 29.0]),
            _row("TorchRL SharedMem send(weights)", "torchrl", [theirs_ms] * 3, their_mixed),
        ],
    }  # fmt: skip
    too_big = [{"contender": "every dist contender", "reason": "needs ~27 GiB"}]
    skipped = {"model": "1GiB", "model_bytes": GIB, "tensors": 4, "workers": 8,
               "transport": "dist", "contenders": [], "errors": [], "skipped": too_big}  # fmt: skip
    small = {
        "model": "1MiB", "model_bytes": MIB, "tensors": 4, "workers": 4,
        "transport": "shm", "skipped": [], "errors": [],
        "contenders": [
            _row("aiowsync shm send()", "aiowsync", [ours_ms / 30] * 3, mixed=0),
            _row("raw copy_", "limit", [0.3] * 3),
            _row("raw zmq round trip", "floor", [0.9, 1.1, 1.0]),
        ],
    }  # fmt: skip
    failed = {"model": "64MiB", "workers": 1, "transport": "shm", "failed": "Trace\nBoom: x"}
    env = {"command": "aiowsync bench", "date": "2026-11-30", "cpus": 2, "mem_gib": 24,
           "python": "3.11", "torch": "2.13.0", "tensordict": "0.14.3", "aiowsync": "0.1.0",
           "torchrl_status": "torchrl 0.14.1", "load_start": [0.5, 0.5, 0.5]}  # fmt: skip
    report = {"env": env, "run": {"cells": [cell, small, skipped, failed], "seconds": 60,
                                  "load_end": [1.0, 1.0, 1.0]}}  # fmt: skip
    report["checks"] = checks(report)
    return report


def _check(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next(c for c in report["checks"] if c["check"].startswith(prefix))


def test_checks_judge_this_runs_ratios(tmp_path: Path) -> None:
    good = _report(ours_ms=36.0, theirs_ms=120.0, their_mixed=7)
    assert _check(good, "256MiB x4: TorchRL SharedMem send(weights)")["met"] is True
    assert _check(good, "256MiB x4: TorchRL SharedMem send(weights)")["value"] == "3.3x"
    assert _check(good, "256MiB x4: aiowsync shm send(weights) / raw copy_")["met"] is True
    assert _check(good, "1000t-64MiB x4: TorchRL")["met"] is None  # not in this run
    assert _check(good, "aiowsync mixed reads")["met"] is True
    # 1 MiB: 36 / 30 = 1.2 ms, shown beside the same cell's raw zmq round trip
    one = _check(good, "1MiB x4: aiowsync shm send() p50")
    assert one["met"] is False and one["value"] == "1.20 (raw zmq round trip: 1.00)"
    assert _check(good, "1MiB x4: aiowsync shm send(weights) p50")["met"] is None

    bad = _report(ours_ms=45.0, theirs_ms=120.0, their_mixed=7)
    assert _check(bad, "256MiB x4: TorchRL SharedMem send(weights)")["met"] is False
    assert _check(bad, "256MiB x4: aiowsync shm send(weights) / raw copy_")["met"] is False

    text = markdown(good)
    assert "| 256MiB | 4 | light | **aiowsync shm send(weights)** | 36.0 |" in text
    assert "| 1.20x |" in text  # 36 / 30 against the raw copy
    assert "| 3.3x |" in text  # TorchRL's row: how much faster aiowsync was
    # the floor is not a limit: no ratio to the raw copy on its row
    assert "| 1MiB | 4 | light | raw zmq round trip | 1.000 | 1.080 | 3 |  | - |  |  |" in text
    assert "| 7 / 100 (send 7, fill 0) |" in text  # its mixed reads, by the sender's phase
    assert "every dist contender: skipped, needs ~27 GiB" in text
    assert "shm: FAILED (Boom: x)" in text
    if HAS_MATPLOTLIB:
        assert plot(good, str(tmp_path / "p.png")) is None
        assert (tmp_path / "p.png").stat().st_size > 1000


def test_report_from_an_earlier_run(tmp_path: Path) -> None:
    source = tmp_path / "earlier.json"
    source.write_text(json.dumps(_report(ours_ms=36.0, theirs_ms=120.0, their_mixed=0)))
    status = main(["--from-json", str(source), "--out", str(tmp_path / "again")])
    assert status == 1  # the earlier run had a failed cell
    again = json.loads((tmp_path / "again" / "bench.json").read_text())
    assert _check(again, "256MiB x4: TorchRL SharedMem send(weights)")["value"] == "3.3x"
    assert "## Checks" in (tmp_path / "again" / "bench.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TORCHRL and not os.environ.get("AIOWSYNC_REQUIRE_TORCHRL"),
    reason="torchrl is not installed (the bench extra; `make test` runs this in .venv-bench)",
)
async def test_torchrl_tree_sends_and_counts_reads() -> None:
    from aiowsync._tools.bench._torchrl import TorchRLTree

    tree = TorchRLTree("shared", "1MiB", 2, timeout=60)
    try:
        info = await tree.open()
        assert info["scheme_class"] == "SharedMemWeightSyncScheme"
        assert info["aliases_sender_model"] == [True, True]  # TorchRL binds workers to its buffer
        for mode in ("send()", "send(weights)"):
            out = await tree.call("sample", mode)
            assert out["send_s"] > 0
        assert (await tree.call("verify"))["ok"]
        tear = await tree.call("tear", "send()", 2, 30.0)
        assert tear["verify"]["ok"] and all(sum(r.values()) > 0 for r in tear["reads"])
        gap = await tree.call("gap", "send(weights)", 1, 0.1)
        assert len(gap["workers_busy_s"]) == 2
    finally:
        await tree.close()
    assert tree._proc is None


def test_p90_lies_between_the_median_and_the_largest_sample() -> None:
    from aiowsync._tools.bench._checks import percentile

    assert percentile([2.0, 1.0], 0.9) == pytest.approx(1.9)
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([float(i) for i in range(11)], 0.9) == pytest.approx(9.0)


async def test_gap_windows_the_host_stole_from_are_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real contender (the raw copy) measures its gaps; the steal counter is the test's."""
    from aiowsync._tools.bench import _run
    from aiowsync._tools.bench._contenders import RawCopy

    stolen = iter([0.0, 60.0, 60.0, 60.0, 60.0, 70.0])  # 60, 0, 10 ms per attempt
    monkeypatch.setattr(_run, "host_steal_ms", lambda: next(stolen))
    settings = _run.Settings(cells=(), gap_sends=2, idle_s=0.05)
    progress = _run.Progress(1)
    raw = RawCopy(MIB)
    await _run._measure_gap(raw, settings, progress, "cell")
    gap = raw.gap
    assert gap is not None
    assert gap["host_steal_ms"] == 0.0  # the second attempt was kept
    assert [a["host_steal_ms"] for a in gap["set_aside"]] == [60.0]
    assert gap["set_aside"][0]["sender_busy_s"] > 0  # the first attempt's own figures
    assert len(raw.samples_outside) == 4  # two sends in each of the two attempts

    # Never more than GAP_RETAKES more: a host that keeps stealing gets its last attempt kept.
    always = iter(float(30 * k) for k in range(100))
    monkeypatch.setattr(_run, "host_steal_ms", lambda: next(always))
    await _run._measure_gap(raw, settings, progress, "cell")
    assert raw.gap is not None and len(raw.gap["set_aside"]) == _run.GAP_RETAKES
    raw.close()


def test_the_gap_check_says_what_was_measured_again() -> None:
    report = _report(ours_ms=36.0, theirs_ms=120.0, their_mixed=0)
    row = _row("aiowsync shm send()", "aiowsync", [70.0] * 3, mixed=0)
    aside = {"sender_idle_s": 0.002, "sender_busy_s": 0.2, "workers_idle_s": [0.002],
             "workers_busy_s": [0.2], "host_steal_ms": 180.0}  # fmt: skip
    row["gap"] = {"sender_idle_s": 0.002, "sender_busy_s": 0.006, "workers_idle_s": [0.002],
                  "workers_busy_s": [0.009], "host_steal_ms": 0.0,
                  "set_aside": [aside]}  # fmt: skip
    cell = {"model": "1GiB", "model_bytes": GIB, "tensors": 4, "workers": 1, "transport": "shm",
            "skipped": [], "errors": [], "contenders": [row]}  # fmt: skip
    report["run"]["cells"].append(cell)
    gap = _check({"checks": checks(report)}, "1GiB shm: aiowsync loop max gap")
    assert gap["met"] is True  # judged on the attempt kept: 7 ms above idle
    assert (
        gap["value"]
        == "7.0 (measured again: 1 window pair(s) in which the host took 180 ms of CPU)"
    )


async def test_rounds_shuffle_who_goes_after_whom() -> None:
    """Every contender samples once per round; the order changes from round to round, so a
    contender does not always follow the same one, and the orders are the same in every run
    of a cell."""
    from aiowsync._tools.bench import _run
    from aiowsync._tools.bench._contenders import Contender
    from aiowsync._tools.bench._rounds import ROUND_START, rounds

    def contenders() -> list[Contender]:
        out = []
        for name in "abcdefg":
            c = Contender(name, "shm")

            async def timed(c: Contender = c) -> float:
                c.notes.append("sampled")  # counts the calls
                return float(len(c.notes) - 1)

            c.timed = timed  # type: ignore[method-assign]
            out.append(c)
        return out

    first, second = contenders(), contenders()
    for everyone in (first, second):
        await rounds(everyone, 12, _run.Progress(1), "64MiB x4 shm", paired=False)
    for c in first:
        assert c.samples == [float(k) for k in range(12)]
        assert len(c.after) == 12 and c.name not in c.after
        assert len(set(c.after)) >= 4  # a rotation would give one name and the round start
    assert [c.after for c in first] == [c.after for c in second]
    starts = [[c.name for c in first if c.after[r] == ROUND_START] for r in range(12)]
    assert all(len(starters) == 1 for starters in starts)
    assert len({s[0] for s in starts}) >= 3

    # Every sample waited for a quiet machine first (a pair: before its first send only).
    assert all(len(c.quiet) == 12 for c in first)
    paired = contenders()
    await rounds(paired, 3, _run.Progress(1), "1MiB x4 shm", paired=True)
    assert all(c.samples_lead == [0.0, 2.0, 4.0] and c.samples == [1.0, 3.0, 5.0] for c in paired)
    assert all(len(c.quiet) == 3 for c in paired)


async def test_a_torchrl_tree_that_fails_to_start_leaves_the_others_their_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, one try covered opening the trees and the rounds: a tree that could not start
    # (TorchRL's distributed tree refuses a host name that resolves to a LAN address) took
    # every sample of aiowsync and of the limits with it, and the run exited 0.
    from aiowsync._tools.bench import _run
    from aiowsync._tools.bench._contenders import RawCopy
    from aiowsync._tools.bench._torchrl import TorchRLError, TorchRLTree

    async def refuse(self: TorchRLTree) -> dict[str, Any]:
        raise TorchRLError(f"{self.scheme}: host name resolves to 10.1.2.3, not loopback")

    closed: list[str] = []

    async def close(self: TorchRLTree) -> None:
        closed.append(self.scheme)

    monkeypatch.setattr(TorchRLTree, "open", refuse)
    monkeypatch.setattr(TorchRLTree, "close", close)
    settings = _parse(["--quick", "--gates", "busy"])
    copy = RawCopy(MIB)
    out: dict[str, Any] = {"errors": []}
    theirs = await _run._batch(
        ["distributed"], "1MiB", 2, [copy], 3, settings, out, _run.Progress(1), "1MiB x2 dist"
    )
    copy.close()
    assert theirs == [] and closed == ["distributed"]
    assert len(copy.busy) == 3  # the standing contender's rounds ran
    assert out["errors"] == [
        {"batch": ["distributed"], "error": "distributed: host name resolves to 10.1.2.3, "
         "not loopback"}
    ]  # fmt: skip


def test_a_run_of_chains_alone_is_plotted(tmp_path: Path) -> None:
    # The plot draws one variant per line: the default's, or the first one run; a run of
    # chains alone drew nothing and said that nothing was measured.
    pytest.importorskip("matplotlib")
    report = _report(ours_ms=36.0, theirs_ms=120.0, their_mixed=0)
    for cell in report["run"]["cells"]:
        cell["topology"] = "chain"
    assert plot(report, str(tmp_path / "chains.png")) is None
    assert (tmp_path / "chains.png").stat().st_size > 0


def test_a_run_with_a_failed_torchrl_tree_or_an_empty_row_exits_non_zero(tmp_path: Path) -> None:
    from aiowsync._tools.bench import _write

    report = _report(ours_ms=36.0, theirs_ms=120.0, their_mixed=0)
    report["run"]["cells"] = [c for c in report["run"]["cells"] if "failed" not in c]
    assert _write(json.loads(json.dumps(report)), str(tmp_path / "whole")) == 0
    report["run"]["cells"][0]["errors"].append({"batch": ["mp"], "error": "no answer"})
    assert _write(json.loads(json.dumps(report)), str(tmp_path / "error")) == 1
    report["run"]["cells"][0]["errors"].clear()
    report["run"]["cells"][0]["contenders"][0]["samples_s"] = []
    assert _write(json.loads(json.dumps(report)), str(tmp_path / "empty")) == 1


async def test_each_round_takes_a_quiet_then_a_busy_sample_of_every_contender() -> None:
    """Under both gates a round is two turns of every contender, each in a shuffled order:
    the quiet one waits for a quiet machine, the busy one starts at once; the busy turn's
    predecessors carry on from the quiet turn's last contender."""
    from aiowsync._tools.bench import _run
    from aiowsync._tools.bench._contenders import Contender
    from aiowsync._tools.bench._rounds import ROUND_START, rounds

    calls: list[str] = []
    everyone = []
    for name in "abc":
        c = Contender(name, "shm")

        async def timed(name: str = name) -> float:
            calls.append(name)
            return float(len(calls))

        c.timed = timed  # type: ignore[method-assign]
        everyone.append(c)
    await rounds(everyone, 4, _run.Progress(1), "64MiB x4 dist", False, ("quiet", "busy"))
    assert len(calls) == 4 * 2 * 3
    for r in range(4):
        turn = calls[r * 6 : (r + 1) * 6]
        assert sorted(turn[:3]) == sorted(turn[3:]) == ["a", "b", "c"]  # every one per gate
    for c in everyone:
        assert len(c.samples) == len(c.busy) == len(c.quiet) == 4  # only quiet ones wait
        assert all(q < b for q, b in zip(c.samples, c.busy, strict=True))  # quiet turn first
        assert ROUND_START not in c.busy_after  # a busy turn follows the quiet one's last
    busy_only = Contender("d", "shm")
    busy_only.timed = everyone[0].timed  # type: ignore[method-assign]
    await rounds([busy_only], 2, _run.Progress(1), "x", True, ("busy",))
    assert len(busy_only.busy) == len(busy_only.busy_lead) == 2
    assert busy_only.samples == [] and busy_only.quiet == []


async def test_a_policy_worker_reads_every_tensor_of_each_new_version_under_the_guard() -> None:
    from aiowsync._tools.bench._models import build_model, poison_init
    from aiowsync._tools.bench._worker import POLICY_PERIOD_S, PolicyReads

    class Guard:
        held = 0

        async def __aenter__(self) -> None:
            Guard.held += 1

        async def __aexit__(self, *exc: object) -> None:
            pass

    class Scheme:
        version = 0

        def read_guard(self) -> Guard:
            return Guard()

    spec = model_spec("1000t-64MiB")
    model = build_model(spec, poison_init)
    scheme = Scheme()
    policy = PolicyReads(model, scheme)
    task = asyncio.create_task(policy.run())
    try:
        await asyncio.sleep(10 * POLICY_PERIOD_S)
        assert policy.reads == 0  # nothing new since it started
        for version in (1, 2):
            scheme.version = version
            for _ in range(2000):
                await asyncio.sleep(POLICY_PERIOD_S)
                if policy.reads == version:
                    break
            await asyncio.sleep(10 * POLICY_PERIOD_S)
            assert policy.reads == version  # once per new version, not per wake-up
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    stats = policy.stats()
    assert stats["tensors"] == len(spec) == len(model.state_dict()) == 1000
    assert stats["bytes"] == spec_bytes(spec) and stats["read_s"] > 0
    assert Guard.held == 2


def test_profiles_and_gates_are_chosen_on_the_command_line() -> None:
    from aiowsync._tools.bench._plan import GATES, PROFILES, Settings

    assert PROFILES == ("policy", "light") and GATES == ("quiet", "busy")
    assert Settings(cells=()).profiles == PROFILES and Settings(cells=()).gates == GATES
    default = _parse([])
    assert default.profiles == ("policy", "light") and default.gates == ("quiet", "busy")
    chosen = _parse(["--profiles", "light", "--gates", "busy,quiet"])
    assert chosen.profiles == ("light",) and chosen.gates == ("busy", "quiet")
    for bad in (["--profiles", "heavy"], ["--gates", "quiet,quiet"], ["--gates", "idle"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_checks_judge_policy_cells_and_every_figure_names_its_profile() -> None:
    """Where a run has both profiles, aiowsync's ratios are judged on the policy cells, the
    comparisons with TorchRL on the light ones (TorchRL runs there only); the table says the
    profile of every row and the busy gate's medians beside the quiet ones."""

    def cell(profile: str, send_ms: float, busy_ms: float) -> dict[str, Any]:
        send = _row("aiowsync dist send()", "aiowsync", [send_ms] * 3, mixed=0)
        send["busy_samples_s"] = [busy_ms / 1e3] * 3
        limit = _row("raw gloo broadcast", "limit", [80.0] * 3)
        limit["busy_samples_s"] = [100 / 1e3] * 3
        return {
            "model": "64MiB", "model_bytes": 64 * MIB, "tensors": 4, "workers": 4,
            "transport": "dist", "profile": profile, "skipped": [], "errors": [],
            "contenders": [send, limit],
        }  # fmt: skip

    report: dict[str, Any] = {
        "env": {"command": "aiowsync bench", "date": "2026-12-07", "cpus": 2, "mem_gib": 24,
                "python": "3.11", "torch": "2.13.0", "tensordict": "0.14.3",
                "aiowsync": "0.1.0", "torchrl_status": "torchrl 0.14.1",
                "load_start": [0.5] * 3},
        "run": {"cells": [cell("policy", 96.0, 130.0), cell("light", 80.0, 100.0)],
                "seconds": 60, "load_end": [1.0] * 3},
    }  # fmt: skip
    report["checks"] = checks(report)
    limit = _check(report, "64MiB x4: aiowsync dist send() / raw gloo broadcast")
    assert limit["check"].endswith("[policy]")
    assert limit["value"] == "1.20x (busy: 1.30x)" and limit["met"] is False
    torchrl = _check(report, "256MiB x4: TorchRL SharedMem send(weights)")
    assert torchrl["check"].endswith("[light]")
    text = markdown(report)
    policy = "| 64MiB | 4 | policy | **aiowsync dist send()** | 96.0 | 96.0 | 3 | 1.20x "
    light = "| 64MiB | 4 | light | **aiowsync dist send()** | 80.0 | 80.0 | 3 | 1.00x "
    assert policy + "| 130.0 | 1.30x |" in text and light + "| 100.0 | 1.00x |" in text
    assert "*policy*: a task on each worker's event loop wakes every 2 ms" in text
    assert "*busy*: in the same rounds" in text
    # An older run (no profiles): light workers, judged as such, no busy column filled.
    old = _report(ours_ms=36.0, theirs_ms=120.0, their_mixed=0)
    assert _check(old, "256MiB x4: aiowsync shm send(weights) / raw copy_")["check"].endswith(
        "[light]"
    )
    assert "*busy*" not in markdown(old)


@pytest.mark.parametrize("paired", [False, True])
async def test_the_raw_gloo_limit_has_rounds_for_every_retaken_gap_window(
    monkeypatch: pytest.MonkeyPatch, paired: bool
) -> None:
    """The raw gloo receivers are told their number of rounds up front. A cell whose gap
    windows were all measured again (the host kept stealing) then two batches of TorchRL
    trees must not run out of them, as full run 12 did in its 64MiB x8 dist cell."""
    from aiowsync._tools.bench import _run
    from aiowsync._tools.bench._contenders import Contender
    from aiowsync._tools.bench._rounds import rounds

    calls = 0

    class Counting(Contender):
        async def timed(self) -> float:
            nonlocal calls
            calls += 1
            return 0.001

    steal = iter(float(100 * k) for k in range(100))  # 100 ms stolen in every window pair
    monkeypatch.setattr(_run, "host_steal_ms", lambda: next(steal))
    settings = _run.Settings(cells=(), gap_sends=3, idle_s=0.01)
    progress = _run.Progress(1)
    limit = Counting("raw gloo broadcast", "dist")
    samples, batches = 4, 2
    await limit.sample()  # the cell's warm-up
    await _run._measure_gap(limit, settings, progress, "cell")
    assert limit.gap is not None and len(limit.gap["set_aside"]) == _run.GAP_RETAKES
    for _ in range(batches):
        await limit.sample()  # each batch's warm-up
        await rounds([limit], samples, progress, "cell", paired, settings.gates)
    assert calls == _run.raw_gloo_rounds(samples, paired, batches, settings)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _readings(*counts: int | None) -> Callable[[], int | None]:
    """A reader of runnable tasks that gives ``counts`` in turn, then the last one for good."""
    it = iter(counts)
    last = counts[-1]

    def read() -> int | None:
        nonlocal last
        last = next(it, last)
        return last

    return read


async def test_the_quiet_wait_finds_quiet_only_after_enough_quiet_reads_in_a_row() -> None:
    from aiowsync._tools.bench._probe import QUIET_READS, wait_quiet

    waited, quiet = await wait_quiet(most=30.0, read=_readings(3, 1, 1, 2, *[1] * QUIET_READS))
    assert quiet and waited < 30.0
    reads = 0

    def counted() -> int:
        nonlocal reads
        reads += 1
        return 1

    assert (await wait_quiet(most=30.0, read=counted))[1] and reads == QUIET_READS
    assert await wait_quiet(most=30.0, read=lambda: None) == (0.0, True)  # Linux does not say


async def test_the_quiet_wait_gives_up_after_its_limit_on_a_machine_that_stays_busy() -> None:
    from aiowsync._tools.bench._probe import wait_quiet

    started = time.perf_counter()
    waited, quiet = await wait_quiet(most=0.3, read=_readings(1, 1, 4))
    took = time.perf_counter() - started
    assert not quiet and 0.3 <= waited <= took < 5.0  # the bound is generous: a busy host


async def test_real_busy_processes_keep_the_machine_from_being_quiet_and_the_wait_gives_up() -> (
    None
):
    """Two processes spinning are always runnable, beside the reader, however many CPUs the
    machine has and whatever else runs on it."""
    from aiowsync._tools.bench._probe import runnable_tasks, wait_quiet

    if runnable_tasks() is None:
        pytest.skip("Linux does not say how many tasks are runnable here")
    ctx = multiprocessing.get_context("spawn")
    busy = [ctx.Process(target=_spin, args=(60.0,), daemon=True) for _ in range(2)]
    for p in busy:
        p.start()
    try:
        await asyncio.sleep(1.0)  # past the interpreter's start-up, into the loop
        started = time.perf_counter()
        waited, quiet = await wait_quiet(most=0.3)
        took = time.perf_counter() - started
        assert not quiet and 0.3 <= waited <= took < 5.0
    finally:
        for p in busy:
            p.kill()
            p.join(timeout=10)


def test_the_report_says_how_long_samples_waited_for_quiet() -> None:
    from aiowsync._tools.bench._report import _quiet_text

    def report(waits: list[float], found: list[bool]) -> dict[str, object]:
        row = {"quiet_wait_s": waits, "quiet_found": found}
        return {"run": {"cells": [{"contenders": [row]}]}}

    text = _quiet_text(report([0.002, 0.004, 1.0], [True, True, False]))
    assert "4 ms median, 1000 ms at most; 1 of 3 samples" in text
    assert _quiet_text({"run": {"cells": [{"contenders": [{}]}]}}) == ""  # an older run
