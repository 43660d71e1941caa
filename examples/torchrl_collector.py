"""A TorchRL collector loop whose weights travel with aiowsync.

Two worker processes collect CartPole frames with TorchRL 0.14's ``MultiSyncCollector``; after
each batch the trainer takes a (made-up) gradient step and calls
``collector.update_policy_weights_()``, which returns once both workers run the new weights.
The only change from a plain TorchRL script is the ``weight_sync_schemes=`` argument and the
``scheme.shutdown()`` at the end.

Needs the ``torchrl`` extra and gymnasium::

    pip install torch==2.13.0 'aiowsync[torchrl]' gymnasium
    python examples/torchrl_collector.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: small machines stay calm

import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv

import aiowsync.torchrl

BATCHES = 10


class Greedy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(self.net(obs).argmax(-1), 2)


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def main() -> None:
    policy = TensorDictModule(Greedy(), in_keys=["observation"], out_keys=["action"])
    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=64,
        total_frames=64 * BATCHES,
        weight_sync_schemes={"policy": scheme},
    )
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    last = 0
    try:
        for i, batch in enumerate(collector):
            # A stand-in for a real loss: move the logits of the observed states.
            logits = policy.module.net(batch["observation"])
            loss = logits.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            started = time.perf_counter()
            collector.update_policy_weights_()  # every worker runs the new weights now
            took = (time.perf_counter() - started) * 1e3
            last = scheme.version
            print(f"batch {i}: {batch.numel()} frames, then weights v{last} in {took:.1f} ms")
    finally:
        collector.shutdown()
        scheme.shutdown()  # the trainer's shared-memory files go with it
    print(f"OK: {BATCHES} batches; the workers ran version {last} at the end")


if __name__ == "__main__":
    main()
