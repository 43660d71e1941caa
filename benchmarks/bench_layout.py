"""Packing a model into flat buffers: aiowsync's layouts against one raw copy of the same bytes.

Two 64 MiB float32 models are built (each an ``nn.Module``):

* ``many-small``: 1000 tensors of varied sizes (500 blocks of a 2-D weight and a 1-D bias,
  sizes drawn from a log-normal, a few hundred bytes to a few MiB each);
* ``few-large``: 4 weight matrices (32, 16, 8 and 8 MiB).

For each, these contenders are measured in the same run, interleaved copy by copy (one copy of
each contender in turn, the order rotating every round) so that drift of the machine, which on
this shared VM changes its memory bandwidth within seconds, hits all of them alike:

* ``raw copy_``: the baseline, ``dst.copy_(src)`` of one contiguous tensor of exactly the
  model's payload bytes (a plain memcpy as fast as torch does it);
* ``pack (fused)``: ``Layout.pack(tensors, views)`` of the module's own tensors into the views of
  freshly allocated layout buffers (``aiowsync._copy.engine.fused_copy``: memmoves, or non-temporal
  stores, shared among a few threads, under the process's default copy policy);
* ``re-homed snapshot``: the module was re-homed with ``aiowsync._weights.binding.rehome``, so its
  tensors already live in the layout's flat buffers; a snapshot is one ``copy_`` per flat buffer
  into a second set of buffers of the same sizes (this copies the alignment padding too);
* ``pack (fused, 1 thread)`` (informational): the same fused pack with
  ``torch.set_num_threads(1)`` around it, so that the calling thread copies every byte alone;
  this contender shows what the helper threads bring;
* ``pack (python loop)`` (informational): ``dst.copy_(src)`` per tensor from Python, to show
  what fusing saves.

Targets, as ratios of medians against ``raw copy_``: fused pack about 1.6x (on the many-small
model), re-homed snapshot <= 1.1x.

Reading the numbers: on this shared 2-core VM the second vCPU is sometimes effectively
unavailable for seconds at a time; a raw copy then runs at one-thread speed. Large copies gain
from the second thread, so the fused-pack ratio moves a lot with that state (per-round ratios
show it). The load average at the start and end is printed and recorded.

Environment: ``OMP_WAIT_POLICY=PASSIVE`` is set (unless already set) before torch is imported,
so that torch's OpenMP threads sleep instead of spinning when idle on the shared 2-core machine.
torch's intra-op thread count is left at its default (printed; every contender uses the same
team) unless ``--threads`` is given.

Usage::

    .venv/bin/python benchmarks/bench_layout.py            # ~30 s
    .venv/bin/python benchmarks/bench_layout.py --quick
"""

from __future__ import annotations

import os

# Must happen before torch is imported: idle OpenMP threads must not spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiowsync._weights.binding import is_homed, module_targets, rehome
from aiowsync._weights.flatten import flatten_weights
from aiowsync._weights.layout import Layout

MIB = 1 << 20
MODEL_BYTES = 64 * MIB
FLOAT_BYTES = 4
TARGETS = {"pack (fused)": 1.6, "re-homed snapshot": 1.1}
TARGET_MODEL = {"pack (fused)": "many-small", "re-homed snapshot": None}  # None: every model


# -- models -------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, weight: Sequence[int], bias: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*weight))
        self.bias = None if bias is None else nn.Parameter(torch.randn(bias))


class Model(nn.Module):
    def __init__(self, blocks: list[tuple[Sequence[int], int | None]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(w, b) for w, b in blocks)


def many_small_shapes(n_tensors: int, total_floats: int, seed: int) -> list[Any]:
    """``n_tensors // 2`` blocks of (weight, bias) whose sizes add up to ``total_floats``."""
    rng = random.Random(seed)
    n_blocks = n_tensors // 2
    biases = [rng.randint(16, 2048) for _ in range(n_blocks)]
    rest = total_floats - sum(biases)
    draws = [rng.lognormvariate(0.0, 1.2) for _ in range(n_blocks)]
    scale = rest / sum(draws)
    blocks: list[tuple[Sequence[int], int | None]] = []
    used = 0
    for i in range(n_blocks - 1):
        rows = rng.choice((32, 64, 128, 256, 512, 1024))
        cols = max(1, int(draws[i] * scale) // rows)
        blocks.append(((rows, cols), biases[i]))
        used += rows * cols
    # the last weight takes whatever is left, so the model is exactly total_floats
    remainder = rest - used
    if remainder <= 0:
        raise AssertionError("size draw overshot the model size; change the seed")
    blocks.append(((remainder,), biases[-1]))
    return blocks


def few_large_shapes() -> list[Any]:
    return [((4096, 2048), None), ((2048, 2048), None), ((2048, 1024), None), ((1024, 2048), None)]


def build(shapes: list[Any], seed: int) -> Model:
    torch.manual_seed(seed)
    with torch.no_grad():
        return Model(shapes)


# -- contenders ---------------------------------------------------------------------------------


class Case:
    """The buffers and operations measured for one model."""

    def __init__(self, name: str, shapes: list[Any], seed: int) -> None:
        self.name = name
        packed_model = build(shapes, seed)
        homed_model = build(shapes, seed)  # same values, re-homed below
        self.layout = Layout.from_weights(packed_model)
        self.tensors = flatten_weights(packed_model)
        self.payload = self.layout.payload_bytes
        if self.payload != MODEL_BYTES:
            raise AssertionError(f"{name}: model has {self.payload} bytes, not {MODEL_BYTES}")

        # raw baseline: one contiguous tensor of the same number of bytes, both ends touched
        self.raw_src = torch.empty(self.payload, dtype=torch.uint8).random_(0, 256)
        self.raw_dst = torch.zeros(self.payload, dtype=torch.uint8)

        # fused pack: module tensors -> views of fresh layout buffers
        self.pack_buffers = self.layout.allocate()
        self.pack_views = self.layout.views(self.pack_buffers)
        self.loop_pairs = [(self.pack_views[k], self.tensors[k]) for k in self.layout.keys]

        # re-homed: the module's tensors are views of flat buffers; snapshot = copy per buffer
        self.homed_model = homed_model
        self.homed_buffers = rehome(homed_model, self.layout)
        targets = module_targets(homed_model)
        if not is_homed(targets, self.layout.views(self.homed_buffers)):
            raise AssertionError(f"{name}: rehome did not leave the module homed")
        self.snap_buffers = self.layout.allocate()
        self.snap_pairs = list(zip(self.snap_buffers, self.homed_buffers, strict=True))

    # the measured operations

    def raw_copy(self) -> None:
        self.raw_dst.copy_(self.raw_src)

    def fused_pack(self) -> None:
        self.layout.pack(self.tensors, self.pack_views)

    def homed_snapshot(self) -> None:
        for dst, src in self.snap_pairs:
            dst.copy_(src)

    def fused_pack_one_thread(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.layout.pack(self.tensors, self.pack_views)
        finally:
            torch.set_num_threads(threads)

    def loop_pack(self) -> None:
        with torch.no_grad():
            for dst, src in self.loop_pairs:
                dst.copy_(src)

    def contenders(self, with_extra: bool) -> dict[str, Callable[[], None]]:
        out = {
            "raw copy_": self.raw_copy,
            "pack (fused)": self.fused_pack,
            "re-homed snapshot": self.homed_snapshot,
        }
        if with_extra:
            out["pack (fused, 1 thread)"] = self.fused_pack_one_thread
            out["pack (python loop)"] = self.loop_pack
        return out

    def verify(self) -> None:
        """The copies must have produced the model's values, byte for byte."""
        if not torch.equal(self.raw_dst, self.raw_src):
            raise AssertionError(f"{self.name}: raw copy differs")
        packed = self.layout.views(self.pack_buffers)
        snap = self.layout.views(self.snap_buffers)
        live = module_targets(self.homed_model)
        for key in self.layout.keys:
            if not torch.equal(packed[key], self.tensors[key]):
                raise AssertionError(f"{self.name}: packed {key} differs from the module's")
            if not torch.equal(snap[key], live[key]):
                raise AssertionError(f"{self.name}: snapshot {key} differs from the module's")
            if not torch.equal(snap[key], self.tensors[key]):
                raise AssertionError(f"{self.name}: re-homed {key} lost its value")


# -- measurement --------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(rounds: list[list[int]], nbytes: int) -> dict[str, Any]:
    ms = sorted(ns / 1e6 for r in rounds for ns in r)
    med = statistics.median(ms)
    round_medians = [statistics.median(r) / 1e6 for r in rounds]
    return {
        "samples": len(ms),
        "bytes_copied": nbytes,
        "median_ms": med,
        "p10_ms": percentile(ms, 10),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "spread_p10_p90_pct": 100 * (percentile(ms, 90) - percentile(ms, 10)) / med,
        "round_medians_ms": round_medians,
        "median_GBps": nbytes / (med / 1e3) / 1e9,
    }


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    ops = case.contenders(not args.no_extra)
    for _ in range(args.warmup):
        for op in ops.values():
            op()
    samples: dict[str, list[list[int]]] = {name: [] for name in ops}
    names = list(ops)
    clock = time.perf_counter_ns
    for r in range(args.rounds):
        # Interleave copy by copy (the machine's memory bandwidth drifts within seconds here),
        # rotating which contender goes first every round.
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            samples[name].append([])
        gc.collect()
        for _ in range(args.reps):
            for name in order:
                op = ops[name]
                t0 = clock()
                op()
                samples[name][-1].append(clock() - t0)
    case.verify()

    nbytes = {name: case.payload for name in ops}
    nbytes["re-homed snapshot"] = sum(case.layout.buffer_sizes)
    results = {name: summarize(rounds, nbytes[name]) for name, rounds in samples.items()}
    raw = results["raw copy_"]["median_ms"]
    ratios: dict[str, Any] = {}
    for name, rounds in samples.items():
        if name == "raw copy_":
            continue
        per_round = [
            statistics.median(a) / statistics.median(b)
            for a, b in zip(rounds, samples["raw copy_"], strict=True)
        ]
        entry: dict[str, Any] = {
            "median_ratio": results[name]["median_ms"] / raw,
            "per_round_median": statistics.median(per_round),
            "per_round_min": min(per_round),
            "per_round_max": max(per_round),
        }
        target = TARGETS.get(name)
        if target is not None and TARGET_MODEL[name] in (None, case.name):
            entry["target"] = target
            entry["target_met"] = entry["median_ratio"] <= target
        ratios[name] = entry
    return {
        "tensors": len(case.layout),
        "payload_bytes": case.payload,
        "layout_bytes": case.layout.total_bytes,
        "flat_buffers": len(case.layout.buffer_sizes),
        "results": results,
        "ratio_vs_raw": ratios,
    }


def environment(load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        # other processes on a 2-core machine change these results a lot: keep the load with them
        "loadavg_1_5_15_at_start": load_at_start,
        "loadavg_1_5_15_at_end": os.getloadavg(),
    }


def print_table(report: dict[str, Any]) -> None:
    cfg, env = report["config"], report["environment"]
    print(
        f"\nlayout packing, {cfg['rounds']} rounds x {cfg['reps']} reps per contender, "
        f"torch threads {env['torch_threads']} ({cfg['threads_note']}), "
        f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
    )
    print(
        f"load average (1 min) {env['loadavg_1_5_15_at_start'][0]:.2f} at start, "
        f"{env['loadavg_1_5_15_at_end'][0]:.2f} at end"
    )
    for model, res in report["models"].items():
        print(
            f"\n{model}: {res['tensors']} tensors, {res['payload_bytes'] / MIB:.2f} MiB payload, "
            f"{res['layout_bytes'] / MIB:.2f} MiB in {res['flat_buffers']} flat buffer(s)"
        )
        header = (
            f"{'contender':<24}{'median ms':>10}{'p10':>8}{'p90':>8}{'p99':>8}{'spread':>8}"
            f"{'GB/s':>7}{'x raw':>7}{'per round':>13}  target"
        )
        print(header)
        print("-" * len(header))
        for name, r in res["results"].items():
            ratio = res["ratio_vs_raw"].get(name)
            if ratio is None:
                x, rng, tgt = "1.00", "", ""
            else:
                x = f"{ratio['median_ratio']:.2f}"
                rng = f"{ratio['per_round_min']:.2f}-{ratio['per_round_max']:.2f}"
                tgt = ""
                if "target" in ratio:
                    tgt = f"<= {ratio['target']}: {'met' if ratio['target_met'] else 'MISSED'}"
            print(
                f"{name:<24}{r['median_ms']:>10.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}"
                f"{r['p99_ms']:>8.2f}{r['spread_p10_p90_pct']:>7.0f}%{r['median_GBps']:>7.1f}"
                f"{x:>7}{rng:>13}  {tgt}"
            )
    print("\n(spread: (p90 - p10) / median; per round: range of the per-round ratio of medians)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12, help="alternating rounds (default 12)")
    p.add_argument("--reps", type=int, default=15, help="copies per contender per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed copies per contender")
    p.add_argument("--quick", action="store_true", help="4 rounds x 5 reps, short warmup")
    p.add_argument("--n-tensors", type=int, default=1000, help="tensors in the many-small model")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) before measuring (default: leave torch's default)",
    )
    p.add_argument(
        "--no-extra",
        action="store_true",
        help="skip the informational contenders (fused pack on 1 thread, Python loop)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/layout.json"),
        help="where to write the results (default bench-results/layout.json)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.warmup = 4, 5, 2
    if args.n_tensors < 2 or args.n_tensors % 2:
        p.error("--n-tensors must be an even number >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads_note = "set by --threads" if args.threads is not None else "torch default, unchanged"
    cases = [
        Case(
            "many-small",
            many_small_shapes(args.n_tensors, MODEL_BYTES // FLOAT_BYTES, args.seed),
            args.seed,
        ),
        Case("few-large", few_large_shapes(), args.seed),
    ]
    models = {case.name: run_case(case, args) for case in cases}
    report = {
        "benchmark": "Layout.pack / re-homed snapshot vs one raw copy_ of the same bytes",
        "config": {
            "rounds": args.rounds,
            "reps": args.reps,
            "warmup": args.warmup,
            "model_bytes": MODEL_BYTES,
            "threads_note": threads_note,
            "seed": args.seed,
        },
        "environment": environment(load_at_start),
        "models": models,
    }
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
