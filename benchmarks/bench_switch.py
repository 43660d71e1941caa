"""What a swap-mode switch costs a receiver, by ``switch`` mode, with and without reads.

A sender and one receiver run in this process (real ZeroMQ sockets, real slot files). For each
``switch`` mode ("rebind", "remap") the sender sends back to back; after each switch the
receiver either leaves its model alone or reads every weight once, as a forward pass would.
Reported per case (medians):

* ``switch``: the synchronous step on the receiver's event loop that points the model at the
  new version (``Applier._commit``, timed by wrapping it);
* ``read``: reading every weight once after the switch (``tensor.sum()`` over the state dict).

The point: remapping a window is nearly free while nobody reads the model, which is what a
latency benchmark with idle workers sees, but a worker that reads its model between updates
pays at the switch for the pages it read (their mappings are torn down, on the event loop)
and again at its next read (the pages fault in). Re-binding costs about a microsecond per
tensor whatever was read, and the pages of each slot stay mapped.

Usage::

    .venv/bin/python benchmarks/bench_switch.py                  # the 1000-tensor 64 MiB model
    .venv/bin/python benchmarks/bench_switch.py --model 64MiB --sends 30
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import aiowsync
from aiowsync._receiving import apply as _apply
from aiowsync._tools.bench._models import build_model, model_spec, random_init


async def one_case(model: str, switch: str, read: bool, sends: int) -> dict[str, Any]:
    spec = model_spec(model)
    src, dst = build_model(spec, random_init), build_model(spec, random_init)
    switch_s: list[float] = []
    read_s: list[float] = []
    original = _apply.Applier._commit

    def timed_commit(self: Any, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        original(self, *args, **kwargs)
        if not kwargs.get("private"):  # not the copy into private memory at shutdown
            switch_s.append(time.perf_counter() - t0)

    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=src, num_workers=1)
    _apply.Applier._commit = timed_commit  # type: ignore[method-assign]
    try:
        async with sender:
            receiver = aiowsync.SharedMemWeightSyncScheme(
                address=sender.address,
                switch=switch,  # type: ignore[arg-type]
            )
            receiver.init_on_receiver(model=dst, worker_idx=0)
            async with receiver:
                await asyncio.gather(sender.connect(timeout=60), receiver.connect(timeout=60))
                switch_s.clear()
                for _ in range(sends):
                    await sender.send(timeout=60)
                    if read:
                        t0 = time.perf_counter()
                        with torch.no_grad():
                            for t in dst.state_dict().values():
                                t.sum()
                        read_s.append(time.perf_counter() - t0)
                pairs = zip(src.state_dict().values(), dst.state_dict().values(), strict=True)
                same = all(torch.equal(a, b) for a, b in pairs)
    finally:
        _apply.Applier._commit = original  # type: ignore[method-assign]
    if not same:
        raise AssertionError("the receiver does not hold the sender's weights")
    warm = switch_s[2:] or switch_s
    return {
        "model": model,
        "switch": switch,
        "read_between": read,
        "sends": sends,
        "switch_ms_p50": statistics.median(warm) * 1e3,
        "read_ms_p50": statistics.median(read_s[2:] or read_s) * 1e3 if read_s else None,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for _ in range(args.rounds):
        for read in (False, True):
            for switch in ("rebind", "remap"):
                rows.append(await one_case(args.model, switch, read, args.sends))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1000t-64MiB", help="a model of aiowsync bench")
    parser.add_argument("--sends", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="each case this many times")
    parser.add_argument("--json", type=Path, help="write every case here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = asyncio.run(run(args))
    print(f"{'model':<13}{'switch':<8}{'reads':<7}{'switch ms':>10}{'read ms':>10}")
    for r in rows:
        read = "-" if r["read_ms_p50"] is None else f"{r['read_ms_p50']:.2f}"
        print(
            f"{r['model']:<13}{r['switch']:<8}{'yes' if r['read_between'] else 'no':<7}"
            f"{r['switch_ms_p50']:>10.3f}{read:>10}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
