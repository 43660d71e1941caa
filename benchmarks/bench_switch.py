"""What a swap-mode switch costs a receiver, by ``switch`` mode, with and without reads.

A sender and one receiver run in this process (real ZeroMQ sockets, real slot files). For each
``switch`` mode ("rebind", "remap") the sender sends back to back; after a send the receiver
may read every weight once, as a forward pass would.
Reported per case (medians):

* ``send``: ``await sender.send()``, which returns once the receiver switched to the new
  version and acknowledged it: the step that points the model at the new version runs on the
  receiver's event loop inside it, and is what differs between the modes;
* ``read``: reading every weight once after the switch (``tensor.sum()`` over the state dict).

Reads: ``no`` (never), ``once`` (after the first send only: a worker that read its model at
some point, say at start, and then only takes versions), ``every`` (after every send).

The point: a switch must not cost a worker that reads its model between updates more than
one that does not. Re-binding costs about a microsecond per tensor whatever was read, and
the pages of each slot stay mapped. The window moves each slot's mapping in and out with its
page tables; where it cannot (kernels before 5.13), it maps each version anew, and every page
read is then torn down at the switch and faulted in again at the next read.

Only public names of aiowsync are used. Models: ``1000t-64MiB`` (1000 tensors of varied sizes,
64 MiB; the default) or ``<n>MiB`` (four float32 tensors of that many MiB in all).

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
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import aiowsync

MIB = 1 << 20


def build_model(name: str) -> nn.Module:
    """``1000t-64MiB``: 1000 float32 tensors whose sizes follow a log-normal draw (a few hundred
    bytes to a few MiB), 64 MiB in all; ``<n>MiB``: four tensors of 1/2, 1/4, 1/8, 1/8."""
    rng = random.Random(0)  # the same sizes on both sides
    if name == "1000t-64MiB":
        draws = [rng.lognormvariate(0.0, 1.2) for _ in range(1000)]
        total = sum(draws)
        sizes = [max(1, int(d / total * 16 * MIB)) for d in draws]
        sizes[-1] += 16 * MIB - sum(sizes)  # exactly 64 MiB of float32
    elif name.endswith("MiB") and name[:-3].isdigit():
        floats = int(name[:-3]) * MIB // 4
        sizes = [floats // 2, floats // 4, floats // 8]
        sizes.append(floats - sum(sizes))
    else:
        raise SystemExit(f"unknown model {name!r}: 1000t-64MiB or <n>MiB")
    return nn.ParameterList(nn.Parameter(torch.empty(n).uniform_(-1.0, 1.0)) for n in sizes)


async def one_case(model: str, switch: str, read: str, sends: int) -> dict[str, Any]:
    src, dst = build_model(model), build_model(model)
    send_s: list[float] = []
    read_s: list[float] = []
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        receiver = aiowsync.SharedMemWeightSyncScheme(
            address=sender.address,
            switch=switch,  # type: ignore[arg-type]
        )
        receiver.init_on_receiver(model=dst, worker_idx=0)
        async with receiver:
            await asyncio.gather(sender.connect(timeout=60), receiver.connect(timeout=60))
            for k in range(sends):
                t0 = time.perf_counter()
                await sender.send(timeout=60)
                send_s.append(time.perf_counter() - t0)
                if read == "every" or (read == "once" and k == 0):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        for t in dst.state_dict().values():
                            t.sum()
                    read_s.append(time.perf_counter() - t0)
            pairs = zip(src.state_dict().values(), dst.state_dict().values(), strict=True)
            same = all(torch.equal(a, b) for a, b in pairs)
    if not same:
        raise AssertionError("the receiver does not hold the sender's weights")
    return {
        "model": model,
        "switch": switch,
        "read_between": read,
        "sends": sends,
        "send_ms_p50": statistics.median(send_s[2:] or send_s) * 1e3,
        "read_ms_p50": statistics.median(read_s[2:] or read_s) * 1e3 if read_s else None,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for _ in range(args.rounds):
        for read in ("no", "once", "every"):
            for switch in ("rebind", "remap"):
                rows.append(await one_case(args.model, switch, read, args.sends))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1000t-64MiB", help="1000t-64MiB or <n>MiB")
    parser.add_argument("--sends", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="each case this many times")
    parser.add_argument("--json", type=Path, help="write every case here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = asyncio.run(run(args))
    print(f"{'model':<13}{'switch':<8}{'reads':<7}{'send ms':>10}{'read ms':>10}")
    for r in rows:
        read = "-" if r["read_ms_p50"] is None else f"{r['read_ms_p50']:.2f}"
        print(
            f"{r['model']:<13}{r['switch']:<8}{r['read_between']:<7}"
            f"{r['send_ms_p50']:>10.3f}{read:>10}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
