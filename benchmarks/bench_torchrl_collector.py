"""How long ``collector.update_policy_weights_()`` takes with aiowsync's TorchRL schemes,
against TorchRL's own shared-memory scheme, in the same run.

Two ``MultiSyncCollector`` of two CartPole workers each (four worker processes in all, busy
collecting: the trainer pulls a batch between updates), one per scheme. The collectors take
turns sample by sample: a batch from each, then an update of each, timed by the caller.
Each report is the median over ``--updates`` updates, and the ratio of ours to TorchRL's.

    .venv-bench/bin/python benchmarks/bench_torchrl_collector.py --hidden 256 --updates 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tensordict.nn import TensorDictModule
from torch import nn


class Policy(nn.Module):
    """An MLP over CartPole's 4 observations, greedy over its 2 actions."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, 2),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(self.net(obs).argmax(-1), 2)


def make_env() -> Any:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def scheme(kind: str) -> Any:
    import torchrl.weight_update

    import aiowsync.torchrl

    if kind == "torchrl":
        return torchrl.weight_update.SharedMemWeightSyncScheme()
    if kind == "aiowsync-shm":
        return aiowsync.torchrl.SharedMemWeightSyncScheme()
    return aiowsync.torchrl.DistributedWeightSyncScheme()


def run(kinds: list[str], hidden: int, updates: int) -> dict[str, Any]:
    from torchrl.collectors import MultiSyncCollector

    runs = {}
    for kind in kinds:
        policy = TensorDictModule(Policy(hidden), in_keys=["observation"], out_keys=["action"])
        made = scheme(kind)
        collector = MultiSyncCollector(
            [make_env, make_env], policy, frames_per_batch=64, total_frames=-1,
            weight_sync_schemes={"policy": made},
        )  # fmt: skip
        runs[kind] = (policy, made, collector, iter(collector), [])
    try:
        for step in range(updates + 2):
            for policy, _, collector, it, times in runs.values():
                next(it)
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.01)
                started = time.perf_counter()
                collector.update_policy_weights_()
                if step >= 2:  # the first two warm up
                    times.append(time.perf_counter() - started)
    finally:
        for _, made, collector, _, _ in runs.values():
            collector.shutdown()
            if hasattr(made, "shutdown"):
                made.shutdown()
    params = sum(p.numel() for p in Policy(hidden).parameters())
    medians = {kind: statistics.median(r[4]) for kind, r in runs.items()}
    return {
        "hidden": hidden,
        "params": params,
        "updates": updates,
        "median_ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
        "ratio_to_torchrl": {
            k: round(v / medians["torchrl"], 2) for k, v in medians.items() if "torchrl" in medians
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--kinds", default="torchrl,aiowsync-shm,aiowsync-dist")
    p.add_argument("--out", default="")
    args = p.parse_args()
    report = run(args.kinds.split(","), args.hidden, args.updates)
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
