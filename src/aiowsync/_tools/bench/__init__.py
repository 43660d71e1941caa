"""``aiowsync bench``: aiowsync against the raw limits and TorchRL, in one run.

For every model (1 MiB, 64 MiB, 256 MiB, 1 GiB, a 1000-tensor 64 MiB model) and worker count
(1, 4, 8), and for each transport (``shm``: one host through shared memory; ``dist``:
torch.distributed, gloo), one *cell* measures in the same run:

* aiowsync's ``send()`` and (``shm``) ``send(weights)``, sender in this process, workers in
  long-lived spawned processes;
* the limit: one ``copy_`` of the same bytes as one flat tensor (``shm``), or one raw gloo
  broadcast of a flat buffer to the same worker processes plus a one-byte confirmation
  (``dist``);
* when torchrl imports: TorchRL's SharedMemWeightSyncScheme (``send()`` and ``send(weights)``)
  and MultiProcessWeightSyncScheme (``shm`` cells), DistributedWeightSyncScheme (``dist``
  cells), each in a process tree of its own, driven through TorchRL's public API.

Each cell is measured once per worker *profile*: ``policy`` (a task on each worker's event
loop wakes every 2 ms and reads every tensor of the model once after each new version) and
``light`` (the workers do nothing else). Contenders take their samples in turn, one each per
round and gate, in an order shuffled every time, so drift of the machine, and whatever a
contender leaves behind for the next, hits all of them alike; under the ``quiet`` gate a sample
starts once the machine is quiet, under ``busy`` at once. Afterwards each contender with
workers measures its event-loop gaps (idle, then during a few sends) and its mixed reads
(readers on every worker check each read during a few sends). Contenders that would not fit
in memory beside the others are skipped and the report says so.

Outputs, in ``--out`` (default ``./aiowsync-bench``): ``bench.json`` (every sample),
``bench.md`` (medians, ratios, checks against the project's targets) and ``bench.png``.

May import: aiowsync, aiowsync._exceptions, aiowsync._config, aiowsync._util,
aiowsync._channel, aiowsync._copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
from importlib import metadata
from typing import Any

__all__ = ["main"]

ALL_MODELS = ("1MiB", "64MiB", "256MiB", "1GiB", "1000t-64MiB")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="aiowsync bench",
        description="Send latency, event-loop gaps and mixed reads of aiowsync, the raw limits "
        "and (when installed) TorchRL's weight-sync schemes, measured in one run.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="64MiB and 1000t-64MiB to 4 workers on shm (TorchRL MultiProcess on 64MiB only), "
        "64MiB on dist; few samples (a few minutes with both profiles and gates)",
    )
    p.add_argument("--models", help=f"comma-separated, among {','.join(ALL_MODELS)} (default: all)")
    p.add_argument("--workers", help="comma-separated worker counts (default: 1,4,8)")
    p.add_argument("--transports", help="comma-separated: shm, dist (default: both)")
    p.add_argument(
        "--samples",
        type=int,
        help="rounds of a cell, each one sample per contender and gate (default: by model, "
        "4 to 30; --quick: 2 to 10); quote medians of 20 or more",
    )
    p.add_argument("--no-torchrl", action="store_true", help="leave TorchRL out")
    p.add_argument(
        "--wire-dtype",
        choices=["bfloat16", "float16"],
        help="aiowsync's schemes send floats in this dtype; workers copy with a cast "
        "(default: as they are)",
    )
    p.add_argument(
        "--rehome",
        action="store_true",
        help="aiowsync's senders re-home their model (its tensors become views of one flat "
        "buffer, so a snapshot is one copy)",
    )
    p.add_argument(
        "--bucket-mib",
        type=float,
        help="bucket size of aiowsync's distributed scheme, MiB (default: the scheme's)",
    )
    p.add_argument(
        "--topologies",
        help="comma-separated topologies of aiowsync's distributed scheme: star, chain; each "
        "dist cell is measured once per topology (default: star)",
    )
    p.add_argument(
        "--control-auth",
        help="comma-separated, of the dist cells' control channel: curve (the default: CURVE "
        "keys of the scheme's own), off (ZmqChannelFactory(allow_insecure_bind=True)); each "
        "dist cell is measured once per entry, in this order (repeats allowed, e.g. "
        "curve,off,off,curve), and the checks compare curve with off",
    )
    p.add_argument(
        "--profiles",
        help="comma-separated, what aiowsync's workers do beside receiving: policy (a task on "
        "each worker's event loop wakes every 2 ms and reads every tensor once after each new "
        "version), light (nothing else); each cell is measured once per profile, in this "
        "order; TorchRL joins the light cells only (default: policy,light)",
    )
    p.add_argument(
        "--gates",
        help="comma-separated, when a sample starts: quiet (once no other task of the machine "
        "runs), busy (at once, whatever still runs); each round samples every contender once "
        "per gate, and the report shows each gate's medians (default: quiet,busy)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="deadline of every wait, s (default: 120)"
    )
    p.add_argument(
        "--out", default="aiowsync-bench", help="directory for the outputs (default: %(default)s)"
    )
    p.add_argument(
        "--from-json", metavar="FILE", help="measure nothing: write the report of an earlier run"
    )
    args = p.parse_args(argv)
    options = ("models", "workers", "transports", "topologies", "control_auth", "profiles", "gates")
    for option in options:
        value = getattr(args, option, None)
        if value is not None and "" in value.split(","):
            p.error(f"--{option.replace('_', '-')} has an empty entry: {value!r}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    models = tuple(args.models.split(",")) if args.models else ALL_MODELS
    bad = [m for m in models if m not in ALL_MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose among {', '.join(ALL_MODELS)}")
    workers: tuple[int, ...] = (1, 4, 8)
    if args.workers:
        try:
            workers = tuple(int(w) for w in args.workers.split(","))
        except ValueError:
            p.error(f"--workers must be integers, got {args.workers!r}")
    if any(w < 1 for w in workers):
        p.error("worker counts must be at least 1")
    transports = tuple(args.transports.split(",")) if args.transports else ("shm", "dist")
    if not set(transports) <= {"shm", "dist"}:
        p.error("--transports takes shm, dist or both")
    if args.samples is not None and args.samples < 1:
        p.error("--samples must be at least 1")
    if args.bucket_mib is not None and args.bucket_mib <= 0:
        p.error("--bucket-mib must be positive")
    args.topologies = tuple(args.topologies.split(",")) if args.topologies else ("star",)
    if not set(args.topologies) <= {"star", "chain"}:
        p.error("--topologies takes star, chain or both")
    args.control_auth = tuple(args.control_auth.split(",")) if args.control_auth else ("curve",)
    if not set(args.control_auth) <= {"curve", "off"}:
        p.error("--control-auth takes curve and off")
    args.profiles = _choice(p, "--profiles", args.profiles, ("policy", "light"))
    args.gates = _choice(p, "--gates", args.gates, ("quiet", "busy"))
    from ._plan import QUICK_CELLS, matrix

    chosen = args.models or args.workers or args.transports
    args.cells = QUICK_CELLS if args.quick and not chosen else matrix(models, workers, transports)
    return args


def _choice(
    p: argparse.ArgumentParser, option: str, given: str | None, known: tuple[str, ...]
) -> tuple[str, ...]:
    """A comma-separated option's entries, each among ``known``, each once; all of ``known``
    when not given."""
    chosen = tuple(given.split(",")) if given else known
    if not set(chosen) <= set(known) or len(set(chosen)) != len(chosen):
        p.error(f"{option} takes {', '.join(known)}, each once")
    return chosen


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _environment(argv: list[str], torchrl_line: str) -> dict[str, Any]:
    from aiowsync._copy.engine import default_policy  # imports torch: only when a run starts

    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return {
        "command": " ".join(["aiowsync", "bench", *argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "mem_gib": mem_kb / 2**20,
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "tensordict": _version("tensordict"),
        "torchrl": _version("torchrl"),
        "aiowsync": f"{_version('aiowsync')} ({_git_commit() or 'no git'})",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "copies": "non-temporal stores" if default_policy().streaming else "ordinary stores",
        "torchrl_status": torchrl_line,
        "load_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    """``aiowsync bench [options]``; returns the exit status (1 when a cell failed)."""
    args_list = sys.argv[2:] if argv is None else list(argv)
    if argv is None and os.environ.get("OMP_WAIT_POLICY") is None:
        # Idle OpenMP threads must sleep, not spin, or a small machine measures its own
        # spinning; the policy is read when torch loads, so start again with it set.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "aiowsync", "bench", *args_list])
    args = _parse(args_list)
    if args.from_json:
        with open(args.from_json) as f:
            return _write(json.load(f), args.out)

    from ._plan import FULL_SAMPLES, QUICK_LEAVE_OUT, QUICK_SAMPLES, Settings
    from ._run import run_sync
    from ._torchrl import torchrl_status

    torchrl_version, torchrl_line = torchrl_status()
    use_torchrl = torchrl_version is not None and not args.no_torchrl
    if args.no_torchrl:
        torchrl_line += " (left out: --no-torchrl)"
    samples = dict(QUICK_SAMPLES if args.quick else FULL_SAMPLES)
    if args.samples is not None:
        samples = dict.fromkeys(samples, args.samples)
    settings = Settings(
        cells=args.cells,
        samples=samples,
        gap_sends=1 if args.quick else 3,
        tear_sends=2 if args.quick else 5,
        tear_max_s=6.0 if args.quick else 15.0,
        idle_s=0.3 if args.quick else 0.5,
        timeout=args.timeout,
        torchrl=use_torchrl,
        leave_out=QUICK_LEAVE_OUT if args.quick else (),
        wire_dtype=args.wire_dtype,
        rehome=args.rehome,
        bucket_bytes=None if args.bucket_mib is None else int(args.bucket_mib * 2**20),
        topologies=args.topologies,
        control_auth=args.control_auth,
        profiles=args.profiles,
        gates=args.gates,
    )
    print(f"aiowsync bench: {torchrl_line}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "env": _environment(args_list, torchrl_line),
        "settings": dataclasses.asdict(settings),
    }
    report["run"] = run_sync(settings)
    return _write(report, args.out)


def _write(report: dict[str, Any], out: str) -> int:
    from ._checks import checks
    from ._report import markdown, plot

    report["checks"] = checks(report)
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f"bench.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    why = plot(report, paths["png"])
    if why:
        text += f"\n{why}\n"
        del paths["png"]
    with open(paths["md"], "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {', '.join(paths.values())}", file=sys.stderr)
    return 1 if any(_incomplete(c) for c in report["run"]["cells"]) else 0


def _incomplete(cell: dict[str, Any]) -> bool:
    """Whether a cell failed, or some of it did (a TorchRL tree, a row without samples)."""
    if "failed" in cell or cell.get("errors"):
        return True
    return any(
        not (row["samples_s"] or row.get("busy_samples_s")) for row in cell.get("contenders", [])
    )
